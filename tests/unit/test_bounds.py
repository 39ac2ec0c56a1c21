"""The history bound and the failure classes (contract/bounds.py, activities/failures.py)."""

from __future__ import annotations

import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from activities.failures import MAX_MESSAGE_CHARS, classify
from contract import bounds
from contract.payloads import (
    MAX_TOOL_CALLS_PER_REPLY,
    MAX_TOOL_CALLS_PER_TURN,
    CloseSession,
    DeleteMemory,
    GrantTool,
    RevokeTool,
    SessionOpen,
    ToolCallOutcome,
    TurnFailure,
    TurnResult,
)
from core.items import BudgetClass
from core.plan import PlanStatus, PlanSummary
from workflows.session import bound_answers


class TestHistoryBound:
    def test_every_accepted_cap_keeps_a_run_under_ten_thousand_events(self) -> None:
        """Exhaustively over every pair of caps SessionOpen accepts, no run can pass 10,000 history events."""
        worst = max(
            bounds.run_events_bound(per_reply=r, per_turn=t)
            for r in range(1, MAX_TOOL_CALLS_PER_REPLY + 1)
            for t in range(1, MAX_TOOL_CALLS_PER_TURN + 1)
        )
        assert worst <= bounds.RUN_EVENTS_TARGET

    @given(st.integers(), st.integers())
    def test_caps_outside_the_bounds_are_refused(self, per_reply: int, per_turn: int) -> None:
        """A cap SessionOpen accepts is one the bound covers; any other is refused at the door."""
        values = {"agent_instructions": "x", "max_tool_calls_per_reply": per_reply, "max_tool_calls_per_turn": per_turn}
        try:
            SessionOpen.model_validate(values)
        except ValidationError:
            return
        assert bounds.run_events_bound(per_reply=per_reply, per_turn=per_turn) <= bounds.RUN_EVENTS_TARGET

    def test_thresholds_are_ordered(self) -> None:
        """Continue-as-new comes first, then turns in child runs, then refusal of new updates."""
        assert bounds.HISTORY_CONTINUE_AS_NEW < bounds.HISTORY_TURN_IN_CHILD < bounds.HISTORY_ADMIT_LIMIT


class TestClassify:
    def test_nul_from_postgres_is_invalid_data(self) -> None:
        """PostgreSQL's data exceptions (class 22) never retry."""
        exc = asyncpg.exceptions.UntranslatableCharacterError("unsupported Unicode escape sequence")
        failure = classify(exc)
        assert failure.type == "InvalidData" and failure.non_retryable

    def test_outage_is_retryable(self) -> None:
        """A refused connection or a server shutting down is retried."""
        assert not classify(ConnectionRefusedError(111, "refused")).non_retryable
        assert not classify(asyncpg.exceptions.CannotConnectNowError("starting up")).non_retryable

    def test_bug_is_a_programming_error(self) -> None:
        """A bug retried is the same bug."""
        failure = classify(KeyError("inputs"))
        assert failure.type == "ProgrammingError" and failure.non_retryable

    @pytest.mark.parametrize("size", [10, 100_000])
    def test_message_is_short_and_cause_first(self, size: int) -> None:
        """The failure message starts with the cause and fits far inside Temporal's failure limit."""
        failure = classify(ValueError("x" * size))
        assert failure.message.startswith("ValueError: x") and len(failure.message) <= MAX_MESSAGE_CHARS


def _largest_turn_result(turn: int) -> TurnResult:
    """A turn result as large as a turn can make it: the most tool calls, each with the longest name and summary."""
    plan = PlanSummary(
        epoch=1,
        prefix_sha256="p" * 64,
        request_sha256="r" * 64,
        status=PlanStatus.FITS,
        deficit_tokens=0,
        estimated_tokens=100_000,
        raw_tokens=100_000,
        input_limit=120_000,
        prefix_tokens=9_000,
        body_tokens=91_000,
        tokens_by_class={c.value: 1_000 for c in BudgetClass},
        segments=2_000,
        pointers=256,
    )
    call = ToolCallOutcome(
        name="n" * 64, call_id="c" * 40, allowed=True, is_error=False, trust="EXTERNAL_UNTRUSTED", summary="s" * 120
    )
    calls = [call.model_copy(update={"call_id": f"{turn}-{i}"}) for i in range(MAX_TOOL_CALLS_PER_TURN)]
    return TurnResult(turn=turn, epoch=1, text="t" * 8_000, prefix_sha256="p" * 64, plan=plan, tool_calls=calls)


class TestCarriedAnswers:
    def test_the_continue_as_new_input_stays_under_temporals_payload_limit(self) -> None:
        """Thirty-two results of the largest turn a session allows, and thirty-two failures with the longest
        reasons, would pass Temporal's 2 MB payload limit in the continue-as-new input (its workflow task would
        then fail for good: the session wedged). `bound_answers` keeps them under CARRIED_RESULTS_BYTES, dropping
        the oldest, and the newest answer is always kept."""
        results: dict[str, TurnResult] = {}
        failures: dict[str, TurnFailure] = {}
        sizes: dict[str, int] = {}
        for turn in range(1, 65):
            key = f"k{turn}"
            if turn % 2:
                results[key] = _largest_turn_result(turn)
                sizes[key] = len(results[key].model_dump_json())
            else:
                failures[key] = TurnFailure(type="TurnTooLarge", message="m" * 2_000, details=[{"x": "d" * 2_000}])
                sizes[key] = len(failures[key].model_dump_json())
            bound_answers(results, failures, sizes)
            assert key in results or key in failures
        unbounded = 32 * len(_largest_turn_result(0).model_dump_json())
        assert unbounded > 2 * 1024 * 1024  # what the count bound alone let through
        carried = SessionOpen(agent_instructions="x", carried_results=results, carried_failures=failures)
        assert len(carried.model_dump_json()) <= bounds.CARRIED_RESULTS_BYTES + 10_000
        assert sum(sizes.values()) <= bounds.CARRIED_RESULTS_BYTES
        assert set(sizes) == set(results) | set(failures) and "k64" in failures and "k63" in results

    def test_reasons_are_capped(self) -> None:
        """A `reason` longer than REASON_CHARS is refused at the door: two revocations with 1 MB reasons carried
        the session's state past Temporal's payload limit."""
        for model in (RevokeTool, GrantTool, CloseSession, DeleteMemory):
            fields = {"name": "web.fetch"} if model in (RevokeTool, GrantTool) else {}
            fields |= {"memory_id": "m1"} if model is DeleteMemory else {}
            model.model_validate({**fields, "reason": "r" * bounds.REASON_CHARS})
            with pytest.raises(ValidationError):
                model.model_validate({**fields, "reason": "r" * (bounds.REASON_CHARS + 1)})
