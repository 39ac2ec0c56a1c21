"""A worker's memo of a session's log (`SessionCache.items`): the logged items a request can still show, in log
order, as columns; each item parsed only when a caller looks into it.

A worker that has not seen a session reads thousands of logged items at once. Their segments are made from their
stored JSON and renders column by column (`core.build.segments_of_logged`), and only the few items an activity
looks into (the turn's, a tool call's, a result whose pointer was not stored) are made: making each one costs a
cold build more than everything else it does with the item.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any, overload

from activities.rows import LiveLog
from core.items import HistoryItem, parse_history_item

_seq, _id, _kind = map(operator.itemgetter, ("seq", "id", "kind"))


class MemoLog(Sequence[HistoryItem]):
    """Logged items in log order: their positions, ids and kinds, each one's stored JSON (a dict) and the item made
    of it the first time a caller asks for it (`item`)."""

    __slots__ = ("_items", "_payloads", "counts", "ids", "kinds", "pointers", "referable", "renders", "seqs")

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.ids: list[str] = []
        self.kinds: list[str] = []
        self._payloads: list[dict[str, Any]] = []
        self._items: list[HistoryItem | None] = []
        # What was stored with each when it was logged (`LiveLog`); a count missing is an empty dict.
        self.renders: list[str | None] = []
        self.counts: list[dict[str, int]] = []
        self.referable: list[bool] = []
        self.pointers: list[dict[str, Any] | None] = []

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
        """The item at index `k`, made of its stored JSON the first time."""
        made = self._items[k]
        if made is None:
            made = self._items[k] = parse_history_item(self._payloads[k])
        return made

    def made(self) -> int:
        """How many of the items held were made (a caller looked into them)."""
        return sum(map(operator.is_not, self._items, repeat(None)))

    def payloads(self, start: int, stop: int) -> list[dict[str, Any]]:
        """The stored JSON of the items at `start`..`stop - 1`."""
        return self._payloads[start:stop]

    def extend(self, rows: LiveLog) -> None:
        """Items logged after the last one held, as read (their stored JSON, as dicts, and renders)."""
        payloads = rows.payloads
        columns = (rows.renders, rows.counts, rows.referable, rows.pointers)
        if any(len(column) != len(payloads) for column in columns):
            lengths = [len(payloads), *(len(column) for column in columns)]
            raise ValueError(f"a log read with columns of different lengths: {lengths}")
        self.seqs += map(_seq, payloads)
        self.ids += map(_id, payloads)
        self.kinds += map(_kind, payloads)
        self._payloads += payloads
        self._items += [None] * len(payloads)
        self.renders += rows.renders
        self.counts += rows.counts if None not in rows.counts else [c or {} for c in rows.counts]  # type: ignore[arg-type]
        self.referable += rows.referable
        self.pointers += rows.pointers

    def drop_head(self, k: int) -> None:
        """Forget the first `k` items."""
        for column in (self.seqs, self.ids, self.kinds, self._payloads, self._items, self.renders, self.counts):
            del column[:k]
        del self.referable[:k], self.pointers[:k]
