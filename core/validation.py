"""Pre-send validation (ADR-0020 decision 9): a tool call and its result are one unit; orphans never go out."""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import OrphanedToolItemError
from core.plan import Segment

_CALL = "tool_call"
_RESULT_KINDS = frozenset({"tool_result", "elided_span"})


def find_orphans(segments: Sequence[Segment]) -> list[str]:
    """Item ids of calls without exactly one later result, and of results without an earlier call."""
    open_calls: dict[str, str] = {}
    answered: set[str] = set()
    orphans: list[str] = []
    for seg in segments:
        if seg.kind == _CALL and seg.call_id is not None:
            if seg.call_id in open_calls or seg.call_id in answered:
                orphans.append(seg.item_id)  # a second call reusing an id is as malformed as an orphan
            else:
                open_calls[seg.call_id] = seg.item_id
        elif seg.kind in _RESULT_KINDS and seg.call_id is not None:
            if seg.call_id in open_calls:
                del open_calls[seg.call_id]
                answered.add(seg.call_id)
            else:
                orphans.append(seg.item_id)
    orphans.extend(open_calls.values())
    return orphans


def validate_pairs(segments: Sequence[Segment]) -> None:
    orphans = find_orphans(segments)
    if orphans:
        raise OrphanedToolItemError(orphans)
