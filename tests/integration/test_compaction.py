"""Compaction, escalation and working state on the live stack (ADR-0020 decisions 10, 12, 14)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.provider import ProviderReply, ProviderUsage, ScriptedProvider, SummaryRequest
from activities.providers import build_providers
from activities.session import SessionActivities
from activities.store import ForeignReferenceError, Store
from activities.tokens import TiktokenCounter
from activities.tools import marker
from contract import names, retries
from contract.payloads import ActivityTimeouts, SessionState
from core.items import parse_history_item
from tests.integration.session_helpers import session_open, stack, start, turn

pytestmark = pytest.mark.integration

SMALL = {"context_window": 5_000, "output_reserve": 500}
CONSTRAINTS = [f"constraint number {i:02d}: never book flights before 09:{i:02d}" for i in range(20)]


def _set_constraints() -> str:
    ops = [{"op": "add_constraint", "text": c} for c in CONSTRAINTS]
    return "/call context.update_working_state " + json.dumps({"operations": ops})


async def _run_until(handle, store: Store, *, escalations: int, max_turns: int = 120) -> list:  # type: ignore[no-untyped-def]
    results = []
    for i in range(max_turns):
        text = f"turn {i}: look this up\n/call web.fetch {json.dumps({'url': f'fixture://marker/{i}'})}"
        results.append(await turn(handle, text))
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        if state.metrics.escalations >= escalations:
            return results
    raise AssertionError(f"no escalation within {max_turns} turns: {state.metrics}")


async def test_laundering_constraints_and_prefix(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """Two compactions then an escalation: no untrusted byte reaches a summarizer, pointers resolve, constraints
    and the prefix hash survive."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
        first = await turn(handle, _set_constraints())
        assert not first.tool_calls[0].is_error
        results = [first, *await _run_until(handle, store, escalations=1)]
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.metrics.compactions >= 2 and state.metrics.max_summary_depth == 2
        assert state.metrics.escalations == 1

        # Laundering: every summarizer input recorded, none with a marker byte.
        inputs = await store.summarizer_inputs(handle.id)
        assert inputs
        markers = [marker(str(i)) for i in range(len(results))]
        assert not [m for m in markers for row in inputs if m in row.input]
        assert not [row for row in inputs if "MARKER-" in row.input]

        # Every untrusted span is a pointer that resolves to the original bytes and keeps its trust level.
        checkpoints = await store.checkpoints(handle.id)
        pointers = [p for cp in checkpoints for p in cp["pointers"]]
        assert pointers
        for p in pointers:
            resolved = await store.resolve(handle.id, p["reference"])
            assert resolved.trust == p["trust"] == "EXTERNAL_UNTRUSTED"
            assert resolved.tainted == p["tainted"]
            assert "MARKER-" in resolved.content

        # Constraints survive byte for byte; the prefix hash never moved.
        for c in CONSTRAINTS:
            assert c in state.working_state
        last = await store.get_request(results[-1].plan.request_sha256)
        ws = next(s for s in last.body if s["kind"] == "working_state")
        assert all(c in ws["text"] for c in CONSTRAINTS)
        records = await store.records(handle.id)
        assert len({r.prefix_sha256 for r in records}) == 1

        # The escalation's event says why the plan escalated (it said "summary depth is capped at 2" whatever the
        # reason was), and its fresh body how many times the context was summarized.
        escalated = [
            e.payload
            for e in await store.events(handle.id)
            if e.type == "context.compaction.completed" and e.payload["decision"] == "escalate"
        ]
        plans = [await store.get_compaction_plan(handle.id, e["checkpoint_id"]) for e in escalated]
        assert escalated and all(
            e["reason"].startswith(f"{p['reason']}; child run from ") for e, p in zip(escalated, plans, strict=True)
        )
        # Compaction and escalation are child workflows of the session.
        kids = [w.id async for w in temporal_client.list_workflows(f'WorkflowId STARTS_WITH "{handle.id}/"')]
        assert any("/compaction/" in k for k in kids) and any("/child-run/" in k for k in kids)


async def test_foreign_reference_is_refused(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A pointer of one session never resolves in another: a typed error, whoever asks."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        a = await start(temporal_client, task_queue)
        b = await start(temporal_client, task_queue)
        await turn(a, '/call web.fetch {"url": "fixture://marker/secret"}')
        await turn(b, "hello")
        ref = next(
            r.payload["artifact_ref"] for r in await store.load_items(a.id) if r.payload["kind"] == "tool_result"
        )
        resolved = await store.resolve(a.id, ref)
        assert marker("secret") in resolved.content and resolved.trust == "EXTERNAL_UNTRUSTED"
        with pytest.raises(ForeignReferenceError):
            await store.resolve(b.id, ref)


async def test_a_pointer_resolves_with_its_taint(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A pointer's original keeps its taint when resolved: a note the model saved after reading a page (`TOOL`,
    derived from untrusted content) resolves as tainted by its item, a note saved before the page does not, and an
    artifact a tainted result refers to resolves as tainted. Trust alone would name the later note trusted tool
    content."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue)
        await turn(handle, '/call notes.save {"text": "before any page"}')
        await turn(handle, '/call web.fetch {"url": "fixture://marker/taint"}')
        await turn(handle, '/call notes.save {"text": "after the page"}')
        notes = [
            r.payload
            for r in await store.load_items(handle.id)
            if r.payload["kind"] == "tool_result" and r.payload["tool_name"] == "notes.save"
        ]
        clean, derived = notes
        assert derived["trust"] == clean["trust"] == "TOOL"
        assert derived["tainted"] and not clean["tainted"]
        by_item = await store.resolve(handle.id, f"item:{derived['id']}")
        assert by_item.tainted and by_item.trust == "TOOL" and "after the page" in by_item.content
        assert not (await store.resolve(handle.id, f"item:{clean['id']}")).tainted

        # An artifact (a result too large to show whole) is stored once per content, with the first result's trust:
        # tainted if a tainted result refers to it, untrusted if an untrusted one does.
        other = await start(temporal_client, task_queue)
        await turn(other, "hello")
        ref = "artifact:" + await store.put_artifact(other.id, "a long note " * 50, trust="TOOL")
        assert not (await store.resolve(other.id, ref)).tainted
        result = {**derived, "id": "late.result", "call_id": "late", "artifact_ref": ref}
        await store.append_items(other.id, 2, [result])
        resolved = await store.resolve(other.id, ref)
        assert resolved.tainted and resolved.trust == "TOOL" and resolved.content == "a long note " * 50
        assert await store.put_artifact(other.id, "a long note " * 50, trust="EXTERNAL_UNTRUSTED") == ref.split(":")[1]
        page = {**result, "id": "page.result", "call_id": "page", "trust": "EXTERNAL_UNTRUSTED", "tainted": False}
        await store.append_items(other.id, 3, [page])
        assert (await store.resolve(other.id, ref)).trust == "EXTERNAL_UNTRUSTED"


async def test_full_context_still_compacts(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """With history filling the window, a long new message still gets its turn after compaction."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
        for i in range(12):
            await turn(handle, f"message {i}: " + "context " * 120)
        big = await turn(handle, "a long final question: " + "detail " * 600)
        assert big.plan.status == "fits"
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.metrics.compactions >= 1
        assert len({r.prefix_sha256 for r in await store.records(handle.id)}) == 1


class _Observed(SessionActivities):
    """The worker's activities, kept where the test can read the worker's per-session memo."""

    last: ClassVar[_Observed | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Observed.last = self


async def test_memo_holds_what_the_checkpoint_does_not_cover(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """After a compaction the worker's memo drops the items the checkpoint covers (bounded memory), and a worker
    that has not seen the session reads only the items after it (a cold read costs the window, not the log)."""
    async with stack(temporal_client, pg_dsn, task_queue, activities_class=_Observed) as store:
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
        for i in range(14):
            await turn(handle, f"message {i}: " + "context " * 120)
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.metrics.compactions >= 1
        await turn(handle, "one more after the compaction")
        checkpoint = await store.latest_checkpoint(handle.id)
        assert checkpoint is not None
        covers = int(checkpoint["covers_to_seq"])
        logged = await store.load_items(handle.id)
        assert logged[0].seq <= covers < logged[-1].seq

        assert _Observed.last is not None
        memo = _Observed.last.state.cached(handle.id)
        assert memo is not None and memo.floor == covers
        assert memo.items and all(item.seq > covers for item in memo.items)
        covered = {row.payload["id"] for row in logged if row.seq <= covers}
        assert not covered & set(memo.by_id)
        for key, render in memo.renders.items():
            assert not covered & set(memo.referable[key]) and len(memo.segments[key]) == len(memo.items)
            assert all(render.lookup(item) is None for item in (parse_history_item(r.payload) for r in logged[:3]))

        cold = SessionActivities(store, build_providers()).state
        _, _, fresh = await cold.session(handle.id)
        items = await cold.items(handle.id, fresh)
        assert [i.seq for i in items] == [row.seq for row in logged if row.seq > covers]
        assert fresh.floor == covers


async def test_failed_compaction_does_not_poison_later_ones(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A turn that cannot fit at all fails alone (TurnTooLarge, nothing logged), naming the room a message has
    beside the escalation checkpoint the session's turns may end up with; so does one that fits beside the prefix
    but not there (before, it was logged, escalated, and failed in the child run, ContextNeedsCompaction, a few tokens
    short: one run in five of this test), naming the same room; a turn sized from that room is answered through
    escalation; later turns still compact under new ids. (Before, the first refusal named the room beside the prefix
    alone, 67-86 tokens more than a message could take.)"""

    # Each message's update id is its log id's: ids of one shape take the same tokens, so a message's estimate is a
    # function of its words alone (random UUIDs moved it by tens of tokens at 2,000 words).
    ids = iter(f"probe-{k}" for k in range(10))

    async def too_large(words: int) -> dict[str, Any]:
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await turn(handle, "x: " + "detail " * words, update_id=next(ids))
        cause = info.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "TurnTooLarge", cause
        sizes: dict[str, Any] = cause.details[0]
        assert sizes["logged"] is False and sizes["minimum_body_tokens"] + sizes["prefix_tokens"] > sizes["input_limit"]
        return sizes

    def room(sizes: dict[str, Any]) -> int:
        """The tokens a message may take beside what `sizes` names."""
        rest = sizes["minimum_body_tokens"] - sizes["message_tokens"]
        return int(sizes["input_limit"] - sizes["prefix_tokens"] - rest)

    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
        for i in range(6):
            await turn(handle, f"message {i}: " + "context " * 150)
        # Two refusals give a message's tokens as a function of its words (the estimate scales them by the route's
        # ratio, beside a fixed envelope), and the room they name.
        big, bigger = await too_large(3_000), await too_large(4_000)
        per_word = (bigger["message_tokens"] - big["message_tokens"]) / 1_000
        envelope = bigger["message_tokens"] - per_word * 4_000
        assert room(big) == room(bigger)

        def words_for(tokens: int) -> int:
            return int((tokens - envelope) / per_word)

        edge = words_for(room(bigger))
        # Over the named room by less than the escalation checkpoint's size: it would fit beside the prefix alone.
        assert room(await too_large(edge + 20)) == room(bigger)
        before = await handle.query(names.QUERY_STATE, result_type=SessionState)
        answered = await turn(handle, "x: " + "detail " * (edge - 20), update_id=next(ids))
        assert answered.plan.status.value == "fits"
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.turns == before.turns + 1 and state.metrics.escalations >= 1
        for i in range(12):
            await turn(handle, f"later {i}: " + "context " * 150)
        ids = [c["checkpoint_id"] for c in await store.checkpoints(handle.id)]
        assert len(ids) >= 2 and len(set(ids)) == len(ids)
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.compaction_runs >= len(ids) and state.metrics.escalations >= 1


async def test_a_failed_child_run_does_not_fail_the_next_turn(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A turn escalates and its child run fails (its body never fits, a harness fault): the next turn compacts
    under an id of its own (the child's compactions are numbered in the child's scope) and is answered. Numbered
    in one scope, the session's next compaction took the failed child's number, read its stored 'nothing to
    compact' plan and failed a turn that fits."""
    from harness.faults import FailingChildRuns

    async with stack(temporal_client, pg_dsn, task_queue, activities_class=FailingChildRuns) as store:
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
        escalated = await _first_failure(handle, lambda i: f"turn {i}: look this up\n{_fetch(f'fixture://marker/{i}')}")
        assert escalated is not None and "nothing left to compact" in str(escalated), escalated
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        assert state.metrics.escalations == 1
        # A turn that fits only once compacted: the session compacts (the failed turn's message is new to it).
        after = await turn(handle, "and now this: " + "context " * 1_500)
        assert after.plan.status.value == "fits"
        plans = await store.pool.fetch(
            "SELECT checkpoint_id, plan->>'decision' AS decision FROM compaction_plans WHERE session_id = $1",
            handle.id,
        )
        assert len({p["checkpoint_id"] for p in plans}) == len(plans)
        assert [p["decision"] for p in plans if "-e" in p["checkpoint_id"]] == ["nothing_to_compact"]


async def test_a_failed_child_run_s_requests_are_counted(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    """A child run sends a request (the model, reading an injected page, calls tools), then fails the turn (a
    harness fault: its next body never fits). The session does not adopt the failed run's state, but the `state`
    query's metrics count the request it sent: requests and input tokens equal those of the stored request records
    that have the provider's usage. Before, the failed child's requests were missing from the metrics."""
    from harness.adversarial_model import AdversarialProvider
    from harness.faults import ChildRunsFailAfterACall

    async with stack(
        temporal_client,
        pg_dsn,
        task_queue,
        activities_class=ChildRunsFailAfterACall,
        providers={"scripted": AdversarialProvider()},
    ) as store:
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
        failed = await _first_failure(handle, lambda i: f"turn {i}: read this\n{_fetch('fixture://injection')}")
        assert getattr(failed, "type", None) == "ContextNeedsCompaction", failed
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        sent = [r for r in await store.records(handle.id) if r.actual_input_tokens is not None]
        children = [r for r in sent if r.turn == state.turns and r.call_index > 0]
        assert state.metrics.escalations >= 1 and children
        assert state.metrics.requests == len(sent)
        assert state.metrics.input_tokens == sum(r.actual_input_tokens or 0 for r in sent)


def _fetch(url: str) -> str:
    return f"/call web.fetch {json.dumps({'url': url})}"


async def _first_failure(handle: WorkflowHandle[Any, Any], text: Callable[[int], str]) -> BaseException | None:
    """Turns `text(0)`, `text(1)`, ... until one fails (at most 120): that update's failure, or None."""
    from temporalio.client import WorkflowUpdateFailedError

    for i in range(120):
        try:
            await turn(handle, text(i))
        except WorkflowUpdateFailedError as exc:
            return exc.cause
    return None


class _LongSummaries(ScriptedProvider):
    """A summarizer that writes far past `max_tokens`."""

    async def summarize(self, request: SummaryRequest) -> ProviderReply:
        return ProviderReply(text="the session went on and on " * 800, usage=ProviderUsage(input_tokens=1))


class _BlankSummaries(ScriptedProvider):
    async def summarize(self, request: SummaryRequest) -> ProviderReply:
        return ProviderReply(text="  \n", usage=ProviderUsage(input_tokens=1))


class _HangingSummaries(ScriptedProvider):
    calls = 0

    async def summarize(self, request: SummaryRequest) -> ProviderReply:
        type(self).calls += 1
        await asyncio.sleep(3_600)
        raise AssertionError("unreachable")


async def _until_compacted(handle: WorkflowHandle[Any, Any], store: Store) -> list[dict[str, Any]]:
    for i in range(40):
        await turn(handle, f"message {i}: " + "context " * 150)
        checkpoints = await store.checkpoints(handle.id)
        if checkpoints:
            return checkpoints
    raise AssertionError("no compaction within 40 turns")


async def test_a_summary_is_held_to_its_share_of_the_body(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A summarizer that writes 5,600 tokens where it was asked for a few hundred: the checkpoint keeps the
    chunk's share of the fifth of the body a summary may take, and every later request fits. A blank summary is
    replaced by the span's opening. Before, the whole reply was stored (a 4,004-token summary on a 4,500-token
    input limit), and a request went over the limit by the provider's count."""
    counter = TiktokenCounter()
    for provider, expect in ((_LongSummaries(), "the session went on"), (_BlankSummaries(), "returned nothing")):
        async with stack(temporal_client, pg_dsn, task_queue, providers={"scripted": provider}) as store:
            handle = await start(temporal_client, task_queue, session_open(budget=SMALL))
            checkpoint = (await _until_compacted(handle, store))[0]
            plan = await store.get_compaction_plan(handle.id, checkpoint["checkpoint_id"])
            assert plan is not None
            limit = plan["summary_tokens_per_chunk"] * len(plan["chunks"])
            assert expect in checkpoint["summary"]
            assert 0 < counter.count(checkpoint["summary"]) <= limit + len(plan["chunks"]), checkpoint["summary"][:80]
            for i in range(4):
                await turn(handle, f"after {i}: " + "context " * 150)
            records = await store.records(handle.id)
            assert all(r.estimated_tokens <= 4_500 for r in records)


async def test_a_hanging_summarizer_fails_the_turn_typed_after_a_model_call_s_attempts(
    temporal_client: Client, pg_dsn: str, task_queue: str
) -> None:
    """A summarizer that never answers: the turn fails `ModelCallTimeout` after the model call's four attempts.
    Before, the summarize activity took the database's retry policy (40 attempts: with the default 300 s model
    timeout, 3.3 hours in which the session took no turn) and the failure was untyped ("Child Workflow execution
    failed")."""
    model = _HangingSummaries()
    timeouts = ActivityTimeouts(build_seconds=5, model_seconds=1, model_heartbeat_seconds=5, tool_seconds=5)
    async with stack(temporal_client, pg_dsn, task_queue, providers={"scripted": model}):
        handle = await start(temporal_client, task_queue, session_open(budget=SMALL, timeouts=timeouts))
        with pytest.raises(WorkflowUpdateFailedError) as info:
            for i in range(40):
                await turn(handle, f"message {i}: " + "context " * 150)
        cause = info.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "ModelCallTimeout", cause
        assert _HangingSummaries.calls == retries.MODEL_MAX_ATTEMPTS
