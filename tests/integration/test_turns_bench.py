"""`ctxengine bench turns` reduced: the engine and the floor measured side by side on the fixtures' servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client

from harness.bench import turns_bench as tb
from tests.conftest import fresh_database

pytestmark = pytest.mark.integration

# The keys the issue asks for (with the default concurrency of 20 and 100 sessions).
REQUIRED = (
    "engine_p50_ms",
    "floor_p50_ms",
    "overhead_ratio",
    "turns_per_s_100_sessions",
    "floor_turns_per_s_100_sessions",
    "long_session_growth_ratio",
    "max_history_events_per_run",
    "worker_rss_growth_mb",
)
VERDICTS = (
    "meets_overhead_target",
    "meets_throughput_target",
    "meets_growth_target",
    "meets_history_target",
    "meets_round_trips_target",
    "meets_rss_target",
    "meets_cold_build_target",
    "meets_two_workers_target",
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bench_dsn(pg_server: str) -> AsyncIterator[str]:
    """A fresh database for the module (pg_dsn is per test; the bench runs once for the module)."""
    async with fresh_database(pg_server, "test_bench") as dsn:
        yield dsn


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def result(temporal_address: str, temporal_client: Client, bench_dsn: str) -> dict[str, Any]:
    """One reduced run on the fixtures' servers: 10 latency turns (20 activities for the two workers to share: with
    5, all of them once landed on one worker of the two under the full suite's load), 4 sessions x 2 turns, a
    30-turn session, cold builds of a 60-item session."""
    return await tb.run(
        turns=10,
        long_turns=30,
        sessions=(4,),
        turns_per_session=2,
        throughput_rounds=1,
        warmup_turns=1,
        cold_items=(60,),
        cold_rounds=2,
        address=temporal_address,
        dsn=bench_dsn,
        namespace=temporal_client.namespace,
    )


def test_reports_every_figure_measured(result: dict[str, Any]) -> None:
    """Every figure is there and measured: latencies, throughput and ratios positive; one JSON object."""
    per_n = {  # this reduced run measures 4 concurrent sessions instead of 20 and 100
        "turns_per_s_100_sessions": "turns_per_s_4_sessions",
        "floor_turns_per_s_100_sessions": "floor_turns_per_s_4_sessions",
    }
    for key in REQUIRED:
        assert per_n.get(key, key) in result, key
    for key in (
        "engine_p50_ms",
        "engine_p95_ms",
        "floor_p50_ms",
        "floor_p95_ms",
        "long_first_10pct_p50_ms",
        "disk_flush_p50_ms_back_to_back",
        "disk_flush_p50_ms_after_quiet",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    for key in ("turns_per_s_4_sessions", "floor_turns_per_s_4_sessions"):
        assert result[key] > 0, key
    for key in ("overhead_ratio", "throughput_ratio", "throughput_ratio_4_sessions", "long_session_growth_ratio"):
        assert isinstance(result[key], float) and result[key] > 0, key
    for key in VERDICTS:
        assert isinstance(result[key], bool), key
    assert result["turns"] == 10 and result["long_turns"] == 30
    assert isinstance(result["worker_rss_growth_mb"], float)
    assert json.loads(json.dumps(result)) == result
    # Whether the workflow modules had bytecode (`compiled` is tested in tests/unit/test_bench_measure.py).
    assert isinstance(result["workflow_modules_compiled"], bool)
    # The turn path's figures: round trips counted at the pool, a fresh process's cold builds, two workers.
    assert result["pg_round_trips_per_plain_turn"] > 0
    assert result["cold_build_p50_ms_60"] > 0 and result["cold_build_pg_round_trips_60"] > 0
    assert result["cold_build_rounds"] == 2
    assert result["two_workers_p50_ms"] > 0 and result["two_workers_no_affinity_p50_ratio"] > 0
    assert result["one_worker_process_no_eager_p50_ms"] > 0 and result["two_workers_vs_one_no_eager_p50_ratio"] > 0
    # Where the throughput phase's CPU went: the bench's process and the embedded services' own processes.
    for side in ("engine", "floor"):
        for proc in ("worker", "temporal"):
            assert result[f"{side}_{proc}_cpu_ms_per_turn_4_sessions"] > 0, (side, proc)
    assert result["engine_postgres_cpu_ms_per_turn_4_sessions"] > 0
    for side in ("engine", "floor"):  # of the bench's process, the garbage collector's part (0: it did not run)
        assert (
            0
            <= result[f"{side}_worker_gc_cpu_ms_per_turn_4_sessions"]
            <= result[f"{side}_worker_cpu_ms_per_turn_4_sessions"]
        )
    # Where each tenth of the long session's time went: the server's records of its activities and workflow
    # tasks (31 builds and model calls: the opening turn's too), the worker's PostgreSQL time.
    tenths = result["long_by_tenth"]
    assert tenths["p50_ms"] == [result[f"long_p50_ms_tenth_{k:02d}"] for k in range(1, 11)]
    for key in ("floor_p50_ms", "build_p50_ms", "model_call_p50_ms", "workflow_task_p50_ms", "postgres_ms_per_turn"):
        assert len(tenths[key]) == 10 and all(v > 0 for v in tenths[key]), key
    # The compactions of each tenth, from the session's events: each one a child workflow of the session's runs.
    assert len(tenths["compactions"]) == 10
    assert sum(tenths["compactions"]) <= result["long_session_child_workflows"]
    # Ratios and verdicts come last.
    keys = list(result)
    assert keys.index("overhead_ratio") > keys.index("worker_rss_growth_mb")
    assert keys[-len(VERDICTS) - 3 : -len(VERDICTS)] == [
        "overhead_ratio",
        "throughput_ratio",
        "long_session_growth_ratio",
    ]
    assert keys[-len(VERDICTS) :] == list(VERDICTS)


def test_engine_turns_are_real_and_history_stays_small(result: dict[str, Any]) -> None:
    """An engine turn is two activities (build, model call); the floor's is its two no-ops; no prompt in history."""
    assert result["engine_activities_per_turn"] == 2.0
    assert result["floor_activities_per_turn"] == 2.0
    assert 0 < result["max_history_events_per_run"] <= tb.HISTORY_EVENTS_LIMIT
    assert result["long_session_runs"] >= 1
    assert result["max_history_event_bytes"] < 64 * 1024  # plan summaries, never the rendered request


def test_two_workers_both_serve_the_session(result: dict[str, Any]) -> None:
    """Without affinity, activities land on either worker process (the server's history names who ran each)."""
    assert result["two_workers_identities"] == 2
    assert result["two_workers_activity_hop_share"] > 0


def test_percentile_interpolates() -> None:
    assert tb.percentile([1.0], 50) == 1.0
    assert tb.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert tb.percentile([10.0, 0.0], 100) == 10.0
    with pytest.raises(ValueError):
        tb.percentile([], 50)
