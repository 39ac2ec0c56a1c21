"""SessionWorkflow on the real Temporal dev server and PostgreSQL: turns, tools, trust, prefix stability."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.provider import ModelProvider
from activities.session import SessionActivities
from contract import names
from contract.payloads import ModelRoute, RevokeTool, SessionOpen, SessionState, WriteMemory
from harness.faults import FirstCloseFails
from tests.integration.session_helpers import session_open, stack, start, turn

pytestmark = pytest.mark.integration


async def test_plain_turns_keep_one_prefix(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Three plain turns: each answered, one prefix hash, recorded in Postgres."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        results = [await turn(handle, f"hello number {i}") for i in range(3)]
        assert [r.turn for r in results] == [1, 2, 3]
        assert all(r.text.startswith("Noted:") for r in results)
        assert len({r.prefix_sha256 for r in results}) == 1
        records = await store.records(handle.id)
        assert len(records) == 3
        assert {r.prefix_sha256 for r in records} == {results[0].prefix_sha256}
        assert all(r.actual_input_tokens and r.actual_input_tokens <= r.estimated_tokens for r in records)
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.turns == 3 and state.metrics.prefix_hash_violations == 0
        # A later request whose history is one run of log positions is stored whole (a delta of the previous one
        # would save no entry): one reference for the four logged items; read back, it is the request sent.
        raw = await store.pool.fetchval(
            "SELECT body FROM rendered_requests WHERE sha256 = $1", results[2].plan.request_sha256
        )
        assert isinstance(raw, dict) and raw["base"] is None
        assert [e for e in raw["tail"] if "seqs" in e or "ref" in e] == [{"seqs": [0, 3]}]
        whole = await store.get_request(results[2].plan.request_sha256)
        prefix = await store.get_prefix(handle.id, 1)
        assert len(whole.body) == results[2].plan.segments - len(prefix.prefix["segments"])
        text = prefix.prefix["text"] + "".join(seg["text"] for seg in whole.body)
        assert hashlib.sha256(text.encode()).hexdigest() == results[2].plan.request_sha256


async def test_tool_call_untrusted_result_and_revocation(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """An untrusted fetch is enveloped as EXTERNAL_UNTRUSTED; a revoked tool is denied, prefix unchanged."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        first = await turn(handle, 'check the page\n/call web.fetch {"url": "fixture://injection"}')
        assert first.tool_calls[0].allowed and first.tool_calls[0].trust == "EXTERNAL_UNTRUSTED"
        await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="web.fetch"), result_type=SessionState)
        second = await turn(handle, 'again\n/call web.fetch {"url": "fixture://weather"}')
        assert not second.tool_calls[0].allowed and second.tool_calls[0].is_error
        assert "revoked" in second.tool_calls[0].summary
        assert first.prefix_sha256 == second.prefix_sha256
        items = await store.load_items(handle.id)
        results = [r.payload for r in items if r.payload["kind"] == "tool_result"]
        assert results[0]["trust"] == "EXTERNAL_UNTRUSTED" and results[0]["artifact_ref"].startswith("artifact:")
        request = await store.get_request(second.plan.request_sha256)
        untrusted = [s for s in request.body if s["trust"] == "EXTERNAL_UNTRUSTED"]
        assert untrusted and all(s["text"].startswith("<<ctx:") for s in untrusted)


async def test_bad_tool_calls_are_tool_errors(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A call outside the pinned set or with schema-invalid arguments becomes a readable tool error."""
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue)
        res = await turn(handle, '/call shell.exec {"cmd": "rm -rf /"}\n/call web.fetch {"link": 3}')
        assert [c.allowed for c in res.tool_calls] == [False, True]
        assert "not in this session's tool set" in res.tool_calls[0].summary
        assert "schema" in res.tool_calls[1].summary and res.tool_calls[1].is_error
        assert (await turn(handle, "still alive?")).text.startswith("Noted:")


async def test_a_tool_call_with_unstorable_text_is_stored_with_replacement_characters(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A model that writes a lone surrogate or a NUL into a call's arguments (a page can get it to: the scripted
    model parses `\\ud800` in JSON as one): the call runs, its arguments logged with U+FFFD where PostgreSQL
    could not store what was written. Before, the turn failed `InvalidData` (`invalid input syntax for type
    json`), and the same reply again at every retry."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        res = await turn(handle, '/call web.fetch {"url": "fixture://weather", "note\\ud800": "a\\ud800b\\u0000c"}')
        assert [c.allowed for c in res.tool_calls] == [True]
        calls = [i.payload for i in await store.load_items(handle.id) if i.payload["kind"] == "tool_call"]
        assert calls[-1]["arguments"]["note\ufffd"] == "a\ufffdb\ufffdc", calls[-1]
        assert (await turn(handle, "still alive?")).text.startswith("Noted:")


async def test_prefix_over_ceiling_fails_open(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Agent instructions over 4,000 tokens fail the session at open, naming the class."""
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, session_open(agent_instructions="word " * 4_500))
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
        message = str(info.value.cause)
        assert "agent_instructions" in message and "4,000" in message


async def test_memory_write_reaches_recall_not_prefix(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A memory written mid-session is recalled in Region B; the prefix hash does not move."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        before = await turn(handle, "hello")
        await handle.execute_update(names.UPDATE_WRITE_MEMORY, WriteMemory(text="The user's dog is called Rufus."))
        after = await turn(handle, "what is my dog called?")
        assert after.prefix_sha256 == before.prefix_sha256
        request = await store.get_request(after.plan.request_sha256)
        assert any(s["kind"] == "recall" and "Rufus" in s["text"] for s in request.body)


async def test_malformed_updates_are_rejected(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Blank text, unknown tools and a second close are rejected with clear messages; the session survives."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, "first")
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await turn(handle, "   ")
        assert "blank" in str(info.value.cause)
        # Typed as the contract says, and non-retryable: the same input gets the same answer.
        assert isinstance(info.value.cause, ApplicationError) and info.value.cause.type == "ValueError"
        assert info.value.cause.non_retryable
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="nope"))
        assert "not in this session's tool set" in str(info.value.cause)
        assert isinstance(info.value.cause, ApplicationError) and info.value.cause.non_retryable
        count = len(await store.load_items(handle.id))
        assert (await turn(handle, "second")).turn == 2
        assert len(await store.load_items(handle.id)) == count + 2
        await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"})
        assert (await handle.result())["status"] == "closed"
        # The closed session's workflow has completed: Temporal itself refuses further updates.
        with pytest.raises(RPCError, match="already completed"):
            await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "again"})


async def test_continue_as_new_carries_state(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Across continue-as-new the turn count, prefix hash, revocations and update de-duplication carry over."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(continue_as_new_after_turns=2))
        first = await turn(handle, "one", update_id="u-1")
        await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="notes.save"))
        results = [first] + [await turn(handle, f"turn {i}") for i in range(2, 6)]
        assert [r.turn for r in results] == [1, 2, 3, 4, 5]
        assert len({r.prefix_sha256 for r in results}) == 1
        again = await turn(handle, "one", update_id="u-1")  # a client retry of an update from an earlier run
        assert again.turn == 1
        desc = await handle.describe()
        assert desc.run_id != first_run_id(handle)
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.turns == 5 and "notes.save" in state.revoked_tools
        denied = await turn(handle, '/call notes.save {"text": "x"}')
        assert not denied.tool_calls[0].allowed
        assert len(await store.records(handle.id)) == 5 + 2


def first_run_id(handle) -> str:  # type: ignore[no-untyped-def]
    return handle.first_execution_run_id or handle.result_run_id or ""


async def test_unknown_session_and_oversized_input(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """An unknown session id and an oversized message are refused with clear errors; nothing stored changes."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        with pytest.raises(RPCError, match="not found"):
            await temporal_client.get_workflow_handle("no-such-session").execute_update(
                names.UPDATE_SUBMIT_TURN, {"text": "hello"}
            )
        handle = await start(temporal_client, task_queue)
        await turn(handle, "first")
        before = [r.payload["id"] for r in await store.load_items(handle.id)]
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await handle.execute_update(names.UPDATE_SUBMIT_TURN, {"text": "x" * 100_001})
        assert "at most 100000 characters" in str(info.value.cause.__cause__ or info.value.cause)
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await handle.execute_update(names.UPDATE_SUBMIT_TURN, {"txt": "typo"})
        assert "text" in str(info.value.cause.__cause__ or info.value.cause)
        # Input that does not decode is typed and non-retryable too: the same input gets the same answer.
        for bad in ({"txt": "typo"}, {"text": ""}):
            with pytest.raises(WorkflowUpdateFailedError) as info:
                await handle.execute_update(names.UPDATE_SUBMIT_TURN, bad)
            cause = info.value.cause
            assert isinstance(cause, ApplicationError) and cause.type == "ValidationError" and cause.non_retryable
        assert [r.payload["id"] for r in await store.load_items(handle.id)] == before
        assert (await turn(handle, "still usable")).turn == 2


async def test_inspect_shows_the_window(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """`inspect` shows regions, classes against caps, trust of each segment, yields and usage for a turn."""
    from ctxengine.inspection import inspect_session

    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, '/call web.fetch {"url": "fixture://injection"}')
        await turn(handle, "thanks")
        view = await inspect_session(store, handle.id, turn=1)
        assert view["turn"] == 1 and view["call_index"] == 1
        assert {s["region"] for s in view["segments"]} == {"A", "B"}
        assert any(s["trust"] == "EXTERNAL_UNTRUSTED" for s in view["segments"])
        assert view["caps"]["agent_instructions"] == 4_000 and view["actual_input_tokens"] > 0
        last = await inspect_session(store, handle.id)
        assert last["turn"] == 2 and last["distinct_prefix_hashes_in_epoch"] == 1


async def test_bad_start_input_fails_with_the_field(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A start input that is not a SessionOpen, or a budget override that is invalid, fails the session naming
    the field instead of retrying forever."""
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION, {"agent_instrctions": "typo"}, id=f"bad-{task_queue}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
        assert "agent_instructions" in str(info.value.cause)
        # Refused by SessionOpen's own validation now (a client building the model gets it at once); sent raw,
        # it fails the run at decode time, before anything is stored.
        raw = {
            **session_open().model_dump(mode="json", exclude={"carried", "carried_results"}),
            "budget": {"output_reserve": -5},
        }
        handle = await temporal_client.start_workflow(
            names.WORKFLOW_SESSION, raw, id=f"bad-budget-{task_queue}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
        assert "budget.output_reserve" in str(info.value.cause)


async def test_a_session_without_a_model_route(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A session that names no model_route fails at open on a worker that is not on the embedded services
    (typed, non-retryable, naming the field, nothing stored); a worker on them gives it the scripted model."""
    unrouted = SessionOpen.model_validate(session_open().model_dump(exclude={"model_route"}))
    assert unrouted.model_route is None
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, unrouted)
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(handle.result(), timeout=30)
        cause = info.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "ModelRouteRequired" and cause.non_retryable
        assert cause.message.startswith("session failed to open: model_route: required on this worker")
        assert await store.get_session(handle.id) is None
    embedded_queue = f"{task_queue}-embedded"
    async with stack(temporal_client, pg_dsn, embedded_queue, embedded_services=True):
        handle = await start(temporal_client, embedded_queue, unrouted)
        assert (await turn(handle, "hello")).turn == 1
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.model_route == ModelRoute(provider="scripted", model="scripted-1")


class _KeptProviders(SessionActivities):
    """The session activities, keeping the providers each worker gave them."""

    given: ClassVar[list[dict[str, ModelProvider]]] = []

    def __init__(self, store: Any, providers: dict[str, ModelProvider], **kwargs: Any) -> None:
        super().__init__(store, providers, **kwargs)
        _KeptProviders.given.append(providers)


async def test_a_stopped_worker_has_closed_its_adapters_sdk_clients(
    temporal_client: Client, pg_dsn: str, task_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OpenAI and Anthropic adapters a worker builds (their keys set) hold SDK clients with connection pools:
    open while the worker runs, closed once it has stopped."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    _KeptProviders.given.clear()
    async with stack(temporal_client, pg_dsn, task_queue, activities_class=_KeptProviders):
        (providers,) = _KeptProviders.given
        clients = [providers["openai"].client, providers["anthropic"].client]  # type: ignore[attr-defined]
        assert not any(c.is_closed() for c in clients)
    assert all(c.is_closed() for c in clients)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Each update's example input, in an order a session accepts them all (the memory written is then deleted).
EXAMPLE_UPDATES = [
    (names.UPDATE_SUBMIT_TURN, "submit_turn.json"),
    (names.UPDATE_REVOKE_TOOL, "revoke_tool.json"),
    (names.UPDATE_GRANT_TOOL, "grant_tool.json"),
    (names.UPDATE_WORKING_STATE, "update_working_state.json"),
    (names.UPDATE_WRITE_MEMORY, "write_memory.json"),
    (names.UPDATE_DELETE_MEMORY, "delete_memory.json"),
    (names.UPDATE_ROTATE_EPOCH, "rotate_epoch.json"),
    (names.UPDATE_CLOSE_SESSION, "close_session.json"),
]


async def test_every_example_input_is_accepted(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """The inputs in examples/ work as shipped: the start input opens a session, and each update's example,
    sent as its JSON, is accepted in turn (every examples/*.json is one of them)."""
    shipped = {p.name for p in EXAMPLES.glob("*.json")}
    assert shipped == {"session_open.json"} | {f for _, f in EXAMPLE_UPDATES}
    async with stack(temporal_client, pg_dsn, task_queue):
        open_ = SessionOpen.model_validate_json((EXAMPLES / "session_open.json").read_text())
        handle = await start(temporal_client, task_queue, open_)
        for update, file in EXAMPLE_UPDATES:
            try:
                await asyncio.wait_for(handle.execute_update(update, json.loads((EXAMPLES / file).read_text())), 60)
            except WorkflowUpdateFailedError as exc:
                raise AssertionError(f"{file} was refused: {exc.cause}") from exc
        await asyncio.wait_for(handle.result(), 60)


async def test_a_close_that_failed_leaves_the_session_open_and_closable(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A close whose activity fails (PostgreSQL down past its retries): the session stays open, takes turns, and
    the same close sent again closes it. Before, it stayed "closing" for good: a second close was refused as
    already closed, a turn as `SessionNotOpen`, and a purge because it was not closed."""
    async with stack(temporal_client, pg_dsn, task_queue, activities_class=FirstCloseFails) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"})
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.status == "open"
        assert (await turn(handle, "still here?")).turn == 2
        closed = await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"}, result_type=SessionState)
        assert closed.status == "closed" and (await handle.result())["status"] == "closed"
        assert (
            await store.pool.fetchval("SELECT closed_at FROM sessions WHERE session_id = $1", handle.id)
        ) is not None
