"""A worker killed with SIGKILL during a compaction: the checkpoint is written once, the session completes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from pathlib import Path

import pytest
from temporalio.client import Client

from activities.store import Store
from contract import names
from contract.payloads import ActivityTimeouts, SessionState
from harness.worker_process import worker_process
from tests.integration.session_helpers import session_open, start, turn

pytestmark = pytest.mark.integration

CRASH = ActivityTimeouts(build_seconds=4, model_seconds=6, model_heartbeat_seconds=2, tool_seconds=4)
SMALL = {"context_window": 5_000, "output_reserve": 500}


async def test_worker_killed_during_compaction(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str, tmp_path: Path
) -> None:
    """Kill the worker while a chunk is being summarized; a fresh worker finishes it, one checkpoint per id."""
    spawn = functools.partial(
        worker_process,
        temporal_client,
        temporal_address=temporal_address,
        dsn=pg_dsn,
        task_queue=task_queue,
        home=tmp_path,
    )
    async with contextlib.AsyncExitStack() as exits:
        first = await exits.enter_async_context(spawn(name="first"))
        handle = await start(temporal_client, task_queue, session_open(timeouts=CRASH, budget=SMALL))
        # The first turn's text makes the scripted summarizer slow once that turn is compacted.
        await turn(handle, "remember this\n/sleep 3")
        pending: asyncio.Task[object] | None = None
        for i in range(40):
            pending = asyncio.create_task(turn(handle, f"turn {i}: " + "context " * 150))
            child = f"{handle.id}/compaction/1"
            deadline = time.monotonic() + 3
            started = False
            while time.monotonic() < deadline and not pending.done():
                kids = [w.id async for w in temporal_client.list_workflows(f'WorkflowId = "{child}"')]
                if kids:
                    started = True
                    break
                await asyncio.sleep(0.1)
            if started:
                break
            await pending
        assert pending is not None and not pending.done(), "compaction never started"
        await asyncio.sleep(1.0)  # inside the 3 s summarize activity
        first.kill()
        await exits.enter_async_context(spawn(name="second"))
        result = await asyncio.wait_for(pending, timeout=90)
        after = await turn(handle, "and after?")
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.metrics.compactions >= 1
        async with Store.from_dsn(pg_dsn, max_size=2) as store:
            checkpoints = await store.checkpoints(handle.id)
            ids = [c["checkpoint_id"] for c in checkpoints]
            assert ids.count("cp-1") == 1 and len(ids) == len(set(ids))
            calls = await store.summarizer_inputs(handle.id)
            assert len({(r.checkpoint_id, r.chunk_index) for r in calls}) == len(calls)
            records = await store.records(handle.id)
            assert len({r.prefix_sha256 for r in records}) == 1
        assert result is not None and after.turn == state.turns
