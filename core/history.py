"""The session log as the builder reads it (`core.build.build`): column by column, in log order."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat

from core.items import HistoryItem
from core.plan import Segment


class LoggedHistory:
    """Logged history items in log order, as columns: each one's log position, its segment (rendered and counted by
    the build's counter; None: not made yet, so the builder renders the item), and the item itself only when a
    build looks into it (`item`).

    A worker that has not seen a session makes its memo of thousands of items from their renders stored at write
    time: the build reads their segments, and parses only the items it looks into (a tool result whose pointer was
    not stored). A list of items is one too: `of` (the builder renders them), or `RenderCache.logged` (the
    builder's memo of their segments, which `build` uses for a `BodyInputs` given items)."""

    __slots__ = ("_item", "ids", "segments", "seqs")

    def __init__(
        self,
        seqs: Sequence[int],
        segments: Sequence[Segment | None],
        ids: Sequence[str],
        item: Callable[[int], HistoryItem],
    ) -> None:
        if not len(seqs) == len(segments) == len(ids):
            raise ValueError(
                f"a logged history needs one segment and id per position: {len(seqs)}, {len(segments)}, {len(ids)}"
            )
        self.seqs = seqs
        self.segments = segments
        self.ids = ids
        self._item = item

    @classmethod
    def of(cls, items: Sequence[HistoryItem]) -> LoggedHistory:
        """`items` (in log order), none of their segments made yet."""
        return cls([i.seq for i in items], [None] * len(items), [i.id for i in items], items.__getitem__)

    def __len__(self) -> int:
        return len(self.seqs)

    def item(self, k: int) -> HistoryItem:
        """The item at index `k`."""
        return self._item(k)

    def head(self, k: int) -> LoggedHistory:
        """The first `k` items."""
        return LoggedHistory(self.seqs[:k], self.segments[:k], self.ids[:k], self._item)

    def without(self, at: int, k: int) -> LoggedHistory:
        """The first `k` items but the one at index `at`."""
        item = self._item

        def shifted(j: int) -> HistoryItem:
            return item(j if j < at else j + 1)

        return LoggedHistory(
            [*self.seqs[:at], *self.seqs[at + 1 : k]],
            [*self.segments[:at], *self.segments[at + 1 : k]],
            [*self.ids[:at], *self.ids[at + 1 : k]],
            shifted,
        )


def missing(segments: Sequence[Segment | None]) -> bool:
    """Whether a segment of `segments` is not made yet (None). By identity: `None in segments` would call a
    segment's `__eq__` (Python code) once per segment."""
    return not all(map(operator.is_not, segments, repeat(None)))
