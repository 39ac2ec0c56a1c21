"""Helpers for session tests: a worker on a fresh task queue and database, and a session starter."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import ActivityEnvironment

from activities.providers import build_providers
from activities.session import SessionActivities
from activities.store import Store
from activities.tools import DEMO_TOOLS
from contract import names
from contract.payloads import ActivityTimeouts, OpenInput, SessionOpen, TurnInput, TurnResult
from harness.bench import cold_build
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


async def pages_session(store: Store, session_id: str) -> None:
    """A session over its window: 12 turns, each fetching a long untrusted page (tool results a build under
    pressure shows as pointers)."""
    seeder = SessionActivities(store, build_providers())
    small = cold_build.session_open().model_copy(update={"budget": {"context_window": 6_000, "output_reserve": 500}})
    await ActivityEnvironment().run(
        seeder.lifecycle.open_session, OpenInput(session_id=session_id, open=small, owner="run-pointers")
    )
    _, _, cache = await seeder.state.session(session_id)
    for turn in range(1, 13):
        call_id = f"call_t{turn}_m0_0"
        page = f"page {turn}: " + "the shard migration log reads all clear; " * 40
        await seeder.state.append(
            session_id,
            turn,
            [
                {"id": f"u:{turn}", "kind": "user_message", "trust": "USER", "text": f"fetch page {turn}"},
                {
                    "id": f"t{turn}.m0.call0",
                    "kind": "tool_call",
                    "trust": "MODEL",
                    "call_id": call_id,
                    "tool_name": "web.fetch",
                    "arguments": {"url": f"fixture://page/{turn}"},
                },
                {
                    "id": f"t{turn}.m0.call0.result",
                    "kind": "tool_result",
                    "trust": "EXTERNAL_UNTRUSTED",
                    "call_id": call_id,
                    "tool_name": "web.fetch",
                    "content": page,
                    "is_error": False,
                    "artifact_ref": None,
                },
                {"id": f"t{turn}.m1.text", "kind": "assistant_message", "trust": "MODEL", "text": "noted"},
            ],
            cache,
        )


async def memories_in_default_scope(dsn: str) -> int:
    """The memories in the scope a session names when it names none (`default`), read from PostgreSQL."""
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM memories WHERE scope = 'default'"))
    finally:
        await conn.close()
