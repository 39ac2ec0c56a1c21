"""Decision 8: recall yields first, then tool results become pointers, then compaction is reported."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.budget import ContextBudget
from core.build import BodyInputs, RenderCache, build, pointer_for, pointer_segment_of, segment_of
from core.errors import NonYieldableOverflowError
from core.item_rendering import UNTRUSTED_PROVENANCE, render_item
from core.items import CorrectionLine, CurrentUserMessage, RecallItem, ToolResult, TrustLevel, WorkingStateBlock
from core.plan import PlanStatus, YieldStep
from tests.unit import factories as f

PREFIX = f.prefix()


def _plan(body: BodyInputs, window: int):  # type: ignore[no-untyped-def]
    budget = ContextBudget(context_window=window, output_reserve=500)
    return build(PREFIX, body, budget=budget, estimator=f.estimator(), secret=f.SECRET)


def _body(turns: int, recalls: int = 4) -> BodyInputs:
    base = f.body(turns)
    return base.model_copy(
        update={
            "recall": [
                RecallItem(id=f"rc{i}", memory_id=f"m{i}", rank=i, text="recalled " * 80) for i in range(recalls)
            ]
        }
    )


def _steps(plan) -> list[tuple[YieldStep, str]]:  # type: ignore[no-untyped-def]
    return [(y.step, y.reason) for y in plan.yields]


class TestYieldOrder:
    def test_no_pressure_no_yield(self) -> None:
        """With room to spare nothing yields."""
        plan = _plan(_body(4), 100_000)
        assert plan.yields == [] and plan.status is PlanStatus.FITS

    def test_recall_yields_first(self) -> None:
        """Light pressure drops recall and leaves every tool result whole."""
        full = _plan(_body(6), 100_000)
        recall_tokens = full.tokens_by_class["recall"]
        plan = _plan(_body(6), full.estimated_tokens + 500 - recall_tokens // 2)
        assert _steps(plan) == [(YieldStep.RECALL_DROPPED, "pressure")]
        assert not any(s.kind == "elided_span" for s in plan.segments)
        assert plan.status is PlanStatus.FITS

    def test_tool_results_yield_second_as_pointers(self) -> None:
        """More pressure turns the oldest tool results into typed pointers after recall is gone."""
        full = _plan(_body(10), 100_000)
        plan = _plan(_body(10), full.estimated_tokens + 500 - full.tokens_by_class["recall"] - 200)
        assert _steps(plan) == [
            (YieldStep.RECALL_DROPPED, "pressure"),
            (YieldStep.TOOL_RESULTS_TO_POINTERS, "pressure"),
        ]
        pointers = [s for s in plan.segments if s.kind == "elided_span"]
        assert pointers and pointers[0].item_id == "r0#pointer"
        assert pointers[0].trust is TrustLevel.EXTERNAL_UNTRUSTED
        assert "artifact:r0" in pointers[0].text

    def test_a_tainted_result_keeps_its_taint_as_a_pointer(self) -> None:
        """A tool result derived from untrusted content (a note the model saved after reading a page) that becomes
        a pointer under pressure says so: the untrusted provenance in its envelope and in its text, as the whole
        result showed it. Without the taint the pointer would name trusted tool content."""
        base = _body(10)
        body = base.model_copy(
            update={
                "history": [
                    h.model_copy(update={"trust": TrustLevel.TOOL, "tainted": True}) if h.id == "r0" else h
                    for h in base.history
                ]
            }
        )
        full = _plan(body, 100_000)
        plan = _plan(body, full.estimated_tokens + 500 - full.tokens_by_class["recall"] - 200)
        pointer = next(s for s in plan.segments if s.item_id == "r0#pointer")
        assert pointer.trust is TrustLevel.TOOL
        assert f'id="r0#pointer" provenance="{UNTRUSTED_PROVENANCE}">>' in pointer.text
        assert "derived from untrusted content" in pointer.text
        untainted = next(s for s in plan.segments if s.kind == "elided_span" and s.item_id != "r0#pointer")
        assert "provenance=" not in untainted.text

    def test_compaction_is_last_and_reports_deficit(self) -> None:
        """When the cheap yields are exhausted the plan says needs_compaction with the deficit in tokens."""
        plan = _plan(_body(60), 6_000)
        assert plan.status is PlanStatus.NEEDS_COMPACTION
        assert plan.deficit_tokens == plan.estimated_tokens - plan.input_limit
        assert (YieldStep.RECALL_DROPPED, "pressure") in _steps(plan)
        assert not any(s.kind in ("tool_result", "recall") for s in plan.segments)

    def test_tool_results_capped_at_a_quarter_of_the_body(self) -> None:
        """Tool results over 25% of the body are truncated oldest first even without window pressure."""
        base = f.body(4)
        big = [
            h.model_copy(update={"content": "data " * 3_000}) if h.kind == "tool_result" else h for h in base.history
        ]
        plan = _plan(base.model_copy(update={"history": big}), 20_000)
        assert (YieldStep.TOOL_RESULTS_TO_POINTERS, "cap") in _steps(plan)
        body_budget = plan.input_limit - plan.prefix_tokens
        assert plan.tokens_by_class["tool_results"] <= body_budget * 0.25


class TestNeverYields:
    def test_active_turn_current_message_state_and_corrections_survive(self) -> None:
        """Under maximum pressure the current message, working state, corrections and active pair remain."""
        base = _body(40)
        hist = list(base.history)
        turn_start = hist[-1].seq + 1
        from core.items import ToolCall, ToolResult

        hist += [
            ToolCall(id="ac", seq=turn_start + 1, call_id="active", tool_name="t00"),
            ToolResult(id="ar", seq=turn_start + 2, call_id="active", tool_name="t00", content="active " * 50),
        ]
        body = base.model_copy(
            update={
                "history": hist,
                "turn_start_seq": turn_start,
                "current": None,
                "working_state": WorkingStateBlock(id="ws", text="constraint: be brief"),
                "corrections": [CorrectionLine(id="cor", memory_id="m1", text="user moved to Oslo")],
            }
        )
        plan = _plan(body, 5_000)
        ids = {s.item_id for s in plan.segments}
        assert {"ac", "ar", "ws", "cor"} <= ids

    def test_non_yieldable_overflow_names_classes(self) -> None:
        """If never-yield items alone overflow, a typed error names them."""
        body = BodyInputs(current=CurrentUserMessage(id="cur", seq=0, text="long " * 5_000))
        with pytest.raises(NonYieldableOverflowError, match="current_message"):
            _plan(body, 3_000)

    def test_working_state_is_never_trimmed_at_build(self) -> None:
        """The working state's cap is enforced at write time; at build the block is carried whole, never trimmed."""
        text = "constraint " * 1_200
        body = f.body(1).model_copy(update={"working_state": WorkingStateBlock(id="ws", text=text)})
        plan = _plan(body, 100_000)
        assert text in plan.text and plan.tokens_by_class["working_state"] > 1_000

    def test_write_time_measure_matches_build(self) -> None:
        """measure_working_state gives the tokens build() charges the block, so accepted writes always fit."""
        from core.build import measure_working_state

        text = "# Working state\n## Constraints (never dropped)\n- [c1] stay under budget"
        block = WorkingStateBlock(id="working_state", text=text)
        plan = _plan(f.body(1).model_copy(update={"working_state": block}), 100_000)
        assert (
            measure_working_state(text, estimator=f.estimator(), secret=f.SECRET)
            == plan.tokens_by_class["working_state"]
        )

    def test_pointer_never_larger_than_its_result(self) -> None:
        """A tiny result is left whole: a pointer bigger than the result would free nothing."""
        base = f.body(30)
        tiny = [h.model_copy(update={"content": "ok"}) if h.kind == "tool_result" else h for h in base.history]
        plan = _plan(base.model_copy(update={"history": tiny}), 6_000)
        assert all(y.tokens_freed >= 0 for y in plan.yields)
        assert not any(s.kind == "elided_span" for s in plan.segments)


def _active_turn(base: BodyInputs, results: int, words: int = 150) -> BodyInputs:
    """`base` with an active turn of `results` tool pairs after its current message (a later model call)."""
    from core.items import ToolCall, ToolResult

    hist = list(base.history)
    start = hist[-1].seq + 1 if hist else 0
    active: list = [f.UserMessage(id="cur", seq=start, text="go")]  # type: ignore[attr-defined]
    for i in range(results):
        active += [
            ToolCall(id=f"ac{i}", seq=start + 1 + 2 * i, call_id=f"act{i}", tool_name="t00"),
            ToolResult(
                id=f"ar{i}",
                seq=start + 2 + 2 * i,
                call_id=f"act{i}",
                tool_name="t00",
                content=f"active {i} " + "data " * words,
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
            ),
        ]
    return base.model_copy(update={"history": hist + active, "turn_start_seq": start, "current": None})


class TestYieldInsideTheActiveTurn:
    def test_active_results_become_pointers_oldest_first_when_nothing_is_left_to_compact(self) -> None:
        """With no older history, the active turn's results become pointers, oldest first; every call stays."""
        body = _active_turn(BodyInputs(), 6)
        full = _plan(body, 100_000)
        plan = _plan(body, full.estimated_tokens + 500 - 300)
        assert plan.status is PlanStatus.FITS
        assert [y.step for y in plan.yields] == [YieldStep.ACTIVE_TOOL_RESULTS_TO_POINTERS]
        ids = [s.item_id for s in plan.segments]
        assert "ar0#pointer" in ids and "ar5" in ids  # oldest first, the newest stays whole
        assert all(f"ac{i}" in ids for i in range(6))  # the call stays: the pair is atomic
        from core.validation import find_orphans

        assert find_orphans([s for s in plan.segments if s.region.value == "B"]) == []

    def test_older_history_yields_before_the_active_turn(self) -> None:
        """While older results can still become pointers, no active result does."""
        body = _active_turn(f.body(10), 2, words=40)
        full = _plan(body, 100_000)
        plan = _plan(body, full.estimated_tokens + 500 - 150)
        steps = [y.step for y in plan.yields]
        assert YieldStep.ACTIVE_TOOL_RESULTS_TO_POINTERS not in steps
        assert YieldStep.TOOL_RESULTS_TO_POINTERS in steps

    def test_compactable_history_is_compacted_before_active_results_yield(self) -> None:
        """With compactable older history the plan asks for compaction instead of pointering the active turn."""
        body = _active_turn(f.body(60), 2, words=40)
        plan = _plan(body, 6_000)
        assert plan.status is PlanStatus.NEEDS_COMPACTION
        assert YieldStep.ACTIVE_TOOL_RESULTS_TO_POINTERS not in [y.step for y in plan.yields]

    def test_active_turn_alone_over_the_window_yields_even_with_compactable_history(self) -> None:
        """An active turn too big on its own yields as far as it must; compaction handles the rest."""
        body = _active_turn(f.body(60), 8, words=800)
        plan = _plan(body, 6_000)
        assert YieldStep.ACTIVE_TOOL_RESULTS_TO_POINTERS in [y.step for y in plan.yields]
        assert plan.status is PlanStatus.NEEDS_COMPACTION

    def test_checkpoint_pointers_go_last_when_nothing_is_compactable(self) -> None:
        """After the active turn is pointers, a checkpoint's own pointers are dropped, oldest first."""
        from core.compaction import Checkpoint
        from core.items import ElidedSpan

        pointers = [
            ElidedSpan(
                id=f"p{i}",
                seq=i,
                original_id=f"x{i}",
                original_tokens=900,
                reference=f"artifact:x{i}",
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                reason="compaction_elided",
            )
            for i in range(20)
        ]
        cp = Checkpoint(
            checkpoint_id="cp-3",
            kind="escalation",
            depth=0,
            covers_from_seq=0,
            covers_to_seq=99,
            summary="Earlier context by reference.",
            pointers=pointers,
        )
        body = _active_turn(BodyInputs(checkpoint=cp), 4)
        body = body.model_copy(
            update={"history": [h.model_copy(update={"seq": h.seq + 100}) for h in body.history], "turn_start_seq": 100}
        )
        fits = _plan(body.model_copy(update={"checkpoint": cp.model_copy(update={"pointers": []})}), 100_000)
        plan = _plan(body, fits.estimated_tokens + 500)
        assert plan.status is PlanStatus.FITS
        steps = [y.step for y in plan.yields]
        assert steps == [YieldStep.ACTIVE_TOOL_RESULTS_TO_POINTERS, YieldStep.CHECKPOINT_POINTERS_DROPPED]
        assert "p0" in plan.yields[1].item_ids and "checkpoint:cp-3" in {s.item_id for s in plan.segments}


class TestTurnTooLarge:
    def test_minimum_body_over_the_limit_is_a_typed_error_with_sizes(self) -> None:
        """A message that cannot fit beside the prefix fails with TurnTooLarge naming the class and the sizes."""
        from core.errors import TurnTooLargeError

        body = BodyInputs(current=CurrentUserMessage(id="cur", seq=0, text="long " * 5_000))
        with pytest.raises(TurnTooLargeError) as info:
            _plan(body, 3_000)
        d = info.value.details()
        assert d["class"] == "current_message" and d["input_limit"] == 2_500
        # The prefix as the budget sets it aside: its estimate and the safety margin (core/estimator.py, rules 2).
        assert d["message_tokens"] > 5_000 and d["prefix_tokens"] == PREFIX_TOKENS + PREFIX_MARGIN_TOKENS
        assert d["minimum_body_tokens"] + d["prefix_tokens"] > d["input_limit"]

    def test_active_pairs_as_pointers_count_in_the_minimum(self) -> None:
        """Big active results are not a reason to fail: their pointers are what the minimum body holds."""
        plan = _plan(_active_turn(BodyInputs(), 8, words=800), 4_000)
        assert plan.status is PlanStatus.FITS


PREFIX_TOKENS = _plan(BodyInputs(), 100_000).prefix_tokens
PREFIX_MARGIN_TOKENS = _plan(BodyInputs(), 100_000).prefix_margin_tokens


@given(
    result=st.builds(
        ToolResult,
        id=st.text(min_size=1, max_size=20),
        seq=st.integers(min_value=0, max_value=10**6),
        trust=st.sampled_from(TrustLevel),
        tainted=st.booleans(),
        call_id=st.text(max_size=10),
        tool_name=st.text(max_size=10),
        content=st.text(max_size=30),
        artifact_ref=st.none() | st.text(max_size=10),
    ),
    raw_tokens=st.integers(min_value=0, max_value=10**6),
    pointer_tokens=st.integers(min_value=0, max_value=10**4),
)
def test_a_pointer_segment_made_without_its_item_is_the_pointer_items_segment(
    result: ToolResult, raw_tokens: int, pointer_tokens: int
) -> None:
    """A build makes a pointer's segment straight from the tool result's segment (`pointer_segment_of`: no result
    or pointer item per result, which a cold worker's build under pressure makes hundreds of); it is the very
    segment `segment_of` makes of the pointer item, for every trust, taint, call id and reference."""
    pointer = pointer_for(result, raw_tokens)
    text = render_item(pointer, f.SECRET)
    result_seg = segment_of(result, render_item(result, f.SECRET), raw_tokens)
    assert pointer_segment_of(result_seg, text, pointer_tokens) == segment_of(pointer, text, pointer_tokens)


def test_forgetting_the_items_a_checkpoint_covers_forgets_their_pointers() -> None:
    """A build under pressure memoises each pointer with its tool result: when the results leave the memo (a
    checkpoint covers them), so do their pointers: the memo holds nothing of the items it forgot."""
    body = _body(10)
    cache = RenderCache(f.SECRET)
    full = _plan(body, 100_000)
    window = full.estimated_tokens + 500 - full.tokens_by_class["recall"] - 200
    budget = ContextBudget(context_window=window, output_reserve=500)
    plan = build(PREFIX, body, budget=budget, estimator=f.estimator(), secret=f.SECRET, cache=cache)
    assert any(s.kind == "elided_span" for s in plan.segments)
    shown = [*body.history, *body.recall, *([body.current] if body.current else [])]
    cache.forget({item.id for item in shown})
    assert len(cache) == 0
