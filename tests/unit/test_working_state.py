"""Decision 14: working state is typed, bounded, written by the control tool and runtime, never evicts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from core.errors import WorkingStateCapError, WorkingStateError
from core.working_state import (
    CAPS,
    WorkingState,
    WorkingStateUpdate,
    WorkingStateWrite,
    apply,
    carry,
    control_tool_schema,
    fold,
    render,
    write_problem,
)
from tests.unit import factories as f

count = f.COUNTER.count


def upd(*ops: dict[str, object]) -> WorkingStateUpdate:
    return WorkingStateUpdate.model_validate({"operations": list(ops)})


def add(op: str, n: int) -> WorkingStateUpdate:
    return upd(*[{"op": op, "text": f"item {i}"} for i in range(n)])


class TestCaps:
    @pytest.mark.parametrize(
        ("op", "field"),
        [
            ("add_constraint", "constraints"),
            ("add_task", "tasks"),
            ("add_fact", "facts"),
            ("add_question", "open_questions"),
        ],
    )
    def test_write_past_cap_fails_and_changes_nothing(self, op: str, field: str) -> None:
        """Filling a field to its cap works; one more fails with a typed error and the state is unchanged."""
        cap = CAPS[field]
        state = WorkingState()
        for start in range(0, cap, 20):
            state = apply(state, add(op, min(20, cap - start)), writer="model", count=count, token_cap=10_000)
        assert len(getattr(state, field)) == cap
        with pytest.raises(WorkingStateCapError) as info:
            apply(state, add(op, 1), writer="model", count=count, token_cap=10_000)
        assert info.value.field == field and info.value.cap == cap
        assert len(getattr(state, field)) == cap

    def test_token_cap(self) -> None:
        """A write that would render past 1,000 tokens fails and changes nothing."""
        state = apply(WorkingState(), add("add_fact", 1), writer="model", count=count)
        long = upd(*[{"op": "add_fact", "text": "lengthy zebra " * 120} for _ in range(4)])
        with pytest.raises(WorkingStateCapError, match="tokens"):
            apply(state, long, writer="model", count=count)
        assert len(state.facts) == 1

    def test_constraints_are_never_evicted(self) -> None:
        """At the constraint cap the new constraint is refused; every old one is still there."""
        state = apply(WorkingState(), add("add_constraint", 20), writer="model", count=count, token_cap=10_000)
        before = [c.text for c in state.constraints]
        with pytest.raises(WorkingStateCapError):
            apply(state, add("add_constraint", 1), writer="model", count=count, token_cap=10_000)
        assert [c.text for c in state.constraints] == before

    def test_model_cannot_remove_a_constraint(self) -> None:
        """Only the runtime may remove a constraint."""
        state = apply(WorkingState(), add("add_constraint", 1), writer="model", count=count)
        with pytest.raises(WorkingStateError, match="only the runtime"):
            apply(state, upd({"op": "remove_constraint", "id": "c1"}), writer="model", count=count)
        assert (
            apply(state, upd({"op": "remove_constraint", "id": "c1"}), writer="runtime", count=count).constraints == []
        )

    def test_batch_is_all_or_nothing(self) -> None:
        """A batch with one bad operation applies none of them."""
        state = WorkingState()
        with pytest.raises(WorkingStateError, match="t99"):
            apply(
                state,
                upd({"op": "add_task", "text": "a"}, {"op": "set_task_status", "id": "t99", "status": "done"}),
                writer="model",
                count=count,
            )
        assert state.tasks == []

    def test_untrusted_context_taints_facts(self) -> None:
        """A fact written while untrusted content was in view is marked tainted."""
        state = apply(WorkingState(), add("add_fact", 1), writer="model", count=count, untrusted_in_context=True)
        assert state.facts[0].tainted


class TestTypedTool:
    def test_malformed_arguments_are_rejected(self) -> None:
        """The control tool takes typed operations only: prose or unknown ops fail validation."""
        with pytest.raises(ValidationError):
            WorkingStateUpdate.model_validate({"operations": "remember that the user likes tea"})
        with pytest.raises(ValidationError):
            upd({"op": "drop_everything"})

    def test_schema_is_json_schema(self) -> None:
        """The tool's schema is a JSON schema pinned with the other tools."""
        assert control_tool_schema()["type"] == "object"


class TestCarry:
    def test_done_tasks_do_not_carry(self) -> None:
        """At a turn boundary done tasks are dropped; constraints, facts and questions carry."""
        state = apply(
            WorkingState(),
            upd(
                {"op": "add_task", "text": "a"},
                {"op": "add_task", "text": "b"},
                {"op": "add_constraint", "text": "c"},
                {"op": "add_fact", "text": "f"},
                {"op": "add_question", "text": "q"},
            ),
            writer="model",
            count=count,
        )
        state = apply(state, upd({"op": "set_task_status", "id": "t1", "status": "done"}), writer="model", count=count)
        carried = carry(state)
        assert [t.text for t in carried.tasks] == ["b"]
        assert len(carried.constraints) == len(carried.facts) == len(carried.open_questions) == 1

    def test_fold_rebuilds_state_from_the_log(self) -> None:
        """The state at a turn is the fold of the logged writes of earlier turns."""
        writes = [
            WorkingStateWrite(turn=0, writer="model", update=add("add_constraint", 1)),
            WorkingStateWrite(turn=1, writer="model", update=add("add_task", 2)),
            WorkingStateWrite(
                turn=1, writer="model", update=upd({"op": "set_task_status", "id": "t2", "status": "done"})
            ),
            WorkingStateWrite(turn=3, writer="model", update=add("add_fact", 1)),
        ]
        at2 = fold(writes, count=count, upto_turn=2)
        assert [t.id for t in at2.tasks] == ["t3"] and [c.id for c in at2.constraints] == ["c1"]
        assert fold(writes, count=count, upto_turn=4).facts[0].id == "f4"

    @given(st.lists(st.sampled_from(["add_constraint", "add_task", "add_fact", "add_question"]), max_size=30))
    @settings(max_examples=40, deadline=None)
    def test_render_is_deterministic(self, ops: list[str]) -> None:
        """Rendering the same state twice gives the same bytes."""
        state = WorkingState()
        for op in ops:
            try:
                state = apply(state, upd({"op": op, "text": op}), writer="model", count=count)
            except WorkingStateCapError:
                pass
        assert render(state) == render(state.model_copy())


@pytest.mark.parametrize(
    ("operation", "problem"),
    [
        ({"op": "add_task", "text": " \t "}, "operations[0] (add_task).text: must not be blank"),
        ({"op": "add_constraint", "text": "a\x00b"}, "operations[0] (add_constraint).text: contains a NUL"),
        ({"op": "add_fact", "text": "ok", "evidence": ["x", "\ud800"]}, "(add_fact).evidence[1]: contains a lone"),
        ({"op": "add_question", "text": "Which trains run on Sunday?"}, None),
    ],
)
def test_a_new_write_is_refused_with_blank_or_unstorable_text(
    operation: dict[str, object], problem: str | None
) -> None:
    """What comes in as a write (the runtime's update, the control tool) names its blank or unstorable text; the
    writes already logged are read back as they were (no validator of the models refuses them)."""
    update = WorkingStateUpdate.model_validate({"operations": [operation]})
    found = write_problem(update)
    assert (found is None) if problem is None else (found is not None and problem in found), found
