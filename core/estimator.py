"""Token estimation (ADR-0020 decision 11): the prefix is measured exactly, the body estimated conservatively.

Core never imports tiktoken: it receives a `TokenCounter`. tiktoken is not every provider's tokenizer
(Claude counts 1.0-1.45x more), so each model profile carries a calibration ratio learned from the usage
every response reports, and estimates add a 5% safety margin on top: to the body, and (rules 2) to the prefix.
"""

from __future__ import annotations

import math
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

# What an estimate adds its safety margin to. 1: the body only (the prefix taken at its calibrated count). 2: the
# whole request. The calibration is learned from whole requests, whose per-message overheads dilute the observed
# ratio, so a prefix that is mostly text can count more per token than the calibration says: under rules 1 a
# reconciled request could still be estimated under the provider's count, and sent over its window. Each request
# record keeps the rules it was built under (`RequestInputs.estimate_rules`), so replay rebuilds it the same way.
ESTIMATE_RULES_VERSION = 2


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class ModelProfile(BaseModel):
    """What the estimator knows about one model route."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: str = "scripted"
    model: str = "scripted-1"
    encoding: str = "cl100k_base"
    per_message_tokens: int = Field(default=4, ge=0)
    per_tool_tokens: int = Field(default=8, ge=0)
    request_overhead_tokens: int = Field(default=3, ge=0)
    safety_margin: float = Field(default=0.05, ge=0, le=1)
    calibration: float = Field(default=1.0, gt=0)
    min_cacheable_tokens: int = Field(default=1_024, ge=0)
    context_window: int = Field(default=200_000, gt=0)

    @property
    def route(self) -> str:
        return f"{self.provider}/{self.model}"


# Starting points per provider. A provider whose tokenizer differs from the encoding starts at the top of
# its known ratio range (conservative by construction) and learns downwards from reported usage.
DEFAULT_PROFILES: dict[str, ModelProfile] = {
    "scripted": ModelProfile(),
    "openai": ModelProfile(provider="openai", model="gpt-4o", encoding="o200k_base", context_window=128_000),
    "anthropic": ModelProfile(
        provider="anthropic",
        model="claude-sonnet-4-6",
        calibration=1.45,
        per_message_tokens=5,
        min_cacheable_tokens=1_024,
        context_window=200_000,
    ),
}


class Reconciliation(BaseModel):
    """What one response's usage said about the estimate."""

    model_config = ConfigDict(frozen=True)

    estimated_tokens: int
    actual_tokens: int
    error_tokens: int  # estimate - actual: negative is an underestimate (an overrun)
    overrun: bool
    observed_ratio: float
    calibration_before: float
    calibration_after: float


class TokenEstimator:
    """Applies a profile to counts from a TokenCounter. Deterministic: same counts, same estimates."""

    # How fast the ratio relaxes downwards after an overestimate; upward moves are immediate.
    RELAX = 0.1

    def __init__(self, profile: ModelProfile, counter: TokenCounter, *, rules: int = ESTIMATE_RULES_VERSION) -> None:
        self.profile = profile
        self.counter = counter
        self.rules = rules

    def count(self, text: str) -> int:
        return self.counter.count(text)

    def prefix_tokens(self, raw_tokens: int, tools: int = 0) -> int:
        """Exact count of the prefix bytes, in the provider's units."""
        p = self.profile
        return math.ceil((raw_tokens + tools * p.per_tool_tokens + p.request_overhead_tokens) * p.calibration)

    def prefix_reserve(self, raw_tokens: int, tools: int = 0) -> int:
        """What a request's budget sets aside for the prefix: its count (`prefix_tokens`) with the safety margin
        (rules 2; rules 1 took the count alone)."""
        exact = self.prefix_tokens(raw_tokens, tools)
        return math.ceil(exact * (1.0 + self.profile.safety_margin)) if self.rules >= 2 else exact

    def body_unit(self) -> float:
        """Multiplier from raw counted tokens to conservative estimated body tokens."""
        return self.profile.calibration * (1.0 + self.profile.safety_margin)

    def body_tokens(self, raw_tokens: int, messages: int) -> int:
        return math.ceil((raw_tokens + messages * self.profile.per_message_tokens) * self.body_unit())


# A calibration moves on a grid of 1/10,000. Upwards it takes the observed ratio rounded up to the grid, so an
# estimate stays at or above the usage it learned from. Downwards it relaxes a tenth of the way, to the nearest
# point of the grid: at most 5 points above the observed ratio a step rounds back to where it was, so a route whose
# ratio holds steady stops moving, and the route's row is not written (or locked) by every response of every
# session on it. 1/10,000 of an estimate is 20 tokens of a 200,000-token window, against the 5% margin.
CALIBRATION_GRID = 10_000


def calibration_target(observed: float) -> float:
    """The observed ratio rounded up to the calibration grid: the least calibration that covers it."""
    return math.ceil(observed * CALIBRATION_GRID - 1e-6) / CALIBRATION_GRID


def next_calibration(before: float, target: float) -> float:
    """The calibration after a response whose observed ratio is `target` (on the grid, `calibration_target`):
    `target` at once if it is higher; otherwise a tenth of the way down to it, to the nearest grid point, never
    below it. The store applies the same rule to the stored value (`activities/store.py`, `next_calibration_sql`),
    with the same floating-point operations in the same order."""
    if target > before:
        return target
    relaxed = before + TokenEstimator.RELAX * (target - before)
    return max(target, math.floor(relaxed * CALIBRATION_GRID + 0.5) / CALIBRATION_GRID)


def reconcile(
    profile: ModelProfile, *, raw_tokens: int, estimated_tokens: int, actual_tokens: int
) -> tuple[ModelProfile, Reconciliation]:
    """Learn the calibration from a response's reported input tokens.

    `raw_tokens` is the counter's count of the whole request with overheads, before calibration. A higher
    observed ratio is adopted at once (estimates must stay at or above actual usage); a lower one is
    approached slowly, so one short reply cannot swing the estimator into underestimating (`next_calibration`).
    """
    observed = round(actual_tokens / raw_tokens, 6) if raw_tokens > 0 else profile.calibration
    before = profile.calibration
    after = next_calibration(before, calibration_target(observed))
    record = Reconciliation(
        estimated_tokens=estimated_tokens,
        actual_tokens=actual_tokens,
        error_tokens=estimated_tokens - actual_tokens,
        overrun=estimated_tokens < actual_tokens,
        observed_ratio=observed,
        calibration_before=before,
        calibration_after=after,
    )
    return profile.model_copy(update={"calibration": after}), record
