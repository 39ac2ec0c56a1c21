"""What the benches measure with (`harness.bench.measure`): the garbage collector's time while counted, a
process's CPU time, whether a module's bytecode is current, and the disk's flush latency."""

from __future__ import annotations

import gc
import os
import py_compile
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness.bench.measure import GcClock, compiled, flush_latency, process_cpu_s

# Spins for 25 ms of its own CPU time, says so, then waits for stdin to close.
SPIN = (
    "import sys, time\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.025: pass\n"
    "print(flush=True)\n"
    "sys.stdin.read()"
)


def test_the_clock_counts_collections_only_while_counted() -> None:
    """Collections inside `counted()` add to the clock; after it, none do."""
    clock = GcClock()
    with clock.counted():
        gc.collect()
        counted = clock.seconds
    gc.collect()
    assert counted > 0
    assert clock.seconds == counted


def test_bytecode_is_current_only_for_the_source_it_was_compiled_from(tmp_path: Path) -> None:
    """Bytecode counts when its header records the source's mtime and size, whichever way the mtime moved."""
    source = tmp_path / "flow.py"
    source.write_text("X = 1\n")
    assert not compiled([str(source)])  # never compiled
    py_compile.compile(str(source), invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    assert compiled([str(source)])
    mtime = source.stat().st_mtime
    for moved in (mtime + 10, mtime - 10):  # edited since, or copied with an older time
        os.utime(source, (moved, moved))
        assert not compiled([str(source)])
    assert not compiled([])


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="no scheduler statistics on this kernel")
def test_a_one_thread_process_is_counted_finer_than_clock_ticks() -> None:
    """A one-thread process that ran 25 ms: counted by the scheduler, not in 10 ms clock ticks (which a PostgreSQL
    backend's few milliseconds in a short phase could miss altogether)."""
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline()  # it has spun
        proc = psutil.Process(child.pid)
        assert proc.num_threads() == 1
        seconds = process_cpu_s(proc)
        assert 0.025 <= seconds < 1.0
        assert round(seconds * 1e9) % 10_000_000 != 0  # not a whole number of ticks
    finally:
        child.communicate(b"")


def test_a_process_of_several_threads_is_counted_by_its_user_and_system_time() -> None:
    """This process with a second thread: psutil's user + system time, which counts every thread."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        me = psutil.Process()
        assert me.num_threads() > 1
        before = me.cpu_times()
        seconds = process_cpu_s(me)
        after = me.cpu_times()
        assert before.user + before.system <= seconds <= after.user + after.system
    finally:
        stop.set()
        other.join()


def test_the_flush_probe_times_flushes_back_to_back_and_after_a_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk whose flush takes 3 ms after 4 ms without one and nothing right after another: the probe reports
    each case's own p50, flushes the file it wrote (and only it), and removes it."""
    flushed: list[int] = []
    last = [0.0]

    def fdatasync(fd: int) -> None:
        if time.perf_counter() - last[0] > 0.004:
            time.sleep(0.003)
        flushed.append(fd)
        last[0] = time.perf_counter()

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    measured = flush_latency(tmp_path, probes=20, quiet_s=0.006)
    assert measured.back_to_back_ms < 1.0
    assert measured.after_quiet_ms >= 3.0
    assert len(flushed) == 40 and len(set(flushed)) == 1
    assert list(tmp_path.iterdir()) == []
