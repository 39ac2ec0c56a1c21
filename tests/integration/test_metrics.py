"""Metrics: the worker's one Prometheus endpoint carries the SDK's metrics and ctxengine's."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client

from contract import names
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
