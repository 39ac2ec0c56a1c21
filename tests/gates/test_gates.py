"""The hard gates run by `make test`, on the session's Temporal dev server (the time-skipping server for
stability) and a fresh PostgreSQL database each."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import pytest
from temporalio.client import Client

from activities.openai_provider import OpenAIProvider, read_completion, render_chat_request
from activities.provider import ProviderReply, ProviderRequest, ScriptedProvider
from activities.wire import wire_prefix
from harness.faults import LaunderedStoredSegments, PrefixTimestampFault, TaintOff
from harness.gates import gate_pairs, live_stack, run_gate
from harness.torture import Op, Script
from tests.integration.session_helpers import memories_in_default_scope

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("name", ["stability", "trust", "budget", "pairs", "determinism", "compaction"])
async def test_gate_passes(name: str, temporal_client: Client, pg_dsn: str) -> None:
    """Each gate passes on the live stack and reports its figures."""
    result = await run_gate(name, client=temporal_client, dsn=pg_dsn)
    # In full on failure: pytest would shorten the dict, and its failing figure is often past the cut.
    assert result["passed"], json.dumps(result, default=str, sort_keys=True)
    # A gate remembers in its own scope: a developer's sessions on the same database never see its memories.
    assert await memories_in_default_scope(pg_dsn) == 0
    if name == "stability":
        assert result["turns"] == 100 and result["distinct_prefix_hashes"] == 1
        assert result["wire_requests_checked"] >= 60 and result["wire_prefix_hashes_per_epoch"] == 1
        assert result["history_breaks_unexplained"] == 0 and result["tool_denials"] >= 1
        for session in result["sessions"].values():
            assert len(session["dates_seen"]) >= 2 and session["compactions"] >= 1
    if name in ("trust", "compaction"):
        assert result["adversarial_model"] is True and result["tool_trust_raises_refused"] >= 1
        assert result["untrusted_marker_bytes_in_summaries"] == 0
        assert result["untrusted_marker_bytes_in_summarizer_inputs_outside_envelopes"] == 0
        assert result["untrusted_marker_bytes_in_memories"] == 0
        assert result.get("memories_naming_the_injected_page", 0) == 0
        assert result["untainted_working_state_entries_from_untrusted"] == 0
        assert result["untrusted_bytes_in_summarizer_inputs"] == 0
    if name == "determinism":
        assert result["stored_bodies_identical"] == result["stored_bodies_checked"] == result["requests_rebuilt"]
    if name == "budget":
        assert result["requests_over_window"] == 0 and result["sessions_stuck"] == 0
        assert result["turns_too_large"] == result["turns_too_large_sizes_checked"]
        assert result["min_window_tested"] <= 4_096 and result["sessions"] > 0 and result["requests"] > 0
        assert "rotations_refused" in result


async def test_injected_timestamp_fails_stability_and_is_explained(temporal_client: Client, pg_dsn: str) -> None:
    """A timestamp injected into the prefix (test-only switch) fails the gate; the violation event names the
    offending segment."""
    result = await run_gate("stability", client=temporal_client, dsn=pg_dsn, activities_class=PrefixTimestampFault)
    assert not result["passed"]
    assert result["distinct_prefix_hashes"] > 1 and result["violation_events"] >= 1
    diff = result["violation"]["first_difference"]
    assert diff["item_id"] == "platform.1.policy" and diff["budget_class"] == "platform_policy"
    assert "Rendered at" in diff["actual"]


async def test_laundered_stored_segments_fail_the_determinism_gate(temporal_client: Client, pg_dsn: str) -> None:
    """Segment fields stored with each logged item that claim USER trust (a harness fault) leave every request on
    the building worker's wire as it was, but the stored bodies that refer to those items read back laundered:
    the determinism gate compares them with the rebuilt requests and fails, naming the field."""
    result = await run_gate("determinism", client=temporal_client, dsn=pg_dsn, activities_class=LaunderedStoredSegments)
    assert not result["passed"], result
    assert result["bytes_identical"] == result["requests_rebuilt"] > 0  # the requests themselves are unchanged
    assert result["stored_bodies_identical"] < result["stored_bodies_checked"]
    assert any(f.startswith("stored_body_differs") and " trust: stored 'USER'" in f for f in result["faults"])


class RequestIdInSystemPrompt(OpenAIProvider):
    """The fault the wire observer guards against: an adapter that appends a request id to the system prompt
    (ctxengine's own prefix hash cannot see it; the bytes on the wire change every request)."""

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        kwargs, names = render_chat_request(request)
        kwargs["messages"][0]["content"] += f"\nRequest id: {request.request_sha256[:12]}"
        completion, sent = await self._create_raw(kwargs, request)
        reply = read_completion(completion, names, fallback_input_tokens=0)
        return reply.model_copy(update={"wire_prefix": wire_prefix(sent, "openai")})


async def test_negative_request_id_in_system_prompt_fails_stability(temporal_client: Client, pg_dsn: str) -> None:
    """An adapter that stamps a request id into the system message fails the stability gate on the wire (the
    plan's prefix hash stays single), and the violation event points at the wire bytes."""
    result = await run_gate(
        "stability", client=temporal_client, dsn=pg_dsn, wire_adapters={"openai": RequestIdInSystemPrompt}
    )
    assert not result["passed"]
    assert result["distinct_prefix_hashes"] == 1
    assert result["wire_prefix_hashes_per_epoch"] > 1
    assert any(f.startswith("wire_prefix_changed_within_epoch") for f in result["faults"]), result["faults"]
    violation = result["sessions"]["openai"]["violation"]
    assert violation["observer"] == "wire" and violation["first_difference"]["part"] == "system"
    assert "Request id:" in violation["first_difference"]["actual"]


@pytest.mark.parametrize("name", ["compaction", "trust"])
async def test_negative_taint_off_fails_trust_gates(name: str, temporal_client: Client, pg_dsn: str) -> None:
    """With taint propagation switched off in the harness, the adversarial model launders page text into
    summaries and untainted working state, and the gate fails naming where."""
    result = await run_gate(name, client=temporal_client, dsn=pg_dsn, activities_class=TaintOff)
    assert not result["passed"], result
    assert result["adversarial_model"] is True
    laundered = [
        "untainted_working_state_entries_from_untrusted",
        "untrusted_marker_bytes_in_summaries",
        "untrusted_marker_bytes_in_summarizer_inputs_outside_envelopes",
    ]
    assert any(result[k] > 0 for k in laundered), result
    if name == "trust":
        # The injected page's untainted facts reach memory formation, and the memory checks (which read the memories
        # as written) see them.
        assert result["memories_naming_the_injected_page"] > 0, result


class _OptimisticTokenizer(ScriptedProvider):
    """Test-only provider: its tokenizer counts 10% more than its route publishes, so the estimator that starts
    from the published ratio is 10% optimistic until the first response reconciles it."""

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        reply = await super().complete(request)
        usage = reply.usage.model_copy(update={"input_tokens": math.ceil(reply.usage.input_tokens * 1.1)})
        return reply.model_copy(update={"usage": usage})


async def test_optimistic_estimator_fails_the_budget_gate(temporal_client: Client, pg_dsn: str) -> None:
    """With an estimator 10% optimistic (a provider registered by this test), a first request near its limit
    goes over it, and the budget gate says so."""
    # A paste whose request is estimated at ~96% of the 3,496-token limit (3,367 tokens, measured against the
    # current prefix and the whole-request margin of estimate rules 2; 680 words before that margin): 10% more is
    # over it. The database is fresh, so this is the provider's first request and no observed ratio
    # has corrected the estimator yet.
    scripts = [Script(seed=9_790, window=4_096, output_reserve=600, ratio=1.0, ops=(Op("paste", 600, 3),))]
    result = await run_gate(
        "budget",
        client=temporal_client,
        dsn=pg_dsn,
        providers={"scripted": _OptimisticTokenizer()},
        scripts=scripts,
        routes=False,
    )
    assert not result["passed"] and result["requests_over_window"] >= 1, result


class _DroppingResults:
    """Test-only reader of the store: every stored request it returns has lost its first tool result."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def get_request(self, sha: str) -> Any:
        request = await self._store.get_request(sha)
        body = list(request.body)
        first = next((i for i, s in enumerate(body) if s["kind"] == "tool_result"), None)
        if first is not None:
            del body[first]
        return dataclasses.replace(request, body=body)


async def test_orphaned_result_fails_the_pairs_gate(temporal_client: Client, pg_dsn: str) -> None:
    """A request whose tool result went missing (the store reader is faulty, injected by this test) is counted as
    an orphan sent, and the pairs gate fails."""
    async with live_stack(client=temporal_client, dsn=pg_dsn) as stack:
        stack.store = _DroppingResults(stack.store)  # type: ignore[assignment]
        result = await gate_pairs(stack)
    assert not result["passed"] and result["orphans_sent"] >= 1, result


@pytest.mark.skipif(not os.environ.get("CTXENGINE_TORTURE_LONG"), reason="long profile: set CTXENGINE_TORTURE_LONG=1")
@pytest.mark.timeout(3_600)
async def test_budget_torture_long_profile(temporal_client: Client, pg_dsn: str) -> None:
    """The long torture profile: many more, longer sessions; CTXENGINE_TORTURE_SEED replays one draw."""
    seed = os.environ.get("CTXENGINE_TORTURE_SEED")
    examples = int(os.environ.get("CTXENGINE_TORTURE_EXAMPLES", "40"))
    result = await run_gate(
        "budget",
        client=temporal_client,
        dsn=pg_dsn,
        examples=examples,
        ops=(5, 25),
        seed=int(seed) if seed else None,
        routes=False,
    )
    assert result["passed"], f"seed={seed or 'derandomized'}: {result}"
