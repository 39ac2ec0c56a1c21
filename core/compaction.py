"""Compaction policy, pure (ADR-0020 decision 12). The Temporal side only runs what this decides.

Compaction touches Region B history only. The summarizer sees trusted content only; every untrusted span
becomes a typed pointer (trust level, size, reference), never a paraphrase. Depth is capped at 2: past it
the run escalates to a child run instead of compressing a summary of a summary of a summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.items import (
    AssistantMessage,
    CheckpointSummary,
    ElidedSpan,
    HistoryItem,
    ToolCall,
    ToolResult,
    TrustLevel,
    UserMessage,
)

MAX_SUMMARY_DEPTH = 2
MAX_ESCALATION_POINTERS = 20
# Trust levels whose text a summarizer may read. Anything else is elided to a pointer.
SUMMARIZABLE = frozenset({TrustLevel.PLATFORM, TrustLevel.OPERATOR, TrustLevel.USER, TrustLevel.MODEL, TrustLevel.TOOL})


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


class CompactionDecision(StrEnum):
    COMPACT = "compact"
    ESCALATE = "escalate"
    NOTHING_TO_COMPACT = "nothing_to_compact"


class SummaryChunk(BaseModel):
    """Trusted text for one summarizer call, bounded so compaction works when the context is full."""

    model_config = ConfigDict(frozen=True)

    item_ids: list[str]
    text: str
    raw_tokens: int


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
    pointers = list(current.pointers)
    for item in span:
        if item.trust not in SUMMARIZABLE and not isinstance(item, ElidedSpan):
            pointers.append(_elide(item, count))
        elif isinstance(item, ElidedSpan):
            pointers.append(item)
    # A fresh body stays small: the newest pointers only; older ones stay listed in the ancestors.
    pointers = pointers[-MAX_ESCALATION_POINTERS:]
    refs = ", ".join(f"checkpoint:{a}" for a in ancestors)
    tail = f"; items {span[0].seq}..{span[-1].seq} by item:ID" if span else ""
    summary = (
        f"Earlier context was summarized {MAX_SUMMARY_DEPTH} times and is not repeated here. "
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


def _elide(item: HistoryItem, count: Callable[[str], int]) -> ElidedSpan:
    return ElidedSpan(
        id=f"{item.id}#elided",
        trust=item.trust,
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
        ),
        *checkpoint.pointers,
    ]
    return head + [item for item in history if item.seq > checkpoint.covers_to_seq]


def summary_line(item: HistoryItem) -> str:
    """How a trusted item reads in a summarizer's input."""
    if isinstance(item, UserMessage):
        return f"user: {item.text}"
    if isinstance(item, AssistantMessage):
        return f"assistant: {item.text}"
    if isinstance(item, ToolCall):
        return f"assistant called {item.tool_name}: {item.body_text()}"
    if isinstance(item, ToolResult):
        return f"{item.tool_name} returned: {item.content}"
    return item.body_text()


def plan_compaction(
    history: Sequence[HistoryItem],
    *,
    current: Checkpoint | None,
    keep_from_seq: int,
    count: Callable[[str], int],
    chunk_tokens: int,
    summary_budget: int = 1_500,
) -> CompactionPlan:
    """Choose the span to compact: all history after the current checkpoint and before `keep_from_seq`.

    `keep_from_seq` is where the kept tail starts (the active turn at least). Trusted items are chunked for
    the summarizer, each chunk at most `chunk_tokens` (a single larger item is cut, never dropped); untrusted
    items (and results of untrusted tools) become pointers. Past depth 2 the decision is ESCALATE. The whole
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
            chunks.append(SummaryChunk(item_ids=buf_ids, text="\n".join(buf_text), raw_tokens=buf_tokens))
        buf_ids, buf_text, buf_tokens = [], [], 0

    for item in span:
        if isinstance(item, ElidedSpan):
            pointers.append(item)
            continue
        if item.trust not in SUMMARIZABLE:
            pointers.append(_elide(item, count))
            continue
        for piece in _pieces(summary_line(item), count, chunk_tokens):
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
    )


def _pieces(text: str, count: Callable[[str], int], limit: int) -> list[str]:
    """Cut one oversized text into pieces of at most `limit` tokens (by halving, so counts stay few)."""
    if count(text) <= limit or len(text) < 2:
        return [text]
    mid = len(text) // 2
    return _pieces(text[:mid], count, limit) + _pieces(text[mid:], count, limit)
