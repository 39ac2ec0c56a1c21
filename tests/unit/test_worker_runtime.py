"""The worker's runtime: its garbage-collector settings (`worker.tuned_gc`: start-up's heap frozen, the young
generation collected less often, cycles still collected, the settings as they were on exit), and its log lines."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

from worker import GC_THRESHOLDS, tuned_gc

REPO = Path(__file__).resolve().parents[2]


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


_LOGS_FROM_LOGGING = """
import logging, structlog, worker
worker.configure_logging()
logging.getLogger("temporalio.activity").warning(
    "Completing activity as failed (%s)", "x", extra={"temporal_activity": {"activity_id": "7"}}
)
logging.getLogger("temporalio.worker").info("an info line of another library stays out")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("temporalio.worker").exception("multi\\nline")
structlog.get_logger().info("worker.own", session_id="s")
import warnings
warnings.warn("coroutine 'run' was never awaited", RuntimeWarning)
"""


def test_what_the_sdk_logs_through_logging_is_written_as_json_lines() -> None:
    """The SDK's own loggers (stdlib `logging`) write JSON lines like structlog's, one per record, warnings and
    errors only, with the logger's name, the record's extra fields and the exception."""
    done = subprocess.run(
        [sys.executable, "-c", _LOGS_FROM_LOGGING], capture_output=True, text=True, timeout=60, cwd=REPO, check=True
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is one JSON object
    assert [(line["event"], line["level"]) for line in lines] == [
        ("Completing activity as failed (x)", "warning"),
        ("multi\nline", "error"),
        ("worker.own", "info"),
        ("<string>:14: RuntimeWarning: coroutine 'run' was never awaited\n", "warning"),
    ]
    assert lines[0]["logger"] == "temporalio.activity" and lines[3]["logger"] == "py.warnings"
    assert lines[0]["temporal_activity"] == {"activity_id": "7"}
    assert "ZeroDivisionError" in lines[1]["exception"]
    assert all("timestamp" in line for line in lines)
