"""What a model call reads, on a real PostgreSQL (the activities run in an ActivityEnvironment, no Temporal): the
first attempt on the worker that built the request reads nothing, a retry and another worker read, and neither
asks the model twice for one request."""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.provider import ModelProvider, ProviderReply, ProviderRequest, ProviderSegment
from activities.providers import build_providers
from activities.session import SessionActivities
from activities.session_state import WHOLE_SLACK
from activities.store import SQL_STORE_REQUEST, SQL_TURN_READS, Store
from contract.payloads import BuildInput, ModelInput
from core.plan import SEGMENT
from harness.bench import cold_build
from harness.bench.measure import CountingPool, DbCounts
from tests.integration.session_helpers import pages_session

pytestmark = pytest.mark.integration

NOW = "2026-01-01T00:00:00+00:00"


class CountedModel:
    """The scripted model, counting the requests it answers."""

    def __init__(self, inner: ModelProvider) -> None:
        self.inner = inner
        self.calls = 0

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        self.calls += 1
        return await self.inner.complete(request)


async def _seeded(store: Store) -> tuple[str, int, dict[str, ModelProvider], CountedModel]:
    """A session with 12 logged items, its next turn, and the providers with the scripted model counted."""
    await store.migrate()
    session_id, last = await cold_build.seed(store, 12)
    providers = build_providers()
    model = providers["scripted"] = CountedModel(providers["scripted"])
    return session_id, last + 1, providers, model


def _env(attempt: int) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=attempt)
    return env


async def test_the_building_worker_reads_nothing_on_a_first_attempt_and_a_retry_never_asks_twice(pg_dsn: str) -> None:
    """Round trips counted at the pool, model requests counted by the model: the building worker's first attempt
    writes once and reads nothing; every later call of the request (a retry, the call scheduled again, another
    worker) reads the record and the logged reply and returns it without asking the model."""
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, providers, model = await _seeded(store)
        db = DbCounts()
        acts = SessionActivities(Store(CountingPool(store.pool, db)), providers)
        built = await ActivityEnvironment().run(
            acts.build.build_context,
            BuildInput(session_id=session_id, turn=turn, call_index=0, epoch=1, now_iso=NOW, user_text="status?"),
        )
        inp = ModelInput(
            session_id=session_id, turn=turn, call_index=0, epoch=1, request_sha256=built.plan.request_sha256
        )

        start = sum(db.snapshot()[0].values())

        def trips() -> int:
            return sum(db.snapshot()[0].values()) - start

        first = await _env(1).run(acts.model_call.call_model, inp)
        # One round trip: the outcome's write. The record, the log and the calibrations came from the build.
        assert (trips(), model.calls) == (1, 1)
        record = await store.get_record(session_id, turn, 0)
        assert record is not None and record.actual_input_tokens == first.input_tokens

        # A retry on the same worker (the first attempt's completion was lost): it reads, finds the reply logged
        # and returns it without asking the model again.
        again = await _env(2).run(acts.model_call.call_model, inp)
        assert again == first and model.calls == 1
        assert trips() == 2  # the read only: nothing is written twice
        # Another first attempt on the same worker (the call scheduled again): the memo knows it was answered, so
        # it reads too.
        assert await _env(1).run(acts.model_call.call_model, inp) == first and model.calls == 1
        assert trips() == 3
        # A first attempt on another worker (the same call, retried there): it reads, and does not ask either.
        other = SessionActivities(store, providers)
        assert await _env(1).run(other.model_call.call_model, inp) == first and model.calls == 1
        reply = [i.payload["id"] for i in await store.load_items(session_id) if i.turn == turn]
        assert reply == [f"u:{turn}", f"t{turn}.m0.text"]  # the message and one reply, logged once


async def test_a_build_of_an_answered_call_writes_no_record_and_its_call_asks_nothing(pg_dsn: str) -> None:
    """A build of a call already answered (built again on a fresh worker) does not replace the record, so its
    worker has no record to answer the model call from: the call reads the stored one, whose request is the
    answered one, and fails naming the request without asking the model."""
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, providers, model = await _seeded(store)
        acts = SessionActivities(store, providers)
        inp = BuildInput(session_id=session_id, turn=turn, call_index=0, epoch=1, now_iso=NOW, user_text="status?")
        built = await ActivityEnvironment().run(acts.build.build_context, inp)
        call = ModelInput(
            session_id=session_id, turn=turn, call_index=0, epoch=1, request_sha256=built.plan.request_sha256
        )
        answered = await _env(1).run(acts.model_call.call_model, call)
        fresh = SessionActivities(store, providers)
        again = await ActivityEnvironment().run(
            fresh.build.build_context, inp.model_copy(update={"user_text": None, "user_item_id": f"u:{turn}"})
        )
        memo = fresh.state.cached(session_id)
        assert memo is not None and memo.built[again.plan.request_sha256].record is None
        with pytest.raises(ApplicationError, match="no stored request") as failed:
            await _env(1).run(
                fresh.model_call.call_model, call.model_copy(update={"request_sha256": again.plan.request_sha256})
            )
        assert failed.value.type == "UnknownRequest" and model.calls == 1
        record = await store.get_record(session_id, turn, 0)
        assert record is not None and record.request_sha256 == built.plan.request_sha256
        assert record.actual_input_tokens == answered.input_tokens


class CapturingModel(CountedModel):
    """The scripted model, keeping the segments of each request it answers (what an adapter puts on the wire)."""

    def __init__(self, inner: ModelProvider) -> None:
        super().__init__(inner)
        self.sent: list[list[ProviderSegment]] = []

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        self.sent.append(list(request.segments))
        return await super().complete(request)


async def test_another_worker_sends_the_built_request_taking_the_items_it_refers_to_from_its_memo(
    pg_dsn: str,
) -> None:
    """A call on a worker that did not build its request reads the body as stored (references to logged items
    left in) and takes the items from its memo, which the same read brings up to date: one read and one write,
    and the segments it sends are the ones the building worker built. A memo that lacks an item the body names
    (injected here: one stored render removed) reads the body whole instead, one more round trip, and sends the
    same segments."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, last = await cold_build.seed(store, 40)
        providers = build_providers()
        model = providers["scripted"] = CapturingModel(providers["scripted"])
        builder = SessionActivities(store, providers)

        async def build(turn: int) -> tuple[ModelInput, list[ProviderSegment]]:
            built = await ActivityEnvironment().run(
                builder.build.build_context,
                BuildInput(session_id=session_id, turn=turn, call_index=0, epoch=1, now_iso=NOW, user_text="status?"),
            )
            sha = built.plan.request_sha256
            memo = builder.state.cached(session_id)
            assert memo is not None
            # The body as stored refers to the logged items (or the test would not test the references): as the
            # read hands it on, a run of them stays one entry, its first and last log positions.
            chain = await store.call_reads(session_id, turn, 0, after_seq=memo.max_seq, epoch=1, request=sha)
            assert chain is not None and chain.request is not None
            assert sum(e["seqs"][1] - e["seqs"][0] + 1 for e in chain.request.body if "seqs" in e) >= 40
            expected = [memo.provider_of(s) for s in memo.built[sha].segments]
            return ModelInput(session_id=session_id, turn=turn, call_index=0, epoch=1, request_sha256=sha), expected

        def worker() -> tuple[SessionActivities, DbCounts]:
            db = DbCounts()
            return SessionActivities(Store(CountingPool(store.pool, db)), providers), db

        async def call(inp: ModelInput, acts: SessionActivities, db: DbCounts) -> int:
            """The call on `acts`, and the round trips it made."""
            before = sum(db.snapshot()[0].values())
            await _env(1).run(acts.model_call.call_model, inp)
            return sum(db.snapshot()[0].values()) - before

        # A worker whose memo lacks one referenced item: it reads the body whole.
        inp, expected = await build(last + 1)
        lacking, db = worker()
        _, _, memo = await lacking.state.session(session_id)
        await lacking.state.items(session_id, memo)
        await lacking.state.prefix(session_id, 1, memo)
        memo.items.renders[memo.items.ids.index(f"u:{last}")] = None  # as if logged without its render
        assert await call(inp, lacking, db) == 3  # the read, the body read whole, the outcome's write
        assert model.sent[-1] == expected

        # A worker that has never seen the session: its read brings the whole log, the body's items come from it.
        inp, expected = await build(last + 2)
        assert await call(inp, *worker()) == 3  # the read, the epoch's prefix (once a worker) and the write
        assert model.sent[-1] == expected and model.calls == 2


async def test_a_cold_worker_plans_its_reads_once(pg_dsn: str) -> None:
    """A fresh pool's connection plans each prepared statement once, for any parameters (`SERVER_SETTINGS`): in
    PostgreSQL's own record of the build's read and write, no plan was made for one execution's parameters, where
    its default plans each of a connection's first five executions (about 1-2 ms each for the build's read)."""
    async with Store.from_dsn(pg_dsn, max_size=1) as store:  # one connection: every build's statements on it
        session_id, turn, providers, _ = await _seeded(store)
        for i in range(4):  # each by a worker that has not seen the session
            await ActivityEnvironment().run(
                SessionActivities(store, providers).build.build_context,
                BuildInput(
                    session_id=session_id, turn=turn + i, call_index=0, epoch=1, now_iso=NOW, user_text=f"turn {i}"
                ),
            )
        async with store.pool.acquire() as conn:
            plans = {
                r["statement"]: (r["generic_plans"], r["custom_plans"])
                for r in await conn.fetch("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
            }
    assert plans[SQL_TURN_READS][0] >= 4 and plans[SQL_STORE_REQUEST][0] >= 4
    assert all(custom == 0 for _, custom in plans.values()), plans


async def test_a_body_under_pressure_is_stored_as_a_delta_and_another_worker_sends_it_as_built(pg_dsn: str) -> None:
    """A body that shows pointers (segments stored as JSON) is stored as a delta of the previous request built on
    the same worker, which it extends; read back it is the body built, and a model call on a worker that did not
    build it (the store composes the chain, cutting the base's runs where the delta keeps less of them; the memo
    resolves the references and runs) sends the segments the building worker would have sent, in order. A body
    that shows the log as a run is stored whole, a row a worker that did not build it reads alone."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id = "pointers-delta"
        await pages_session(store, session_id)
        providers = build_providers()
        model = providers["scripted"] = CapturingModel(providers["scripted"])
        builder = SessionActivities(store, providers)

        async def build(turn: int) -> str:
            built = await ActivityEnvironment().run(
                builder.build.build_context,
                BuildInput(session_id=session_id, turn=turn, call_index=0, epoch=1, now_iso=NOW, user_text="more?"),
            )
            return built.plan.request_sha256

        first, sha = await build(13), await build(14)
        raw = await store.pool.fetchval("SELECT body FROM rendered_requests WHERE sha256 = $1", sha)
        memo = builder.state.cached(session_id)
        assert memo is not None
        segments = memo.built[sha].segments
        assert raw["base"] == first and raw["keep"] > WHOLE_SLACK
        assert sum(s.kind == "elided_span" for s in segments) > WHOLE_SLACK  # the pointers the delta does not copy
        whole = await store.get_request(sha)
        prefix, _ = memo.prefixes[1]
        assert whole is not None and whole.body == [
            SEGMENT.dump_python(s, mode="json") for s in segments[len(prefix.segments) :]
        ]

        other = SessionActivities(store, providers)  # a worker that did not build the request
        await _env(1).run(
            other.model_call.call_model,
            ModelInput(session_id=session_id, turn=14, call_index=0, epoch=1, request_sha256=sha),
        )
        assert model.sent == [[memo.provider_of(s) for s in segments]]
