"""The wire observers that gate_budget and gate_pairs call (harness/wire_gates.py), on the live stack with the
real adapters against the protocol servers; and the pairs observer catching a fault injected by the harness."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.openai_provider import OpenAIProvider, read_completion, render_chat_request
from activities.provider import ProviderReply, ProviderRequest
from activities.wire import wire_prefix
from harness.faults import RefusalNotLearned
from harness.gates import live_stack
from harness.sessions import gate_open
from harness.wire_gates import wire_budget, wire_pairs, wire_refusal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


class DroppedToolCallId(OpenAIProvider):
    """The fault the pairs observer guards against: a tool message sent without its tool_call_id."""

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        kwargs, names = render_chat_request(request)
        for message in kwargs["messages"]:
            if message["role"] == "tool":
                message.pop("tool_call_id")
                break
        completion, sent = await self._create_raw(kwargs, request)
        return read_completion(completion, names, 0).model_copy(update={"wire_prefix": wire_prefix(sent, "openai")})


async def test_wire_pairs_no_orphans_through_both_adapters(temporal_client: Client, pg_dsn: str) -> None:
    """The pairs scenario through both adapters sends no orphaned call or result on the wire."""
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True) as stack:
        result = await wire_pairs(stack, turns=8)
    assert result["faults"] == [] and result["wire_requests_with_orphans"] == 0
    assert result["wire_requests_checked"] >= 16


async def test_negative_wire_pairs_dropped_tool_call_id(temporal_client: Client, pg_dsn: str) -> None:
    """An adapter that drops a tool_call_id on the wire fails the pairs observer, which names the orphan."""
    wire_adapters: dict[str, Any] = {"openai": DroppedToolCallId}
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True, wire_adapters=wire_adapters) as stack:
        result = await wire_pairs(stack, turns=4)
    assert result["wire_requests_with_orphans"] > 0
    assert result["faults"][0].startswith("orphan_on_wire: openai") and "tool_call_id" in result["faults"][0]


async def test_wire_budget_server_count_within_window(temporal_client: Client, pg_dsn: str) -> None:
    """Through the OpenAI adapter, with the server counting 1.0 and 1.45 times its tokenizer, no request is over
    its window by the server's own count, and reconciled estimates cover it."""
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True) as stack:
        result = await wire_budget(stack, ratios=(1.0, 1.45), windows=(12_000,), turns=10)
    assert result["wire_requests_checked"] >= 20
    assert result["faults"] == [], result


async def test_wire_budget_small_window_turns_fit_or_fail_typed(temporal_client: Client, pg_dsn: str) -> None:
    """On a 4,096-token window, counted 1.2 and 1.45 times by the server, every turn is answered within its window
    by the server's count, or fails alone and typed with nothing sent; reconciled estimates cover the server."""
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True) as stack:
        result = await wire_budget(stack, ratios=(1.2, 1.45), windows=(4_096,), output_reserve=512)
    assert result["wire_requests_checked"] >= 20
    assert result["faults"] == [], result
    assert result["least_headroom_tokens"] >= 0


async def test_a_refused_request_is_learned_and_built_again(temporal_client: Client, pg_dsn: str) -> None:
    """The server refuses the first request of a route it counts 1.3 times as too long for the model: the model
    call learns the server's count, the turn builds the request again (compacting) and is answered."""
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True) as stack:
        result = await wire_refusal(stack)
    assert result["requests_refused"] == 1, result  # the scenario reaches the provider's limit
    assert result["turns_failed"] == []
    [event] = result["refusal_events"]
    assert event["actual_tokens"] == result["refused_counts"][0] > event["estimated_tokens"]
    assert event["calibration_after"] > event["calibration_before"]
    assert result["answered_after_refusal"] == 3 and result["underestimates_by_server_count"] == 0


async def test_negative_a_refusal_not_learned_fails_the_turn(temporal_client: Client, pg_dsn: str) -> None:
    """With the refusal not learned (a fault set in the harness), the request is built the same, refused again,
    and the turn fails `ContextLengthExceeded`: the rebuild is only as good as what the model call learned."""
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True, activities_class=RefusalNotLearned) as stack:
        result = await wire_refusal(stack)
    assert result["turns_failed"][:1] == ["ContextLengthExceeded"], result
    # Every turn that failed was refused twice (refused twice: the turn fails), and nothing was learned.
    assert result["requests_refused"] == 2 * len(result["turns_failed"]) and result["refusal_events"] == []


async def test_a_window_larger_than_the_models_is_named_not_learned(temporal_client: Client, pg_dsn: str) -> None:
    """A route configured with an 8,000-token window whose model (the server) has 5,000: the refusal states the
    model's window, so the turn fails `ContextWindowMismatch` naming the fix, and the route's calibration is not
    lifted (before, each refusal lifted it by up to 10%: it swung between 0.96 and 1.54 over 40 turns)."""
    async with live_stack(client=temporal_client, dsn=pg_dsn, wire=True) as stack:
        model = f"mismatch-{uuid.uuid4().hex[:6]}-w5000-r1.0"
        route = {"provider": "openai", "model": model, "encoding": "cl100k_base"}
        handle = await stack.start(
            gate_open(model_route=route, budget={"context_window": 8_000, "output_reserve": 512}), "mismatch"
        )
        failed: list[ApplicationError] = []
        for t in range(14):
            try:
                await stack.turn(handle, f"turn {t}: " + "alpha beta gamma " * 60)
            except WorkflowUpdateFailedError as exc:
                assert isinstance(exc.cause, ApplicationError)
                failed.append(exc.cause)
        assert failed and {f.type for f in failed} == {"ContextWindowMismatch"}, [f.type for f in failed]
        assert "set model_route.context_window" in failed[0].message and "5,000" in failed[0].message
        calibration = await stack.store.get_calibration(f"openai/{model}")
        assert calibration is not None and calibration <= 1.05
        events = await stack.store.events(handle.id)
        assert not [e for e in events if e.type == "context.estimator.refused"]
