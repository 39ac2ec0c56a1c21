"""What the store's reads return: one frozen dataclass per kind of row, so no caller indexes a row by column
name. JSON columns stay JSON (`dict`); the models that give them meaning (`FrozenPrefix`, `PlanSummary`,
`RequestInputs`, ...) are validated by the caller that needs them. `ItemRender` goes the other way: what a
write stores beside each item it logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import repeat
from typing import Any

from core.items import HistoryItem, parse_history_item, parse_history_json


@dataclass(frozen=True, slots=True)
class StoredSession:
    open: dict[str, Any]  # the SessionOpen, as JSON
    secret: bytes
    created_at: datetime
    closed_at: datetime | None
    close_reason: str | None


@dataclass(frozen=True, slots=True)
class SessionClaim:
    """A claim of a session id by a run: whether the run holds it, and the session that holds the id."""

    owned: bool
    secret: bytes
    created_at: datetime
    closed_at: datetime | None


@dataclass(frozen=True, slots=True)
class LoggedItem:
    """One item of the session log: its position, the turn that wrote it, the item as JSON."""

    seq: int
    turn: int
    payload: dict[str, Any]
    rendered: str | None = None  # the item's segment text, rendered when it was written (None: not stored)
    tokens: dict[str, int] | None = None  # its raw token count per counter key, counted when it was written
    # Whether its segment's other fields were stored too (migration 6): a request body may then refer to it.
    referable: bool = False
    pointer: dict[str, Any] | None = None  # a tool result's pointer render: {"text", "tokens" per counter key}


@dataclass(frozen=True, slots=True)
class LiveLog:
    """Logged items as a worker's memo reads them (`Store.load_live_items` and the activities' reads), in log
    order: each item's position and head (id, kind, trust, call id, and its segment's taint: None when no segment
    was stored), what its item is made of (`ItemSource`: the memo makes it when a caller looks into it), and what
    was stored with it when it was logged (`LoggedItem` is one row as JSON). Columns, not an object per row: a
    worker that has not seen the session reads thousands of them."""

    seqs: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    trusts: list[str] = field(default_factory=list)
    call_ids: list[str | None] = field(default_factory=list)
    taints: list[bool | None] = field(default_factory=list)
    sources: list[ItemSource] = field(default_factory=list)
    renders: list[str | None] = field(default_factory=list)  # each one's segment text (None: not stored)
    # Each one's raw token count, one column per counter key (None: not counted by it): `count_columns`.
    counts: dict[str, list[int | None]] = field(default_factory=dict)
    # Whether its segment's other fields were stored too: a request body may refer to it.
    referable: list[bool] = field(default_factory=list)
    # A tool result's pointer render: {"text", "tokens" per counter key}.
    pointers: list[dict[str, Any] | None] = field(default_factory=list)

    @classmethod
    def of_payloads(
        cls,
        payloads: list[dict[str, Any]],
        segments: list[dict[str, Any] | None],
        renders: list[str | None],
        counts: list[dict[str, int] | None],
        pointers: list[dict[str, Any] | None],
    ) -> LiveLog:
        """Logged items from their JSON (dicts, `seq` set) and their stored segments' other fields (`ItemRender`'s
        `segment`; None: not stored)."""
        stored = [s or {} for s in segments]
        return cls(
            seqs=[p["seq"] for p in payloads],
            ids=[p["id"] for p in payloads],
            kinds=[p["kind"] for p in payloads],
            trusts=[p["trust"] for p in payloads],
            call_ids=[p.get("call_id") for p in payloads],
            taints=[s.get("taints") for s in stored],
            sources=list(payloads),
            renders=renders,
            counts=count_columns(counts),
            referable=[s is not None for s in segments],
            pointers=pointers,
        )

    @property
    def items(self) -> list[HistoryItem]:
        """Each logged item, made of its source."""
        made: dict[int, list[HistoryItem]] = {}
        out: list[HistoryItem] = []
        for seq, source in zip(self.seqs, self.sources, strict=True):
            if isinstance(source, dict):
                out.append(parse_history_item(source))
            else:
                run = made.get(id(source)) or made.setdefault(id(source), items_of(source))
                out.append(run[seq - source[1]])
        return out


# What a logged item is made of: its JSON as a dict, or the JSON texts of a run of items at consecutive positions
# (a block's, or one row's) joined by commas and the run's first position (`items_of`). The items of one block
# share one source, so the first of them a caller looks into makes them all, in one pass.
ItemSource = dict[str, Any] | tuple[str, int]


def items_of(source: tuple[str, int]) -> list[HistoryItem]:
    """The items of a run's source, in log order."""
    return parse_history_json([source[0]])


@dataclass(frozen=True, slots=True)
class ItemRender:
    """An item's render, stored with it when it is logged (render once, at write time): its segment text, its
    raw token count per counter key, its segment's other fields (a `Segment` without `text` and `raw_tokens`),
    so a stored request body refers to the item instead of copying its segment, and for a tool result its
    pointer's render and count."""

    text: str
    tokens: dict[str, int]
    segment: dict[str, Any]
    # A tool result's pointer (what a build under pressure shows instead), rendered and counted too.
    pointer: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    trust: str
    media_type: str
    content: str


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a pointer's reference stands for (`Store.resolve`): the original text, its trust level, and whether it
    was written while untrusted content was in view (`tainted`: a note the model saved after reading a page is
    `TOOL` content derived from untrusted content)."""

    content: str
    trust: str
    tainted: bool


@dataclass(frozen=True, slots=True)
class StoredPrefix:
    """An epoch's frozen prefix (`FrozenPrefix` JSON), its route's profile (`ModelProfile` JSON) and the Region A
    inputs it was measured from (`PrefixInputs` JSON)."""

    sha256: str
    reason: str
    profile: dict[str, Any]
    prefix: dict[str, Any]
    inputs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A rendered request: its prefix hash and its body segments (as JSON), whole; or, as a model call reads it,
    with references to logged items left in (`{"ref", "session", "counter"}`: its worker's memo holds them)."""

    prefix_sha256: str
    body: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class EpochPrefix:
    """A distinct prefix hash of an epoch's requests, and the first turn that sent it."""

    prefix_sha256: str
    first_turn: int


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as built (estimate, plan summary and inputs as JSON) and, once answered, its usage."""

    session_id: str
    turn: int
    call_index: int
    epoch: int
    prefix_sha256: str
    request_sha256: str
    estimated_tokens: int
    raw_tokens: int
    plan: dict[str, Any]  # PlanSummary JSON
    inputs: dict[str, Any]  # RequestInputs JSON
    actual_input_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    created_at: datetime
    wire_prefix_sha256: str | None


@dataclass(frozen=True, slots=True)
class StoredWirePrefix:
    """A distinct wire prefix of an epoch, exactly as an adapter sent it, and the first turn that sent it."""

    sha256: str
    text: str
    first_turn: int


@dataclass(frozen=True, slots=True)
class StoredEvent:
    event_key: str
    type: str
    turn: int
    epoch: int
    payload: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """A memory as a request holds it: snapshot, recall or correction (`corrects`: the memory it corrects)."""

    memory_id: str
    text: str
    trust: str
    corrects: str | None = None


@dataclass(frozen=True, slots=True)
class WrittenMemory:
    """A memory with its provenance: the session that wrote it (None for a tombstone) and what it corrects."""

    memory_id: str
    text: str
    source_session: str | None
    corrects: str | None


@dataclass(frozen=True, slots=True)
class SummarizerCall:
    """One summarizer call of a compaction: the exact input and the summary stored beside it."""

    checkpoint_id: str
    chunk_index: int
    input: str
    summary: str


@dataclass(frozen=True, slots=True)
class MemoryCandidate:
    """A fact offered to memory formation, and what its gates decided."""

    session_id: str
    fact_id: str
    text: str
    accepted: bool
    gate: str | None
    reason: str
    memory_id: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class TurnReads:
    """Everything a build reads, in one round trip (`Store.turn_reads`): the session, the log after the
    worker's memo, the epoch's prefix (when not memoised), the route's calibrations, the working-state writes,
    the latest checkpoint, the snapshot's corrections and the recall for the turn's message (when asked)."""

    session: StoredSession
    items: LiveLog
    prefix: StoredPrefix | None
    calibration: float | None
    provider_calibration: float | None
    working_state_writes: list[dict[str, Any]]
    checkpoint: dict[str, Any] | None
    corrections: list[MemoryRow]
    recall: list[MemoryRow] | None  # None: no query was given (the caller searches later)


@dataclass(frozen=True, slots=True)
class CallReads:
    """Everything a model call reads, in one round trip (`Store.call_reads`): the session, the request's record,
    the log after the worker's memo (and after the latest checkpoint, the last position it covers: -1 for none),
    the route's calibrations and, for a worker that did not build it, the request's body with its references to
    logged items left in (`SessionCache.resolved` takes them from the memo this read brings up to date).
    `session` is None when nothing was read: the worker that built the request answers its first attempt from
    its memo."""

    session: StoredSession | None
    record: RequestRecord | None
    items: LiveLog
    covers_to_seq: int
    calibration: float | None
    provider_calibration: float | None
    request: StoredRequest | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a model call's write did (`Store.record_outcome`): whether its usage and its event were recorded now
    (an earlier attempt's stay), the reply's positions (none: its group was logged already), and the route's
    calibration after it with its provider's highest, as the next build will read them."""

    usage_recorded: bool
    event_added: bool
    seqs: list[int]
    calibration: float
    provider_calibration: float


def count_columns(counts: Sequence[dict[str, int] | None]) -> dict[str, list[int | None]]:
    """Items' counts (each its raw token count per counter key; None: not counted) as one column per counter key,
    a key present when an item was counted by it: the form a block stores them in (migration 9)."""
    keys = sorted({key for by_key in counts if by_key for key in by_key})
    dicts = [by_key or {} for by_key in counts]
    return {key: list(map(dict.get, dicts, repeat(key))) for key in keys}


def joined_counts(parts: Sequence[tuple[int, dict[str, list[int | None]]]]) -> dict[str, list[int | None]]:
    """Count columns of consecutive runs of items (each run's length and its columns) as the columns of them all:
    a run without a key's column was not counted by it."""
    out: dict[str, list[int | None]] = {}
    for key in sorted({key for _, columns in parts for key in columns}):
        column: list[int | None] = []
        for n, columns in parts:
            column += columns.get(key) or [None] * n
        out[key] = column
    return out
