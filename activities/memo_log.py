"""A worker's memo of a session's log (`SessionCache.items`): the logged items a request can still show, in log
order, as columns; each item made only when a caller looks into it.

A worker that has not seen a session reads thousands of logged items at once. Their segments are made from their
heads and renders column by column (`core.build.segments_of_logged`), and only the few items an activity looks
into (the turn's, a tool call's, a result whose pointer was not stored) are made: making each one costs a cold
build more than everything else it does with the item.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any, overload

from activities.rows import ItemSource, LiveLog, items_of
from core.items import HistoryItem, parse_history_item


class MemoLog(Sequence[HistoryItem]):
    """Logged items in log order, column by column (`LiveLog`'s): their positions and heads, what each is made of
    and what was stored with it; and each item made the first time a caller asks for it (`item`)."""

    __slots__ = (
        "_items",
        "call_ids",
        "counts",
        "ids",
        "kinds",
        "pointers",
        "referable",
        "renders",
        "seqs",
        "sources",
        "taints",
        "trusts",
    )

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.ids: list[str] = []
        self.kinds: list[str] = []
        self.trusts: list[str] = []
        self.call_ids: list[str | None] = []
        self.taints: list[bool | None] = []
        self.sources: list[ItemSource] = []
        self._items: list[HistoryItem | None] = []
        self.renders: list[str | None] = []
        self.counts: dict[str, list[int | None]] = {}  # one column per counter key (`LiveLog.counts`)
        self.referable: list[bool] = []
        self.pointers: list[dict[str, Any] | None] = []

    def _columns(self) -> tuple[list[Any], ...]:
        return (
            self.seqs,
            self.ids,
            self.kinds,
            self.trusts,
            self.call_ids,
            self.taints,
            self.sources,
            self._items,
            self.renders,
            *self.counts.values(),
            self.referable,
            self.pointers,
        )

    def __len__(self) -> int:
        return len(self.seqs)

    @overload
    def __getitem__(self, k: int) -> HistoryItem: ...

    @overload
    def __getitem__(self, k: slice) -> list[HistoryItem]: ...

    def __getitem__(self, k: int | slice) -> HistoryItem | list[HistoryItem]:
        if isinstance(k, slice):
            return [self.item(i) for i in range(*k.indices(len(self.seqs)))]
        return self.item(k)

    def __iter__(self) -> Iterator[HistoryItem]:
        return map(self.item, range(len(self.seqs)))

    def item(self, k: int) -> HistoryItem:
        """The item at index `k`, made of its source the first time (with the rest of its run)."""
        k = range(len(self.seqs))[k]  # a negative index counts from the end
        made = self._items[k]
        if made is not None:
            return made
        source = self.sources[k]
        if isinstance(source, dict):
            made = self._items[k] = parse_history_item(source)
            return made
        # Every item of the run the memo still holds (a checkpoint may have covered its head).
        base = k - (self.seqs[k] - source[1])
        for j, item in enumerate(items_of(source)):
            if 0 <= base + j < len(self._items) and self.sources[base + j] is source:
                self._items[base + j] = item
        made = self._items[k]
        assert made is not None and made.seq == self.seqs[k], (k, self.seqs[k])
        return made

    def at(self, seq: int) -> int:
        """The index of the item at log position `seq` (held: the memo's positions ascend)."""
        return bisect.bisect_left(self.seqs, seq)

    def made(self) -> int:
        """How many of the items held were made (a caller looked into them)."""
        return sum(map(operator.is_not, self._items, repeat(None)))

    def extend(self, rows: LiveLog) -> None:
        """Items logged after the last one held, as read."""
        columns: tuple[Sequence[Any], ...] = (
            rows.ids,
            rows.kinds,
            rows.trusts,
            rows.call_ids,
            rows.taints,
            rows.sources,
            rows.renders,
            *rows.counts.values(),
            rows.referable,
            rows.pointers,
        )
        if any(len(column) != len(rows.seqs) for column in columns):
            lengths = [len(rows.seqs), *(len(column) for column in columns)]
            raise ValueError(f"a log read with columns of different lengths: {lengths}")
        held, n = len(self.seqs), len(rows.seqs)
        for key in self.counts.keys() | rows.counts.keys():  # a column a run lacks: not counted by that key
            column = self.counts.get(key)
            if column is None:
                column = self.counts[key] = [None] * held
            column += rows.counts.get(key) or [None] * n
        self.seqs += rows.seqs
        self.ids += rows.ids
        self.kinds += rows.kinds
        self.trusts += rows.trusts
        self.call_ids += rows.call_ids
        self.taints += rows.taints
        self.sources += rows.sources
        self._items += [None] * len(rows.seqs)
        self.renders += rows.renders
        self.referable += rows.referable
        self.pointers += rows.pointers

    def drop_head(self, k: int) -> None:
        """Forget the first `k` items."""
        for column in self._columns():
            del column[:k]
