"""Trust on the live stack: a revocation racing a child run's start reaches the child (docs/trust.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.client import Client

from contract import names
from contract.payloads import GrantTool, RevokeTool, SessionState
from tests.integration.child_start_hold import TOOL, HoldChildStart, HoldChildStartForGrant
from tests.integration.session_helpers import session_open, stack, start, turn

pytestmark = pytest.mark.integration


# Both races hinge on wall clock: the child run waits at most CHILD_WAITS (5 s) for the change to reach the session
# (child_start_hold.py). Under xdist they run while no other test does (tests/conftest.py).
@pytest.mark.exclusive
async def test_revocation_racing_a_child_start_reaches_the_child(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A revoke_tool that arrives after a child run is scheduled but before the session holds its handle is
    forwarded: the child denies the revoked tool."""
    async with stack(temporal_client, pg_dsn, task_queue, interceptors=[HoldChildStart()]):
        handle = await start(
            temporal_client, task_queue, session_open(budget={"context_window": 5_000, "output_reserve": 500})
        )
        escalated = None
        for t in range(1, 60):
            # A long message, so that the pressure (and the escalation) comes at the turn's first build, and
            # the child run makes the turn's call.
            text = f"turn {t}: " + "plan the trip " * 450 + f'\n/call {TOOL} {{"url": "fixture://weather"}}'
            pending = asyncio.ensure_future(turn(handle, text))
            while not pending.done():
                state: SessionState = await handle.query(names.QUERY_STATE, result_type=SessionState)
                if state.metrics.escalations >= 1:
                    await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name=TOOL, reason="race"))
                    break
                await asyncio.sleep(0.05)
            result = await pending
            if (await handle.query(names.QUERY_STATE, result_type=SessionState)).metrics.escalations >= 1:
                escalated = result
                break
        assert escalated is not None, "the session never escalated to a child run"
        fetches = [c for c in escalated.tool_calls if c.name == TOOL]
        assert fetches and not fetches[-1].allowed, escalated


async def _escalating_turn(handle: Any, on_escalation: Any) -> Any:
    """Turns with long messages until one escalates to a child run at its first build (so the child makes the
    turn's call); `on_escalation` runs once the session has counted the escalation, while the child starts."""
    for t in range(1, 60):
        text = f"turn {t}: " + "plan the trip " * 450 + f'\n/call {TOOL} {{"url": "fixture://weather"}}'
        pending = asyncio.ensure_future(turn(handle, text))
        while not pending.done():
            state: SessionState = await handle.query(names.QUERY_STATE, result_type=SessionState)
            if state.metrics.escalations >= 1:
                await on_escalation()
                break
            await asyncio.sleep(0.05)
        result = await pending
        if (await handle.query(names.QUERY_STATE, result_type=SessionState)).metrics.escalations >= 1:
            return result
    raise AssertionError("the session never escalated to a child run")


@pytest.mark.exclusive
async def test_regrant_racing_a_child_start_reaches_the_child(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A tool revoked before the turn and granted again while its child run starts is allowed in the child."""
    async with stack(temporal_client, pg_dsn, task_queue, interceptors=[HoldChildStartForGrant()]):
        handle = await start(
            temporal_client, task_queue, session_open(budget={"context_window": 5_000, "output_reserve": 500})
        )
        await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name=TOOL, reason="until further notice"))

        async def grant() -> None:
            await handle.execute_update(names.UPDATE_GRANT_TOOL, GrantTool(name=TOOL))

        escalated = await _escalating_turn(handle, grant)
        fetches = [c for c in escalated.tool_calls if c.name == TOOL]
        assert fetches and fetches[-1].allowed, escalated
