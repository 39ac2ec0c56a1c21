"""The typed client on the live stack: runtime working-state writes, grants both ways, idempotent turns,
forgetting and purge (issue 16; docs/contract.md)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from temporalio.client import Client

from activities.rebuild import rebuild_session
from activities.rows import StoredPrefix
from activities.store import Store
from activities.tokens import TiktokenCounter
from contract import names
from contract.bounds import RECENT_UPDATES
from contract.payloads import ChildRunInput, ChildRunResult, GrantTool, RevokeTool
from ctxengine.client import (
    CtxEngineClient,
    CtxEngineError,
    PrefixOverflow,
    SessionIdTaken,
    SessionNotClosed,
    SessionNotOpen,
    ToolNotPinned,
    ValidationFailed,
    WorkingStateRejected,
    map_failure,
)
from services.embedded import temporal_binary, temporal_namespace
from tests.integration.session_helpers import session_open, stack

pytestmark = pytest.mark.integration

FETCH = '/call web.fetch {"url": "fixture://weather"}'


def control(*ops: dict[str, Any]) -> str:
    return "/call context.update_working_state " + json.dumps({"operations": list(ops)})


async def region_b(store: Store, request_sha256: str, kind: str) -> str:
    request = await store.get_request(request_sha256)
    assert request is not None
    body = request.body
    return "\n".join(s["text"] for s in body if s["kind"] == kind)


async def test_runtime_working_state_writes(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """The runtime may remove a constraint (the model may not); writes show in the next request and in inspect,
    are idempotent by key, and a bad write names its operation and field and changes nothing."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open())
        await s.submit_turn(control({"op": "add_constraint", "text": "Never book flights before 09:00."}))
        done = await s.update_working_state(
            {"operations": [{"op": "remove_constraint", "id": "c1"}, {"op": "add_constraint", "text": "Trains only."}]},
            idempotency_key="ws-1",
        )
        again = await s.update_working_state(
            {"operations": [{"op": "remove_constraint", "id": "c1"}, {"op": "add_constraint", "text": "Trains only."}]},
            idempotency_key="ws-1",
        )
        assert again == done and "Trains only." in done.working_state and "09:00" not in done.working_state
        runtime_rows = await store.pool.fetch(
            "SELECT write_key FROM working_state_writes WHERE session_id = $1 AND write_key LIKE 'runtime:%'",
            s.session_id,
        )
        assert len(runtime_rows) == 1
        after = await s.submit_turn("what are my constraints?")
        ws = await region_b(store, after.plan.request_sha256, "working_state")
        assert "Trains only." in ws and "09:00" not in ws
        view = await ctx.inspect(s.session_id, turn=after.turn)
        assert any(seg["kind"] == "working_state" and seg["region"] == "B" for seg in view["segments"])
        # The model can never drop a constraint: the control tool's removal fails as before.
        model = await s.submit_turn(control({"op": "remove_constraint", "id": "c2"}))
        assert model.tool_calls[0].is_error and "only the runtime" in model.tool_calls[0].summary
        # Unknown id and over a cap: typed, named, nothing changed.
        with pytest.raises(WorkingStateRejected, match=r"operations\[1\] \(remove_constraint\).*'c9'"):
            await s.update_working_state(
                {"operations": [{"op": "add_task", "text": "pack"}, {"op": "remove_constraint", "id": "c9"}]}
            )
        over = [{"op": "add_constraint", "text": f"rule {i}"} for i in range(20)]
        with pytest.raises(WorkingStateRejected, match=r"operations\[19\] \(add_constraint\).*'constraints'"):
            await s.update_working_state({"operations": over})
        # Malformed input is rejected by the update itself, naming the operation and the field.
        with pytest.raises(ValidationFailed, match=r"add_task.*text"):
            try:
                await s.handle.execute_update(names.UPDATE_WORKING_STATE, {"operations": [{"op": "add_task"}]})
            except Exception as exc:
                raise map_failure(exc) from exc
        state = await s.state()
        assert "pack" not in state.working_state and "rule 0" not in state.working_state
        assert "Trains only." in state.working_state


async def test_idempotent_turn_across_continue_as_new(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A retried submit_turn with the same key returns the same TurnResult and appends nothing, after the run
    it first ran in continued as new."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open(continue_as_new_after_turns=2), session_id=f"idem-{task_queue}")
        first = await s.submit_turn("hello", idempotency_key="req-1")
        await s.submit_turn("second")
        await s.submit_turn("third")  # lands on the second run
        runs = [w async for w in temporal_client.list_workflows(f"WorkflowId = '{s.session_id}'")]
        assert len(runs) >= 2
        items = len(await store.load_items(s.session_id))
        retried = await s.submit_turn("hello", idempotency_key="req-1")
        assert retried == first
        assert len(await store.load_items(s.session_id)) == items
        assert (await s.state()).turns == 3
        with pytest.raises(SessionIdTaken):
            await ctx.start_session(session_open(), session_id=s.session_id)


async def test_a_retried_working_state_write_answers_its_first_turn_across_continue_as_new(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A runtime write resent with the same key after the session went on (and continued as new) is logged once and
    answers the turn it was first logged for, not the turn the resend arrived before. The client starts the session
    with the workflow task timeout it is given."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open(continue_as_new_after_turns=2), task_timeout=timedelta(seconds=5))
        write = {"operations": [{"op": "add_constraint", "text": "Trains only."}]}
        await s.submit_turn("hello")
        first = await s.update_working_state(write, idempotency_key="ws-once")
        await s.submit_turn("second")
        await s.submit_turn("third")  # lands on the second run
        again = await s.update_working_state(write, idempotency_key="ws-once")
        assert (first.turn, again.turn) == (2, 2)
        rows = await store.pool.fetch("SELECT turn FROM working_state_writes WHERE session_id = $1", s.session_id)
        assert [r["turn"] for r in rows] == [2]
        started = await temporal_client.get_workflow_handle(s.session_id).describe()
        assert started.raw_description.execution_config.default_workflow_task_timeout.seconds == 5


@pytest.mark.parametrize(
    ("budget", "words"),
    [({}, 2), ({"context_window": 5_000, "output_reserve": 500}, 150)],  # in the memo; covered by a checkpoint
)
async def test_a_turn_key_older_than_the_carried_answers_fails_at_once_and_appends_nothing(
    temporal_client: Client, pg_dsn: str, task_queue: str, budget: dict[str, int], words: int
) -> None:
    """A retry of a turn's key after 36 more turns (the session carries its last 32 answers across continue-as-new)
    fails `UpdateIdReused` at once, naming the turn the key was, appends nothing and leaves no request record
    behind (every recorded request still replays); the session goes on. Before, the build found the message
    logged, raised the undocumented `LogMoved` and built again for ~75 s with the turn lock held, and each try
    left a record replay could not reproduce."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open(continue_as_new_after_turns=4, budget=budget))
        first = await s.submit_turn("remember this", idempotency_key="old-key")
        for n in range(RECENT_UPDATES + 4):  # the last continue-as-new carries 32 newer answers
            await s.submit_turn(f"turn {n}: " + "words " * words)
        if budget:  # a checkpoint covers the first turn: a build reads the log after it only
            assert (await s.state()).metrics.compactions >= 1
        items = [r.payload["id"] for r in await store.load_items(s.session_id)]
        began = time.monotonic()
        with pytest.raises(CtxEngineError) as refused:
            await s.submit_turn("remember this", idempotency_key="old-key")
        assert time.monotonic() - began < 20
        assert refused.value.type == "UpdateIdReused" and f"was turn {first.turn}'s" in str(refused.value)
        assert [r.payload["id"] for r in await store.load_items(s.session_id)] == items
        rebuilt = await rebuild_session(store, s.session_id, lambda _: TiktokenCounter("cl100k_base"))
        assert rebuilt and all(r.reproduced for r in rebuilt), [r for r in rebuilt if not r.reproduced][:2]
        assert (await s.submit_turn("and now?")).text


async def test_every_update_takes_an_idempotency_key(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A rotation, a revocation, a grant, a memory deletion and a close resent with the same key (a caller retrying
    after a timeout) are answered as the first was and apply nothing again: one new epoch, not two."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open())
        await s.submit_turn("hello")
        rotations = [await s.rotate_epoch("provider_routing_changed", idempotency_key="rot-1") for _ in range(2)]
        assert [r.epoch for r in rotations] == [2, 2]
        revoked = [await s.revoke_tool("web.fetch", idempotency_key="rev-1") for _ in range(2)]
        assert all("web.fetch" in r.revoked_tools for r in revoked)
        granted = [await s.grant_tool("web.fetch", idempotency_key="grant-1") for _ in range(2)]
        assert all("web.fetch" not in g.revoked_tools for g in granted)
        await s.write_memory("likes trains", memory_id="m-trains")
        deleted = [await s.delete_memory("m-trains", idempotency_key="del-1") for _ in range(2)]
        assert deleted[0] == deleted[1]
        closed = [await s.close("done", idempotency_key="close-1") for _ in range(2)]
        assert closed[0].status == closed[1].status == "closed"
        assert closed[1].epoch == 2 and closed[1].metrics.epochs == rotations[0].metrics.epochs
        epochs = await store.pool.fetchval("SELECT count(*) FROM prefixes WHERE session_id = $1", s.session_id)
        assert epochs == 2


async def test_a_key_used_by_another_kind_of_update_is_refused_typed(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """Temporal answers an update id with the first update's outcome, whatever its name: a close sent with a turn's
    key gets the turn's answer. The client raises UpdateIdReused, naming the key, and the session stays open. Before,
    the caller got pydantic's ValidationError for SessionState."""
    from ctxengine.client import UpdateIdReused

    async with stack(temporal_client, pg_dsn, task_queue):
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue)
        s = await ctx.start_session(session_open())
        await s.submit_turn("hello", idempotency_key="req-1")
        with pytest.raises(UpdateIdReused) as info:
            await s.close("done", idempotency_key="req-1")
        assert "'req-1'" in str(info.value) and info.value.type == "UpdateIdReused"
        with pytest.raises(UpdateIdReused):  # a grant's answer is a state too, but not a closed one
            await s.grant_tool("web.fetch", idempotency_key="grant-1")
            await s.close("done", idempotency_key="grant-1")
        state = await s.state()
        assert state.status == "open" and state.turns == 1
        assert (await s.submit_turn("still open")).turn == 2
        await s.close("done", idempotency_key="close-1")
        with pytest.raises(UpdateIdReused):  # a close's answer, a closed state, is never a grant's
            await s.grant_tool("web.fetch", idempotency_key="close-1")


async def test_a_failed_start_s_id_may_be_used_again(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A start that fails at open (a prefix over its cap) raises PrefixOverflow; the same id then starts a session
    with a fixed open, and once that one is closed the id is refused."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        sid = f"retry-{task_queue}"
        with pytest.raises(PrefixOverflow):
            await ctx.start_session(session_open(agent_instructions="word " * 6_000), session_id=sid)
        s = await ctx.start_session(session_open(agent_instructions="FIXED"), session_id=sid)
        assert (await s.submit_turn("hello")).turn == 1
        await s.close()
        with pytest.raises(SessionIdTaken):
            await ctx.start_session(session_open(), session_id=sid)


async def test_revoke_regrant_and_call(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Grant a pinned tool the open left out, revoke it, re-grant it across continue-as-new and call it: one
    prefix hash throughout; a tool that is not pinned cannot be granted."""
    async with stack(temporal_client, pg_dsn, task_queue):
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue)
        s = await ctx.start_session(session_open(grants=["notes.save"], continue_as_new_after_turns=2))
        denied = await s.submit_turn(FETCH)
        assert not denied.tool_calls[0].allowed and "not granted" in denied.tool_calls[0].summary
        await s.grant_tool("web.fetch")
        allowed = await s.submit_turn(FETCH)  # the run continues as new after this turn
        assert allowed.tool_calls[0].allowed
        await s.revoke_tool("web.fetch", "incident 7")
        revoked = await s.submit_turn(FETCH)
        assert not revoked.tool_calls[0].allowed and "incident 7" in revoked.tool_calls[0].summary
        state = await s.grant_tool("web.fetch")
        assert "web.fetch" not in state.revoked_tools and state.granted_tools == ["web.fetch"]
        regranted = await s.submit_turn(FETCH)
        assert regranted.tool_calls[0].allowed
        with pytest.raises(ToolNotPinned, match="epoch rotation"):
            await s.grant_tool("shell.exec")
        final = await s.state()
        assert final.epoch == 1 and len(final.prefix_hashes["1"]) == 1
        assert {r.prefix_sha256 for r in (denied, allowed, revoked, regranted)} == set(final.prefix_hashes["1"])
        runs = [w async for w in temporal_client.list_workflows(f"WorkflowId = '{s.session_id}'")]
        assert len(runs) >= 2


async def test_grant_reaches_a_running_child_run(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A child run authorises against its own copy of the grants: a grant signalled while it runs lets its
    pending call through."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue)
        open_ = session_open()
        s = await ctx.start_session(open_)
        await s.submit_turn("hello")
        await s.revoke_tool("web.fetch")
        state = await s.state()
        await store.append_items(
            s.session_id,
            2,
            [{"id": "u:child", "kind": "user_message", "trust": "USER", "text": f"/sleep 1\n{FETCH}"}],
        )
        child = await temporal_client.start_workflow(
            names.WORKFLOW_CHILD_RUN,
            ChildRunInput(open=open_, state=state, turn=2, user_item_id="u:child", call_index=0),
            id=f"{s.session_id}/child-run/test",
            task_queue=task_queue,
            result_type=ChildRunResult,
        )
        await child.signal(names.UPDATE_REVOKE_TOOL, RevokeTool(name="notes.save"))
        await child.signal(names.UPDATE_GRANT_TOOL, GrantTool(name="web.fetch"))
        done: ChildRunResult = await child.result()
        assert done.result.tool_calls[0].allowed
        assert "web.fetch" not in done.state.revoked_tools and "notes.save" in done.state.revoked_tools


async def test_delete_memory(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A deleted memory leaves the store and recall; the session's frozen snapshot keeps it, withdrawn by a
    correction line, until the next epoch."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await store.write_memory(
            "default", "home", "The user lives in Bergen.", trust="USER", session_id=None, corrects=None
        )
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue)
        s = await ctx.start_session(session_open())
        before = await s.submit_turn("hello")
        gone = await s.delete_memory("home", reason="user asked to forget")
        assert gone.deleted and gone.in_snapshot
        assert (await s.delete_memory("home")).deleted  # a retry finds it deleted
        after = await s.submit_turn("where do I live? Bergen?")
        assert after.prefix_sha256 == before.prefix_sha256
        assert "withdrawn" in await region_b(store, after.plan.request_sha256, "correction")
        assert "Bergen" not in await region_b(store, after.plan.request_sha256, "recall")
        assert not await store.memory_exists("default", "home")
        await s.rotate_epoch("model_route_changed", model_route=session_open().model_route)
        rotated = await s.submit_turn("where do I live? Bergen?")
        assert rotated.epoch == 2
        assert "Bergen" not in _prefix_text(await store.get_prefix(s.session_id, 2))
        assert not await region_b(store, rotated.plan.request_sha256, "correction")
        other = await ctx.start_session(session_open())
        fresh = await other.submit_turn("where do I live? Bergen?")
        assert "Bergen" not in _prefix_text(await store.get_prefix(other.session_id, 1))
        assert "Bergen" not in await region_b(store, fresh.plan.request_sha256, "recall")


def _prefix_text(stored: StoredPrefix | None) -> str:
    assert stored is not None
    return str(stored.prefix["text"])


async def _rows_mentioning(store: Store, needles: list[str]) -> dict[str, int]:
    """Rows of every table in the schema (from the catalogue, so none can hide) whose text holds a needle."""
    tables = [
        r["table_name"]
        for r in await store.pool.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() "
            "AND table_type = 'BASE TABLE'"
        )
    ]
    found: dict[str, int] = {}
    for table in tables:
        n = await store.pool.fetchval(
            f'SELECT count(*) FROM "{table}" AS t WHERE t::text LIKE ANY($1::text[])', [f"%{x}%" for x in needles]
        )
        if n:
            found[table] = n
    return found


async def test_purge_leaves_nothing(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Purging a closed session removes every row of it (log, artifacts, requests, prefixes, checkpoints,
    events, formed memories) from every table, and nothing of another session. What stays is its id, with the
    dates it opened and closed, so the id still names that session: a start with it is refused `SessionIdTaken`
    (before, a purged session's id opened a new session)."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open(budget={"context_window": 5_000, "output_reserve": 500}))
        keep = await ctx.start_session(session_open())
        await keep.submit_turn(FETCH)
        await s.submit_turn(control({"op": "add_fact", "text": "The user prefers night trains to Berlin."}))
        await s.write_memory("The user's cat is called Miso.", idempotency_key="mem-1")
        for i in range(40):
            await s.submit_turn(f"turn {i}\n/call web.fetch {json.dumps({'url': f'fixture://marker/{i}'})}")
            if (await s.state()).metrics.compactions:
                break
        assert (await s.state()).metrics.compactions >= 1
        with pytest.raises(SessionNotClosed):
            await ctx.purge(s.session_id)
        await s.close()
        records = await store.records(s.session_id)
        needles = [s.session_id, *{r.request_sha256 for r in records}, *{r.prefix_sha256 for r in records}]
        needles += [r["memory_id"] for r in await store.pool.fetch("SELECT memory_id FROM memories")]
        before = await _rows_mentioning(store, needles)
        assert {"items", "artifacts", "checkpoints", "events", "rendered_requests", "memories"} <= set(before)
        kept_before = await _rows_mentioning(store, [keep.session_id])
        result = await ctx.purge(s.session_id)
        assert result.rows_deleted["sessions"] == 1 and "retention" in result.temporal_history
        assert await _rows_mentioning(store, needles) == {"purged_sessions": 1}
        tombstone = await store.pool.fetchrow("SELECT * FROM purged_sessions WHERE session_id = $1", s.session_id)
        assert tombstone is not None and set(dict(tombstone)) == {"session_id", "opened_at", "closed_at", "purged_at"}
        assert await _rows_mentioning(store, [keep.session_id]) == kept_before
        with pytest.raises(SessionIdTaken):
            await ctx.start_session(session_open(), session_id=s.session_id)


async def _temporal_cli(address: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        str(temporal_binary()),
        *args,
        "--address",
        address,
        "--namespace",
        temporal_namespace(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def test_stock_cli_runtime_write_grant_and_forget(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str
) -> None:
    """The stock `temporal` CLI drives the new updates with plain JSON: a runtime write, revoke and re-grant
    (one prefix hash), delete_memory; then `ctxengine purge` erases the closed session."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await store.write_memory(
            "default", "pet", "The user's cat is Miso.", trust="USER", session_id=None, corrects=None
        )
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue, store=store)
        s = await ctx.start_session(session_open())

        async def update(name: str, payload: dict[str, Any]) -> tuple[int, str]:
            return await _temporal_cli(
                temporal_address,
                "workflow",
                "update",
                "execute",
                "--workflow-id",
                s.session_id,
                "--name",
                name,
                "--input",
                json.dumps(payload),
            )

        code, out = await update("update_working_state", {"operations": [{"op": "add_constraint", "text": "No fly."}]})
        assert code == 0 and "No fly." in out, out
        code, out = await update("update_working_state", {"operations": [{"op": "add_task"}]})
        assert code != 0 and "text" in out and "add_task" in out, out
        code, out = await update("revoke_tool", {"name": "web.fetch"})
        assert code == 0, out
        assert not (await s.submit_turn(FETCH)).tool_calls[0].allowed
        code, out = await update("grant_tool", {"name": "web.fetch"})
        assert code == 0, out
        code, out = await update("grant_tool", {"name": "shell.exec"})
        assert code != 0 and "epoch rotation" in out, out
        granted = await s.submit_turn(FETCH)
        assert granted.tool_calls[0].allowed
        assert "No fly." in await region_b(store, granted.plan.request_sha256, "working_state")
        assert len((await s.state()).prefix_hashes["1"]) == 1
        code, out = await update("delete_memory", {"memory_id": "pet"})
        assert code == 0 and "deleted:true" in out, out
        await s.close()
    env = {**os.environ, "CTXENGINE_DATABASE_URL": pg_dsn}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ctxengine.cli", "purge", "--session", s.session_id, "--json",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out_b, err_b = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err_b.decode()[-2000:]
    report = json.loads(out_b.decode().strip().splitlines()[-1])
    assert report["rows_deleted"]["sessions"] == 1 and "retention" in report["temporal_history"]


async def test_list_sessions_by_search_attributes(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Sessions are listed by status, epoch and prefix hash (the search attributes the session upserts)."""
    async with stack(temporal_client, pg_dsn, task_queue):
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue)
        s = await ctx.start_session(session_open())
        done = await s.submit_turn("hello")

        async def listed(**filters: Any) -> list[str]:
            for _ in range(100):  # visibility is eventually consistent
                ids = [x.session_id for x in await ctx.list_sessions(**filters)]
                if s.session_id in ids:
                    return ids
                await asyncio.sleep(0.1)
            return []

        assert s.session_id in await listed(epoch=1, prefix_sha256=done.prefix_sha256)
        summary = next(x for x in await ctx.list_sessions(prefix_sha256=done.prefix_sha256))
        assert summary.epoch == 1 and summary.prefix_sha256 == done.prefix_sha256 and summary.status == "running"
        assert s.session_id not in [x.session_id for x in await ctx.list_sessions(epoch=2)]
        await s.close()
        assert s.session_id in await listed(status="completed")
        with pytest.raises(SessionNotOpen):
            await s.submit_turn("anyone there?")


async def test_input_the_session_would_refuse_is_refused_typed(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """Input that does not validate raises ValidationFailed naming what is wrong, whether the client refuses it
    before sending (a field that does not validate) or the session does (a tool it does not have); the session is
    unchanged."""
    async with stack(temporal_client, pg_dsn, task_queue):
        ctx = CtxEngineClient(temporal_client, task_queue=task_queue)
        s = await ctx.start_session(session_open())
        await s.submit_turn("hello")
        before = await s.state()
        bad: list[tuple[str, Any]] = [
            ("text", s.submit_turn("")),
            ("text", s.submit_turn("a\x00b")),
            ("text", s.submit_turn(123)),  # type: ignore[arg-type]
            ("reason", s.rotate_epoch("bogus")),
            ("not in this session's tool set", s.revoke_tool("")),
            ("text", s.write_memory("")),
        ]
        for field, call in bad:
            with pytest.raises(ValidationFailed, match=field):
                await call
        after = await s.state()
        assert (after.turns, after.epoch, after.revoked_tools) == (before.turns, before.epoch, before.revoked_tools)
