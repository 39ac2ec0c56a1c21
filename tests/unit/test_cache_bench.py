"""`ctxengine bench cache` on reduced sessions, and its two cache models on hand-checked inputs."""

from __future__ import annotations

from typing import Any

import pytest

from harness.bench import cache_bench as cb

SHARES = ("cached_share_openai", "cached_share_anthropic_strict", "cached_share_anthropic_lookback")
RATIOS = ("cost_ratio_vs_trim_last_openai", "cost_ratio_vs_trim_last_anthropic")
TARGETS = (
    "meets_cached_share_target_openai",
    "meets_cached_share_target_anthropic_strict",
    "meets_cost_target_vs_trim_last_openai",
    "meets_cost_target_vs_trim_last_anthropic",
)
HEADLINE = SHARES + RATIOS + TARGETS


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return cb.run(gate_turns=16, long_turns=40, long_window=40_000)


class TestReducedRun:
    def test_reports_the_headline_keys(self, result: dict[str, Any]) -> None:
        """Every headline key is there; shares are fractions, ratios positive, targets booleans."""
        assert set(HEADLINE) <= set(result)
        assert all(0.0 <= result[key] <= 1.0 for key in SHARES)
        assert all(result[key] > 0 for key in RATIOS)
        assert all(isinstance(result[key], bool) for key in TARGETS)
        assert result["s50_turns"] == 16 and result["s200_turns"] == 40

    def test_ctxengine_caches_more_than_naive(self, result: dict[str, Any]) -> None:
        """On both sessions and under every cache rule ctxengine's cached share beats naive's."""
        for session in ("s50", "s200"):
            for rule in cb.RULES:
                mine = result[f"{session}_ctxengine_{rule}_cached_share"]
                assert mine > result[f"{session}_naive_{rule}_cached_share"], (session, rule)
                assert result[f"{session}_{rule}_cost_ratio_vs_naive"] < 1.0

    def test_one_prefix_and_compaction_ran(self, result: dict[str, Any]) -> None:
        """ctxengine keeps one prefix hash per session and compacts; summarize-all rewrites at least as often."""
        assert result["s50_ctxengine_prefix_hashes"] == result["s200_ctxengine_prefix_hashes"] == 1
        assert result["s50_ctxengine_compactions"] >= 1  # the gate script forces one
        assert result["s200_ctxengine_compactions"] >= 1
        assert result["s200_summarize_all_compactions"] >= result["s200_ctxengine_compactions"]
        assert result["s200_naive_compactions"] == 0

    def test_figures_are_consistent(self, result: dict[str, Any]) -> None:
        """Cached never exceeds input; cost lies between all-read and all-written; headlines are the worst case."""
        for session in ("s50", "s200"):
            for name in cb.ASSEMBLERS:
                for rule in cb.RULES:
                    key = f"{session}_{name}_{rule}"
                    tokens, cached = result[f"{key}_input_tokens"], result[f"{key}_cached_tokens"]
                    assert 0 <= cached <= tokens
                    prices = cb.PRICES[cb.RULE_PRICES[rule]]
                    low = tokens * prices.get("cache_read", prices.get("cached_input", 0)) / 1e6
                    high = (tokens * prices.get("cache_write", prices["input"])) / 1e6
                    summarizer = result[f"{session}_{name}_summarizer_input_tokens"] * prices["input"] / 1e6
                    assert low <= result[f"{key}_cost_usd"] <= high + summarizer + 1e-3
        assert result["cost_ratio_vs_trim_last_anthropic"] == max(
            result[f"s200_{r}_cost_ratio_vs_trim_last"] for r in ("anthropic_strict", "anthropic_lookback")
        )
        assert (
            result["s200_ctxengine_anthropic_strict_cached_tokens"]
            <= result["s200_ctxengine_anthropic_lookback_cached_tokens"]
        )

    def test_scripts_are_deterministic(self) -> None:
        """The same seed and size generate the same session, event for event."""
        assert cb.gate_script(12).events == cb.gate_script(12).events
        script = cb.gate_script(12)
        turns = [e for e in script.events if isinstance(e, cb.Turn)]
        assert turns[0].at.day != turns[-1].at.day  # the clock crosses midnight
        assert any(isinstance(e, cb.Revoke) for e in script.events)
        assert sum(isinstance(e, cb.Remember) for e in script.events) == 3


def _openai(*contents: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": c} for c in contents]}


def _anthropic(system: str, *texts: str, marks: tuple[int, ...] = ()) -> dict[str, Any]:
    """A Messages request whose system block carries a breakpoint, and user text blocks at `marks` too."""
    blocks = [
        {"type": "text", "text": t, **({"cache_control": {"type": "ephemeral"}} if i in marks else {})}
        for i, t in enumerate(texts)
    ]
    return {
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": blocks}],
    }


class TestOpenAIRule:
    def test_cached_prefix_rounds_down_to_128_from_1024(self) -> None:
        """A common prefix of 1,508 tokens caches 1,024 + 3 x 128 = 1,408; the first request caches nothing."""
        cache = cb.OpenAICache(len)  # one token per character; each message adds its role ("user", 4)
        cache.send(_openai("a" * 1_500, "first"))
        cache.send(_openai("a" * 1_500, "second"))
        assert cache.bill.shares[0] == 0.0
        assert cache.bill.cached_tokens == 1_408
        assert cache.bill.input_tokens == 2 * (4 + 1_500) + (4 + len("first")) + (4 + len("second"))

    def test_nothing_cached_below_1024(self) -> None:
        """A shared prefix shorter than 1,024 tokens is not cached."""
        cache = cb.OpenAICache(len)
        cache.send(_openai("b" * 900, "x"))
        cache.send(_openai("b" * 900, "y"))
        assert cache.bill.cached_tokens == 0

    def test_prefix_may_end_inside_a_block(self) -> None:
        """The common prefix runs to the first differing character, also within a block."""
        cache = cb.OpenAICache(len)
        cache.send(_openai("c" * 2_000 + "tail one"))
        cache.send(_openai("c" * 2_000 + "tail two"))
        assert cache.bill.cached_tokens == 1_024 + (4 + 2_005 - 1_024) // 128 * 128


class TestAnthropicRule:
    def test_write_then_read_at_the_system_breakpoint(self) -> None:
        """A new system prefix is written (1.25x), the next request reads it (0.1x); the rest is base."""
        cache = cb.AnthropicCache(len)
        cache.send(_anthropic("s" * 2_000, "hello"))
        cache.send(_anthropic("s" * 2_000, "world"))
        assert cache.bill.cache_write_tokens == 2_000 and cache.bill.cached_tokens == 2_000
        price = cb.PRICES["anthropic"]
        expected = (2_000 * price["cache_write"] + 2_000 * price["cache_read"]) / 1e6
        expected += 2 * (len("user") + 5) * price["input"] / 1e6
        assert cache.bill.cost == pytest.approx(expected)

    def test_below_the_minimum_nothing_is_cached(self) -> None:
        """A breakpoint before 1,024 tokens neither writes nor reads."""
        cache = cb.AnthropicCache(len)
        cache.send(_anthropic("s" * 800, "a"))
        cache.send(_anthropic("s" * 800, "b"))
        assert cache.bill.cache_write_tokens == 0 and cache.bill.cached_tokens == 0

    def test_a_history_breakpoint_reads_the_previous_one_within_20_blocks(self) -> None:
        """An entry written at an earlier breakpoint is found up to 20 content blocks back, not further."""
        near = cb.AnthropicCache(len)
        base = [f"m{i:03d}" for i in range(5)]
        near.send(_anthropic("s" * 1_100, *base, marks=(4,)))
        near.send(_anthropic("s" * 1_100, *base, *[f"n{i:03d}" for i in range(10)], marks=(14,)))
        assert near.bill.cached_tokens == 1_100 + len("user") + 5 * 4  # read through the old history end
        far = cb.AnthropicCache(len)
        far.send(_anthropic("s" * 1_100, *base, marks=(4,)))
        far.send(_anthropic("s" * 1_100, *base, *[f"n{i:03d}" for i in range(25)], marks=(29,)))
        assert far.bill.cached_tokens == 1_100  # only the system breakpoint is in reach

    def test_strict_rule_reads_only_at_a_marked_offset(self) -> None:
        """Under the strict rule a moved history breakpoint finds nothing, however near; at the same offset it
        reads."""
        base = [f"m{i:03d}" for i in range(5)]
        moved = cb.AnthropicCache(len, lookback=0)
        moved.send(_anthropic("s" * 1_100, *base, marks=(4,)))
        moved.send(_anthropic("s" * 1_100, *base, "n000", marks=(5,)))
        assert moved.bill.cached_tokens == 1_100
        kept = cb.AnthropicCache(len, lookback=0)
        kept.send(_anthropic("s" * 1_100, *base, marks=(4,)))
        kept.send(_anthropic("s" * 1_100, *base, "n000", marks=(4, 5)))
        assert kept.bill.cached_tokens == 1_100 + len("user") + 5 * 4

    def test_breakpoint_markers_are_not_content(self) -> None:
        """Moving a breakpoint off a block does not change that block's identity in the prefix."""
        cache = cb.AnthropicCache(len)
        cache.send(_anthropic("s" * 1_100, "a" * 50, marks=(0,)))
        cache.send(_anthropic("s" * 1_100, "a" * 50, "b" * 50, marks=(1,)))
        assert cache.bill.cached_tokens == 1_100 + len("user") + 50
