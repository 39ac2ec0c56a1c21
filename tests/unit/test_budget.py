"""Decisions 6 and 7: absolute caps, output reserve first, only history scales; the prefix never yields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.budget import ContextBudget
from core.build import build, open_prefix
from core.errors import PrefixOverflowError
from core.items import BudgetClass, MemorySnapshotEntry
from tests.unit import factories as f


class TestDefaults:
    def test_adr_caps_are_the_defaults(self) -> None:
        """The defaults are the ADR's absolute caps."""
        b = ContextBudget()
        assert (b.platform_policy_tokens, b.agent_instructions_tokens) == (2_000, 4_000)
        assert (b.tools_max_count, b.tools_tokens) == (30, 6_000)
        assert (b.memory_snapshot_max_items, b.memory_snapshot_tokens) == (40, 1_500)
        assert (b.working_state_tokens, b.retrieved_context_tokens, b.tool_results_share) == (
            1_000,
            2_000,
            0.25,
        )

    def test_output_reserve_is_subtracted_first(self) -> None:
        """The input limit is the window less the output reserve."""
        assert ContextBudget(context_window=100_000, output_reserve=10_000).input_limit == 90_000

    def test_reserve_must_fit_the_window(self) -> None:
        """A reserve as large as the window is a configuration error."""
        with pytest.raises(ValueError, match="output_reserve"):
            ContextBudget(context_window=1_000, output_reserve=1_000)

    def test_only_history_scales_with_the_window(self) -> None:
        """Doubling the window changes no cap except the space left for history."""
        small, large = ContextBudget(context_window=100_000), ContextBudget(context_window=200_000)
        assert small.prefix_caps() == large.prefix_caps()
        assert small.retrieved_context_tokens == large.retrieved_context_tokens
        assert small.working_state_tokens == large.working_state_tokens

    def test_history_fills_a_larger_window(self) -> None:
        """A history that needs compaction in a small window fits in a large one."""
        body = f.body(60)
        small = build(
            f.prefix(),
            body,
            budget=ContextBudget(context_window=8_000, output_reserve=1_000),
            estimator=f.estimator(),
            secret=f.SECRET,
        )
        large = build(
            f.prefix(),
            body,
            budget=ContextBudget(context_window=64_000, output_reserve=1_000),
            estimator=f.estimator(),
            secret=f.SECRET,
        )
        assert small.status == "needs_compaction"
        assert large.status == "fits"


class TestPrefixNeverYields:
    @pytest.mark.parametrize(
        ("overrides", "budget_class", "cap"),
        [
            ({"agent_instructions": "word " * 4_500}, "agent_instructions", 4_000),
            ({"platform_policy": "rule " * 2_100}, "platform_policy", 2_000),
            (
                {
                    "memory_snapshot": [
                        MemorySnapshotEntry(id=f"m{i}", memory_id=f"m{i}", text="fact " * 60) for i in range(30)
                    ]
                },
                "memory_snapshot",
                1_500,
            ),
        ],
    )
    def test_over_cap_class_is_named(self, overrides: dict[str, object], budget_class: str, cap: int) -> None:
        """An over-cap prefix class fails the open with the class, its size and its cap."""
        with pytest.raises(PrefixOverflowError) as info:
            f.prefix(**overrides)
        assert info.value.budget_class == budget_class
        assert info.value.cap == cap
        assert info.value.tokens > cap
        assert budget_class in str(info.value) and f"{cap:,}" in str(info.value)

    def test_tool_count_cap(self) -> None:
        """A 31st tool fails the open naming the tool class and the count."""
        with pytest.raises(PrefixOverflowError, match="tools") as info:
            f.prefix(tools=f.tools(31))
        assert (info.value.tokens, info.value.cap, info.value.unit) == (31, 30, "tools")

    def test_snapshot_item_cap(self) -> None:
        """A 41st snapshot memory fails the open."""
        snap = [MemorySnapshotEntry(id=f"m{i}", memory_id=f"m{i}", text="x") for i in range(41)]
        with pytest.raises(PrefixOverflowError, match="memory_snapshot"):
            f.prefix(memory_snapshot=snap)

    def test_prefix_is_never_truncated(self) -> None:
        """A prefix that fits is carried whole: every byte of the instructions is in it."""
        text = "Follow rule number {}. " * 300
        p = f.prefix(agent_instructions=text)
        assert text in p.text
        assert p.class_tokens[BudgetClass.AGENT_INSTRUCTIONS.value] <= 4_000

    def test_tool_tokens_include_per_tool_overhead(self) -> None:
        """Tool tokens count each tool's overhead as well as its bytes."""
        p = open_prefix(f.prefix_inputs(), budget=ContextBudget(), estimator=f.estimator(), secret=f.SECRET)
        tool_text = "".join(s.text for s in p.segments if s.budget_class is BudgetClass.TOOLS)
        assert p.class_tokens["tools"] == f.COUNTER.count(tool_text) + 3 * 8


def test_a_budget_window_lowers_the_route_s_never_raises_it() -> None:
    """`budget.context_window` over a route's window takes the route's (a model takes no more), also after a
    rotation to a route with a smaller window; under it, it applies."""
    from contract.payloads import ModelRoute, SessionOpen

    small = ModelRoute.model_validate({"provider": "openai", "model": "m", "context_window": 4_096})
    large = ModelRoute.model_validate({"provider": "openai", "model": "m", "context_window": 40_960})
    open_ = SessionOpen.model_validate(
        {"agent_instructions": "x", "model_route": large, "budget": {"context_window": 16_000, "output_reserve": 500}}
    )
    assert open_.context_budget().context_window == 16_000
    assert open_.context_budget(small.profile()).context_window == 4_096
    over = open_.model_copy(update={"model_route": small})
    assert over.context_budget().input_limit == 4_096 - 500


@pytest.mark.parametrize("written", [100_000.0, "100000", 100_000])
def test_a_budget_window_written_as_a_float_or_a_string_never_raises_the_route_s(written: object) -> None:
    """The override is read as `ContextBudget` reads it (a float without a fraction, a numeric string) before the
    smaller of the two is taken: `100000.0` over an 8,000-token route is 8,000, not a window the model does not
    have (before, only an `int` was lowered and every request over 8,000 tokens was refused by the provider)."""
    from contract.payloads import SessionOpen

    route = {"provider": "openai", "model": "m", "context_window": 8_000}
    budget = {"context_window": written, "output_reserve": 1_000}
    open_ = SessionOpen.model_validate({"agent_instructions": "x", "model_route": route, "budget": budget})
    assert open_.context_budget().context_window == 8_000


@pytest.mark.parametrize("written", ["1e5", 1.5, "a lot"])
def test_a_budget_window_that_is_not_an_integer_is_refused_naming_the_field(written: object) -> None:
    from contract.payloads import SessionOpen

    route = {"provider": "openai", "model": "m", "context_window": 8_000}
    with pytest.raises(ValidationError, match=r"budget\.context_window"):
        SessionOpen.model_validate(
            {"agent_instructions": "x", "model_route": route, "budget": {"context_window": written}}
        )


@pytest.mark.parametrize(
    "budget",
    [
        {"output_reserve": 0},  # refused since, by the open activity
        {"context_window": 100_000.0, "output_reserve": 10_000},  # a float override was left as written
        {"context_window": "100000", "output_reserve": 10_000},
    ],
)
def test_an_open_accepted_before_still_decodes(budget: dict[str, object]) -> None:
    """A running session's start input decodes as it did before (a workflow replays and continues as new on it):
    the validator accepts what it accepted, and what the open now refuses, the open activity refuses. The
    effective budget of a float override over an 8,000-token route with a 10,000-token reserve does not validate:
    that session's builds fail typed, where before every request went over the model's window."""
    from contract.payloads import SessionOpen

    route = {"provider": "openai", "model": "m", "context_window": 8_000}
    open_ = SessionOpen.model_validate({"agent_instructions": "x", "model_route": route, "budget": budget})
    if "context_window" in budget:
        with pytest.raises(ValidationError, match="output_reserve"):
            open_.context_budget()
    else:
        assert open_.context_budget().output_reserve == 0
