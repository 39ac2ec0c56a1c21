"""What the benches measure with: percentiles, and PostgreSQL round trips counted at the pool."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from temporalio import activity


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of an empty sample")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class DbCounts:
    """PostgreSQL round trips and their wall time, by the activity type that made them."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def add(self, calls: int, seconds: float) -> None:
        who = activity.info().activity_type if activity.in_activity() else "other"
        self.calls[who] = self.calls.get(who, 0) + calls
        self.seconds[who] = self.seconds.get(who, 0.0) + seconds

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        return dict(self.calls), dict(self.seconds)


class CountingConnection:
    """An asyncpg connection that counts each query (and BEGIN/COMMIT) as a round trip."""

    def __init__(self, conn: Any, counts: DbCounts) -> None:
        self._conn = conn
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def _timed(self, method: str, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await getattr(self._conn, method)(*args, **kwargs)
        finally:
            self._counts.add(1, time.perf_counter() - t0)

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("execute", *args, **kwargs)

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("fetch", *args, **kwargs)

    async def fetchrow(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("fetchrow", *args, **kwargs)

    async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("fetchval", *args, **kwargs)

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        self._counts.add(2, 0.0)  # BEGIN and COMMIT (their time lands in the surrounding block)
        return self._conn.transaction(*args, **kwargs)


class CountingPool(CountingConnection):
    """The store's pool, counting round trips; `acquire()` hands out counting connections."""

    @asynccontextmanager
    async def acquire(self, *args: Any, **kwargs: Any) -> AsyncIterator[CountingConnection]:
        async with self._conn.acquire(*args, **kwargs) as conn:
            yield CountingConnection(conn, self._counts)
