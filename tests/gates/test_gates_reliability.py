"""The reliability gates' fast profiles (`make test`) and their negative tests: a fault injected by the test
harness (never by anything production code reads) makes each gate fail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from temporalio.client import Client

from activities.store import Store
from harness.gates_reliability import FAST_CHAOS, FAST_INPUTS, gate_chaos, gate_inputs, log_figures
from tests.integration.session_helpers import memories_in_default_scope, stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
FAULTY_WORKER = Path(__file__).with_name("faulty_worker.py")


async def test_inputs_gate_fast_profile(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Generated hostile inputs are each answered, refusals change nothing, no session wedges."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        result = await gate_inputs(temporal_client, store, task_queue, FAST_INPUTS)
    assert result["passed"], str(result)
    assert await memories_in_default_scope(pg_dsn) == 0  # its memory writes land in the gates' own scope


# The gate's p95 turn latency bound is wall-clock: under xdist it runs while no other test does (tests/conftest.py).
@pytest.mark.exclusive
async def test_chaos_gate_fast_profile(temporal_client: Client, temporal_address: str) -> None:
    """Worker SIGKILLs and a PostgreSQL crash during sessions: nothing lost, doubled or unpaired."""
    result = await gate_chaos(temporal_client, temporal_address, FAST_CHAOS)
    assert result["passed"], str(result)


async def test_chaos_gate_catches_a_non_idempotent_worker(temporal_client: Client, temporal_address: str) -> None:
    """Workers whose tool results are appended under a fresh id each attempt (the harness's faulty worker):
    the log checks count duplicated or unpaired items and the gate fails."""
    profile = replace(FAST_CHAOS, kills=2, postgres_restarts=0, turns=5, worker_script=FAULTY_WORKER)
    result = await gate_chaos(temporal_client, temporal_address, profile)
    assert not result["passed"]
    assert result["items_duplicated"] + result["unpaired_tool_items"] > 0, result


async def test_log_checks_catch_orphans_and_doubles(pg_dsn: str) -> None:
    """The chaos gate's log invariants count an orphaned call and a second user message in one turn."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        await store.create_session("s", {}, b"k")
        await store.append_items(
            "s",
            1,
            [
                {"id": "u:a", "kind": "user_message", "trust": "USER", "text": "a"},
                {"id": "u:b", "kind": "user_message", "trust": "USER", "text": "b"},
                {"id": "t1.m0.call0", "kind": "tool_call", "trust": "MODEL", "call_id": "c0", "tool_name": "x"},
            ],
        )
        figures = await log_figures(store, ["s"])
    assert figures["items_duplicated"] == 1 and figures["unpaired_tool_items"] == 1


async def test_inputs_gate_catches_a_wedging_worker(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """With the door left open and failures unclassified (patched in by the test, in this process only), a NUL
    turn holds its session past the gate's bound and the gate fails."""
    from temporalio.worker import Interceptor

    import contract.payloads as contract
    import worker as worker_module

    mp = pytest.MonkeyPatch()
    mp.setattr(contract, "storable_text_error", lambda value, path="": None)
    mp.setattr(worker_module, "FailureInterceptor", Interceptor)  # a database error is retried again and again
    try:
        async with stack(temporal_client, pg_dsn, task_queue) as store:
            profile = replace(FAST_INPUTS, cases=1, bound_s=8, turn_bound_s=8)
            result = await gate_inputs(temporal_client, store, task_queue, profile)
    finally:
        mp.undo()
    assert not result["passed"], str(result)
    assert result["sessions_wedged"] + result["timed_out"] > 0, str(result)
