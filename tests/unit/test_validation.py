"""Decision 9: a tool call and its result are one unit; orphans are rejected before send."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.budget import ContextBudget
from core.build import BodyInputs, build
from core.errors import OrphanedToolItemError
from core.items import AssistantMessage, ToolCall, ToolResult
from core.validation import find_orphans
from tests.unit import factories as f


def _plan(history):  # type: ignore[no-untyped-def]
    return build(
        f.prefix(),
        BodyInputs(history=history, turn_start_seq=10_000),
        budget=ContextBudget(),
        estimator=f.estimator(),
        secret=f.SECRET,
    )


class TestPairs:
    def test_orphan_call_rejected_with_id(self) -> None:
        """A call with no result is rejected, naming the call's item id."""
        with pytest.raises(OrphanedToolItemError, match="c1"):
            _plan([ToolCall(id="c1", seq=0, call_id="x", tool_name="t00")])

    def test_orphan_result_rejected_with_id(self) -> None:
        """A result with no call is rejected, naming the result's item id."""
        with pytest.raises(OrphanedToolItemError, match="r1"):
            _plan([ToolResult(id="r1", seq=0, call_id="x", tool_name="t00", content="c")])

    def test_result_before_call_is_an_orphan(self) -> None:
        """A result placed before its call is malformed."""
        with pytest.raises(OrphanedToolItemError):
            _plan(
                [
                    ToolResult(id="r1", seq=0, call_id="x", tool_name="t00", content="c"),
                    ToolCall(id="c1", seq=1, call_id="x", tool_name="t00"),
                ]
            )

    def test_pointer_keeps_the_pair_whole(self) -> None:
        """A truncated result still answers its call."""
        plan = build(
            f.prefix(),
            f.body(30),
            budget=ContextBudget(context_window=7_000, output_reserve=500),
            estimator=f.estimator(),
            secret=f.SECRET,
        )
        assert find_orphans(plan.segments) == []
        assert any(s.kind == "elided_span" for s in plan.segments)

    @given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=12), st.randoms())
    @settings(max_examples=80, deadline=None)
    def test_every_orphan_is_found(self, pairs: list[tuple[bool, bool]], rnd) -> None:  # type: ignore[no-untyped-def]
        """For any mix of whole and broken pairs, exactly the broken halves are reported."""
        history = []
        expected = set()
        seq = 0
        for i, (has_call, has_result) in enumerate(pairs):
            if has_call:
                history.append(ToolCall(id=f"c{i}", seq=seq, call_id=f"k{i}", tool_name="t"))
                seq += 1
            history.append(AssistantMessage(id=f"a{i}", seq=seq, text="."))
            seq += 1
            if has_result:
                history.append(ToolResult(id=f"r{i}", seq=seq, call_id=f"k{i}", tool_name="t", content="."))
                seq += 1
            if has_call != has_result:
                expected.add(f"c{i}" if has_call else f"r{i}")
        if expected:
            with pytest.raises(OrphanedToolItemError) as info:
                _plan(history)
            assert set(info.value.item_ids) == expected
        else:
            assert find_orphans(_plan(history).segments) == []
