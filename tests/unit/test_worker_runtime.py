"""The worker's garbage-collector settings (`worker.tuned_gc`): start-up's heap frozen, the young generation
collected less often, cycles still collected, the settings as they were on exit."""

from __future__ import annotations

import gc
import weakref

from worker import GC_THRESHOLDS, tuned_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_tuned_gc_freezes_start_up_and_restores_the_settings() -> None:
    """Inside, the heap made so far is frozen and the thresholds are the worker's; on exit both are as before."""
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with tuned_gc():
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_before_stays_frozen() -> None:
    """A freeze the process made before (a pre-fork one, an outer `tuned_gc`) outlives an inner `tuned_gc`."""
    gc.freeze()
    try:
        outer = gc.get_freeze_count()
        with tuned_gc():
            pass
        assert gc.get_freeze_count() >= outer > 0
    finally:
        gc.unfreeze()


def test_cycles_made_after_start_up_are_still_collected_automatically() -> None:
    """A reference cycle made while tuned is freed by a collection the allocations trigger, with no call."""
    assert gc.isenabled()
    with tuned_gc():  # its collection just reset the young generation's count: the cycle is young below
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # a cycle: reference counting alone never frees it
        kept = [_Node() for _ in range(2 * GC_THRESHOLDS[0])]  # past the young generation's threshold
        assert gone() is None
        del kept
