"""Metrics: the worker's one Prometheus endpoint carries the SDK's metrics and ctxengine's."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import ActivityEnvironment

from activities import metrics
from activities.metrics import record_event
from contract import names
from contract.events import EventType
from contract.payloads import SessionState
from harness.worker_process import WorkerProcess
from services.embedded import free_port
from tests.integration.session_helpers import start, turn

pytestmark = pytest.mark.integration


async def test_prometheus_endpoint(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str, tmp_path: Path
) -> None:
    """After a few turns the endpoint exposes Temporal's worker metrics and ctxengine's request counters."""
    port = free_port()
    worker = WorkerProcess(
        temporal_address=temporal_address,
        dsn=pg_dsn,
        task_queue=task_queue,
        home=tmp_path,
        extra_env={"CTXENGINE_METRICS_ADDRESS": f"127.0.0.1:{port}"},
    )
    try:
        await worker.start(temporal_client)
        handle = await start(temporal_client, task_queue)
        for i in range(3):
            await turn(handle, f"hello {i}")
        state = await handle.query(names.QUERY_STATE, result_type=SessionState)
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
    finally:
        worker.kill()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples.get("ctxengine_requests", samples.get("ctxengine_requests_total")) == state.metrics.requests == 3
    assert samples.get("ctxengine_sessions_opened", samples.get("ctxengine_sessions_opened_total")) == 1
    assert any(name.startswith("temporal_") for name in samples)
    assert "ctxengine_prefix_hash_violations" not in samples  # nothing broke, nothing counted


def test_metric_instruments_are_made_once_per_label_set() -> None:
    """The SDK gives each activity run a new meter, carrying the run's activity type. Instruments are made once per
    name and label set, not once per meter: a worker's metrics take the same memory after 120 model calls as after
    2, and each activity type's runs are exported under its own label. (Kept by meter, each run recording a
    request added 7 instruments, about 2.9 kB: 14 MB after 5,000 calls.)"""
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    runs = {"model.call": 70, "context.build": 50}
    order = [t for i in range(max(runs.values())) for t in runs if i < runs[t]]
    reconciled = {"actual_tokens": 100, "cached_tokens": 0, "prefix_tokens_reused": 0, "error_tokens": -3}
    instruments: list[int] = []
    for activity_type in order:
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, activity_type=activity_type)
        env.metric_meter = runtime.metric_meter
        env.run(record_event, EventType.ESTIMATOR_RECONCILED, reconciled)
        instruments.append(len(metrics._instruments))
    assert instruments[-1] == instruments[1]  # after one run of each type, no run adds one
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    exported = {
        s.labels.get("activity_type"): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in ("ctxengine_requests", "ctxengine_requests_total")
    }
    assert exported == runs


def test_two_runtimes_in_one_process_count_their_own_runs() -> None:
    """Instruments are kept per runtime too: runs with the same labels under two runtimes (two workers of one process,
    each with its own metrics endpoint) are each exported by their own runtime's endpoint, never by the other's."""
    ports = [free_port(), free_port()]
    runtimes = [
        Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}"))) for port in ports
    ]
    runs = [3, 5]
    reconciled = {"actual_tokens": 100, "cached_tokens": 0, "prefix_tokens_reused": 0, "error_tokens": 0}
    for runtime, n in zip(runtimes, runs, strict=True):
        for _ in range(n):
            env = ActivityEnvironment()
            env.info = dataclasses.replace(env.info, activity_type="model.call")
            env.metric_meter = runtime.metric_meter
            env.run(record_event, EventType.ESTIMATOR_RECONCILED, reconciled)
    exported = []
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        exported.append(
            sum(
                s.value
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name in ("ctxengine_requests", "ctxengine_requests_total")
            )
        )
    assert exported == runs
