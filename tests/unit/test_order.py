"""Decision 2: assembly order is fixed and total, platform policy first and the current message last."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from core.budget import ContextBudget
from core.build import FRAMING_ID, POLICY_ID, BodyInputs, build
from core.items import (
    AgentInstructions,
    CorrectionLine,
    CurrentUserMessage,
    Item,
    PlatformPolicy,
    RecallItem,
    TurnContext,
    WorkingStateBlock,
)
from core.order import SECTIONS, assembly_order, check_order, order_key
from tests.unit import factories as f


def _all_items(seed: int) -> list[Item]:
    rng = random.Random(seed)
    p = f.prefix_inputs()
    items: list[Item] = [
        PlatformPolicy(id=POLICY_ID, text="p"),
        PlatformPolicy(id=FRAMING_ID, text="f"),
        AgentInstructions(id="agent.instructions", text="i"),
        *p.tools,
        *p.memory_snapshot,
        *f.history(rng.randint(0, 6)),
        *[RecallItem(id=f"rc{i}", memory_id=f"m{i}", rank=i, text="r") for i in range(rng.randint(0, 3))],
        *[CorrectionLine(id=f"cor{i}", memory_id=f"m{i}", text="c") for i in range(rng.randint(0, 2))],
        WorkingStateBlock(id="ws", text="w"),
        TurnContext(id="clock", text="now"),
        CurrentUserMessage(id="cur", seq=999, text="q"),
    ]
    return items


class TestOrder:
    @given(st.integers(min_value=0, max_value=10_000), st.randoms())
    @settings(max_examples=60, deadline=None)
    def test_any_shuffle_sorts_to_one_order(self, seed: int, rnd: random.Random) -> None:
        """Whatever order items arrive in, assembly yields the same sequence: the order is total."""
        items = _all_items(seed)
        shuffled = list(items)
        rnd.shuffle(shuffled)
        assert [i.id for i in assembly_order(shuffled)] == [i.id for i in assembly_order(items)]
        keys = [order_key(i) for i in items]
        assert len(set(keys)) == len(keys)

    @given(st.integers(min_value=0, max_value=10_000))
    @settings(max_examples=30, deadline=None)
    def test_policy_first_current_message_last(self, seed: int) -> None:
        """Platform policy is first and the current user message last."""
        ordered = assembly_order(_all_items(seed))
        assert ordered[0].kind == "platform_policy"
        assert ordered[-1].kind == "current_message"

    def test_sections_cover_every_type_once(self) -> None:
        """Every item type has exactly one section."""
        from core.items import ITEM_TYPES

        listed = [t for _, types in SECTIONS for t in types]
        assert sorted(t.__name__ for t in listed) == sorted(t.__name__ for t in ITEM_TYPES)

    def test_region_a_sections_precede_region_b(self) -> None:
        """All Region A sections come before any Region B section."""
        regions = [types[0].region.value for _, types in SECTIONS]
        assert regions == sorted(regions)

    def test_check_order_rejects_misordered(self) -> None:
        """check_order names the item that is out of place."""
        items = assembly_order(_all_items(3))
        items[0], items[-1] = items[-1], items[0]
        try:
            check_order(items)
        except Exception as exc:
            assert "out of assembly order" in str(exc)
        else:
            raise AssertionError("misordered items passed check_order")

    @given(st.integers(min_value=0, max_value=8), st.integers(min_value=0, max_value=3))
    @settings(max_examples=25, deadline=None)
    def test_build_emits_assembly_order(self, turns: int, recalls: int) -> None:
        """build() puts body items in exactly the assembly order."""
        base = f.body(turns)
        body = BodyInputs(
            history=base.history,
            turn_start_seq=base.turn_start_seq,
            current=base.current,
            recall=[
                RecallItem(id=f"rc{i}", memory_id=f"m{i}", rank=recalls - i, text="recall") for i in range(recalls)
            ],
            corrections=[CorrectionLine(id="cor1", memory_id="m1", text="fixed")],
            working_state=WorkingStateBlock(id="ws", text="state"),
            turn_context=TurnContext(id="clock", text="2026-11-30T23:59:00Z"),
        )
        plan = build(f.prefix(), body, budget=ContextBudget(), estimator=f.estimator(), secret=f.SECRET)
        by_id = {i.id: i for i in (*body.history, *body.recall, *body.corrections)}
        for extra in (body.working_state, body.turn_context, body.current):
            by_id[extra.id] = extra
        body_ids = [s.item_id for s in plan.segments if s.region.value == "B"]
        assert body_ids[-1] == "current"
        check_order([by_id[i] for i in body_ids])
