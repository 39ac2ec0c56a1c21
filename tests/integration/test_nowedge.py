"""Regression tests: no input and no fault wedges, kills or mixes a session (docs/reliability.md).

Each test is one of the failures a careless or hostile client could cause through the public updates: a NUL
character, a 10,000-call turn, a reused session id, a failed start, a model slower than its timeout, a route
window with a smaller reserve, and the smaller refusals (tool schema, memory ids, a double close).
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import RawValue, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError

from activities.openai_provider import UnconfiguredProvider
from activities.provider import ScriptedProvider
from activities.store import Store
from contract import bounds, names, retries
from contract.payloads import ActivityTimeouts, CloseSession, SessionState, WriteMemory
from tests.integration.session_helpers import session_open, stack, start, turn
from workflows.child_run import first_typed_cause

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _update(handle: WorkflowHandle[Any, Any], name: str, arg: Any, timeout: float = 30) -> Any:
    return await asyncio.wait_for(handle.execute_update(name, arg), timeout=timeout)


async def _refused(handle: WorkflowHandle[Any, Any], name: str, arg: Any, timeout: float = 30) -> str:
    """The update is answered with a failure within `timeout`; its message (cause first)."""
    with pytest.raises(WorkflowUpdateFailedError) as info:
        await _update(handle, name, arg, timeout)
    cause = info.value.cause
    return f"{getattr(cause, 'type', '')}: {cause}"


async def _snapshot(store: Store, session_id: str) -> tuple[Any, ...]:
    items = [(r.seq, r.payload["id"]) for r in await store.load_items(session_id)]
    records = [(r.turn, r.call_index) for r in await store.records(session_id)]
    return items, records


async def test_nul_is_refused_at_the_door_and_the_session_goes_on(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A NUL in a turn, a memory or a revocation is refused by the update's validation, names the field, stores
    nothing and takes no lock: the next turn and close_session work."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        before = await _snapshot(store, handle.id)
        message = await _refused(handle, names.UPDATE_SUBMIT_TURN, {"text": "hello\u0000world"})
        assert "text" in message and "NUL" in message
        message = await _refused(handle, names.UPDATE_WRITE_MEMORY, {"text": "ok", "corrects": "a\u0000"})
        assert "corrects" in message and "NUL" in message
        # A runtime working-state write: a NUL or a blank text, named by operation and field.
        for text, said in (("a\u0000b", "NUL"), ("   ", "must not be blank")):
            write = {"operations": [{"op": "add_task", "text": "fine"}, {"op": "add_constraint", "text": text}]}
            message = await _refused(handle, names.UPDATE_WORKING_STATE, write)
            assert message.startswith("ValueError: ") and "operations[1] (add_constraint).text" in message
            assert said in message, message
        written = await store.pool.fetchval(
            "SELECT count(*) FROM working_state_writes WHERE session_id = $1", handle.id
        )
        assert written == 0
        assert await _snapshot(store, handle.id) == before
        after = await turn(handle, "hello again")
        assert after.turn == 2
        closed = await _update(handle, names.UPDATE_CLOSE_SESSION, CloseSession())
        assert closed["status"] == "closed"


async def test_ten_thousand_calls_in_one_turn_are_capped(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A legal turn of 10,000 `/call` lines runs 64 calls, refuses the rest in one pair the model sees, and the
    run stays far from Temporal's history limit; the session takes another turn."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        result = await asyncio.wait_for(turn(handle, "/call x\n" * 10_000), timeout=100)
        assert len(result.tool_calls) == 64
        rows = await store.load_items(handle.id)
        calls = [r for r in rows if r.payload["kind"] == "tool_call"]
        results = [r for r in rows if r.payload["kind"] == "tool_result"]
        assert len(calls) == len(results) == 65
        refusal = next(r for r in results if "refused" in r.payload["content"])
        assert "10,000 tool calls" in refusal.payload["content"]
        events = [e async for e in handle.fetch_history_events()]
        # The per-activity figure the bound is computed with holds on a real history.
        assert len(events) <= bounds.turn_events(per_reply=64, per_turn=256) + 50
        assert len(events) < bounds.RUN_EVENTS_TARGET
        assert (await turn(handle, "and now a normal turn")).text.startswith("Noted")


async def test_reused_session_id_is_refused_and_serves_nothing_of_the_old_one(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """The PIN scenario: a second session started with a used id fails at open with SessionIdTaken naming when
    the first opened and closed; nothing of the first reaches a model for it."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        sid = f"s1-{task_queue}"
        first = await start(temporal_client, task_queue, session_open(agent_instructions="FIRST-OWNER"), sid)
        await turn(first, "my PIN is 4321")
        await _update(first, names.UPDATE_CLOSE_SESSION, CloseSession())
        await first.result()
        records_before = len(await store.records(sid))
        second = await start(
            temporal_client, task_queue, session_open(agent_instructions="SECOND", tools=[], memory_scope="other"), sid
        )
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(second.result(), timeout=30)
        cause = info.value.cause
        assert getattr(cause, "type", None) == "SessionIdTaken", cause
        assert "opened at" in str(cause) and "closed at" in str(cause)
        assert len(await store.records(sid)) == records_before  # no request was built for the second owner
        row = await store.get_session(sid)
        assert row is not None and row.open["agent_instructions"] == "FIRST-OWNER"


async def test_failed_start_does_not_poison_its_id(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A start that fails at open (prefix overflow) leaves its id reusable: the next start opens with its own
    inputs and its first turn works."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        sid = f"x-{task_queue}"
        bad = await start(temporal_client, task_queue, session_open(agent_instructions="word " * 6_000), sid)
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(bad.result(), timeout=30)
        assert getattr(info.value.cause, "type", None) == "PrefixOverflowError"
        good = await start(temporal_client, task_queue, session_open(agent_instructions="FIXED"), sid)
        result = await asyncio.wait_for(turn(good, "hello"), timeout=30)
        assert result.turn == 1 and result.text.startswith("Noted")
        row = await store.get_session(sid)
        assert row is not None and row.open["agent_instructions"] == "FIXED"


async def test_undecodable_start_input_fails_the_run_at_once(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A start input the worker cannot decode as a SessionOpen (none, null, bytes, an unknown encoding, JSON of the
    wrong shape) fails its run within seconds with a typed error, and a query on it answers: no first workflow
    task failing again and again. (Two arguments fail it too; a query on that run is not answered: see
    docs/reliability.md.)"""
    odd = {"encoding": b"x-unknown/1"}
    inputs: list[tuple[list[Any], str]] = [
        ([{"agent_instructions": "x"}, 1], "InvalidSessionOpen"),
        ([], "InvalidSessionOpen"),
        ([None], "InvalidSessionOpen"),
        ([b"raw bytes"], "InvalidSessionOpen"),
        ([RawValue(Payload(metadata=odd, data=b"{}"))], "InvalidSessionOpen"),
        ([RawValue(Payload(metadata={"encoding": b"json/plain"}, data=b"null"))], "InvalidSessionOpen"),  # the CLI's
        ([{"agent_instructions": 5}], "ValidationError"),
    ]
    async with stack(temporal_client, pg_dsn, task_queue):
        for args, type_ in inputs:
            handle = await temporal_client.start_workflow(
                names.WORKFLOW_SESSION, args=args, id=f"odd-{uuid.uuid4().hex[:8]}", task_queue=task_queue
            )
            with pytest.raises(WorkflowFailureError) as info:
                await asyncio.wait_for(handle.result(), timeout=10)
            assert getattr(info.value.cause, "type", None) == type_, (args, info.value.cause)
            if len(args) > 1:
                continue
            state = await asyncio.wait_for(handle.query(names.QUERY_STATE), timeout=10)
            assert state["status"] == "failed", (args, state)


async def test_a_start_that_carries_a_closed_session_s_state_is_refused(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """What a run carries is handed over by continue-as-new only. A start (here with the id of a closed session,
    reused as the stock CLI's `--id-reuse-policy AllowDuplicate` does) that sends the closed session's state as
    `carried`, marked open, fails `InvalidSessionOpen`: it does not skip the open and take turns on the closed
    session (before, it did, and its turns were logged after the close)."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        await handle.execute_update(names.UPDATE_CLOSE_SESSION, CloseSession(reason="done"))
        closed = SessionState.model_validate(await handle.query(names.QUERY_STATE))
        items = len(await store.load_items(handle.id))
        forged = session_open().model_copy(
            update={"carried": closed.model_copy(update={"status": "open"}), "carried_update_ids": ["x"]}
        )
        again = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION,
            forged,
            id=handle.id,
            task_queue=task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        )
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(again.result(), timeout=30)
        assert getattr(info.value.cause, "type", None) == "InvalidSessionOpen", info.value.cause
        assert len(await store.load_items(handle.id)) == items


async def test_a_route_to_a_provider_without_its_key_is_refused_at_open_and_at_rotation(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A worker registers a provider whose key is not set as a stand-in (docs/providers.md). A start naming it fails
    at open `ProviderNotConfigured`, saying what to set; a rotation to it is refused and the session keeps its
    epoch and takes turns (before, both went through and every later turn failed)."""
    unset = "provider 'openai' is not configured: set OPENAI_API_KEY"
    providers = {"scripted": ScriptedProvider(), "openai": UnconfiguredProvider("openai", unset)}
    route = {"provider": "openai", "model": "gpt-4o"}
    async with stack(temporal_client, pg_dsn, task_queue, providers=providers):
        bad = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION,
            session_open(model_route=route),
            id=f"keyless-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(bad.result(), timeout=30)
        failure = first_typed_cause(info.value)
        assert failure is not None and failure.type == "ProviderNotConfigured" and unset in failure.message

        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await _update(handle, names.UPDATE_ROTATE_EPOCH, {"reason": "model_route_changed", "model_route": route})
        failure = refused.value.cause  # typed at the top, as any refusal: not an activity error over it
        assert isinstance(failure, ApplicationError) and failure.type == "ProviderNotConfigured", failure
        assert unset in failure.message and failure.non_retryable
        state = SessionState.model_validate(await handle.query(names.QUERY_STATE))
        assert state.epoch == 1 and state.model_route.provider == "scripted"
        assert (await turn(handle, "still here")).turn == 2


async def test_slow_model_fails_the_turn_not_the_session(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """`timeouts.model_seconds: 5` and a 10 s model call: the turn fails with a typed error after a bounded
    number of attempts, the lock is released, and the next turn works."""
    timeouts = ActivityTimeouts(build_seconds=5, model_seconds=5, model_heartbeat_seconds=2, tool_seconds=5)
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(timeouts=timeouts))
        began = time.monotonic()
        message = await _refused(handle, names.UPDATE_SUBMIT_TURN, {"text": "think\n/sleep 10"}, timeout=90)
        assert "ModelCallTimeout" in message, message
        assert time.monotonic() - began < 60
        after = await asyncio.wait_for(turn(handle, "quick one"), timeout=30)
        assert after.turn == 2
        # The failed turn left nothing half-written: its message, no reply from a late attempt.
        kinds = [r.payload["kind"] for r in await store.load_items(handle.id)]
        assert kinds == ["user_message", "user_message", "assistant_message"]
        # The failed turn was sealed with a few quick attempts, not another 75 s of them (the next build seals
        # what it could not).
        seals = [
            e.activity_task_scheduled_event_attributes
            async for e in handle.fetch_history_events()
            if e.activity_task_scheduled_event_attributes.activity_type.name == names.ACTIVITY_SEAL_TURN
        ]
        assert [a.retry_policy.maximum_attempts for a in seals] == [retries.SEAL_MAX_ATTEMPTS]
        await _update(handle, names.UPDATE_CLOSE_SESSION, CloseSession())


async def test_failed_turn_leaves_no_orphan_in_a_later_request(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A tool call a failed turn never answered (written straight into the log here) gets an error result
    before the next turn's request is built, so that request is valid."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        await store.append_items(
            handle.id,
            1,
            [{"id": "t1.m9.call0", "kind": "tool_call", "trust": "MODEL", "call_id": "c-orphan", "tool_name": "x"}],
        )
        result = await asyncio.wait_for(turn(handle, "next"), timeout=30)
        assert result.turn == 2
        rows = {r.payload["id"]: r.payload for r in await store.load_items(handle.id)}
        assert rows["t1.m9.call0.result"]["is_error"]


async def test_route_window_with_a_smaller_reserve_opens(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """`model_route.context_window: 8192` with `budget.output_reserve: 1024` opens; without the override the
    start is refused naming `budget.output_reserve`."""
    async with stack(temporal_client, pg_dsn, task_queue):
        route = {"provider": "scripted", "model": "scripted-1", "context_window": 8192}
        handle = await start(
            temporal_client, task_queue, session_open(model_route=route, budget={"output_reserve": 1024})
        )
        assert (await turn(handle, "hello")).turn == 1
        raw = {**session_open().model_dump(mode="json", exclude={"carried", "carried_results"}), "model_route": route}
        bad = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION, raw, id=f"win-{task_queue}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(bad.result(), timeout=30)
        assert "budget.output_reserve" in str(info.value.cause)


@pytest.mark.parametrize(
    ("budget", "named"),
    [
        ({"output_reserve": 0}, "budget.output_reserve: must be at least 1"),
        ({"context_window": 100_000.0, "output_reserve": 10_000}, "budget.output_reserve"),
    ],
)
async def test_an_open_the_door_refuses_fails_typed_naming_the_field(
    temporal_client: Client, pg_dsn: str, task_queue: str, budget: dict[str, Any], named: str
) -> None:
    """A reserve of 0 (sent as `max_tokens: 0`, which providers refuse), or a float window override that, lowered
    to the route's 8,000 tokens, leaves no room for its reserve: the start input decodes (as it did for sessions
    opened before these checks), and the open activity fails the start `InvalidSessionOpen`, naming the field."""
    async with stack(temporal_client, pg_dsn, task_queue):
        route = {"provider": "scripted", "model": "scripted-1", "context_window": 8_000}
        raw = {
            **session_open().model_dump(mode="json", exclude={"carried", "carried_results"}),
            "model_route": route,
            "budget": budget,
        }
        bad = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION, raw, id=f"door-{uuid.uuid4().hex[:8]}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(bad.result(), timeout=30)
        failure = first_typed_cause(info.value)
        assert isinstance(failure, ApplicationError) and failure.type == "InvalidSessionOpen", info.value
        assert named in failure.message


async def test_smaller_refusals(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """An invalid tool schema fails the start naming the tool; a dangling `corrects` and a taken memory id are
    refused typed (nothing stored); two concurrent closes: one succeeds, formation runs once."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        raw = session_open().model_dump(mode="json", exclude={"carried", "carried_results"})
        raw["tools"] = [{"name": "broken", "description": "d", "input_schema": {"type": "objekt"}}]
        bad = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION, raw, id=f"schema-{task_queue}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(bad.result(), timeout=30)
        assert "tools.0.input_schema" in str(info.value.cause) or "input_schema" in str(info.value.cause.__cause__)

        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        message = await _refused(handle, names.UPDATE_WRITE_MEMORY, WriteMemory(text="fix", corrects="nothing"))
        assert message.startswith("UnknownMemory")
        await _update(handle, names.UPDATE_WRITE_MEMORY, WriteMemory(text="first", memory_id="m1"))
        await _update(handle, names.UPDATE_WRITE_MEMORY, WriteMemory(text="first", memory_id="m1"))  # same: ok
        message = await _refused(handle, names.UPDATE_WRITE_MEMORY, WriteMemory(text="second", memory_id="m1"))
        assert message.startswith("MemoryIdTaken")
        row = await store.get_memory("default", "m1")
        assert row is not None and row.text == "first"

        outcomes = await asyncio.gather(
            _update(handle, names.UPDATE_CLOSE_SESSION, CloseSession()),
            _update(handle, names.UPDATE_CLOSE_SESSION, CloseSession()),
            return_exceptions=True,
        )
        assert sum(not isinstance(o, BaseException) for o in outcomes) == 1, outcomes
        # The other close is answered as any update to a closing or closed session is: SessionNotOpen, for good.
        [lost] = [o for o in outcomes if isinstance(o, WorkflowUpdateFailedError)]
        assert isinstance(lost.cause, ApplicationError) and lost.cause.type == "SessionNotOpen", lost.cause
        assert lost.cause.non_retryable
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.status == "closed"


async def test_changes_accepted_beside_a_close_that_went_first_change_nothing(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A close, then a rotation, a grant and a revocation, reach the session in one workflow task (sent while no
    worker polled): all pass their validators; the close goes first, and the others are answered SessionNotOpen:
    no epoch 2, no prefix stored for it, the tools as they were. (The order is read from the history: one a slow
    host delivered before the close must have applied.) Before, the rotation waited for the lock and then
    opened a new epoch of the closed session, and the grant and the revocation were applied to the closing session
    (answered `status: open`)."""
    from contract.payloads import GrantTool, RevokeTool, RotateEpoch

    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="notes.save"))
    sent = [
        (names.UPDATE_CLOSE_SESSION, CloseSession()),
        (names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="provider_routing_changed")),
        (names.UPDATE_GRANT_TOOL, GrantTool(name="notes.save")),
        (names.UPDATE_REVOKE_TOOL, RevokeTool(name="web.fetch")),
    ]
    calls = {}
    for name, arg in sent:  # spaced, so that the server takes them in this order
        calls[name] = asyncio.create_task(handle.execute_update(name, arg, id=f"race-{name}"))
        await asyncio.sleep(0.5)
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await asyncio.wait_for(calls.pop(names.UPDATE_CLOSE_SESSION), timeout=60)
        # The order the session took them in, from its history (a slow host may deliver a call late).
        history = await handle.fetch_history()
        accepted = [
            e.workflow_execution_update_accepted_event_attributes.accepted_request.meta.update_id
            for e in history.events
            if e.HasField("workflow_execution_update_accepted_event_attributes")
        ]
        after_close = accepted[accepted.index(f"race-{names.UPDATE_CLOSE_SESSION}") + 1 :]
        assert after_close, accepted  # at least one change to check
        for name, call in calls.items():
            if f"race-{name}" not in after_close:
                await asyncio.wait_for(call, timeout=60)  # taken before the close: applied, as it should be
                continue
            with pytest.raises(WorkflowUpdateFailedError) as info:
                await asyncio.wait_for(call, timeout=60)
            cause = info.value.cause
            assert isinstance(cause, ApplicationError) and cause.type == "SessionNotOpen", cause
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        rotated = f"race-{names.UPDATE_ROTATE_EPOCH}" not in after_close
        assert state.status == "closed" and state.epoch == 1 + rotated
        assert (await store.get_prefix(handle.id, 2) is None) is not rotated
        revoked = {"notes.save"} - ({"notes.save"} if f"race-{names.UPDATE_GRANT_TOOL}" not in after_close else set())
        revoked |= {"web.fetch"} if f"race-{names.UPDATE_REVOKE_TOOL}" not in after_close else set()
        assert set(state.revoked_tools) == revoked


async def test_worker_waits_for_postgres_at_start(
    temporal_client: Client, temporal_address: str, pg_restartable: Any, tmp_path: Any
) -> None:
    """A worker started while PostgreSQL is down waits (logged backoff) and serves once it is up."""
    from harness.worker_process import WorkerProcess

    server_dsn = await pg_restartable.start()
    await pg_restartable.stop()
    queue = f"wait-{time.monotonic_ns()}"
    worker = WorkerProcess(
        temporal_address=temporal_address, dsn=server_dsn, task_queue=queue, home=tmp_path, name="patient"
    )
    try:
        starting = asyncio.create_task(worker.start(temporal_client, timeout=90))
        # PostgreSQL comes back only once the worker has said it is waiting for it (however slowly the worker
        # process starts on a loaded host), and the worker must still be alive then.
        deadline = time.monotonic() + 60
        while "worker.waiting" not in (worker.log_path.read_text() if worker.log_path.exists() else ""):
            assert time.monotonic() < deadline, worker.log_tail()
            assert not starting.done(), worker.log_tail()
            await asyncio.sleep(0.2)
        assert worker.alive, worker.log_tail()
        await pg_restartable.start()
        await starting
        handle = await start(temporal_client, queue)
        assert (await asyncio.wait_for(turn(handle, "hello"), timeout=30)).turn == 1
    finally:
        worker.kill()
        await pg_restartable.start()


async def test_continued_session_keeps_its_id(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A session that continued as new is the same owner: a later rotation reopens its own id."""
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, session_open(continue_as_new_after_turns=1))
        await turn(handle, "one")
        await turn(handle, "two")
        state = await _update(
            handle,
            names.UPDATE_ROTATE_EPOCH,
            {"reason": "model_route_changed", "model_route": {"provider": "scripted", "model": "scripted-2"}},
        )
        assert state["epoch"] == 2
        assert (await turn(handle, "three")).epoch == 2


async def test_an_update_without_input_is_refused_or_defaulted(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """An update sent with no input, or with a null payload (`binary/null`: what the Python SDK's converter sends
    for None, and the stock CLI's `--input-meta encoding=binary/null`), is refused by its validator, typed
    ValueError and non-retryable, naming the update, and so is a binary payload (it decodes to bytes);
    `close_session`, whose fields all have defaults, closes with its default reason. Before, a null or binary
    `close_session` passed the validator, ran memory formation, then failed its workflow task on `req.reason`,
    again and again: the session answered no query or update ever after."""
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        for name in (names.UPDATE_SUBMIT_TURN, names.UPDATE_REVOKE_TOOL, names.UPDATE_ROTATE_EPOCH):
            for args in ([None], []):
                with pytest.raises(WorkflowUpdateFailedError) as info:
                    await asyncio.wait_for(handle.execute_update(name, *args), timeout=30)
                cause = info.value.cause
                assert getattr(cause, "type", None) == "ValueError" and getattr(cause, "non_retryable", False)
                assert f"{name}: no input was sent, or it was null" in str(cause), cause
        assert (await turn(handle, "still here")).turn == 2
        for name in (names.UPDATE_CLOSE_SESSION, names.UPDATE_SUBMIT_TURN):  # a binary payload decodes to bytes
            with pytest.raises(WorkflowUpdateFailedError) as info:
                await asyncio.wait_for(handle.execute_update(name, b"\x00\xffbin"), timeout=30)
            assert f"{name}: its input is bytes, not an object" in str(info.value.cause), info.value.cause
        closed = await asyncio.wait_for(
            handle.execute_update(names.UPDATE_CLOSE_SESSION, None, result_type=SessionState), timeout=60
        )
        assert closed.status == "closed"
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.status == "closed" and state.turns == 2


async def test_tool_names_sent_before_the_session_opened_are_checked(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """`revoke_tool` and a forced-revocation `rotate_epoch` that reach a session before it opened (update with
    start) name a tool the session does not have: refused once it opens, nothing changes. Before, the validators
    skipped the check until the session was open and the handlers never made it: the unknown name was recorded
    as revoked, and an empty epoch was rotated and counted."""
    from temporalio.client import WithStartWorkflowOperation
    from temporalio.common import WorkflowIDConflictPolicy

    from contract.payloads import RevokeTool, RotateEpoch

    async with stack(temporal_client, pg_dsn, task_queue):
        for name, arg in (
            (names.UPDATE_REVOKE_TOOL, RevokeTool(name="bogus.tool")),
            (names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="forced_revocation", revoke_tools=["nonexistent"])),
        ):
            operation = WithStartWorkflowOperation(
                names.WORKFLOW_SESSION,
                session_open(),
                id=f"early-{uuid.uuid4().hex[:8]}",
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            )
            with pytest.raises(WorkflowUpdateFailedError) as info:
                await asyncio.wait_for(
                    temporal_client.execute_update_with_start_workflow(name, arg, start_workflow_operation=operation),
                    timeout=60,
                )
            assert "not in this session's tool set" in str(info.value.cause), info.value.cause
            handle = await operation.workflow_handle()
            state = await handle.query(names.QUERY_STATE, result_type=SessionState)
            assert state.epoch == 1 and state.revoked_tools == {} and state.removed_tools == []
            assert (await turn(handle, "hello")).turn == 1


async def test_updates_sent_before_a_failed_open_are_answered_typed(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A turn, a memory write or a working-state write that reaches a session before its open fails (update with
    start; the open refuses its route, or the start input is refused) is answered SessionNotOpen, naming why, and
    the run fails as before. Before, the run failed with the update unanswered: its caller got an RPC error that is
    no update's answer ("workflow execution already completed"), and Temporal warned of an unfinished handler (an
    error in this suite, where the run's task failed over and over: the CI run that timed out after 240 s)."""
    from temporalio.client import WithStartWorkflowOperation
    from temporalio.common import WorkflowIDConflictPolicy

    from contract.payloads import TurnInput, WorkingStateUpdate, WriteMemory

    scope = f"failed-open-{uuid.uuid4().hex[:8]}"
    too_big = session_open(
        memory_scope=scope,
        agent_instructions="rule " * 3_300,
        model_route={"provider": "scripted", "model": "scripted-1", "context_window": 4_096},
        budget={"output_reserve": 256},
    )
    carried = session_open(memory_scope=scope).model_copy(
        update={"carried_update_ids": ["forged"]}
    )  # a start input refused
    updates = [
        (names.UPDATE_SUBMIT_TURN, TurnInput(text="hi")),
        (names.UPDATE_WRITE_MEMORY, WriteMemory(text="a fact")),
        (
            names.UPDATE_WORKING_STATE,
            WorkingStateUpdate.model_validate({"operations": [{"op": "add_fact", "text": "x"}]}),
        ),
    ]
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        for start_input, why, failed_as in (
            (too_big, "no turn could be answered", "RouteDoesNotFit"),
            (carried, "carried", "InvalidSessionOpen"),
        ):
            for name, arg in updates:
                operation = WithStartWorkflowOperation(
                    names.WORKFLOW_SESSION,
                    start_input,
                    id=f"failed-open-{uuid.uuid4().hex[:8]}",
                    task_queue=task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                )
                with pytest.raises(WorkflowUpdateFailedError) as info:
                    await asyncio.wait_for(
                        temporal_client.execute_update_with_start_workflow(
                            name, arg, start_workflow_operation=operation
                        ),
                        timeout=60,
                    )
                cause = info.value.cause
                assert isinstance(cause, ApplicationError), cause
                handle = await operation.workflow_handle()
                with pytest.raises(WorkflowFailureError) as failed:
                    await asyncio.wait_for(handle.result(), timeout=60)
                assert isinstance(failed.value.cause, ApplicationError) and failed.value.cause.type == failed_as
                if start_input is too_big:  # refused once the open failed, naming why
                    assert cause.type == "SessionNotOpen" and why in cause.message, cause
                else:  # refused by the validator already (the start input was refused in the run's first task)
                    assert cause.type == "SessionNotOpen" and "InvalidSessionOpen: start input" in cause.message, cause
                assert "a fact" not in await store.memory_texts(scope)  # nothing written for a session that failed


async def test_a_rotation_to_a_route_the_budget_does_not_fit_is_refused_at_once(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A rotation to a route whose window the session's output reserve does not fit is refused by the validator,
    typed ValueError, naming the reserve. Before, it was accepted and the open activity failed to
    decode its own input, retryably, until its attempts ran out; the caller got the activity's failure naming
    an internal model (`OpenInput`)."""
    from contract.payloads import ModelRoute, RotateEpoch

    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, session_open(budget={"output_reserve": 4_000}))
        await turn(handle, "hello")
        small = ModelRoute(provider="scripted", model="scripted-small", context_window=2_500)
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await asyncio.wait_for(
                handle.execute_update(
                    names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="model_route_changed", model_route=small)
                ),
                timeout=60,
            )
        cause = info.value.cause
        assert getattr(cause, "type", None) == "ValueError" and getattr(cause, "non_retryable", False), cause
        assert "output_reserve" in str(cause) and "OpenInput" not in str(cause), cause
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.epoch == 1


async def test_a_failed_turn_keeps_its_answer_across_continue_as_new(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A turn fails (TurnTooLarge); the session continues as new; the caller retries with the same update id. The
    retry gets the same failure, naming the same turn, and takes no new turn. Before, only results crossed
    continue-as-new: the retry ran the turn again as a new turn (turn 3, 4, ...), over the message logged by the
    first attempt."""
    open_ = session_open(continue_as_new_after_turns=1, budget={"context_window": 8_000, "output_reserve": 500})
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, open_)
        await turn(handle, "hello")
        latest = temporal_client.get_workflow_handle(handle.id)
        second = await _next_run(latest, handle.result_run_id)
        too_large = {"text": "word " * 15_000}  # about 15,000 tokens: no 8,000-token window takes it
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await latest.execute_update(names.UPDATE_SUBMIT_TURN, too_large, id="big-1")
        failed = str(info.value.cause)
        assert "turn 2 failed" in failed and getattr(info.value.cause, "type", None) == "TurnTooLarge", failed
        await _next_run(latest, second)
        with pytest.raises(WorkflowUpdateFailedError) as again:
            await latest.execute_update(names.UPDATE_SUBMIT_TURN, too_large, id="big-1")
        assert str(again.value.cause) == failed and getattr(again.value.cause, "type", None) == "TurnTooLarge"
        state = await latest.query(names.QUERY_STATE, result_type=SessionState)
        assert state.turns == 2, state.turns


async def _next_run(handle: WorkflowHandle[Any, Any], run_id: str | None) -> str:
    """The id of the run after `run_id`, once the session has continued as new."""
    for _ in range(200):
        current = (await handle.describe()).run_id
        if current != run_id:
            return current
        await asyncio.sleep(0.05)
    raise AssertionError(f"the session did not continue as new from run {run_id}")


async def test_a_run_continues_as_new_before_temporals_update_limit(
    temporal_client: Client, pg_dsn: str, task_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temporal refuses a run's 2,001st update. A session continues as new between turns once its run has taken
    `bounds.UPDATES_CONTINUE_AS_NEW` updates (1,000; 20 here, set in this process, where the test's worker runs:
    1,000 updates take over a minute on a loaded machine), so a caller flooding it with small updates never meets
    that refusal. Before, only history length and Temporal's suggestion triggered it: 2,000 grants, a few events
    each, left a run at about 5,000 events, and the next 727 updates failed."""
    from contract.payloads import GrantTool

    assert bounds.UPDATES_CONTINUE_AS_NEW < bounds.UPDATES_ADMIT_LIMIT < 2_000
    monkeypatch.setattr(bounds, "UPDATES_CONTINUE_AS_NEW", 20)
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        latest = temporal_client.get_workflow_handle(handle.id)
        first = (await latest.describe()).run_id
        grant = GrantTool(name="notes.save")
        for _ in range(2):
            await asyncio.gather(*(latest.execute_update(names.UPDATE_GRANT_TOOL, grant) for _ in range(10)))
        assert await _next_run(latest, first) != first
        assert (await turn(latest, "after the flood")).turn == 2


async def test_a_rotation_retried_after_continue_as_new_rotates_once(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A `rotate_epoch` retried with the same update id after the session continued as new answers with the
    state and rotates nothing; a `revoke_tool` retried so applies nothing either. Before, Temporal's
    de-duplication (within a run) was all there was: the retry opened another epoch, and a prefix cache miss."""
    from contract.payloads import GrantTool, RevokeTool, RotateEpoch

    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, session_open(continue_as_new_after_turns=1))
        await turn(handle, "hello")
        latest = temporal_client.get_workflow_handle(handle.id)
        second = await _next_run(latest, handle.result_run_id)
        rotation = RotateEpoch(reason="provider_routing_changed")
        rotated = await latest.execute_update(names.UPDATE_ROTATE_EPOCH, rotation, id="rot-1", result_type=SessionState)
        assert rotated.epoch == 2
        await latest.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="notes.save"), id="rev-1")
        await latest.execute_update(names.UPDATE_GRANT_TOOL, GrantTool(name="notes.save"), id="grant-1")
        await turn(latest, "the second turn")
        await _next_run(latest, second)
        again = await latest.execute_update(names.UPDATE_ROTATE_EPOCH, rotation, id="rot-1", result_type=SessionState)
        assert again.epoch == 2 and again.metrics.epochs == 2
        revoked = await latest.execute_update(
            names.UPDATE_REVOKE_TOOL, RevokeTool(name="notes.save"), id="rev-1", result_type=SessionState
        )
        assert "notes.save" not in revoked.revoked_tools  # the grant after it stands


@pytest.mark.parametrize("case", ["database", "namespace", "metrics"])
async def test_a_setting_the_server_refuses_fails_the_worker_at_start(
    temporal_client: Client, temporal_address: str, pg_dsn: str, tmp_path: Any, case: str
) -> None:
    """A database that does not exist, a namespace the server does not have, a metrics address in use: the worker
    exits 2 at once, naming the variable. Before, the database was waited for 120 s as if it were down, and the
    other two ended in a traceback with exit 1 (the namespace once the worker had said it was starting)."""
    from harness.worker_process import WorkerProcess

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    dsn, env, variable = pg_dsn, {}, ""
    if case == "database":
        dsn, variable = urlunsplit(urlsplit(pg_dsn)._replace(path="/no_such_database")), "CTXENGINE_DATABASE_URL"
    elif case == "namespace":
        env, variable = {"TEMPORAL_NAMESPACE": "no-such-namespace"}, "TEMPORAL_NAMESPACE"
    else:
        env = {"CTXENGINE_METRICS_ADDRESS": f"127.0.0.1:{held.getsockname()[1]}"}
        variable = "CTXENGINE_METRICS_ADDRESS"
    worker = WorkerProcess(
        temporal_address=temporal_address,
        dsn=dsn,
        task_queue=f"refused-{case}-{time.monotonic_ns()}",
        home=tmp_path,
        name=case,
        extra_env=env,
    )
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            await worker.start(temporal_client, timeout=60)
        # At once: no backoff wait before the exit (a wall-clock bound measured the worker's imports and start,
        # 10-15 s here and 37-47 s on a loaded 2-core host, not whether it waited).
        assert "worker.waiting" not in worker.log_path.read_text(), worker.log_tail()
        assert f"ctxengine worker: {variable}:" in worker.log_tail(), worker.log_tail()
        assert "Traceback" not in worker.log_tail()
    finally:
        worker.kill()
        held.close()
