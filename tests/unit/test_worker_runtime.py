"""What a worker process's run-time costs depend on: the garbage collector's settings (`worker.tuned_gc`: start-up's
heap frozen, the young generation collected less often, cycles still collected, CPython's settings back on exit),
and bytecode for the modules the workflow sandbox imports again for each workflow instance; and how the turns
bench observes both."""

from __future__ import annotations

import gc
import os
import py_compile
import weakref
from pathlib import Path

from harness.bench.turns_bench import _GcTime, compiled
from worker import GC_THRESHOLDS, tuned_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_tuned_gc_freezes_start_up_and_restores_the_settings() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with tuned_gc():
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0  # what start-up made is out of the collector's view
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_cycles_made_after_start_up_are_still_collected_automatically() -> None:
    with tuned_gc():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # a cycle: reference counting alone never frees it
        # More allocations than the young generation's threshold: the collector runs by itself.
        kept = [_Node() for _ in range(2 * GC_THRESHOLDS[0])]
        assert gone() is None
        del kept


def test_the_bench_counts_the_time_collections_take_while_counted() -> None:
    clock = _GcTime()
    gc.collect()
    assert clock.seconds == 0.0  # not counted yet
    with clock.counted():
        gc.collect()
        counted = clock.seconds
    gc.collect()
    assert counted > 0
    assert clock.seconds == counted  # no longer counted


def test_bytecode_counts_only_when_it_is_as_new_as_its_source(tmp_path: Path) -> None:
    source = tmp_path / "flow.py"
    source.write_text("X = 1\n")
    assert not compiled([str(source)])  # never compiled
    py_compile.compile(str(source))
    assert compiled([str(source)])
    later = source.stat().st_mtime + 10
    os.utime(source, (later, later))  # edited since
    assert not compiled([str(source)])
    assert not compiled([])
