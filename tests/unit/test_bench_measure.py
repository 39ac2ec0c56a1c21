"""What the benches measure with (`harness.bench.measure`): the garbage collector's time while counted, and
whether a module's bytecode is current."""

from __future__ import annotations

import gc
import os
import py_compile
from pathlib import Path

from harness.bench.measure import GcClock, compiled


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
