"""The hard gates run by `make test`, on the session's Temporal dev server (the time-skipping server for
stability) and a fresh PostgreSQL database each."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import Client

from activities.context import SessionActivities
from ctxengine.gates import run_gate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("name", ["stability", "trust", "budget", "pairs", "determinism", "compaction"])
async def test_gate_passes(name: str, temporal_client: Client, pg_dsn: str) -> None:
    """Each gate passes on the live stack and reports its figures."""
    result = await run_gate(name, client=temporal_client, dsn=pg_dsn)
    assert result["passed"], result
    if name == "stability":
        assert result["turns"] == 50 and result["distinct_prefix_hashes"] == 1
        assert len(result["dates_seen"]) >= 2 and result["tool_denials"] >= 1 and result["compactions"] >= 1
    if name in ("trust", "compaction"):
        assert result["adversarial_model"] is True and result["tool_trust_raises_refused"] >= 1
        assert result["untrusted_marker_bytes_in_summaries"] == 0
        assert result["untrusted_marker_bytes_in_summarizer_inputs_outside_envelopes"] == 0
        assert result["untrusted_marker_bytes_in_memories"] == 0
        assert result["untainted_working_state_entries_from_untrusted"] == 0


async def test_injected_timestamp_fails_stability_and_is_explained(temporal_client: Client, pg_dsn: str) -> None:
    """A timestamp injected into the prefix (test-only switch) fails the gate; the violation event names the
    offending segment."""
    result = await run_gate("stability", client=temporal_client, dsn=pg_dsn, fault_prefix_timestamp=True)
    assert not result["passed"]
    assert result["distinct_prefix_hashes"] > 1 and result["violation_events"] >= 1
    diff = result["violation"]["first_difference"]
    assert diff["item_id"] == "platform.1.policy" and diff["budget_class"] == "platform_policy"
    assert "Rendered at" in diff["actual"]


class TaintOff(SessionActivities):
    """The fault the trust gates guard against: taint propagation switched off (replies never tainted)."""

    def reply_tainted(self, plan: dict[str, Any]) -> bool:
        return False

    def write_tainted(self, call_tainted: bool, items: list[Any], turn: int) -> bool:
        return False


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
