"""Compaction policy, pure (ADR-0020 decision 12). The Temporal side only runs what this decides.

Compaction touches Region B history only. The summarizer sees trusted, untainted content only, each item in
its envelope exactly as the rendering contract writes it (no bare role lines it could forge); every untrusted
span, and everything the model wrote while untrusted content was in view (tainted, docs/trust.md), becomes a
typed pointer (trust level, provenance, size, reference), never a paraphrase. Depth is capped at 2: past it
the run escalates to a child run instead of compressing a summary of a summary of a summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.item_rendering import render_text_as
from core.items import (
    CheckpointSummary,
    ElidedSpan,
    HistoryItem,
    ToolCall,
    ToolResult,
    TrustLevel,
    lowest_trust,
)

MAX_SUMMARY_DEPTH = 2
MAX_ESCALATION_POINTERS = 20
MAX_ESCALATION_REFS = 4  # checkpoints an escalation's summary names; it counts the earlier ones
# Trust levels whose text a summarizer may read, when untainted. Anything else is elided to a pointer.
SUMMARIZABLE = frozenset({TrustLevel.PLATFORM, TrustLevel.OPERATOR, TrustLevel.USER, TrustLevel.MODEL, TrustLevel.TOOL})
# Room left in a chunk for the envelope around a cut piece (opener, closer, attributes).
_ENVELOPE_TOKENS = 64


def summarizable(item: HistoryItem) -> bool:
    """Whether a summarizer may read `item`: a trusted level and not written with untrusted content in view."""
    return item.trust in SUMMARIZABLE and not item.tainted and not isinstance(item, ElidedSpan)


class Checkpoint(BaseModel):
    """A compaction's durable result: a summary and pointers standing for history up to `covers_to_seq`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint_id: str
    parent_id: str | None = None
    kind: Literal["summary", "escalation"] = "summary"
    # Summaries stacked on this history: 1 or 2. An escalation resets it to 0 (a fresh body, pointers only).
    depth: int = Field(ge=0, le=MAX_SUMMARY_DEPTH)
    covers_from_seq: int = Field(ge=0)
    covers_to_seq: int = Field(ge=0)
    summary: str
    pointers: list[ElidedSpan] = Field(default_factory=list)
    # The provenance of the summary's inputs: tainted if any summarized item was (never, under this policy).
    tainted: bool = False


class CompactionDecision(StrEnum):
    COMPACT = "compact"
    ESCALATE = "escalate"
    NOTHING_TO_COMPACT = "nothing_to_compact"


class SummaryChunk(BaseModel):
    """Enveloped trusted items for one summarizer call, bounded so compaction works when the context is full."""

    model_config = ConfigDict(frozen=True)

    item_ids: list[str]
    text: str
    raw_tokens: int
    tainted: bool = False


class CompactionPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    decision: CompactionDecision
    depth: int
    parent_id: str | None
    covers_from_seq: int = 0
    covers_to_seq: int = 0
    chunks: list[SummaryChunk] = Field(default_factory=list)
    pointers: list[ElidedSpan] = Field(default_factory=list)
    previous_summary: str | None = None
    previous_tainted: bool = False
    summary_tokens_per_chunk: int = 300
    reason: str = ""


class CompactionResult(BaseModel):
    """What a CompactionWorkflow reports back to the session."""

    model_config = ConfigDict(frozen=True)

    decision: CompactionDecision
    checkpoint: Checkpoint | None = None
    summarized_items: int = 0
    elided_items: int = 0
    summarizer_input_tokens: int = 0


def escalation_checkpoint(
    history: Sequence[HistoryItem],
    *,
    current: Checkpoint,
    keep_from_seq: int,
    checkpoint_id: str,
    ancestors: Sequence[str],
    count: Callable[[str], int],
) -> Checkpoint:
    """The fresh body a child run starts from: no new summary, only references.

    Everything before `keep_from_seq` is covered. Untrusted items since the last checkpoint become pointers
    (with the earlier ones); trusted items there, and the earlier checkpoints, are named by reference.
    """
    span = [i for i in history if current.covers_to_seq < i.seq < keep_from_seq]
    pointers = [*current.pointers, *elide_runs(span, count)]
    # A fresh body stays small: the newest pointers only; older ones stay listed in the ancestors.
    pointers = pointers[-MAX_ESCALATION_POINTERS:]
    # The newest checkpoints by name, the earlier ones by count (each names its parent): the fresh body must not
    # grow with the session, or a long one on a small window ends with no room for a turn.
    named = list(ancestors)[-MAX_ESCALATION_REFS:]
    earlier = len(ancestors) - len(named)
    refs = (f"{earlier} earlier checkpoints (each names its parent), " if earlier else "") + ", ".join(
        f"checkpoint:{a}" for a in named
    )
    tail = f"; items {span[0].seq}..{span[-1].seq} by item:ID" if span else ""
    times = {0: "", 1: " once"}.get(current.depth, f" {current.depth} times")
    summary = (
        f"Earlier context was summarized{times} and is not repeated here. "
        f"It is available by reference: {refs}{tail}. Untrusted spans are listed as pointers."
    )
    return Checkpoint(
        checkpoint_id=checkpoint_id,
        parent_id=current.checkpoint_id,
        kind="escalation",
        depth=0,
        covers_from_seq=current.covers_from_seq,
        covers_to_seq=max(keep_from_seq - 1, current.covers_to_seq),
        summary=summary,
        pointers=pointers,
    )


def elide_runs(span: Sequence[HistoryItem], count: Callable[[str], int]) -> list[ElidedSpan]:
    """One typed pointer per run of consecutive items a summarizer may not read (ElidedSpans pass through).

    A page, the model's reply quoting it and the calls it made in that state are one span, so an
    untrusted-heavy session keeps a pointer per run, not per item: pointers too take room in every request.
    """
    pointers: list[ElidedSpan] = []
    run: list[HistoryItem] = []
    for item in [*span, None]:
        if item is not None and not isinstance(item, ElidedSpan) and not summarizable(item):
            run.append(item)
            continue
        if run:
            pointers.append(_elide(run[0], count) if len(run) == 1 else _elide_run(run, count))
            run = []
        if isinstance(item, ElidedSpan):
            pointers.append(item)
    return pointers


def run_trust(items: Sequence[HistoryItem]) -> TrustLevel:
    """The trust a pointer to several items carries: the lowest of theirs (EXTERNAL_UNTRUSTED if any is; a TOOL
    result among MODEL replies makes the run TOOL), never the first item's when a later one is lower."""
    return lowest_trust(i.trust for i in items)


def _elide_run(run: Sequence[HistoryItem], count: Callable[[str], int]) -> ElidedSpan:
    first, last = run[0], run[-1]
    return ElidedSpan(
        id=f"{first.id}#elided-{len(run)}",
        trust=run_trust(run),
        tainted=any(i.tainted for i in run),
        seq=first.seq,
        original_id=f"{first.id}..{last.id}",
        original_tokens=sum(count(i.body_text()) for i in run),
        reference=f"span:{first.seq}-{last.seq}",
        reason="compaction_elided",
    )


def _elide(item: HistoryItem, count: Callable[[str], int]) -> ElidedSpan:
    return ElidedSpan(
        id=f"{item.id}#elided",
        trust=item.trust,
        tainted=item.tainted,
        seq=item.seq,
        original_id=item.id,
        original_tokens=count(item.body_text()),
        reference=(item.artifact_ref if isinstance(item, ToolResult) else None) or f"item:{item.id}",
        # No call_id: the call may be summarized away, and a pointer is not a pair's half.
        tool_name=getattr(item, "tool_name", None),
        reason="compaction_elided",
    )


def apply_checkpoint(history: Sequence[HistoryItem], checkpoint: Checkpoint | None) -> list[HistoryItem]:
    """The history a request shows: the checkpoint's summary and pointers, then everything after it."""
    if checkpoint is None:
        return list(history)
    head: list[HistoryItem] = [
        CheckpointSummary(
            id=f"checkpoint:{checkpoint.checkpoint_id}",
            seq=checkpoint.covers_from_seq,
            checkpoint_id=checkpoint.checkpoint_id,
            depth=checkpoint.depth,
            covers_to_seq=checkpoint.covers_to_seq,
            text=checkpoint.summary,
            tainted=checkpoint.tainted,
        ),
        *checkpoint.pointers,
    ]
    return head + [item for item in history if item.seq > checkpoint.covers_to_seq]


def summarizer_pieces(item: HistoryItem, secret: bytes, count: Callable[[str], int], limit: int) -> list[str]:
    """How `item` reads in a summarizer's input: its envelope, or (too large for one chunk) one per piece."""
    whole = render_text_as(item, item.body_text(), item.id, secret)
    if count(whole) <= limit:
        return [whole]
    parts = _pieces(item.body_text(), count, max(1, limit - _ENVELOPE_TOKENS))
    return [render_text_as(item, part, f"{item.id}#part{k}", secret) for k, part in enumerate(parts)]


def plan_compaction(
    history: Sequence[HistoryItem],
    *,
    current: Checkpoint | None,
    keep_from_seq: int,
    count: Callable[[str], int],
    chunk_tokens: int,
    secret: bytes,
    summary_budget: int = 1_500,
) -> CompactionPlan:
    """Choose the span to compact: all history after the current checkpoint and before `keep_from_seq`.

    `keep_from_seq` is where the kept tail starts (the active turn at least). Trusted, untainted items are
    rendered in their envelopes (under the session's `secret`) and chunked for the summarizer, each chunk at
    most `chunk_tokens` (a single larger item is cut into enveloped pieces, never dropped); untrusted and
    tainted items become pointers. Past depth 2 the decision is ESCALATE. The whole
    summary (the parent's plus this span's) is held to `summary_budget` tokens, shared out over the chunks.
    """
    depth = (current.depth + 1) if current else 1
    parent = current.checkpoint_id if current else None
    start = (current.covers_to_seq + 1) if current else 0
    span = [i for i in history if start <= i.seq < keep_from_seq]
    # Never split a pair: a call whose result is outside the span stays with the kept tail.
    kept_calls = {i.call_id for i in history if isinstance(i, ToolResult) and i.seq >= keep_from_seq}
    span = [i for i in span if not (isinstance(i, ToolCall) and i.call_id in kept_calls)]
    if kept_calls:
        first_kept_call = min(
            (i.seq for i in history if isinstance(i, ToolCall) and i.call_id in kept_calls),
            default=keep_from_seq,
        )
        span = [i for i in span if i.seq < first_kept_call]
    if not span:
        if current is not None and current.kind == "summary":
            # Nothing left outside the active turn but a summary: the run continues in a child run whose body is
            # the minimum (a reference summary, pointers only as room allows), instead of failing the turn.
            return CompactionPlan(
                decision=CompactionDecision.ESCALATE,
                depth=depth,
                parent_id=parent,
                covers_from_seq=current.covers_from_seq,
                covers_to_seq=current.covers_to_seq,
                reason="nothing left to compact outside the active turn: escalate to a minimum body",
            )
        return CompactionPlan(
            decision=CompactionDecision.NOTHING_TO_COMPACT, depth=depth, parent_id=parent, reason="empty span"
        )
    if depth > MAX_SUMMARY_DEPTH:
        return CompactionPlan(
            decision=CompactionDecision.ESCALATE,
            depth=depth,
            parent_id=parent,
            covers_from_seq=span[0].seq,
            covers_to_seq=span[-1].seq,
            reason=f"summary depth would be {depth}, over the cap of {MAX_SUMMARY_DEPTH}",
        )
    pointers: list[ElidedSpan] = list(current.pointers) if current else []
    chunks: list[SummaryChunk] = []
    buf_ids: list[str] = []
    buf_text: list[str] = []
    buf_tokens = 0

    def flush() -> None:
        nonlocal buf_ids, buf_text, buf_tokens
        if buf_ids:
            chunks.append(SummaryChunk(item_ids=buf_ids, text="".join(buf_text), raw_tokens=buf_tokens))
        buf_ids, buf_text, buf_tokens = [], [], 0

    pointers += elide_runs(span, count)
    for item in span:
        if not summarizable(item):
            continue
        for piece in summarizer_pieces(item, secret, count, chunk_tokens):
            tokens = count(piece)
            if buf_tokens + tokens > chunk_tokens:
                flush()
            buf_ids.append(item.id)
            buf_text.append(piece)
            buf_tokens += tokens
    flush()
    previous = count(current.summary) if current else 0
    per_chunk = max(40, (summary_budget - previous) // max(1, len(chunks)))
    return CompactionPlan(
        decision=CompactionDecision.COMPACT,
        summary_tokens_per_chunk=per_chunk,
        depth=depth,
        parent_id=parent,
        covers_from_seq=current.covers_from_seq if current else span[0].seq,
        covers_to_seq=span[-1].seq,
        chunks=chunks,
        pointers=pointers,
        previous_summary=current.summary if current else None,
        previous_tainted=current.tainted if current else False,
    )


def _pieces(text: str, count: Callable[[str], int], limit: int) -> list[str]:
    """Cut one oversized text into pieces of at most `limit` tokens (by halving, so counts stay few)."""
    if count(text) <= limit or len(text) < 2:
        return [text]
    mid = len(text) // 2
    return _pieces(text[:mid], count, limit) + _pieces(text[mid:], count, limit)
