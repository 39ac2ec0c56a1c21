"""Pre-send validation (ADR-0020 decision 9): a tool call and its result are one unit; orphans never go out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import cast

from core.errors import OrphanedToolItemError
from core.plan import Segment

_CALL = "tool_call"
_call_id = attrgetter("call_id")
_RESULT_KINDS = frozenset({"tool_result", "elided_span"})


class PairState:
    """Pairing of calls and results over a prefix of segments, so a longer list can be checked from there."""

    def __init__(self) -> None:
        self.open_calls: dict[str, str] = {}
        self.answered: set[str] = set()
        self.orphans: list[str] = []

    def copy(self) -> PairState:
        other = PairState()
        other.open_calls = dict(self.open_calls)
        other.answered = set(self.answered)
        other.orphans = list(self.orphans)
        return other

    def feed(self, segments: Iterable[Segment]) -> PairState:
        # Only the segments with a call id are visited (picked in C: a log's thousands are mostly messages).
        segs = list(segments)
        for seg in compress(segs, map(is_not, map(_call_id, segs), repeat(None))):
            call_id = cast(str, seg.call_id)
            if seg.kind == _CALL:
                if call_id in self.open_calls or call_id in self.answered:
                    self.orphans.append(seg.item_id)  # a second call reusing an id is as malformed as an orphan
                else:
                    self.open_calls[call_id] = seg.item_id
            elif seg.kind in _RESULT_KINDS:
                if call_id in self.open_calls:
                    del self.open_calls[call_id]
                    self.answered.add(call_id)
                else:
                    self.orphans.append(seg.item_id)
        return self

    def result(self) -> list[str]:
        return [*self.orphans, *self.open_calls.values()]


def find_orphans(segments: Sequence[Segment]) -> list[str]:
    """Item ids of calls without exactly one later result, and of results without an earlier call."""
    return PairState().feed(segments).result()


def validate_pairs(segments: Sequence[Segment], state: PairState | None = None) -> None:
    """Raise unless every call has its result. `state` (already fed with earlier segments) is not modified."""
    orphans = (state.copy() if state is not None else PairState()).feed(segments).result()
    if orphans:
        raise OrphanedToolItemError(orphans)
