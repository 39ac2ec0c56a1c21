"""Decision 11: the prefix is measured exactly, the body estimated conservatively, and usage reconciles."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from core.budget import ContextBudget
from core.build import build
from core.estimator import DEFAULT_PROFILES, ModelProfile, TokenEstimator, reconcile
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
