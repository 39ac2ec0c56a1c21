"""`UnloggedRuns`: what a worker's tool runs returned, kept until logged, by session and call, bounded."""

from __future__ import annotations

import time

import pytest

from activities.tool_calls import UnloggedRuns
from activities.tools import ToolOutput
from core.items import TrustLevel


def _out(text: str) -> ToolOutput:
    return ToolOutput(content=text, trust=TrustLevel.TOOL)


def test_a_run_is_a_session_s_own() -> None:
    """Every session's first call is `t1.m0.call0`: one session's kept run is never another's."""
    runs = UnloggedRuns()
    runs.keep(("session-a", "t1.m0.call0"), _out("a's result"))
    assert runs.get(("session-b", "t1.m0.call0")) is None
    assert runs.get(("session-a", "t1.m0.call0")) == _out("a's result")
    runs.drop(("session-a", "t1.m0.call0"))
    assert runs.get(("session-a", "t1.m0.call0")) is None


def test_at_most_kept_runs_the_oldest_out_first() -> None:
    """Past `kept` runs the oldest kept goes first; a run kept again counts from then."""
    runs = UnloggedRuns(kept=3)
    for n in range(5):
        runs.keep(("s", f"t{n}.m0.call0"), _out(str(n)))
    assert len(runs) == 3
    assert [runs.get(("s", f"t{n}.m0.call0")) is not None for n in range(5)] == [False, False, True, True, True]
    runs.keep(("s", "t2.m0.call0"), _out("2 again"))  # the oldest kept, kept again: now the newest
    runs.keep(("s", "t5.m0.call0"), _out("5"))
    assert runs.get(("s", "t3.m0.call0")) is None and runs.get(("s", "t2.m0.call0")) == _out("2 again")


def test_a_run_is_kept_for_its_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose turn failed is never logged (its call is sealed): it goes once its time is up."""
    now = [1_000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    runs = UnloggedRuns(ttl_s=60)
    runs.keep(("s", "old"), _out("old"))
    now[0] += 61
    assert runs.get(("s", "old")) is None
    runs.keep(("s", "new"), _out("new"))
    assert len(runs) == 1 and runs.get(("s", "new")) == _out("new")
