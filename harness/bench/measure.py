"""What the benches measure with: percentiles, PostgreSQL round trips counted at the pool, the time garbage
collections take, a process's CPU time, whether modules have current bytecode, and how long the disk takes to
flush a write."""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import psutil
from temporalio import activity


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of an empty sample")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def process_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds `proc` has run so far. A process of one thread (a PostgreSQL backend) by its scheduler's own
    count, in nanoseconds (`/proc/PID/schedstat`): the clock-tick counts psutil reads are 10 ms coarse, and a
    backend's few milliseconds in a short phase could read as none. Otherwise (or without schedstat) psutil's user
    + system time, which counts every thread of the process, ended ones too. Raises psutil.Error when the process
    is gone."""
    if proc.num_threads() == 1:
        try:
            with open(f"/proc/{proc.pid}/schedstat") as fh:
                return int(fh.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    times = proc.cpu_times()
    return float(times.user + times.system)


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


class GcClock:
    """The seconds this process spends in garbage collections while counted (`counted()`: a gc callback timing
    each collection from start to stop on the thread that runs it)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    @contextmanager
    def counted(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


def compiled(sources: Sequence[str]) -> bool:
    """Whether each of `sources` (module files) has bytecode in its `__pycache__` that the importer takes as
    current: this Python's magic number, and the source's mtime and size recorded in a timestamp-based header
    (a hash-based one is taken as current too: the importer checks it against the source itself)."""
    for source in map(Path, sources):
        cached = Path(importlib.util.cache_from_source(str(source)))
        try:
            header = cached.read_bytes()[:16]
        except OSError:
            return False
        if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
            return False
        if int.from_bytes(header[4:8], "little") & 1:  # hash-based
            continue
        st = source.stat()
        mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
        if (mtime, size) != (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF):
            return False
    return bool(sources)


FLUSH_BLOCK = 8192  # PostgreSQL's WAL page
FLUSH_PROBES = 100
FLUSH_QUIET_S = 0.010  # about the pause before each of a turn's two commits in the bench's latency phase


class FlushLatency(NamedTuple):
    """p50 milliseconds of an 8 kB write's `fdatasync`: one right after another, and one after a quiet pause."""

    back_to_back_ms: float
    after_quiet_ms: float


def flush_latency(directory: Path, *, probes: int = FLUSH_PROBES, quiet_s: float = FLUSH_QUIET_S) -> FlushLatency:
    """How long the disk under `directory` takes to flush a write, as a PostgreSQL commit waits for it (with
    `synchronous_commit` on, a commit returns once its WAL page is written and `fdatasync`ed): `probes` flushes
    back to back, then `probes` each after `quiet_s` without one. A file of `probes` blocks, written and synced
    first (as PostgreSQL fills a WAL segment before using it), takes each write in turn, and is removed after.

    Explanatory: a disk that answers a flush in microseconds when flushes come one after another may take a
    millisecond after a pause (a virtual machine's disk here did), and a turn's commits come after pauses."""
    fd, name = tempfile.mkstemp(prefix="ctxengine-flush-probe-", dir=directory)
    try:
        os.pwrite(fd, bytes(FLUSH_BLOCK * probes), 0)
        os.fsync(fd)
        block = os.urandom(FLUSH_BLOCK)
        flush = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync

        def p50(pause_s: float) -> float:
            taken: list[float] = []
            for k in range(probes):
                if pause_s:
                    time.sleep(pause_s)
                os.pwrite(fd, block, FLUSH_BLOCK * k)
                t0 = time.perf_counter()
                flush(fd)
                taken.append((time.perf_counter() - t0) * 1000)
            return percentile(taken, 50)

        return FlushLatency(back_to_back_ms=p50(0.0), after_quiet_ms=p50(quiet_s))
    finally:
        os.close(fd)
        os.unlink(name)
