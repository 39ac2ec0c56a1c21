"""Crash and outage tests: a worker killed with SIGKILL mid-turn, PostgreSQL restarted mid-session, two workers
sharing a task queue while one dies. Each asserts the turn completes, the log in Postgres has every item exactly
once, and every request of the session carried one prefix hash.

Timeouts are short (CRASH) so Temporal moves work off a dead worker within seconds; docs/reliability.md says
why each one is what it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities import failures
from activities.provider import ProviderReply, ProviderRequest, ScriptedProvider
from activities.store import Store
from activities.tools import EXECUTORS, ToolOutput
from contract import names
from contract.payloads import ActivityTimeouts, SessionState, TurnResult
from core.items import TrustLevel
from harness.worker_process import WorkerProcess, worker_process
from services.embedded import EmbeddedPostgres, dsn_with_database
from tests.integration.session_helpers import session_open, stack, start, turn

pytestmark = pytest.mark.integration

# Heartbeat 2 s: a model call on a dead worker is retried ~2 s after the kill. Tools and builds do not
# heartbeat, so their start-to-close (4 s) is how long Temporal waits before retrying them elsewhere.
CRASH = ActivityTimeouts(build_seconds=4, model_seconds=10, model_heartbeat_seconds=2, tool_seconds=4)
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- helpers


async def _until(probe: Callable[[], Awaitable[T | None]], what: str, timeout: float = 30.0) -> T:
    """Poll `probe` until it returns something other than None (or fail after `timeout` s, naming `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        found = await probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def _events(handle: WorkflowHandle[Any, Any]) -> list[HistoryEvent]:
    return [e async for e in handle.fetch_history_events()]


def _scheduled(events: list[HistoryEvent], activity_type: str) -> list[HistoryEvent]:
    return [
        e
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
    ]


async def _running_on(handle: WorkflowHandle[Any, Any], activity_type: str, nth: int, worker: WorkerProcess) -> int:
    """Wait until the `nth` scheduled `activity_type` of the run is executing on `worker`; its scheduled event id."""

    async def probe() -> int | None:
        scheduled = _scheduled(await _events(handle), activity_type)
        if len(scheduled) < nth:
            return None
        event = scheduled[nth - 1]
        activity_id = event.activity_task_scheduled_event_attributes.activity_id
        desc = await handle.describe()
        for pending in desc.raw_description.pending_activities:
            if (
                pending.activity_id == activity_id
                and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                and pending.last_worker_identity == worker.identity
            ):
                return event.event_id
        return None

    return await _until(probe, f"{activity_type} #{nth} to start on {worker.name}")


def _attempt(events: list[HistoryEvent], scheduled_event_id: int) -> int:
    """The attempt that completed the activity scheduled as `scheduled_event_id` (1 = first try)."""
    started = [
        e
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and e.activity_task_started_event_attributes.scheduled_event_id == scheduled_event_id
    ]
    assert len(started) == 1, f"activity {scheduled_event_id} has {len(started)} started events"
    return int(started[0].activity_task_started_event_attributes.attempt)


def _spawner(client: Client, address: str, dsn: str, task_queue: str, home: Path) -> Callable[..., Any]:
    """`worker_process` for this test's Temporal, PostgreSQL and queue: call it with `name=` for each worker."""
    return functools.partial(
        worker_process, client, temporal_address=address, dsn=dsn, task_queue=task_queue, home=home
    )


def expected_items(turn_no: int, update_id: str, tool_calls: int) -> list[tuple[int, str, str]]:
    """(turn, item id, kind) of one turn's log, in seq order: the message, the calls, their results, the reply."""
    rows = [(turn_no, f"u:{update_id}", "user_message")]
    if not tool_calls:
        return [*rows, (turn_no, f"t{turn_no}.m0.text", "assistant_message")]
    rows += [(turn_no, f"t{turn_no}.m0.call{j}", "tool_call") for j in range(tool_calls)]
    rows += [(turn_no, f"t{turn_no}.m0.call{j}.result", "tool_result") for j in range(tool_calls)]
    return [*rows, (turn_no, f"t{turn_no}.m1.text", "assistant_message")]


async def assert_log(store: Store, session_id: str, expected: list[tuple[int, str, str]]) -> str:
    """The session's items are exactly `expected` (nothing lost, nothing twice, seqs 0..n-1), every request
    record has its usage, and all of them carry one prefix hash, which is returned."""
    rows = await store.load_items(session_id)
    assert [r.seq for r in rows] == list(range(len(rows)))
    assert [(r.turn, r.payload["id"], r.payload["kind"]) for r in rows] == expected
    records = await store.records(session_id)
    calls_per_turn: dict[int, int] = {}
    for turn_no, item_id, _ in expected:
        if item_id.endswith(".text"):  # t{turn}.m{k}.text: the turn's last model call is k
            calls_per_turn[turn_no] = int(item_id.split(".")[1][1:]) + 1
    assert [(r.turn, r.call_index) for r in records] == [
        (t, k) for t, n in sorted(calls_per_turn.items()) for k in range(n)
    ]
    assert all(r.actual_input_tokens for r in records), "a model call's usage was not recorded"
    hashes = {r.prefix_sha256 for r in records}
    assert len(hashes) == 1, f"prefix hash moved: {hashes}"
    return str(hashes.pop())


async def assert_state(handle: WorkflowHandle[Any, Any], *, turns: int, requests: int, prefix: str) -> None:
    """The `state` query agrees with Postgres: turns, model requests counted once each, one prefix hash."""
    state = await handle.query(names.QUERY_STATE, result_type=SessionState)
    assert state.status == "open"
    assert state.turns == turns
    assert state.prefix_hashes == {"1": [prefix]}
    assert state.metrics.prefix_hash_violations == 0
    assert state.metrics.requests == requests


# ------------------------------------------------------------------------------ 1. SIGKILL mid-turn


@dataclass(frozen=True)
class CrashPoint:
    text: str  # the second turn's message: its script puts the worker where the kill should land
    activity: str  # the activity running when the worker dies
    nth: int  # which scheduled activity of that type in the run (turn 1 made one model call)
    tools: tuple[str, ...]  # the second turn's tool calls, in order


CRASH_POINTS = {
    "model_call": CrashPoint("think slowly about this\n/sleep 3", names.ACTIVITY_MODEL, 2, ()),
    "tool_execution": CrashPoint('/call clock.wait {"seconds": 3}', names.ACTIVITY_TOOL, 1, ("clock.wait",)),
    # The model call and the first tool are done and stored; the worker dies running the second tool.
    "mid_tool_loop": CrashPoint(
        '/call notes.save {"text": "written before the crash"}\n/call clock.wait {"seconds": 3}',
        names.ACTIVITY_TOOL,
        2,
        ("notes.save", "clock.wait"),
    ),
}


@pytest.mark.parametrize("point", list(CRASH_POINTS), ids=list(CRASH_POINTS))
async def test_worker_sigkill_mid_turn(
    point: str, temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str, tmp_path: Path
) -> None:
    """A worker killed with SIGKILL mid-turn: a fresh worker finishes the turn, each item logged once, one prefix."""
    crash = CRASH_POINTS[point]
    spawn = _spawner(temporal_client, temporal_address, pg_dsn, task_queue, tmp_path)
    async with contextlib.AsyncExitStack() as exits:
        first = await exits.enter_async_context(spawn(name="first"))
        handle = await start(temporal_client, task_queue, session_open(timeouts=CRASH))
        before = await turn(handle, "hello before the crash", update_id="turn-1")
        pending = asyncio.create_task(turn(handle, crash.text, update_id="turn-2"))
        exits.callback(pending.cancel)
        scheduled_id = await _running_on(handle, crash.activity, crash.nth, first)
        first.kill()
        assert not pending.done()
        await exits.enter_async_context(spawn(name="second"))
        during = await asyncio.wait_for(pending, timeout=60)
        after = await turn(handle, "hello after the crash", update_id="turn-3")

        # The killed attempt was retried (the attempt that completed is not the first); work that had finished
        # before the kill (the first tool of a mid-loop crash) was not run again.
        events = await _events(handle)
        assert _attempt(events, scheduled_id) >= 2
        earlier = [e for e in _scheduled(events, crash.activity) if e.event_id < scheduled_id]
        assert all(_attempt(events, e.event_id) == 1 for e in earlier)
        assert (before.turn, during.turn, after.turn) == (1, 2, 3)
        assert [c.name for c in during.tool_calls] == list(crash.tools)
        assert all(c.allowed and not c.is_error for c in during.tool_calls)
        if crash.tools:
            assert during.model_calls == 2 and during.text.startswith("Done. Tool results:")
            assert "waited 3 s" in during.tool_calls[-1].summary
        else:
            assert during.model_calls == 1 and during.text.startswith("Noted: think slowly")
        async with Store.from_dsn(pg_dsn, max_size=2) as store:
            prefix = await assert_log(
                store,
                handle.id,
                expected_items(1, "turn-1", 0)
                + expected_items(2, "turn-2", len(crash.tools))
                + expected_items(3, "turn-3", 0),
            )
        assert {before.prefix_sha256, during.prefix_sha256, after.prefix_sha256} == {prefix}
        await assert_state(handle, turns=3, requests=3 + bool(crash.tools), prefix=prefix)


async def test_worker_sigterm_mid_model_call_lets_it_finish(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str, tmp_path: Path
) -> None:
    """SIGTERM (a container stop) while the worker's model call runs: the worker stops polling, lets the call
    finish, exits 0, and a fresh worker goes on with the turn: the call is not run again."""
    spawn = _spawner(temporal_client, temporal_address, pg_dsn, task_queue, tmp_path)
    async with contextlib.AsyncExitStack() as exits:
        first = await exits.enter_async_context(spawn(name="first"))
        handle = await start(temporal_client, task_queue, session_open(timeouts=CRASH))
        await turn(handle, "hello before the stop", update_id="turn-1")
        pending = asyncio.create_task(turn(handle, "think slowly about this\n/sleep 3", update_id="turn-2"))
        exits.callback(pending.cancel)
        scheduled_id = await _running_on(handle, names.ACTIVITY_MODEL, 2, first)
        code = await asyncio.to_thread(first.terminate)
        assert code == 0, first.log_tail()
        assert "worker.stopped" in first.log_tail()
        await exits.enter_async_context(spawn(name="second"))
        during = await asyncio.wait_for(pending, timeout=60)
        assert during.text.startswith("Noted: think slowly")
        assert _attempt(await _events(handle), scheduled_id) == 1
        async with Store.from_dsn(pg_dsn, max_size=2) as store:
            await assert_log(store, handle.id, expected_items(1, "turn-1", 0) + expected_items(2, "turn-2", 0))


# ---------------------------------------------------------------------- 2. PostgreSQL restarted mid-session


@contextlib.asynccontextmanager
async def _database_on(server: EmbeddedPostgres) -> AsyncIterator[str]:
    """A fresh database on the restartable PostgreSQL (started if stopped), its DSN; on exit the server is
    running again (a test may have stopped it) and the database is dropped."""
    server_dsn = await server.start()
    name = f"test_{uuid.uuid4().hex}"
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    try:
        yield dsn_with_database(server_dsn, name)
    finally:
        await server.start()
        with contextlib.suppress(OSError, asyncpg.PostgresError):
            conn = await asyncpg.connect(server_dsn, timeout=5)
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await conn.close()


async def test_postgres_restart_mid_session(
    temporal_client: Client, pg_restartable: EmbeddedPostgres, task_queue: str
) -> None:
    """PostgreSQL stopped during a session: the turn's activities fail and retry, and finish once it is back."""
    async with _database_on(pg_restartable) as dsn:
        async with stack(temporal_client, dsn, task_queue) as store:
            handle = await start(temporal_client, task_queue, session_open(timeouts=CRASH))
            before = await turn(handle, "hello before the outage", update_id="turn-1")
            await pg_restartable.stop()
            try:
                pending = asyncio.create_task(turn(handle, "hello during the outage", update_id="turn-2"))

                async def failed_twice() -> str | None:
                    desc = await handle.describe()
                    for act in desc.raw_description.pending_activities:
                        if act.activity_type.name == names.ACTIVITY_BUILD and act.attempt >= 3:
                            return act.last_failure.message
                    return None

                failure = await _until(failed_twice, "context.build to fail twice while PostgreSQL is down")
                assert not pending.done()
            finally:
                await pg_restartable.start()
            during = await asyncio.wait_for(pending, timeout=60)
            after = await turn(handle, "hello after the outage", update_id="turn-3")

            builds = _scheduled(await _events(handle), names.ACTIVITY_BUILD)
            assert _attempt(await _events(handle), builds[1].event_id) >= 3, failure
            assert [r.turn for r in (before, during, after)] == [1, 2, 3]
            assert during.text.startswith("Noted: hello during the outage")
            prefix = await assert_log(
                store,
                handle.id,
                expected_items(1, "turn-1", 0) + expected_items(2, "turn-2", 0) + expected_items(3, "turn-3", 0),
            )
            assert {before.prefix_sha256, during.prefix_sha256, after.prefix_sha256} == {prefix}
            await assert_state(handle, turns=3, requests=3, prefix=prefix)


class _CountingModel(ScriptedProvider):
    """The scripted model, counting the requests it is asked, by request hash."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[str, int] = {}

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        self.asked[request.request_sha256] = self.asked.get(request.request_sha256, 0) + 1
        return await super().complete(request)


async def test_postgres_restart_during_a_model_call(
    temporal_client: Client, pg_restartable: EmbeddedPostgres, task_queue: str
) -> None:
    """PostgreSQL stopped while the model answers and back 5 s later (longer than the model call's four attempts
    last when each fails at once): the reply is stored by the same attempt once it is back, the model is asked
    once, and the turn completes."""
    model = _CountingModel()
    async with _database_on(pg_restartable) as dsn:
        async with stack(temporal_client, dsn, task_queue, providers={"scripted": model}) as store:
            handle = await start(temporal_client, task_queue, session_open(timeouts=CRASH))
            before = await turn(handle, "hello before the outage", update_id="turn-1")
            pending = asyncio.create_task(turn(handle, "answer slowly\n/sleep 2", update_id="turn-2"))

            async def model_call_started() -> bool | None:
                desc = await handle.describe()
                return next(
                    (
                        True
                        for act in desc.raw_description.pending_activities
                        if act.activity_type.name == names.ACTIVITY_MODEL
                        and act.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                    ),
                    None,
                )

            await _until(model_call_started, "the second turn's model call to start")
            await pg_restartable.stop()
            try:
                await asyncio.sleep(5)
                assert not pending.done()
            finally:
                await pg_restartable.start()
            during = await asyncio.wait_for(pending, timeout=60)
            assert during.text.startswith("Noted: answer slowly")
            calls = _scheduled(await _events(handle), names.ACTIVITY_MODEL)
            assert _attempt(await _events(handle), calls[1].event_id) == 1
            assert sorted(model.asked.values()) == [1, 1], model.asked
            prefix = await assert_log(store, handle.id, expected_items(1, "turn-1", 0) + expected_items(2, "turn-2", 0))
            assert {before.prefix_sha256, during.prefix_sha256} == {prefix}
            await assert_state(handle, turns=2, requests=2, prefix=prefix)


class _OutageTool:
    """`clock.wait`'s stand-in: counts its runs and stops PostgreSQL while it runs (the first time), so the writes
    after it meet the outage."""

    def __init__(self, server: EmbeddedPostgres, trust: TrustLevel) -> None:
        self.server = server
        self.trust = trust
        self.runs = 0

    async def __call__(self, args: dict[str, Any]) -> ToolOutput:
        self.runs += 1
        if self.runs == 1:
            await self.server.stop()
        return ToolOutput(content=f"waited, run {self.runs}", trust=self.trust)


@pytest.mark.parametrize(
    ("outage_s", "tool_seconds", "attempts", "trust"),
    [
        (3, 15, "one", TrustLevel.TOOL),  # within the tool's attempt
        (7, 4, "several", TrustLevel.TOOL),  # longer than it
        (7, 4, "several", TrustLevel.EXTERNAL_UNTRUSTED),  # an untrusted result is also kept as an artifact
    ],
)
async def test_postgres_restart_during_a_tool_runs_it_once(
    temporal_client: Client,
    pg_restartable: EmbeddedPostgres,
    task_queue: str,
    outage_s: float,
    tool_seconds: float,
    attempts: str,
    trust: TrustLevel,
) -> None:
    """PostgreSQL stopped while a tool runs: the tool is not run again. Its result is logged by the same attempt
    once PostgreSQL is back (the tool read all it needs before it ran, and its writes wait out the outage), or, when
    the outage outlasts the attempt, by a later attempt on the same worker, which takes what the run returned
    instead of running the tool again. Before, a read after the run failed the attempt and the retry ran the tool
    again."""
    tool = _OutageTool(pg_restartable, trust)
    async with _database_on(pg_restartable) as dsn:
        async with stack(temporal_client, dsn, task_queue, executors={**EXECUTORS, "clock.wait": tool}) as store:
            timeouts = CRASH.model_copy(update={"tool_seconds": tool_seconds})
            handle = await start(temporal_client, task_queue, session_open(timeouts=timeouts))
            await turn(handle, "hello before the outage", update_id="turn-1")
            pending = asyncio.create_task(turn(handle, '/call clock.wait {"seconds": 0}', update_id="turn-2"))
            await _until(lambda: asyncio.sleep(0, tool.runs or None), "the tool to run")
            try:
                await asyncio.sleep(outage_s)
                assert not pending.done()
            finally:
                await pg_restartable.start()
            await asyncio.wait_for(pending, timeout=60)
            assert tool.runs == 1
            tools = _scheduled(await _events(handle), names.ACTIVITY_TOOL)
            attempt = _attempt(await _events(handle), tools[0].event_id)
            assert attempt == 1 if attempts == "one" else attempt > 1
            [result] = [r.payload for r in await store.load_items(handle.id) if r.payload["kind"] == "tool_result"]
            assert (result["content"], result["is_error"], result["trust"]) == ("waited, run 1", False, trust.value)
            assert (result["artifact_ref"] is not None) == (trust is TrustLevel.EXTERNAL_UNTRUSTED)


OUTAGE_BUDGET_S = 3.0  # STORE_OUTAGE_WAIT_S for the test below (75 s in production)


async def test_an_outage_longer_than_the_budget_fails_the_turn_once_it_is_spent(
    temporal_client: Client, pg_restartable: EmbeddedPostgres, task_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL stopped while a tool runs and left down: the tool's attempt waits for the store within itself
    (its timeout is long), and the turn fails, typed, once the outage has lasted the budget, counted from its first
    failure: not the attempt's wait and then the 40 retries' (before, 12 s and then about 75 s more; the tool and
    model call each took a fresh budget per attempt). The session answers the next turn once PostgreSQL is back."""
    monkeypatch.setattr(failures, "STORE_OUTAGE_WAIT_S", OUTAGE_BUDGET_S)
    tool = _OutageTool(pg_restartable, TrustLevel.TOOL)
    async with _database_on(pg_restartable) as dsn:
        async with stack(temporal_client, dsn, task_queue, executors={**EXECUTORS, "clock.wait": tool}) as store:
            timeouts = CRASH.model_copy(update={"tool_seconds": 12})
            handle = await start(temporal_client, task_queue, session_open(timeouts=timeouts))
            await turn(handle, "hello before the outage", update_id="turn-1")
            try:
                pending = asyncio.create_task(turn(handle, '/call clock.wait {"seconds": 0}', update_id="turn-2"))
                await _until(lambda: asyncio.sleep(0, tool.runs or None), "the tool to run")
                ran = time.monotonic()
                with pytest.raises(WorkflowUpdateFailedError) as failed:
                    await asyncio.wait_for(pending, timeout=30)
                took = time.monotonic() - ran
            finally:
                await pg_restartable.start()
            cause = failed.value.cause
            # Typed by the transient cause's class (docs/contract.md): the socket is gone while PostgreSQL is down.
            assert isinstance(cause, ApplicationError) and cause.type in ("FileNotFoundError", "ConnectionRefusedError")
            # The budget, its last retry's backoff (at most 2 s) and the turn's failure path, not the tool's timeout.
            assert OUTAGE_BUDGET_S < took < timeouts.tool_seconds, took
            after = await turn(handle, "hello after the outage", update_id="turn-3")
            assert after.turn == 3 and tool.runs == 1
            results = [r.payload for r in await store.load_items(handle.id) if r.payload["kind"] == "tool_result"]
            assert [(r["is_error"], r["content"].startswith("error: no result was logged")) for r in results] == [
                (True, True)
            ]


# ------------------------------------------------------------------- 3. two workers, one killed, 20 sessions

SESSIONS = 20
TURNS = 3
FRESH_CALL_S = 0.5  # how long ago a model call on the doomed worker may have started for the kill to cut it short


async def test_two_workers_one_killed_twenty_sessions(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str, tmp_path: Path
) -> None:
    """Twenty live sessions on two workers; one is SIGKILLed partway and the other finishes every turn."""
    spawn = _spawner(temporal_client, temporal_address, pg_dsn, task_queue, tmp_path)
    async with contextlib.AsyncExitStack() as exits:
        doomed, survivor = await asyncio.gather(
            exits.enter_async_context(spawn(name="doomed")), exits.enter_async_context(spawn(name="survivor"))
        )
        handles = await asyncio.gather(
            *(start(temporal_client, task_queue, session_open(timeouts=CRASH)) for _ in range(SESSIONS))
        )
        done: list[TurnResult] = []

        async def converse(handle: WorkflowHandle[Any, Any]) -> list[TurnResult]:
            results = []
            for n in range(1, TURNS + 1):
                results.append(await turn(handle, f"turn {n} of {handle.id}\n/sleep 1", update_id=f"turn-{n}"))
                done.append(results[-1])
            return results

        sessions = asyncio.gather(*(converse(h) for h in handles))
        exits.callback(sessions.cancel)

        async def a_third_done() -> bool | None:
            return True if len(done) >= SESSIONS * TURNS // 3 else None

        await _until(a_third_done, "a third of the turns", timeout=60)

        async def doomed_busy() -> bool | None:
            # The kill must cut an activity short: wait for a model call (1 s each, `/sleep 1`) running on the
            # doomed worker (at the moment a third of the turns are done, every running one may be on the survivor)
            # that started at most FRESH_CALL_S before this round of describes returned, so that at least the rest
            # of its second is left for the kill to land in: on a loaded machine the describes of twenty sessions
            # can take as long as a call, and a call seen started when they were sent may have ended by then.
            described = await asyncio.gather(*(h.describe() for h in handles))
            now = datetime.now(UTC)
            for desc in described:
                for pending in desc.raw_description.pending_activities:
                    if (
                        pending.activity_type.name == names.ACTIVITY_MODEL
                        and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                        and pending.last_worker_identity == doomed.identity
                        and (now - pending.last_started_time.ToDatetime(UTC)).total_seconds() < FRESH_CALL_S
                    ):
                        return True
            return None

        await _until(doomed_busy, "an activity running on the doomed worker", timeout=30)
        doomed.kill()
        killed_after = len(done)
        assert killed_after < SESSIONS * TURNS
        results = await asyncio.wait_for(sessions, timeout=90)
        assert survivor.alive

        retried = 0
        identities: set[str] = set()
        async with Store.from_dsn(pg_dsn, max_size=2) as store:
            for handle, session in zip(handles, results, strict=True):
                assert [r.turn for r in session] == list(range(1, TURNS + 1))
                expected = [row for n in range(1, TURNS + 1) for row in expected_items(n, f"turn-{n}", 0)]
                prefix = await assert_log(store, handle.id, expected)
                assert {r.prefix_sha256 for r in session} == {prefix}
                await assert_state(handle, turns=TURNS, requests=TURNS, prefix=prefix)
                for event in await _events(handle):
                    if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                        identities.add(event.activity_task_started_event_attributes.identity)
                        retried += event.activity_task_started_event_attributes.attempt > 1
        # Both workers did work, and the kill cut at least one activity short (retried on the survivor).
        assert {doomed.identity, survivor.identity} <= identities
        assert retried >= 1, f"no activity was running on the killed worker ({killed_after} turns done at the kill)"
