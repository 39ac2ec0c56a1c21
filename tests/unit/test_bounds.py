"""The history bound and the failure classes (contract/bounds.py, activities/failures.py)."""

from __future__ import annotations

import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from activities.failures import MAX_MESSAGE_CHARS, classify
from contract import bounds
from contract.payloads import MAX_TOOL_CALLS_PER_REPLY, MAX_TOOL_CALLS_PER_TURN, SessionOpen


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
