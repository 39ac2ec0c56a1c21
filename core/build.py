"""The pure context builder (ADR-0020 decisions 1-3, 6-11, 13).

`open_prefix` renders and measures Region A once per epoch; `build` assembles one request from a frozen
prefix and the body inputs. Both are pure: same inputs, same bytes. Neither compacts: pressure that the
cheap yields cannot absorb is reported as NEEDS_COMPACTION with the deficit.

Each distinct item is rendered (escaped, enveloped) and counted once: a `RenderCache` memoises that work
across builds of one session. It never changes a result, only how fast it comes.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
import operator
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, cast, get_args

from pydantic import BaseModel, ConfigDict, Field

from core.budget import ContextBudget
from core.compaction import Checkpoint, apply_checkpoint
from core.errors import PrefixOverflowError, TurnTooLargeError
from core.estimator import TokenEstimator
from core.history import LoggedHistory, missing
from core.item_rendering import render_item, source_of
from core.items import (
    ITEM_TYPES,
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
    Role,
    ToolDefinition,
    ToolResult,
    TrustLevel,
    TurnContext,
    WorkingStateBlock,
)
from core.order import assembly_order
from core.plan import ContextPlan, PlanStatus, Segment, YieldApplied, YieldStep
from core.rendering import ESCAPING_FINGERPRINT, FRAMING_TEXT
from core.validation import PairState, validate_pairs
from core.working_state import CONTROL_TOOL_DESCRIPTION, CONTROL_TOOL_NAME, control_tool_schema

FRAMING_ID = "platform.2.framing"
WORKING_STATE_ID = "working_state"  # one id for the block, so the write-time measure is exactly build's
POLICY_ID = "platform.1.policy"


class PrefixInputs(BaseModel):
    """Everything Region A holds, pinned at session open (or epoch rotation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: int = Field(default=1, ge=1)
    platform_policy: str
    agent_instructions: str
    tools: list[ToolDefinition] = Field(default_factory=list)
    memory_snapshot: list[MemorySnapshotEntry] = Field(default_factory=list)


def operator_tool(name: str, description: str, input_schema: dict[str, Any] | None) -> ToolDefinition:
    """An operator's tool definition as Region A pins it."""
    schema = {} if input_schema is None else {"input_schema": input_schema}
    return ToolDefinition(id=f"tool.{name}", name=name, description=description, **schema)


def region_a_inputs(
    *,
    platform_policy: str,
    agent_instructions: str,
    tools: Sequence[ToolDefinition],
    memory_snapshot: Sequence[MemorySnapshotEntry] = (),
    epoch: int = 1,
) -> PrefixInputs:
    """Region A's inputs, assembled once for every caller (session open, `ctxengine validate`, the benches):
    the operator's tools in their order, then the platform's working-state control tool, which the operator's
    30-tool count cap does not include (`open_prefix`) but whose tokens count against the tools' token cap."""
    operator = [t for t in tools if t.name != CONTROL_TOOL_NAME]
    control = ToolDefinition(
        id=f"tool.{CONTROL_TOOL_NAME}",
        name=CONTROL_TOOL_NAME,
        description=CONTROL_TOOL_DESCRIPTION,
        input_schema=control_tool_schema(),
    )
    return PrefixInputs(
        epoch=epoch,
        platform_policy=platform_policy,
        agent_instructions=agent_instructions,
        tools=[*operator, control],
        memory_snapshot=list(memory_snapshot),
    )


def operator_tool_count(inputs: PrefixInputs) -> int:
    """How many of Region A's tools count against the operator's cap (all but the platform's control tool)."""
    return sum(1 for t in inputs.tools if t.name != CONTROL_TOOL_NAME)


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
    escaping_fingerprint: str = ""  # the escaping tables these bytes were rendered with (rendering contract)


class BodyInputs(BaseModel):
    """Region B inputs of one request. `turn_start_seq`: items from here on are the active turn."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    # Items (validated, as any field), or the memo's columns (`LoggedHistory`): tried in that order, so a list of
    # items is validated once.
    history: Sequence[HistoryItem] | LoggedHistory = Field(default=(), union_mode="left_to_right")
    checkpoint: Checkpoint | None = None
    turn_start_seq: int = 0
    current: CurrentUserMessage | None = None
    recall: Sequence[RecallItem] = ()
    corrections: Sequence[CorrectionLine] = ()
    working_state: WorkingStateBlock | None = None
    turn_context: TurnContext | None = None


def counter_key(estimator: TokenEstimator) -> str:
    """What a cached count depends on: the tokenizer (its name, or its identity when it has none)."""
    name = getattr(estimator.counter, "name", None)
    return str(name) if name else f"counter@{id(estimator.counter)}"


def measure_working_state(text: str, *, estimator: TokenEstimator, secret: bytes) -> int:
    """The working-state block's size as build() counts it (rendered, in the route's units, with the margin).

    The write-time cap uses this, so a write that is accepted always fits the budget it was checked against.
    """
    rendered = render_item(WorkingStateBlock(id=WORKING_STATE_ID, text=text), secret)
    return math.ceil((estimator.count(rendered) + estimator.profile.per_message_tokens) * estimator.body_unit())


class HistoryScan:
    """One pass over older history's segments, before any yield. Immutable once built; `extend` returns a new
    scan."""

    def __init__(self) -> None:
        self.segs: list[Segment] = []
        self.raws: list[int] = []
        self.truncatable: list[int] = []
        self.raw_total = 0
        self.results_raw = 0
        self.pointers = 0  # segments that are typed pointers
        self.tainted = 0  # segments that taint the view
        self.pairs = PairState()

    def extend(self, older: list[Segment]) -> HistoryScan:
        scan = HistoryScan()
        start = len(self.segs)
        scan.segs = older
        scan.raws = list(self.raws)
        scan.truncatable = list(self.truncatable)
        scan.raw_total = self.raw_total
        scan.results_raw = self.results_raw
        scan.pointers = self.pointers
        scan.tainted = self.tainted
        new = older[start:]
        # Column by column (a cold worker's first build scans thousands of segments), in C-level passes.
        raws = list(map(_raw_tokens, new))
        kinds = list(map(_kind, new))
        scan.raws += raws
        scan.raw_total += sum(raws)
        scan.pointers += kinds.count(_POINTER)
        scan.tainted += sum(map(_taints, new))
        results = list(map(operator.eq, kinds, repeat(_RESULT)))
        scan.results_raw += sum(compress(raws, results))
        scan.truncatable += compress(range(start, len(older)), results)
        scan.pairs = self.pairs.copy().feed(new)
        return scan


class RenderCache:
    """Memo of rendered segments for one session secret, keyed by item id and checked against the item."""

    def __init__(self, secret: bytes, counter_key: str = "") -> None:
        self.secret = secret
        self.counter_key = counter_key
        # By item id: the item a segment was made of, and the segment (two dicts, not a pair per item: a cold
        # worker's memo holds thousands).
        self._items: dict[str, Item] = {}
        self._segs: dict[str, Segment] = {}
        self._pointers: dict[str, tuple[Segment, Segment]] = {}  # by result id: its segment and its pointer's
        # Pointer renders stored at write time, by result id: (the result's count, the text, the pointer's count).
        self._stored_pointers: dict[str, tuple[int, str, int]] = {}
        self._chain_prefix = ""
        self._chain: list[Segment] = []
        self._checkpoints: list[Any] = []
        self._scan: HistoryScan | None = None
        self._head: tuple[Checkpoint | None, list[HistoryItem], list[Segment], list[int]] = (None, [], [], [])
        self._logged: tuple[list[HistoryItem], LoggedHistory] = ([], LoggedHistory([], [], [], [].__getitem__))

    def __len__(self) -> int:
        return len(self._segs)

    def lookup(self, item: Item) -> Segment | None:
        """The cached segment of exactly this item object (the warm path's cheap check)."""
        return self._segs.get(item.id) if self._items.get(item.id) is item else None

    def segments(self, items: Sequence[Item], estimator: TokenEstimator) -> list[Segment]:
        """`segment` of each of `items`; in C-level passes when each one is memoised (a cold worker's first build
        takes thousands from the renders stored with them)."""
        ids = list(map(_id, items))
        hits = list(map(operator.is_, map(self._items.get, ids), items))
        segs: list[Segment | None] = list(map(self._segs.get, ids))
        # Only the items not memoised are visited one by one (a warm build's new ones).
        for k in compress(range(len(hits)), map(operator.not_, hits)):
            segs[k] = self.segment(items[k], estimator)
        return cast(list[Segment], segs)

    def pointer_segment(self, result: Segment, item: Callable[[], HistoryItem], estimator: TokenEstimator) -> Segment:
        """The segment of the typed pointer that stands for the tool result whose segment is `result` (`item()`
        gives the result itself, parsed only when its pointer was not stored), made once per result segment."""
        memo = self._pointers.get(result.item_id)
        if memo is not None and memo[0] is result:
            return memo[1]
        stored = self._stored_pointers.get(result.item_id)
        if stored is not None and stored[0] == result.raw_tokens:
            seg = pointer_segment_of(result, stored[1], stored[2])  # read, as a cold worker does: no item made
        else:
            tool_result = item()
            assert isinstance(tool_result, ToolResult), tool_result.kind
            text = render_item(pointer_for(tool_result, result.raw_tokens), self.secret)
            seg = pointer_segment_of(result, text, estimator.count(text))
        # Memoised by the result's id alone, so `forget` drops it with the result.
        self._pointers[result.item_id] = (result, seg)
        return seg

    def adopt_pointers(
        self, result_ids: Sequence[str], result_tokens: Sequence[int], texts: Sequence[str], counts: Sequence[int]
    ) -> None:
        """Take the pointers that may stand for the results `result_ids` (each counted `result_tokens` by this
        cache's counter) from their renders stored at write time (`texts`, counted `counts`), for when a build
        needs them: a cold worker's build of a session under pressure reads its pointers instead of rendering and
        counting them."""
        self._stored_pointers.update(zip(result_ids, zip(result_tokens, texts, counts, strict=True), strict=True))

    def request_hash(self, prefix: FrozenPrefix, body: list[Segment]) -> str:
        """SHA-256 of prefix + body bytes, resumed from the last checkpoint before the first changed segment."""
        if self._chain_prefix != prefix.sha256:
            self._chain_prefix = prefix.sha256
            self._chain = []
            start = hashlib.sha256(prefix.text.encode("utf-8", "surrogatepass"))
            self._checkpoints = [start]
        matches = list(map(operator.is_, body, self._chain))
        same = matches.index(False) if False in matches else len(matches)
        k = same // _HASH_CHECKPOINT_EVERY
        del self._checkpoints[k + 1 :]
        digest = self._checkpoints[k].copy()
        # The texts from the checkpoint on, a checkpoint's worth at a time (one encode and update each).
        texts = list(map(_text, body[k * _HASH_CHECKPOINT_EVERY :]))
        for at in range(0, len(texts), _HASH_CHECKPOINT_EVERY):
            chunk = texts[at : at + _HASH_CHECKPOINT_EVERY]
            digest.update("".join(chunk).encode("utf-8", "surrogatepass"))
            if len(chunk) == _HASH_CHECKPOINT_EVERY:
                self._checkpoints.append(digest.copy())
        self._chain = body
        return str(digest.hexdigest())

    def forget(self, item_ids: set[str]) -> None:
        """Drop the memo of items no build will show again (covered by a checkpoint): memory stays bounded."""
        for item_id in item_ids:
            self._items.pop(item_id, None)
            self._segs.pop(item_id, None)
            self._pointers.pop(item_id, None)
            self._stored_pointers.pop(item_id, None)

    def logged(self, items: Sequence[HistoryItem], estimator: TokenEstimator) -> LoggedHistory:
        """`items` (logged history, in any order) as the builder reads the log: sorted by log position, with their
        segments (memoised: a warm build of the same items makes none)."""
        prev_items, prev = self._logged
        n = len(prev_items)
        if n and n <= len(items) and all(map(operator.is_, items[:n], prev_items)):
            # The last call's items and more (a warm build): the work is the new ones.
            new = list(items[n:])
            seqs = list(map(_seq, new))
            if not seqs or (seqs[0] > prev.seqs[-1] and not any(map(operator.gt, seqs, seqs[1:]))):
                history = prev_items + new
                segs = [*cast(list[Segment], prev.segments), *self.segments(new, estimator)]
                logged = LoggedHistory([*prev.seqs, *seqs], segs, [*prev.ids, *map(_id, new)], history.__getitem__)
                self._logged = (history, logged)
                return logged
        history = list(items)
        seqs = list(map(_seq, history))
        if any(map(operator.gt, seqs, seqs[1:])):
            history.sort(key=_seq)
            seqs = list(map(_seq, history))
        logged = LoggedHistory(seqs, self.segments(history, estimator), list(map(_id, history)), history.__getitem__)
        self._logged = (history, logged)
        return logged

    def checkpoint_head(
        self, checkpoint: Checkpoint | None, estimator: TokenEstimator
    ) -> tuple[list[HistoryItem], list[Segment], list[int]]:
        """What a request shows of `checkpoint` (`apply_checkpoint`: its summary, then its pointers), in log order:
        the items, their segments and their positions; made again only for another checkpoint."""
        prev, items, segs, seqs = self._head
        if checkpoint is None:
            return [], [], []
        if prev is not checkpoint and prev != checkpoint:
            items = sorted(apply_checkpoint((), checkpoint), key=_seq)
            segs = [self.segment(item, estimator) for item in items]
            seqs = list(map(_seq, items))
            self._head = (checkpoint, items, segs, seqs)
        return items, segs, seqs

    def scan_history(self, older: list[Segment]) -> HistoryScan:
        """Counts and pairing of the older history's segments, extending the previous scan when it is a prefix."""
        prev = self._scan
        n = len(prev.segs) if prev is not None else 0
        if prev is not None and n <= len(older) and all(map(operator.is_, older[:n], prev.segs)):
            scan = prev.extend(older)
        else:
            scan = HistoryScan().extend(older)
        self._scan = scan
        return scan

    def segment(self, item: Item, estimator: TokenEstimator) -> Segment:
        known = self._items.get(item.id)
        if known is not None and (known is item or known == item):
            return self._segs[item.id]
        text = render_item(item, self.secret)
        if type(item) is TurnContext:  # a new one per request (its id names the call): not worth a memo entry
            return segment_of(item, text, estimator.count(text))
        return self.adopt(item, text, estimator.count(text))

    def adopt(self, item: Item, text: str, raw_tokens: int) -> Segment:
        """Take `item`'s segment from its render stored at write time (`text`, counted as `raw_tokens` by this
        cache's counter) instead of rendering and counting it again: a cold worker's build reads, not renders.
        Renders are deterministic (the nonce comes from the secret and the item id), so the two are the same
        bytes; the determinism gate re-renders stored items to check it."""
        seg = segment_of(item, text, raw_tokens)
        self._items[item.id] = item
        self._segs[item.id] = seg
        return seg

    def adopt_all(self, items: Sequence[Item], texts: Sequence[str], counts: Sequence[int]) -> list[Segment]:
        """`adopt` for each of `items` (rendered as `texts`, counted as `counts`), their segments made in one go."""
        segs = segments_of(items, texts, counts)
        ids = list(map(_id, items))
        self._items.update(zip(ids, items, strict=True))
        self._segs.update(zip(ids, segs, strict=True))
        return segs


def _type_fields(cls: type[Item]) -> tuple[Region, BudgetClass, Role, bool, bool]:
    """What the segments of an item type share: region, budget class, role, whether the kind pairs (has a call
    id), and whether its taint is the base rule's (its own flag, or untrusted content)."""
    return (
        cls.region,
        cls.budget_class,
        cls.role,
        "call_id" in cls.model_fields,
        cls.taints_view is Item.taints_view,
    )


_TYPE_FIELDS = {t: _type_fields(t) for t in ITEM_TYPES}


def segment_of(item: Item, text: str, raw_tokens: int) -> Segment:
    """`item`'s segment, rendered as `text` and counted as `raw_tokens`: the one place its fields are derived (a
    pointer's without its item: `pointer_segment_of`, tested equal to this)."""
    cls = type(item)
    region, budget_class, role, paired, _ = _TYPE_FIELDS.get(cls) or _type_fields(cls)
    # In field order, positionally (a cold worker's memo makes one per logged item; keywords cost it a third more):
    # item_id, kind, region, budget_class, role, trust, text, raw_tokens, call_id, taints. Only the kinds that
    # pair have a call id (a missing attribute costs a pydantic model an exception).
    return Segment(
        item.id,
        item.kind,
        region,
        budget_class,
        role,
        item.trust,
        text,
        raw_tokens,
        item.call_id if paired else None,  # type: ignore[attr-defined]
        item.taints_view(),
    )


def segments_of(items: Sequence[Item], texts: Sequence[str], counts: Sequence[int]) -> list[Segment]:
    """Each item's segment, as `segment_of` makes it (a cold worker's memo makes thousands): column by column, in
    C-level passes, when every item's type is known and taints by the base rule; else one by one."""
    fields: list[Any] = list(map(_TYPE_FIELDS.get, map(type, items)))
    if None in fields or not all(map(_base_taint, fields)):
        return list(map(segment_of, items, texts, counts))
    # An item's fields by name, from its `__dict__` (a pydantic model keeps them there, defaults included).
    data = list(map(_fields, items))
    return _segments(data, fields, list(map(_trust_field, data)), texts, counts)


def segments_of_logged(
    ids: Sequence[str],
    kinds: Sequence[str],
    trusts: Sequence[str],
    call_ids: Sequence[str | None],
    taints: Sequence[bool | None],
    texts: Sequence[str],
    counts: Sequence[int],
) -> list[Segment] | None:
    """Each logged item's segment, as `segment_of` makes it of the item, from the item's head as stored with it
    (its id, kind, trust, call id and its segment's taint, which `segment_of` gave when it was logged) without
    making the item: a worker that has not seen a session makes thousands, column by column. None when a taint was
    not stored or a kind is not a logged one (the caller makes those items)."""
    fields: list[Any] = list(map(_LOGGED_FIELDS.get, kinds))
    if None in fields or None in taints:
        return None
    # A stored taint means the item was validated when it was logged (a segment was made of it): only the kinds
    # that pair have a call id there (items forbid other fields), as in `segment_of`.
    return list(
        map(
            Segment,
            ids,
            kinds,
            map(_first, fields),
            map(_second, fields),
            map(_third, fields),
            map(_TRUST.__getitem__, trusts),
            texts,
            counts,
            call_ids,
            taints,
        )
    )


def _segments(
    data: Sequence[dict[str, Any]],
    fields: Sequence[tuple[Region, BudgetClass, Role, bool, bool]],
    trusts: list[TrustLevel],
    texts: Sequence[str],
    counts: Sequence[int],
) -> list[Segment]:
    """Segments in C-level passes from each item's fields by name (`data`), its type's (`fields`) and its trust: a
    call id is None for the kinds that do not pair (they have none), as in `segment_of`."""
    taints = map(
        operator.or_,
        map(dict.get, data, repeat("tainted"), repeat(False)),
        map(operator.is_, trusts, repeat(TrustLevel.EXTERNAL_UNTRUSTED)),
    )
    return list(
        map(
            Segment,
            map(_id_field, data),
            map(_kind_field, data),
            map(_first, fields),
            map(_second, fields),
            map(_third, fields),
            trusts,
            texts,
            counts,
            map(dict.get, data, repeat("call_id")),
            taints,
        )
    )


# Each logged kind's type fields (`_TYPE_FIELDS`), by kind.
_LOGGED_FIELDS = {t.model_fields["kind"].default: _TYPE_FIELDS[t] for t in get_args(HistoryItem)}
_TRUST = {level.value: level for level in TrustLevel}


def open_prefix(
    inputs: PrefixInputs, *, budget: ContextBudget, estimator: TokenEstimator, secret: bytes
) -> FrozenPrefix:
    """Render Region A, measure every class exactly, and refuse to open if any class is over its cap."""
    # The count cap is the operator's: the platform's own control tool does not take one of the 30 places
    # (its tokens still count against the tools' token cap).
    if operator_tool_count(inputs) > budget.tools_max_count:
        raise PrefixOverflowError("tools", operator_tool_count(inputs), budget.tools_max_count, unit="tools")
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
    cache = RenderCache(secret, counter_key(estimator))
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
        escaping_fingerprint=ESCAPING_FINGERPRINT,
    )


_seq = attrgetter("seq")
_raw_tokens = attrgetter("raw_tokens")
_kind = attrgetter("kind")
_taints = attrgetter("taints")
_text = attrgetter("text")
_id = attrgetter("id")
_first, _second, _third = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
_base_taint = operator.itemgetter(4)  # a `_TYPE_FIELDS` entry's: the type taints by `Item.taints_view`
_fields = attrgetter("__dict__")
_id_field, _kind_field, _trust_field = map(operator.itemgetter, ("id", "kind", "trust"))
_HASH_CHECKPOINT_EVERY = 64
_POINTER = "elided_span"
_RESULT = "tool_result"
# The kinds of the per-request segments that close a body, after the recall (core.order.SECTIONS).
_LAST_KINDS = frozenset({"working_state", "turn_context", "current_message"})
POINTER_BATCH = 8
POINTER_SUFFIX = "#pointer"  # a typed pointer's id is the tool result's with this after it


def build(
    prefix: FrozenPrefix,
    body: BodyInputs,
    *,
    budget: ContextBudget,
    estimator: TokenEstimator,
    secret: bytes,
    cache: RenderCache | None = None,
) -> ContextPlan:
    """Assemble one request. Pure: the plan depends only on the arguments, never on the cache's contents.

    The warm path is one pass over the history: rendering, counting and pointers come from the cache,
    running totals replace re-summing, and the request hash resumes from the last unchanged segment.
    """
    key = counter_key(estimator)
    if cache is None or cache.secret != secret or cache.counter_key not in ("", key):
        cache = RenderCache(secret, key)  # counts are per tokenizer: another one means another memo
    cache.counter_key = key  # a new cache is bound to the first tokenizer it serves
    unit = estimator.body_unit()
    per_msg = estimator.profile.per_message_tokens
    prefix_tokens = estimator.prefix_tokens(prefix.raw_tokens, prefix.tool_count)
    prefix_reserve = estimator.prefix_reserve(prefix.raw_tokens, prefix.tool_count)
    available = budget.input_limit - prefix_reserve

    def est(seg: Segment) -> float:
        return (seg.raw_tokens + per_msg) * unit

    # The history a request shows (`apply_checkpoint`), as segments and positions in log order, and the item
    # behind each (`item_at`, looked into only for a tool result whose pointer was not stored).
    logged = body.history if isinstance(body.history, LoggedHistory) else cache.logged(body.history, estimator)
    head_items, head_segs, head_seqs = cache.checkpoint_head(body.checkpoint, estimator)
    cut = bisect.bisect_right(logged.seqs, body.checkpoint.covers_to_seq) if body.checkpoint is not None else 0
    shown = logged.segments[cut:]
    seqs = [*head_seqs, *logged.seqs[cut:]]
    n_head = len(head_items)

    def item_at(k: int) -> HistoryItem:
        return head_items[k] if k < n_head else logged.item(cut + k - n_head)

    if missing(shown):  # items no segment was made of yet (the turn's message, one logged without its render)
        shown = [seg or cache.segment(item_at(n_head + k), estimator) for k, seg in enumerate(shown)]
    history = cast(list[Segment], [*head_segs, *shown])
    split = bisect.bisect_left(seqs, body.turn_start_seq)
    older_history, active = history[:split], history[split:]

    # Never yield: current message, working state, correction lines, turn context, the active turn's items.
    fixed_items: list[Item] = [*body.corrections]
    if body.working_state is not None:
        # Its cap is enforced when it is written (measure_working_state); here it never yields.
        fixed_items.append(body.working_state)
    if body.turn_context is not None:
        fixed_items.append(body.turn_context)
    if body.current is not None:
        fixed_items.append(body.current)
    fixed = [*active, *(cache.segment(item, estimator) for item in fixed_items)]
    fixed_total = sum(map(est, fixed))
    # Yield inside the active turn: its results may become pointers (the call stays, so the pair stays whole).
    active_pointers = _active_pointer_candidates(active, split, item_at, cache, estimator)
    minimum = fixed_total - sum(est(s) - est(p) for s, p in active_pointers)
    if minimum > available:
        by_class: dict[str, int] = {}
        instead = {id(s): p for s, p in active_pointers}
        for s in fixed:
            seg = instead.get(id(s), s)
            by_class[seg.budget_class.value] = by_class.get(seg.budget_class.value, 0) + math.ceil(est(seg))
        raise TurnTooLargeError(by_class, available, prefix_tokens=prefix_reserve, input_limit=budget.input_limit)

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
                step=YieldStep.RECALL_DROPPED, reason="cap", item_ids=capped, tokens_freed=math.ceil(capped_tokens)
            )
        )

    # Older history: segments, counts, running totals and which results may become pointers. The pass is
    # memoised: when the previous build's older history is a prefix of this one, only new items are visited.
    scan = cache.scan_history(older_history)
    older_segs = list(scan.segs)
    older_raw = list(scan.raws)
    truncatable = scan.truncatable
    older_raw_total = scan.raw_total
    results_raw = scan.results_raw
    older_pointers = scan.pointers
    older_tainted = scan.tainted
    older_n = len(older_segs)
    active_results = sum(est(s) for s in active if s.kind == _RESULT)
    results_cap = budget.tool_results_cap(available)
    cursor = 0

    def older_total() -> float:
        return (older_raw_total + older_n * per_msg) * unit

    def results_total() -> float:
        return (results_raw + len(truncatable) * per_msg) * unit + active_results

    def truncate_until(limit_ok: Callable[[], bool], reason: str) -> None:
        nonlocal cursor, results_raw, older_raw_total, older_pointers, older_tainted
        freed_ids: list[str] = []
        freed = 0
        # Pointers come in batches: each conversion rewrites the history from that result on, so converting
        # several at once leaves the cached history prefix intact for longer (more cache hits, same total).
        while cursor < len(truncatable) and (not limit_ok() or (freed_ids and cursor % POINTER_BATCH)):
            index = truncatable[cursor]
            cursor += 1
            original = scan.segs[index]
            pseg = cache.pointer_segment(original, functools.partial(item_at, index), estimator)
            delta = older_raw[index] - pseg.raw_tokens
            if delta <= 0:
                continue  # a pointer no smaller than its result would destroy content for nothing
            older_pointers += 1
            older_tainted += pseg.taints - older_segs[index].taints
            older_segs[index] = pseg
            older_raw[index] = pseg.raw_tokens
            older_raw_total -= delta
            results_raw -= delta
            freed += delta
            freed_ids.append(original.item_id)
        if freed_ids:
            yields.append(
                YieldApplied(
                    step=YieldStep.TOOL_RESULTS_TO_POINTERS,
                    reason=reason,
                    item_ids=freed_ids,
                    tokens_freed=math.ceil(freed * unit),
                )
            )

    truncate_until(lambda: results_total() <= results_cap, "cap")

    def total() -> float:
        return fixed_total + recall_total + older_total()

    if total() > available and recall:
        # Yield 1: in-turn recall, lowest rank first.
        dropped: list[str] = []
        freed_recall = 0.0
        while recall and total() > available:
            gone, _, e = recall.pop()
            recall_total -= e
            dropped.append(gone.id)
            freed_recall += e
        yields.append(
            YieldApplied(
                step=YieldStep.RECALL_DROPPED,
                reason="pressure",
                item_ids=dropped,
                tokens_freed=math.ceil(freed_recall),
            )
        )
    if total() > available:
        # Yield 2: tool results to typed pointers, oldest first.
        truncate_until(lambda: total() <= available, "pressure")

    compactable = _compactable(seqs[:split], body.checkpoint)
    pointered: dict[str, Segment] = {}
    if total() > available and active_pointers:
        # Yield 2, inside the active turn, oldest first: as far as the active turn alone needs while older
        # history can still be compacted (compaction cannot shrink the active turn), all the way otherwise.
        def active_done() -> bool:
            return (fixed_total if compactable else total()) <= available

        freed_active = 0.0
        for seg, pseg in active_pointers:
            if active_done():
                break
            pointered[seg.item_id] = pseg
            freed_active += est(seg) - est(pseg)
            fixed_total -= est(seg) - est(pseg)
        if pointered:
            yields.append(
                YieldApplied(
                    step=YieldStep.ACTIVE_TOOL_RESULTS_TO_POINTERS,
                    reason="pressure",
                    item_ids=list(pointered),
                    tokens_freed=math.ceil(freed_active),
                )
            )
    dropped_pointers: set[int] = set()
    if total() > available and not compactable:
        # The minimum body: nothing is left to compact and the active turn is pointers, so the checkpoint's own
        # pointers go, oldest first (each still resolves by its reference; the summary names the checkpoints).
        dropped_ids: list[str] = []
        freed_cp = 0
        for index, h in enumerate(older_segs):
            if total() <= available:
                break
            if h.kind == _POINTER and h.call_id is None:
                dropped_pointers.add(index)
                older_pointers -= 1
                older_tainted -= h.taints
                dropped_ids.append(h.item_id)
                freed_cp += older_raw[index]
                older_raw_total -= older_raw[index]
                older_n -= 1
        if dropped_ids:
            yields.append(
                YieldApplied(
                    step=YieldStep.CHECKPOINT_POINTERS_DROPPED,
                    reason="pressure",
                    item_ids=dropped_ids,
                    tokens_freed=math.ceil((freed_cp + len(dropped_ids) * per_msg) * unit),
                )
            )
    estimated_body = total()
    status = PlanStatus.FITS if estimated_body <= available else PlanStatus.NEEDS_COMPACTION
    deficit = max(0, math.ceil(estimated_body - available))

    # Built in assembly order (core.order.SECTIONS): history, corrections, recall, working state, turn
    # context, current message. Tests assert it against order_key; sorting here would cost a pass per build.
    tail = [pointered.get(s.item_id) or s for s in active]
    if dropped_pointers:
        older_segs = [seg for index, seg in enumerate(older_segs) if index not in dropped_pointers]
    tail += [cache.segment(c, estimator) for c in sorted(body.corrections, key=attrgetter("id"))]
    tail += [s for _, s, _ in recall]
    tail += [s for s in fixed[len(active) :] if s.kind in _LAST_KINDS]
    body_segments = older_segs + tail
    # Pointers keep their result's call_id, so the pairing of the older history is the scan's.
    validate_pairs(tail, scan.pairs)

    tokens_by_class = dict(prefix.class_tokens)
    class_raw: dict[BudgetClass, list[int]] = {}
    for seg in tail:
        acc = class_raw.setdefault(seg.budget_class, [0, 0])
        acc[0] += seg.raw_tokens
        acc[1] += 1
    history_raw = older_raw_total - results_raw
    history_n = older_n - len(truncatable)
    for cls, raw, n in (
        (BudgetClass.HISTORY, history_raw, history_n),
        (BudgetClass.TOOL_RESULTS, results_raw, len(truncatable)),
    ):
        if n:
            acc = class_raw.setdefault(cls, [0, 0])
            acc[0] += raw
            acc[1] += n
    for cls, (raw, n) in class_raw.items():
        tokens_by_class[cls.value] = math.ceil((raw + n * per_msg) * unit)
    body_tokens = math.ceil(estimated_body)
    raw_total = prefix.raw_tokens + older_raw_total + sum(s.raw_tokens for s in tail)
    return ContextPlan.model_construct(
        epoch=prefix.epoch,
        prefix_sha256=prefix.sha256,
        request_sha256=cache.request_hash(prefix, body_segments),
        segments=prefix.segments + body_segments,
        prefix_text=prefix.text,
        status=status,
        deficit_tokens=deficit,
        estimated_tokens=prefix_reserve + body_tokens,
        raw_tokens=raw_total
        + len(body_segments) * per_msg
        + prefix.tool_count * estimator.profile.per_tool_tokens
        + estimator.profile.request_overhead_tokens,
        input_limit=budget.input_limit,
        prefix_tokens=prefix_tokens,
        body_tokens=body_tokens,
        prefix_margin_tokens=prefix_reserve - prefix_tokens,
        tokens_by_class=tokens_by_class,
        yields=yields,
        untrusted_in_view=older_tainted > 0 or any(s.taints for s in tail),
        pointers=older_pointers
        + sum(s.kind == _POINTER for s in tail)
        + sum(s.kind == _POINTER for s in prefix.segments),
    )


def _compactable(older_seqs: Sequence[int], checkpoint: Checkpoint | None) -> bool:
    """Whether compaction would find a span: an older item the checkpoint does not cover (plan_compaction's rule);
    `older_seqs`: the older history's positions, in log order."""
    if checkpoint is None:
        return bool(older_seqs)
    return bool(older_seqs) and older_seqs[-1] > checkpoint.covers_to_seq


def _active_pointer_candidates(
    active: list[Segment],
    start: int,
    item_at: Callable[[int], HistoryItem],
    cache: RenderCache,
    estimator: TokenEstimator,
) -> list[tuple[Segment, Segment]]:
    """The active turn's results (`active`, from history index `start`), oldest first, with the pointer each may
    become (only when that is smaller)."""
    out: list[tuple[Segment, Segment]] = []
    for k, seg in enumerate(active):
        if seg.kind == _RESULT:
            pseg = cache.pointer_segment(seg, functools.partial(item_at, start + k), estimator)
            if pseg.raw_tokens < seg.raw_tokens:
                out.append((seg, pseg))
    return out


def pointer_segment_of(result: Segment, text: str, raw_tokens: int) -> Segment:
    """The segment of `pointer_for(...)` of the tool result whose segment is `result`, rendered as `text` and
    counted as `raw_tokens`, without the result or the pointer item (a cold worker's build of a session under
    pressure makes hundreds): `segment_of` of the pointer, field for field (`tests/unit/test_yields.py` compares
    them). The pointer's id, trust and call id are the result's; it shows none of the content, so it never taints
    the view (`ElidedSpan.taints_view`)."""
    region, budget_class, role, _, _ = _TYPE_FIELDS[ElidedSpan]
    return Segment(
        f"{result.item_id}{POINTER_SUFFIX}",
        _POINTER,
        region,
        budget_class,
        role,
        result.trust,
        text,
        raw_tokens,
        result.call_id,
        False,
    )


def pointer_for(result: ToolResult, raw_tokens: int) -> ElidedSpan:
    """The typed pointer that stands for `result` (counted `raw_tokens`) when the build turns it into one."""
    return ElidedSpan(
        id=f"{result.id}{POINTER_SUFFIX}",
        trust=result.trust,
        tainted=result.tainted,  # a result derived from untrusted content says so as a pointer too
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
