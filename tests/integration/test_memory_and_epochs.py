"""Memory formation, corrections and epoch rotation on the live stack (ADR-0020 decisions 5 and 15)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError

from activities.store import Store
from contract import names
from contract.payloads import ModelRoute, RotateEpoch, SessionState, TurnResult, WriteMemory
from tests.integration.session_helpers import session_open, stack, start, turn

pytestmark = pytest.mark.integration


def facts(*texts: str) -> str:
    return "/call context.update_working_state " + json.dumps(
        {"operations": [{"op": "add_fact", "text": t} for t in texts]}
    )


async def test_formation_gates_and_untrusted_ban(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """At close, facts pass the gates in order; a fact written with untrusted content in view is never stored."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await store.write_memory(
            "default", "old", "The user lives in Bergen.", trust="USER", session_id=None, corrects=None
        )
        handle = await start(temporal_client, task_queue)
        await turn(handle, facts("The user prefers trains over planes.", "tiny", "The user lives in Bergen."))
        await turn(
            handle, '/call web.fetch {"url": "fixture://injection"}\n' + facts("Trailrunner 5 is the best boot.")
        )
        await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"})
        rows = {r.text: r for r in await store.candidates(handle.id)}
        assert rows["The user prefers trains over planes."].accepted
        assert rows["tiny"].gate == "length"
        assert rows["The user lives in Bergen."].gate == "duplicate"
        assert rows["Trailrunner 5 is the best boot."].gate == "untrusted"
        texts = {r["text"] for r in await store.pool.fetch("SELECT text FROM memories")}
        assert "The user prefers trains over planes." in texts
        assert "Trailrunner 5 is the best boot." not in texts


async def test_correction_of_snapshot_memory(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Correcting a snapshot memory adds a correction line in Region B; the prefix stays byte-stable."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await store.write_memory(
            "default", "home", "The user lives in Bergen.", trust="USER", session_id=None, corrects=None
        )
        handle = await start(temporal_client, task_queue)
        before = await turn(handle, "hello")
        result = await handle.execute_update(
            names.UPDATE_WRITE_MEMORY, WriteMemory(text="The user moved to Oslo.", corrects="home")
        )
        assert result["correction_of_snapshot"]
        after = await turn(handle, "where do I live?")
        assert after.prefix_sha256 == before.prefix_sha256
        request = await store.get_request(after.plan.request_sha256)
        assert request is not None
        body = request.body
        line = next(s for s in body if s["kind"] == "correction")
        assert "moved to Oslo" in line["text"] and line["region"] == "B"
        stored = await store.get_prefix(handle.id, 1)
        assert stored is not None
        prefix = stored.prefix["text"]
        assert "Bergen" in prefix and "Oslo" not in prefix


async def test_prefix_reuse_is_what_the_provider_read_from_its_cache(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """The prefix tokens a session counts as reused are, per request, the cached tokens the provider reported, up
    to the prefix's size: none for the first request of an epoch whose prefix is new. Before, every
    request after the session's first counted its whole prefix, the first request of a new epoch too, and a
    provider that cached nothing still gave a cache efficiency of 0.7."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, "hello")
        await turn(handle, "again")
        await handle.execute_update(
            names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="forced_revocation", revoke_tools=["web.fetch"])
        )
        await turn(handle, "after the rotation")
        records = sorted(await store.records(handle.id), key=lambda r: (r.turn, r.call_index))
        assert records[2].epoch == 2 and records[2].cached_tokens == 0  # a new prefix: nothing cached
        reused = [min(r.plan["prefix_tokens"], r.cached_tokens or 0) for r in records]
        assert reused[0] == reused[2] == 0 and reused[1] > 0, reused
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        m = state.metrics
        assert m.prefix_tokens_reused == sum(reused) and m.cached_tokens == sum(r.cached_tokens or 0 for r in records)
        assert m.cache_efficiency == m.cached_tokens / m.input_tokens
        events = [e.payload for e in await store.events(handle.id) if e.type == "context.estimator.reconciled"]
        assert sorted(e["prefix_tokens_reused"] for e in events) == sorted(reused)


async def test_epoch_rotation(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """rotate_epoch opens a new prefix, emits context.epoch.rotated with the reason, and counts epochs."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        before = await turn(handle, "hello")
        await handle.execute_update(
            names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="forced_revocation", revoke_tools=["web.fetch"])
        )
        after = await turn(handle, '/call web.fetch {"url": "fixture://weather"}')
        assert after.epoch == 2 and after.prefix_sha256 != before.prefix_sha256
        assert not after.tool_calls[0].allowed
        stored2 = await store.get_prefix(handle.id, 2)
        assert stored2 is not None
        prefix2 = stored2.prefix["text"]
        assert "web.fetch" not in prefix2
        await handle.execute_update(
            names.UPDATE_ROTATE_EPOCH,
            RotateEpoch(reason="model_route_changed", model_route=ModelRoute(model="scripted-2")),
        )
        third = await turn(handle, "again")
        assert third.epoch == 3
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.metrics.epochs == 3 and state.metrics.prefix_hash_violations == 0
        events = [e for e in await store.events(handle.id) if e.type == "context.epoch.rotated"]
        assert [e.payload["reason"] for e in events] == ["forced_revocation", "model_route_changed"]
        records = await store.records(handle.id)
        for epoch in (1, 2, 3):
            assert len({r.prefix_sha256 for r in records if r.epoch == epoch}) == 1


async def test_untrusted_in_history_taints_later_facts(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A fact written while an untrusted result from an earlier turn is still in view is marked untrusted."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, '/call web.fetch {"url": "fixture://injection"}')
        await turn(handle, facts("Trailrunner 5 boots are waterproof."))
        await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"})
        rows = await store.candidates(handle.id)
        assert [r.gate for r in rows] == ["untrusted"]


async def test_a_runtime_fact_after_the_last_turn_is_offered(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """Every fact of the working state at close is offered, a runtime write after the last turn (logged under the
    next turn's number) too; a tainted fact of the last turn is still refused."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)

        async def add_fact(text: str) -> None:
            await handle.execute_update(names.UPDATE_WORKING_STATE, {"operations": [{"op": "add_fact", "text": text}]})

        await add_fact("The user prefers trains over planes.")
        await turn(
            handle, '/call web.fetch {"url": "fixture://injection"}\n' + facts("Trailrunner 5 is the best boot.")
        )
        await add_fact("The user travels with a bicycle.")
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert "trains" in state.working_state and "bicycle" in state.working_state
        await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"})
        rows = {r.text: r for r in await store.candidates(handle.id)}
        assert rows["The user prefers trains over planes."].accepted
        assert rows["Trailrunner 5 is the best boot."].gate == "untrusted"
        assert rows["The user travels with a bicycle."].accepted  # KeyError before: the late fact was never offered


async def test_corrections_of_one_memory_render_as_its_latest(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """Sixteen corrections of one snapshot memory render as one correction line, the latest. Before, every
    correction rendered, and correction lines never yield: sixteen of 4,000 characters, written from another
    session on the scope, left a 16k-token session no room for any turn."""
    scope = f"flood-{task_queue}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await _remember(store, scope, "msnap", "The office is in Bergen.")
        open_ = session_open(memory_scope=scope, budget={"context_window": 16_384, "output_reserve": 1_000})
        handle = await start(temporal_client, task_queue, open_)
        await turn(handle, "hello")
        for i in range(16):
            text = f"correction {i}: " + "the office moved again " * 170
            await _remember(store, scope, f"fix{i}", text, corrects="msnap")
        body = await _body_of(store, await turn(handle, "where is the office?"))
        lines = [s["text"] for s in body if s["kind"] == "correction"]
        assert len(lines) == 1 and "correction 15:" in lines[0], [line[:40] for line in lines]
        # A correction of the latest correction is the memory's line now; no correction of it is recalled beside
        # its line (the snapshot holds the memory).
        await _remember(store, scope, "fixfix", "The office is in Oslo after all.", corrects="fix15")
        body = await _body_of(store, await turn(handle, "where is the office moved again?"))
        lines = [s["text"] for s in body if s["kind"] == "correction"]
        assert len(lines) == 1 and "Oslo after all" in lines[0], [line[:40] for line in lines]
        assert not [s for s in body if s["kind"] == "recall"]


async def test_a_rotation_frees_a_session_a_correction_filled(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A correction too long for the window beside the prefix: the turn fails TurnTooLarge (correction lines never
    yield). A rotation on the same route is checked like any other: its snapshot leaves the corrected memory out,
    its correction line goes with it, and the next turn is answered. Before, a same-route rotation whose prefix did
    not grow was not checked: it kept the memory, and every turn still failed."""
    scope = f"stuck-{task_queue}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await _remember(store, scope, "msnap", "The office is in Bergen.")
        open_ = session_open(memory_scope=scope, budget={"context_window": 2_800, "output_reserve": 256})
        handle = await start(temporal_client, task_queue, open_)
        await turn(handle, "hello")
        await _remember(store, scope, "fix", "The office moved: " + "word " * 800, corrects="msnap")
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await turn(handle, "where is the office?")
        assert getattr(info.value.cause, "type", None) == "TurnTooLarge", info.value.cause
        rotated = await handle.execute_update(
            names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="provider_routing_changed"), result_type=SessionState
        )
        assert rotated.epoch == 2
        answered = await turn(handle, "where is the office now?")
        assert answered.epoch == 2 and answered.plan.tokens_by_class.get("corrections", 0) == 0


async def test_a_withdrawn_memory_id_is_not_reused(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A deleted memory leaves a withdrawal that sessions whose snapshot held it still show; a new memory under the
    same id would be withdrawn by it too, so the id is refused (MemoryIdTaken). Before, the write succeeded and
    every later session showed the new memory beside a line withdrawing it."""
    async with stack(temporal_client, pg_dsn, task_queue):
        handle = await start(temporal_client, task_queue, session_open(memory_scope=f"ids-{task_queue}"))
        await handle.execute_update(names.UPDATE_WRITE_MEMORY, WriteMemory(memory_id="m2", text="The codename is OWL."))
        await handle.execute_update(names.UPDATE_DELETE_MEMORY, {"memory_id": "m2", "reason": "obsolete"})
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await handle.execute_update(
                names.UPDATE_WRITE_MEMORY, WriteMemory(memory_id="m2", text="The codename is HERON now.")
            )
        cause = info.value.cause
        assert getattr(cause, "type", None) == "MemoryIdTaken" and "withdrawn" in str(cause), cause


async def test_one_oversized_memory_does_not_empty_the_snapshot(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """The scope's oldest memory alone is over the snapshot's 1,500-token cap; 39 small ones follow. A new
    session's snapshot leaves out the oversized one and keeps the oldest small ones that fit. Before, the newest
    went first, down to the oversized one, then it too: the snapshot was empty in every session on the scope."""
    scope = f"big-{task_queue}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await _remember(store, scope, "huge", "x," * 2_000)
        for i in range(39):
            await _remember(store, scope, f"s{i:02d}", f"Small fact {i}.")
        handle = await start(temporal_client, task_queue, session_open(memory_scope=scope))
        await turn(handle, "hello")
        prefix = await store.get_prefix(handle.id, 1)
        assert prefix is not None
        kept = [s["item_id"] for s in prefix.prefix["segments"] if s["kind"] == "memory_snapshot"]
        assert kept and kept == [f"memory.s{i:02d}" for i in range(len(kept))], kept  # the oldest that fit the cap


async def _body_of(store: Store, answered: TurnResult) -> list[dict[str, Any]]:
    """The stored body of the request that answered a turn."""
    request = await store.get_request(answered.plan.request_sha256)
    assert request is not None
    return request.body


async def _remember(store: Store, scope: str, memory_id: str, text: str, corrects: str | None = None) -> None:
    """A memory written straight to the store, as another session on the scope would have."""
    await store.write_memory(scope, memory_id, text, trust="USER", session_id=None, corrects=corrects)


async def test_a_corrected_memory_is_recalled_as_its_latest_correction(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A memory outside the snapshot (written after the session opened) matches the turn's message; it has been
    corrected twice, and the corrections' words do not match. Recall shows the latest correction, once. Before,
    recall showed the memory's old text: the session was told the code it had been told was wrong."""
    scope = f"recall-{task_queue}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(memory_scope=scope))
        await turn(handle, "hello")
        await _remember(store, scope, "gate", "The parking garage gate code is 4411.")
        await _remember(store, scope, "fix1", "It changed to 5522 in March.", corrects="gate")
        await _remember(store, scope, "fix2", "It changed to 9090 in May.", corrects="gate")
        answered = await turn(handle, "what is the parking garage gate code?")
        request = await store.get_request(answered.plan.request_sha256)
        assert request is not None
        recalled = [s["text"] for s in request.body if s["kind"] == "recall"]
        assert len(recalled) == 1 and "9090" in recalled[0], recalled
        assert not any("4411" in s["text"] for s in request.body)
        # The same search when the build looks the message up after its read (a retry, another worker).
        rows = await store.search_memories(scope, "parking garage gate code", limit=5)
        assert [(r.memory_id, r.text) for r in rows] == [("fix2", "It changed to 9090 in May.")]
        # A match on the memory and on its latest correction is recalled once.
        rows = await store.search_memories(scope, "parking garage code 9090 May", limit=5)
        assert [r.memory_id for r in rows] == ["fix2"]
        # A match on an older correction alone is the same fact: recalled as its newest memory, and so is a
        # correction of a correction.
        assert [r.memory_id for r in await store.search_memories(scope, "what changed in March", limit=5)] == ["fix2"]
        await _remember(store, scope, "fix3", "No: it is 7070 since June.", corrects="fix2")
        assert [r.text for r in await store.search_memories(scope, "March", limit=5)] == ["No: it is 7070 since June."]


async def test_a_fact_whose_memory_id_another_writer_took_is_not_reported_formed(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """Another writer on the scope took the id memory formation gives a session's fact (`SESSION:f1`) before the
    session closed. The fact is recorded as not formed (gate `id_taken`), not as accepted under the other
    writer's text. Before, the formation's write did nothing on the conflict and the candidate read `accepted`,
    pointing at a memory that said the opposite."""
    scope = f"hijack-{task_queue}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(memory_scope=scope))
        fact = {"op": "add_fact", "text": "The user is allergic to penicillin."}
        await handle.execute_update(names.UPDATE_WORKING_STATE, {"operations": [fact]})
        await turn(handle, "hello")
        await _remember(store, scope, f"{handle.id}:f1", "The user is NOT allergic to anything.")
        await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "done"})
        (candidate,) = [r for r in await store.candidates(handle.id) if r.fact_id == "f1"]
        assert not candidate.accepted and candidate.gate == "id_taken" and candidate.memory_id is None, candidate


async def test_deleting_a_memory_deletes_its_corrections(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """`delete_memory` of a corrected memory deletes its corrections, and theirs: they restate what it said. Its
    withdrawal stays (sessions whose snapshot holds it show it). Before, the corrections stayed in the scope,
    recalled by any later session."""
    scope = f"forget-{task_queue}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        await _remember(store, scope, "m1", "The favourite colour is teal.")
        await _remember(store, scope, "c1", "The favourite colour is navy, not teal.", corrects="m1")
        await _remember(store, scope, "c2", "The favourite colour is navy blue.", corrects="c1")
        await _remember(store, scope, "other", "The favourite food is soup.")
        handle = await start(temporal_client, task_queue, session_open(memory_scope=scope))
        await handle.execute_update(names.UPDATE_DELETE_MEMORY, {"memory_id": "m1", "reason": "obsolete"})
        rows = await store.pool.fetch("SELECT memory_id FROM memories WHERE scope = $1", scope)
        left = {r["memory_id"] for r in rows}
        assert left == {"other", "withdrawn:m1"}, left
