"""A provider's refusal of a request as too long, learned by the model call on a real PostgreSQL (the activity runs
in an ActivityEnvironment, no Temporal): each refusal is its own event, and lifts the route's calibration, never
lowers it. The turn's rebuild after it is tested on the live stack (tests/gates/test_wire_observers.py)."""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.openai_provider import context_length_error
from activities.provider import ProviderReply, ProviderRequest
from activities.providers import build_providers
from activities.session import SessionActivities
from activities.store import Store
from contract.payloads import BuildInput, ModelInput
from harness.bench import cold_build

pytestmark = pytest.mark.integration

NOW = "2026-01-01T00:00:00+00:00"


class Refusing:
    """A provider that refuses every request as too long, in OpenAI's words (`message`)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.calls = 0

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        self.calls += 1
        raise context_length_error(
            provider="openai", request=request, model="m", status=400, message=self.message, request_id=None
        )


def _env(activity_id: str, attempt: int = 1) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, activity_id=activity_id, attempt=attempt)
    return env


async def _refused(
    store: Store, message: str, calls: int, expect: str = "ContextLengthExceeded"
) -> tuple[str, list[dict[str, object]], list[float]]:
    """A seeded session's next request, sent `calls` times to a provider refusing it with `message`: the refusal
    events and the route's calibration after each."""
    await store.migrate()
    session_id, last = await cold_build.seed(store, 12)
    providers = build_providers()
    providers["scripted"] = Refusing(message)  # type: ignore[assignment]
    acts = SessionActivities(store, providers)
    build = BuildInput(session_id=session_id, turn=last + 1, call_index=0, epoch=1, now_iso=NOW, user_text="status?")
    lifted: list[float] = []
    route_key = ""
    for n in range(calls):
        # As the turn does: build (again, after a refusal: the message is logged by then), then call the model.
        built = await ActivityEnvironment().run(acts.build.build_context, build)
        build = build.model_copy(update={"user_text": None, "user_item_id": built.user_item_id})
        route = (await store.records(session_id))[-1].inputs["profile"]
        route_key = f"{route['provider']}/{route['model']}"
        inp = ModelInput(
            session_id=session_id, turn=last + 1, call_index=0, epoch=1, request_sha256=built.plan.request_sha256
        )
        with pytest.raises(ApplicationError) as refused:
            await _env(str(2 * n + 2)).run(acts.model_call.call_model, inp)
        assert refused.value.type == expect and refused.value.non_retryable, refused.value.type
        lifted.append(await store.get_calibration(route_key) or 0.0)
    events = [e.payload for e in await store.events(session_id) if e.type == "context.estimator.refused"]
    return route_key, events, lifted


async def test_each_refusal_is_an_event_and_lifts_the_calibration(pg_dsn: str) -> None:
    """The same request refused twice (a message stating no count: each teaches the estimate and the margin) is two
    events, and two lifts of the route's calibration."""
    async with Store.from_dsn(pg_dsn) as store:
        _, events, lifted = await _refused(store, "the prompt is too long for this model's context window", 2)
    assert len(events) == 2, events
    assert events[0]["calibration_after"] == lifted[0] < lifted[1] == events[1]["calibration_after"]
    assert [e["provider_tokens"] for e in events] == [None, None]


async def test_a_refusal_that_says_the_window_is_smaller_is_not_learned(pg_dsn: str) -> None:
    """A refusal stating a model window (100 tokens) smaller than the route's, and a count no larger than the
    estimate: the route's window is wrong, not its estimate. The call fails `ContextWindowMismatch` naming the fix,
    and nothing is learned (no event, no calibration stored)."""
    async with Store.from_dsn(pg_dsn) as store:
        message = "This model's maximum context length is 100 tokens. However, your messages resulted in 101 tokens."
        await _refused(store, message, 1, expect="ContextWindowMismatch")
        assert await store.pool.fetchval("SELECT count(*) FROM calibrations") == 0
        assert await store.pool.fetchval("SELECT count(*) FROM events WHERE type = 'context.estimator.refused'") == 0


async def test_a_retried_call_whose_refusal_was_stored_does_not_ask_again(pg_dsn: str) -> None:
    """A worker killed after storing a refusal, before completing the call: Temporal retries the call, whose next
    attempt finds the refusal stored and fails as it did, without asking the provider again (before, the provider
    was asked, and refused, twice for one call)."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, last = await cold_build.seed(store, 12)
        providers = build_providers()
        refusing = Refusing("The request is too long: your messages resulted in 130563 tokens.")
        providers["scripted"] = refusing  # type: ignore[assignment]
        acts = SessionActivities(store, providers)
        build = BuildInput(session_id=session_id, turn=last + 1, call_index=0, epoch=1, now_iso=NOW, user_text="hi")
        built = await ActivityEnvironment().run(acts.build.build_context, build)
        inp = ModelInput(
            session_id=session_id, turn=last + 1, call_index=0, epoch=1, request_sha256=built.plan.request_sha256
        )
        for attempt in (1, 2):
            with pytest.raises(ApplicationError) as refused:
                await _env("7", attempt).run(acts.model_call.call_model, inp)
            assert refused.value.type == "ContextLengthExceeded" and refused.value.non_retryable
        assert refusing.calls == 1
        events = [e for e in await store.events(session_id) if e.type == "context.estimator.refused"]
        assert len(events) == 1 and events[0].payload["provider_tokens"] == 130_563
