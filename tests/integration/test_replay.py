"""Determinism: recorded SessionWorkflow histories replay against today's workflow code, and a changed workflow
does not.

The scenarios below run real sessions (in-process worker, max_cached_workflows=0) and replay what they produced.
With ``CTXENGINE_RECORD_HISTORIES=1`` they also write each run's history to ``tests/histories/`` (one file per
run; a continue-as-new scenario writes ``<name>.run2.json`` and so on). Those committed files are what the
replay tests check: a workflow change that alters the commands a recorded history expects fails them.
Re-record only for a change that must not affect running sessions' histories (docs/reliability.md).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    import os
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    import pytest
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client, WorkflowHandle, WorkflowHistory
    from temporalio.worker import Replayer

    from contract import names
    from contract.converter import DATA_CONVERTER
    from contract.payloads import (
        CloseSession,
        EventInput,
        MemoryResult,
        ModelRoute,
        RevokeTool,
        RotateEpoch,
        SessionState,
        WriteMemory,
    )
    from tests.integration.session_helpers import session_open, stack, start, turn
    from workflows.session import SessionWorkflow

pytestmark = pytest.mark.integration

# This module defines a workflow, so the sandbox re-imports it: no file system or environment access there.
_OUTSIDE = not workflow.unsafe.in_sandbox()
HISTORIES = Path(__file__).parent.parent / "histories"
RECORD = _OUTSIDE and os.environ.get("CTXENGINE_RECORD_HISTORIES") == "1"
HISTORY_FILES = sorted(HISTORIES.glob("*.json")) if _OUTSIDE else []


def _workflow_id(name: str) -> str:
    return f"history-{name}"


def _history(path: Path) -> WorkflowHistory:
    """A recorded run: `<scenario>.json` or `<scenario>.runN.json`, whose workflow id is `history-<scenario>`."""
    return WorkflowHistory.from_json(_workflow_id(path.name.split(".")[0]), path.read_text())


def replayer(*workflows: type) -> Replayer:
    return Replayer(workflows=list(workflows) or [SessionWorkflow], data_converter=DATA_CONVERTER)


# --------------------------------------------------------------------------------------------- scenarios


async def tools_memory_close(client: Client, handle: WorkflowHandle[Any, Any]) -> None:
    """Two plain turns, an untrusted fetch, a revocation, a denied call, a memory write, close."""
    assert (await turn(handle, "hello, this is the first turn")).turn == 1
    assert (await turn(handle, "and this is the second one")).turn == 2
    fetched = await turn(handle, 'read this page\n/call web.fetch {"url": "fixture://injection"}')
    assert fetched.tool_calls[0].allowed and fetched.tool_calls[0].trust == "EXTERNAL_UNTRUSTED"
    await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="web.fetch"), result_type=SessionState)
    denied = await turn(handle, 'again\n/call web.fetch {"url": "fixture://weather"}')
    assert not denied.tool_calls[0].allowed
    await handle.execute_update(
        names.UPDATE_WRITE_MEMORY, WriteMemory(text="The user's dog is called Rufus."), result_type=MemoryResult
    )
    await handle.execute_update(names.UPDATE_CLOSE_SESSION, CloseSession(reason="scenario done"))


async def continue_as_new(client: Client, handle: WorkflowHandle[Any, Any]) -> None:
    """Five turns with continue-as-new every two turns (three runs), then close."""
    latest = client.get_workflow_handle(handle.id)  # no run id: updates follow the chain to the newest run
    for n in range(1, 6):
        assert (await turn(latest, f"turn {n} of a long session", update_id=f"turn-{n}")).turn == n
    state = await latest.execute_update(names.UPDATE_CLOSE_SESSION, CloseSession(), result_type=SessionState)
    assert state.turns == 5 and state.metrics.prefix_hash_violations == 0


async def epoch_rotation(client: Client, handle: WorkflowHandle[Any, Any]) -> None:
    """A route change and a forced revocation each rotate the epoch; the revoked tool's call is denied."""
    await turn(handle, "hello before any rotation")
    await handle.execute_update(
        names.UPDATE_ROTATE_EPOCH,
        RotateEpoch(reason="model_route_changed", model_route=ModelRoute(model="scripted-2")),
        result_type=SessionState,
    )
    await turn(handle, "hello on the new route")
    state = await handle.execute_update(
        names.UPDATE_ROTATE_EPOCH,
        RotateEpoch(reason="forced_revocation", revoke_tools=["notes.save"]),
        result_type=SessionState,
    )
    assert state.epoch == 3
    denied = await turn(handle, '/call notes.save {"text": "not any more"}')
    assert not denied.tool_calls[0].allowed
    await handle.execute_update(names.UPDATE_CLOSE_SESSION, CloseSession(reason="scenario done"))


async def compaction(client: Client, handle: WorkflowHandle[Any, Any]) -> None:
    """A small window: long turns until the session has compacted (a CompactionWorkflow child), then close."""
    for n in range(1, 30):
        await turn(handle, f"turn {n}: " + "context " * 150 + '\n/call web.fetch {"url": "fixture://weather"}')
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        if state.metrics.compactions >= 1 and n >= 8:
            break
    assert state.metrics.compactions >= 1
    await handle.execute_update(names.UPDATE_CLOSE_SESSION, CloseSession(reason="scenario done"))


Scenario = Callable[[Client, WorkflowHandle[Any, Any]], Awaitable[None]]
SCENARIOS: dict[str, tuple[Scenario, dict[str, Any]]] = {
    "tools_memory_close": (tools_memory_close, {}),
    "continue_as_new": (continue_as_new, {"continue_as_new_after_turns": 2}),
    "epoch_rotation": (epoch_rotation, {}),
    "compaction": (compaction, {"budget": {"context_window": 5_000, "output_reserve": 500}}),
}


async def _runs(client: Client, workflow_id: str, first_run_id: str) -> list[WorkflowHistory]:
    """Every run's history, following continue-as-new from the first run."""
    histories: list[WorkflowHistory] = []
    run_id: str | None = first_run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append(history)
        last = history.events[-1]
        run_id = (
            last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
            if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
            else None
        )
    return histories


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_scenario_replays(name: str, temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A fresh session of each scenario completes and its histories replay (and are written when recording)."""
    scenario, overrides = SCENARIOS[name]
    workflow_id = _workflow_id(name) if RECORD else f"{_workflow_id(name)}-{task_queue[-12:]}"
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, session_open(**overrides), session_id=workflow_id)
        await scenario(temporal_client, handle)
        final = temporal_client.get_workflow_handle(workflow_id, result_type=SessionState)
        assert (await final.result()).status == "closed"
    assert handle.first_execution_run_id is not None
    histories = await _runs(temporal_client, workflow_id, handle.first_execution_run_id)
    assert len(histories) == (3 if name == "continue_as_new" else 1)
    for history in histories:
        await replayer().replay_workflow(history)
    if RECORD:
        HISTORIES.mkdir(exist_ok=True)
        for old in HISTORIES.glob(f"{name}.*json"):
            old.unlink()
        for n, history in enumerate(histories, start=1):
            path = HISTORIES / (f"{name}.json" if len(histories) == 1 else f"{name}.run{n}.json")
            path.write_text(history.to_json() + "\n")


def test_every_scenario_is_recorded() -> None:
    """tests/histories/ holds at least one recorded run of every scenario."""
    recorded = {p.name.split(".")[0] for p in HISTORY_FILES}
    assert set(SCENARIOS) <= recorded, f"record with CTXENGINE_RECORD_HISTORIES=1; missing {set(SCENARIOS) - recorded}"


@pytest.mark.parametrize("path", HISTORY_FILES, ids=[p.name for p in HISTORY_FILES])
async def test_recorded_history_replays(path: Path) -> None:
    """A committed history replays against today's SessionWorkflow without a non-determinism error."""
    result = await replayer().replay_workflow(_history(path))
    assert result.replay_failure is None


# ----------------------------------------------------------------------------------------- negative replay


@workflow.defn(name=names.WORKFLOW_SESSION)
class ChangedSessionWorkflow(SessionWorkflow):
    """SessionWorkflow with a deployment mistake: each turn now records an event before building the context."""

    @workflow.run
    # Same parameters and annotations as SessionWorkflow.run (whatever they are): @workflow.init is inherited and
    # Temporal requires init and run to match; __module__/__qualname__ stay this class's, as @workflow.run needs.
    @functools.wraps(SessionWorkflow.run, assigned=("__annotations__", "__doc__"))
    async def run(self, *args: Any) -> Any:  # type: ignore[override]  # same parameters at run time, via wraps
        return await super().run(*args)

    async def _turn(self, *args: Any, **kwargs: Any) -> Any:
        await workflow.execute_activity(
            names.ACTIVITY_EVENT,
            EventInput(session_id=self.state.session_id, event_key="extra", type="turn.started", turn=0, epoch=1),
            start_to_close_timeout=timedelta(seconds=5),
        )
        return await super()._turn(*args, **kwargs)


async def test_changed_workflow_fails_replay() -> None:
    """Replaying a recorded history against a workflow that schedules an extra activity raises NondeterminismError."""
    path = HISTORIES / "tools_memory_close.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: record it with CTXENGINE_RECORD_HISTORIES=1")
    with pytest.raises(workflow.NondeterminismError, match=r"'context\.build' does not match .*'event\.record'"):
        await replayer(ChangedSessionWorkflow).replay_workflow(_history(path))
