"""The pure context builder (ADR-0020 decisions 1-3, 6-11, 13).

`open_prefix` renders and measures Region A once per epoch; `build` assembles one request from a frozen
prefix and the body inputs. Both are pure: same inputs, same bytes. Neither compacts: pressure that the
cheap yields cannot absorb is reported as NEEDS_COMPACTION with the deficit.

Each distinct item is rendered (escaped, enveloped) and counted once: a `RenderCache` memoises that work
across builds of one session. It never changes a result, only how fast it comes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from operator import attrgetter

from pydantic import BaseModel, ConfigDict, Field

from core.budget import ContextBudget
from core.compaction import Checkpoint, apply_checkpoint
from core.errors import NonYieldableOverflowError, PrefixOverflowError, WorkingStateCapError
from core.estimator import TokenEstimator
from core.items import (
    AgentInstructions,
    BudgetClass,
    CorrectionLine,
    CurrentUserMessage,
    ElidedSpan,
    HistoryItem,
    Item,
    MemorySnapshotEntry,
    PlatformPolicy,
    RecallItem,
    Region,
    ToolCall,
    ToolDefinition,
    ToolResult,
    TrustLevel,
    TurnContext,
    WorkingStateBlock,
)
from core.order import assembly_order
from core.plan import ContextPlan, PlanStatus, Segment, YieldApplied, YieldStep
from core.rendering import FRAMING_TEXT, derive_nonce, render_envelope
from core.validation import validate_pairs

FRAMING_ID = "platform.framing"
POLICY_ID = "platform.policy"


class PrefixInputs(BaseModel):
    """Everything Region A holds, pinned at session open (or epoch rotation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: int = Field(default=1, ge=1)
    platform_policy: str
    agent_instructions: str
    tools: list[ToolDefinition] = Field(default_factory=list)
    memory_snapshot: list[MemorySnapshotEntry] = Field(default_factory=list)


class FrozenPrefix(BaseModel):
    """Region A rendered and measured exactly. Its bytes do not change for the epoch."""

    model_config = ConfigDict(frozen=True)

    epoch: int
    text: str
    sha256: str
    raw_tokens: int
    tool_count: int
    class_tokens: dict[str, int]
    segments: list[Segment]


class BodyInputs(BaseModel):
    """Region B inputs of one request. `turn_start_seq`: items from here on are the active turn."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    history: Sequence[HistoryItem] = ()
    checkpoint: Checkpoint | None = None
    turn_start_seq: int = 0
    current: CurrentUserMessage | None = None
    recall: Sequence[RecallItem] = ()
    corrections: Sequence[CorrectionLine] = ()
    working_state: WorkingStateBlock | None = None
    turn_context: TurnContext | None = None


def source_of(item: Item) -> str:
    """The attribution an envelope carries."""
    if isinstance(item, ToolResult | ToolCall):
        return f"{item.kind}:{item.tool_name}"
    if isinstance(item, ElidedSpan) and item.tool_name:
        return f"{item.kind}:{item.tool_name}"
    if isinstance(item, ToolDefinition):
        return f"tool_definition:{item.name}"
    if isinstance(item, MemorySnapshotEntry | RecallItem | CorrectionLine):
        return f"{item.kind}:{item.memory_id}"
    return item.kind


def render_item(item: Item, secret: bytes) -> str:
    """Platform text renders as is; every other trust level inside a nonced, attributed envelope."""
    if item.trust is TrustLevel.PLATFORM:
        return item.body_text() + "\n"
    return render_envelope(
        item.body_text(),
        nonce=derive_nonce(secret, item.id),
        source=source_of(item),
        trust=item.trust.value,
        item_id=item.id,
    )


class RenderCache:
    """Memo of rendered segments for one session secret, keyed by item id and checked against the item."""

    def __init__(self, secret: bytes, counter_name: str = "") -> None:
        self.secret = secret
        self.counter_name = counter_name
        self._entries: dict[str, tuple[Item, Segment]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def segment(self, item: Item, estimator: TokenEstimator) -> Segment:
        entry = self._entries.get(item.id)
        if entry is not None and (entry[0] is item or entry[0] == item):
            return entry[1]
        text = render_item(item, self.secret)
        seg = Segment(
            item_id=item.id,
            kind=item.kind,
            region=type(item).region,
            budget_class=type(item).budget_class,
            role=type(item).role,
            trust=item.trust,
            text=text,
            raw_tokens=estimator.count(text),
            call_id=getattr(item, "call_id", None),
        )
        self._entries[item.id] = (item, seg)
        return seg


def open_prefix(
    inputs: PrefixInputs, *, budget: ContextBudget, estimator: TokenEstimator, secret: bytes
) -> FrozenPrefix:
    """Render Region A, measure every class exactly, and refuse to open if any class is over its cap."""
    if len(inputs.tools) > budget.tools_max_count:
        raise PrefixOverflowError("tools", len(inputs.tools), budget.tools_max_count, unit="tools")
    if len(inputs.memory_snapshot) > budget.memory_snapshot_max_items:
        raise PrefixOverflowError(
            "memory_snapshot", len(inputs.memory_snapshot), budget.memory_snapshot_max_items, unit="items"
        )
    names = [t.name for t in inputs.tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique; duplicates: {sorted({n for n in names if names.count(n) > 1})}")
    items: list[Item] = [
        PlatformPolicy(id=POLICY_ID, text=inputs.platform_policy),
        PlatformPolicy(id=FRAMING_ID, text=FRAMING_TEXT),
        AgentInstructions(id="agent.instructions", text=inputs.agent_instructions),
        *inputs.tools,
        *inputs.memory_snapshot,
    ]
    cache = RenderCache(secret)
    segments = [cache.segment(item, estimator) for item in assembly_order(items)]
    class_tokens: dict[str, int] = {}
    caps = budget.prefix_caps()
    for cls in caps:
        text = "".join(s.text for s in segments if s.budget_class is cls)
        tools = len(inputs.tools) if cls is BudgetClass.TOOLS else 0
        # Measured exactly: one count of the class's exact bytes, in the provider's units.
        tokens = math.ceil(
            (estimator.count(text) + tools * estimator.profile.per_tool_tokens) * estimator.profile.calibration
        )
        class_tokens[cls.value] = tokens
    for cls, cap in caps.items():
        if class_tokens[cls.value] > cap:
            raise PrefixOverflowError(cls.value, class_tokens[cls.value], cap)
    text = "".join(s.text for s in segments)
    return FrozenPrefix(
        epoch=inputs.epoch,
        text=text,
        sha256=hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
        raw_tokens=estimator.count(text),
        tool_count=len(inputs.tools),
        class_tokens=class_tokens,
        segments=segments,
    )


_seq = attrgetter("seq")


def build(
    prefix: FrozenPrefix,
    body: BodyInputs,
    *,
    budget: ContextBudget,
    estimator: TokenEstimator,
    secret: bytes,
    cache: RenderCache | None = None,
) -> ContextPlan:
    """Assemble one request. Pure: the plan depends only on the arguments, never on the cache's contents."""
    if cache is None or cache.secret != secret:
        cache = RenderCache(secret)
    unit = estimator.body_unit()
    per_msg = estimator.profile.per_message_tokens
    prefix_tokens = estimator.prefix_tokens(prefix.raw_tokens, prefix.tool_count)
    available = budget.input_limit - prefix_tokens

    def est(seg: Segment) -> float:
        return (seg.raw_tokens + per_msg) * unit

    history = sorted(apply_checkpoint(body.history, body.checkpoint), key=_seq)
    active = [h for h in history if h.seq >= body.turn_start_seq]
    older = [h for h in history if h.seq < body.turn_start_seq]

    # Never yield: current message, working state, correction lines, turn context, the active turn's items.
    fixed_items: list[Item] = [*active, *body.corrections]
    if body.working_state is not None:
        ws = cache.segment(body.working_state, estimator)
        ws_tokens = math.ceil(est(ws))
        if ws_tokens > budget.working_state_tokens:
            raise WorkingStateCapError("working_state", ws_tokens, budget.working_state_tokens, unit="tokens")
        fixed_items.append(body.working_state)
    if body.turn_context is not None:
        fixed_items.append(body.turn_context)
    if body.current is not None:
        fixed_items.append(body.current)
    fixed = [(item, cache.segment(item, estimator)) for item in fixed_items]
    fixed_total = sum(est(s) for _, s in fixed)
    if fixed_total > available:
        by_class: dict[str, int] = {}
        for _, s in fixed:
            by_class[s.budget_class.value] = by_class.get(s.budget_class.value, 0) + math.ceil(est(s))
        raise NonYieldableOverflowError(by_class, available)

    yields: list[YieldApplied] = []
    # Recall within its own cap, best rank first.
    recall: list[tuple[Item, Segment, float]] = []
    recall_total = 0.0
    capped: list[str] = []
    capped_tokens = 0.0
    for r in sorted(body.recall, key=attrgetter("rank")):
        s = cache.segment(r, estimator)
        e = est(s)
        if recall_total + e <= budget.retrieved_context_tokens:
            recall.append((r, s, e))
            recall_total += e
        else:
            capped.append(r.id)
            capped_tokens += e
    if capped:
        yields.append(
            YieldApplied(
                step=YieldStep.RECALL_DROPPED,
                reason="cap",
                item_ids=capped,
                tokens_freed=math.ceil(capped_tokens),
            )
        )

    # Older history; tool results within their share of the body, oldest truncated to pointers first.
    older_segs = [(h, cache.segment(h, estimator)) for h in older]
    older_est = [est(s) for _, s in older_segs]
    results_total = sum(e for (h, _), e in zip(older_segs, older_est, strict=True) if isinstance(h, ToolResult))
    results_total += sum(est(s) for h, s in fixed if isinstance(h, ToolResult))
    results_cap = budget.tool_results_cap(available)
    truncatable = [i for i, (h, _) in enumerate(older_segs) if isinstance(h, ToolResult)]
    cursor = 0

    def truncate_until(limit_ok: Callable[[], bool], reason: str) -> None:
        nonlocal cursor, results_total
        freed_ids: list[str] = []
        freed = 0.0
        while cursor < len(truncatable) and not limit_ok():
            index = truncatable[cursor]
            cursor += 1
            original, seg = older_segs[index]
            assert isinstance(original, ToolResult)
            pointer = _pointer_for(original, seg.raw_tokens)
            pseg = cache.segment(pointer, estimator)
            delta = older_est[index] - est(pseg)
            older_segs[index] = (pointer, pseg)
            older_est[index] = est(pseg)
            results_total -= delta
            freed += delta
            freed_ids.append(original.id)
        if freed_ids:
            yields.append(
                YieldApplied(
                    step=YieldStep.TOOL_RESULTS_TO_POINTERS,
                    reason=reason,
                    item_ids=freed_ids,
                    tokens_freed=math.ceil(freed),
                )
            )

    truncate_until(lambda: results_total <= results_cap, "cap")

    def total() -> float:
        return fixed_total + recall_total + sum(older_est)

    if total() > available and recall:
        # Yield 1: in-turn recall, lowest rank first.
        dropped: list[str] = []
        freed = 0.0
        while recall and total() > available:
            r, _, e = recall.pop()
            recall_total -= e
            dropped.append(r.id)
            freed += e
        yields.append(
            YieldApplied(
                step=YieldStep.RECALL_DROPPED,
                reason="pressure",
                item_ids=dropped,
                tokens_freed=math.ceil(freed),
            )
        )
    if total() > available:
        # Yield 2: tool results to typed pointers, oldest first.
        truncate_until(lambda: total() <= available, "pressure")

    estimated_body = total()
    status = PlanStatus.FITS if estimated_body <= available else PlanStatus.NEEDS_COMPACTION
    deficit = max(0, math.ceil(estimated_body - available))

    # Built in assembly order (core.order.SECTIONS): history, corrections, recall, working state, turn
    # context, current message. Tests assert it against order_key; sorting here would cost a pass per build.
    body_segments = [s for _, s in older_segs]
    body_segments += [cache.segment(h, estimator) for h in active]
    body_segments += [cache.segment(c, estimator) for c in sorted(body.corrections, key=attrgetter("id"))]
    body_segments += [s for _, s, _ in recall]
    body_segments += [s for item, s in fixed if isinstance(item, WorkingStateBlock | TurnContext | CurrentUserMessage)]
    validate_pairs(body_segments)

    segments = prefix.segments + body_segments
    body_text = "".join(s.text for s in body_segments)
    request_sha = hashlib.sha256()
    request_sha.update(prefix.text.encode("utf-8", "surrogatepass"))
    request_sha.update(body_text.encode("utf-8", "surrogatepass"))
    tokens_by_class = dict(prefix.class_tokens)
    class_est: dict[str, float] = {}
    for s in body_segments:
        class_est[s.budget_class.value] = class_est.get(s.budget_class.value, 0.0) + est(s)
    for name, value in class_est.items():
        tokens_by_class[name] = math.ceil(value)
    body_tokens = math.ceil(estimated_body)
    raw_total = prefix.raw_tokens + sum(s.raw_tokens for s in body_segments)
    return ContextPlan.model_construct(
        epoch=prefix.epoch,
        prefix_sha256=prefix.sha256,
        request_sha256=request_sha.hexdigest(),
        segments=segments,
        prefix_text=prefix.text,
        body_text=body_text,
        status=status,
        deficit_tokens=deficit,
        estimated_tokens=prefix_tokens + body_tokens,
        raw_tokens=raw_total
        + len(body_segments) * per_msg
        + prefix.tool_count * estimator.profile.per_tool_tokens
        + estimator.profile.request_overhead_tokens,
        input_limit=budget.input_limit,
        prefix_tokens=prefix_tokens,
        body_tokens=body_tokens,
        tokens_by_class=tokens_by_class,
        yields=yields,
    )


def _pointer_for(result: ToolResult, raw_tokens: int) -> ElidedSpan:
    return ElidedSpan(
        id=f"{result.id}#pointer",
        trust=result.trust,
        seq=result.seq,
        original_id=result.id,
        original_tokens=raw_tokens,
        reference=result.artifact_ref or f"item:{result.id}",
        call_id=result.call_id,
        tool_name=result.tool_name,
        reason="tool_result_truncated",
    )


__all__ = [
    "BodyInputs",
    "FrozenPrefix",
    "PrefixInputs",
    "Region",
    "RenderCache",
    "build",
    "open_prefix",
    "render_item",
    "source_of",
]
