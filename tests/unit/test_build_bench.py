"""`ctxengine bench build` on a reduced session: the figures exist, are measured, and the cache holds."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from activities.tokens import TiktokenCounter
from core.items import ToolCall, ToolResult, TrustLevel
from harness.bench import build_bench as bb

REQUIRED = (
    "warm_p50_ms",
    "cold_p50_ms",
    "trim_messages_docs_p50_ms",
    "trim_messages_cached_p50_ms",
    "floor_p50_ms",
    "speedup_vs_trim_cached",
    "ratio_to_floor",
    "scaling_10k_over_1k",
)
RATIOS = ("speedup_vs_trim_docs", "speedup_vs_trim_cached", "ratio_to_floor", "scaling_10k_over_1k")


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return bb.run(rounds=3, items=200, big_items=400)


def test_reports_every_figure_measured(result: dict[str, Any]) -> None:
    """Every key the issue names is there, every timing and ratio is a positive number."""
    assert set(REQUIRED) <= set(result)
    for key, value in result.items():
        if key.endswith("_ms") or key in RATIOS:
            assert isinstance(value, float) and value > 0, key
    assert result["history_items"] == 200 and result["big_history_items"] == 400
    assert result["trim_messages_docs_rounds"] == 3
    json.loads(json.dumps(result))  # flat and JSON-serialisable
    assert all(not isinstance(v, dict | list) for v in result.values())


def test_each_item_is_counted_once(result: dict[str, Any]) -> None:
    """A cold build counts each distinct item once; a warm build counts only the turn's new items."""
    assert result["counts_cold_build"] == result["distinct_items_cold_build"]
    assert result["counts_cold_build"] >= result["history_items"]
    assert 1 <= result["counts_per_warm_build"] <= 3
    assert 1 <= result["counts_per_warm_build_10k"] <= 3


def test_ratios_come_last_and_follow_the_figures(result: dict[str, Any]) -> None:
    keys = list(result)
    assert keys[-1] == "scaling_10k_over_1k"
    assert min(keys.index(k) for k in RATIOS) > max(i for i, k in enumerate(keys) if k.endswith("_ms"))
    assert result["speedup_vs_trim_cached"] == pytest.approx(
        result["trim_messages_cached_p50_ms"] / result["warm_p50_ms"]
    )
    assert result["ratio_to_floor"] == pytest.approx(result["warm_p50_ms"] / result["floor_p50_ms"])
    assert result["meets_floor_target"] == (result["ratio_to_floor"] <= bb.FLOOR_TARGET)


def test_progress_goes_to_stderr_only(capsys: pytest.CaptureFixture[str]) -> None:
    bb.run(rounds=1, progress=True, items=60, big_items=80)
    assert capsys.readouterr().out == ""


def test_session_is_deterministic_and_shaped_as_specified() -> None:
    """Same seed, same history; 10% of items are tool pairs and 20% of results are untrusted."""
    counter = TiktokenCounter()

    def make() -> list[Any]:
        return bb.history(bb.TextGen(random.Random(7), counter), 500, ["search_web"])

    first, second = make(), make()
    assert first == second
    assert len(first) == 500
    results = [h for h in first if isinstance(h, ToolResult)]
    assert len(results) == sum(isinstance(h, ToolCall) for h in first) == 50
    assert sum(r.trust is TrustLevel.EXTERNAL_UNTRUSTED for r in results) == 10


def test_both_langchain_counters_agree() -> None:
    """The cached counter is the docs' counter plus a memo: the same count for the same messages."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    messages = [SystemMessage(content="policy"), HumanMessage(content="hello there"), AIMessage(content="hi")]
    cached = bb.CachedTiktokenCounter()
    assert cached(messages) == bb.docs_tiktoken_counter(messages) == cached(messages)
