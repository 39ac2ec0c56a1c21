"""Helpers for session tests: a worker on a fresh task queue and database, and a session starter."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from temporalio.client import Client, WorkflowHandle

from activities.store import Store
from activities.tools import DEMO_TOOLS
from contract import names
from contract.payloads import ActivityTimeouts, SessionOpen, TurnInput, TurnResult
from harness.sessions import SCRIPTED
from worker import running_worker

FAST = ActivityTimeouts(build_seconds=5, model_seconds=5, model_heartbeat_seconds=5, tool_seconds=5)


def session_open(**overrides: Any) -> SessionOpen:
    values: dict[str, Any] = {
        "agent_instructions": "You are a careful research assistant. Cite what tools return.",
        "tools": DEMO_TOOLS,
        "timeouts": FAST,
        "model_route": SCRIPTED,  # named: the tests' workers are not on the embedded services' defaults
    }
    values.update(overrides)
    return SessionOpen.model_validate(values)


@asynccontextmanager
async def stack(client: Client, dsn: str, task_queue: str, **worker_kw: Any) -> AsyncIterator[Store]:
    async with Store.from_dsn(dsn) as store:
        await store.migrate()
        async with running_worker(client, store, task_queue=task_queue, max_cached_workflows=0, **worker_kw):
            yield store


async def start(
    client: Client, task_queue: str, open_: SessionOpen | None = None, session_id: str | None = None
) -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        names.WORKFLOW_SESSION,
        open_ or session_open(),
        id=session_id or f"session-{uuid.uuid4().hex[:12]}",
        task_queue=task_queue,
    )


async def turn(handle: WorkflowHandle[Any, Any], text: str, update_id: str | None = None) -> TurnResult:
    result: TurnResult = await handle.execute_update(
        names.UPDATE_SUBMIT_TURN, TurnInput(text=text), id=update_id, result_type=TurnResult
    )
    return result
