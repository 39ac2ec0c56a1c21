"""Decision 11: the prefix is measured exactly, the body estimated conservatively, and usage reconciles."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from activities.assembly import RequestInputs
from core.budget import ContextBudget
from core.build import build
from core.estimator import (
    CALIBRATION_GRID,
    DEFAULT_PROFILES,
    ModelProfile,
    TokenEstimator,
    calibration_target,
    next_calibration,
    reconcile,
)
from tests.unit import factories as f


class TestMeasurement:
    def test_prefix_is_exact_count_of_its_bytes(self) -> None:
        """The prefix's raw tokens are the counter's count of exactly the prefix bytes."""
        p = f.prefix()
        assert p.raw_tokens == f.COUNTER.count(p.text)

    def test_body_carries_the_safety_margin(self) -> None:
        """Body estimates include the 5% margin on top of the calibrated count."""
        est = TokenEstimator(ModelProfile(per_message_tokens=0), f.COUNTER)
        assert est.body_tokens(1_000, 0) == 1_050

    def test_the_margin_covers_the_prefix_too(self) -> None:
        """Rules 2: the budget sets the prefix aside at its calibrated count plus the 5% margin; rules 1 (requests
        recorded before) at the count alone, so replay rebuilds those as they were built."""
        profile = ModelProfile(calibration=1.2)
        exact = TokenEstimator(profile, f.COUNTER).prefix_tokens(2_000, 3)
        assert exact == math.ceil((2_000 + 3 * 8 + 3) * 1.2)
        assert TokenEstimator(profile, f.COUNTER).prefix_reserve(2_000, 3) == math.ceil(exact * 1.05)
        assert TokenEstimator(profile, f.COUNTER, rules=1).prefix_reserve(2_000, 3) == exact
        plan = build(f.prefix(), f.body(3), budget=ContextBudget(), estimator=f.estimator(), secret=f.SECRET)
        reserve = f.estimator().prefix_reserve(f.prefix().raw_tokens, f.prefix().tool_count)
        assert plan.estimated_tokens == reserve + plan.body_tokens
        assert plan.prefix_margin_tokens == reserve - plan.prefix_tokens > 0

    def test_a_request_recorded_before_the_rules_were_versioned_is_rules_1(self) -> None:
        inputs = RequestInputs(
            turn=1,
            call_index=0,
            max_seq=0,
            user_item_id=None,
            checkpoint_id=None,
            now_iso="2026-01-01T00:00:00+00:00",
            profile=ModelProfile(),
            budget=ContextBudget(),
        )
        stored = inputs.model_dump(mode="json")
        del stored["estimate_rules"]
        assert RequestInputs.model_validate(stored).estimate_rules == 1

    def test_plan_estimate_is_at_least_the_exact_count(self) -> None:
        """A plan's estimate is never below the exact count of the request it built."""
        plan = build(f.prefix(), f.body(10), budget=ContextBudget(), estimator=f.estimator(), secret=f.SECRET)
        assert plan.estimated_tokens >= f.COUNTER.count(plan.text)

    def test_profiles_do_not_assume_claude_equals_tiktoken(self) -> None:
        """The Anthropic profile starts at the top of the known ratio range, not at 1.0."""
        assert DEFAULT_PROFILES["anthropic"].calibration >= 1.45


class TestReconcile:
    def test_underestimate_raises_calibration_at_once(self) -> None:
        """An overrun moves the ratio up to the observed ratio immediately."""
        profile, rec = reconcile(ModelProfile(), raw_tokens=1_000, estimated_tokens=1_050, actual_tokens=1_300)
        assert rec.overrun and rec.error_tokens == -250
        assert profile.calibration == 1.3

    def test_overestimate_relaxes_slowly(self) -> None:
        """A lower observed ratio is approached gradually."""
        start = ModelProfile(calibration=1.45)
        profile, rec = reconcile(start, raw_tokens=1_000, estimated_tokens=1_522, actual_tokens=1_100)
        assert not rec.overrun
        assert 1.1 < profile.calibration < 1.45

    @given(
        st.floats(min_value=1.0, max_value=1.45),
        st.lists(st.integers(min_value=200, max_value=50_000), min_size=3, max_size=30),
    )
    @settings(max_examples=80, deadline=None)
    def test_after_reconciliation_estimates_do_not_underestimate(self, true_ratio: float, sizes: list[int]) -> None:
        """For a provider whose tokenizer counts a fixed ratio more, estimates stay at or above actual once learned."""
        profile = ModelProfile()
        _, first = reconcile(
            profile, raw_tokens=sizes[0], estimated_tokens=0, actual_tokens=math.ceil(sizes[0] * true_ratio)
        )
        profile, _ = reconcile(
            profile, raw_tokens=sizes[0], estimated_tokens=0, actual_tokens=math.ceil(sizes[0] * true_ratio)
        )
        for raw in sizes[1:]:
            est = TokenEstimator(profile, f.COUNTER)
            estimate = est.body_tokens(raw, 0)
            actual = math.ceil(raw * true_ratio)
            assert estimate >= actual
            profile, rec = reconcile(profile, raw_tokens=raw, estimated_tokens=estimate, actual_tokens=actual)
            assert not rec.overrun
        assert first.observed_ratio >= 1.0


def _on_grid(value: float) -> bool:
    return value == round(value * CALIBRATION_GRID) / CALIBRATION_GRID


class TestCalibrationGrid:
    def test_an_upward_move_rounds_up(self) -> None:
        """The observed ratio is covered: rounded up to the grid, never down."""
        assert calibration_target(1.30004) == 1.3001
        assert calibration_target(1.3) == 1.3
        assert next_calibration(1.0, calibration_target(1.30004)) == 1.3001

    @given(st.floats(min_value=0.3, max_value=3.0), st.floats(min_value=0.3, max_value=3.0))
    @settings(max_examples=300, deadline=None)
    def test_the_next_calibration_covers_the_ratio_and_is_on_the_grid(self, before: float, observed: float) -> None:
        """For any stored value and any observed ratio (as `reconcile` gives it, to 6 decimals)."""
        observed = round(observed, 6)
        after = next_calibration(before, calibration_target(observed))
        assert after >= observed
        assert _on_grid(after)
        if observed > before:
            assert after == calibration_target(observed)  # at once
        else:
            assert after <= max(before, calibration_target(observed))  # never up on a lower ratio

    @given(st.floats(min_value=0.5, max_value=2.0), st.floats(min_value=0.5, max_value=2.0))
    @settings(max_examples=200, deadline=None)
    def test_a_steady_ratio_settles_within_five_points_above_it(self, start: float, observed: float) -> None:
        """Applied again and again with one ratio, the calibration stops moving within 200 responses, at or above
        the ratio and at most 5 points of the grid above its target."""
        observed = round(observed, 6)
        target = calibration_target(observed)
        value = start
        for _ in range(200):
            after = next_calibration(value, target)
            if after == value:
                break
            value = after
        else:
            raise AssertionError(f"still moving after 200 responses: {value}")
        assert target <= value <= target + 5 / CALIBRATION_GRID + 1e-12

    @given(st.floats(min_value=0.5, max_value=2.0), st.lists(st.floats(0.0, 3e-4), min_size=5, max_size=60))
    @settings(max_examples=150, deadline=None)
    def test_a_ratio_that_wavers_within_three_points_moves_only_upwards(self, base: float, noise: list[float]) -> None:
        """Ratios within 3 points of the grid of each other: each move is up to a new highest target, so the row is
        written at most as often as a new highest ratio arrives (no see-saw between two points)."""
        value = calibration_target(base + max(noise))
        for n in noise:
            after = next_calibration(value, calibration_target(base + n))
            assert after >= value
            value = after
