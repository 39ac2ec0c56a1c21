"""OpenTelemetry: one trace per turn, spanning the update, its activities and its compaction children."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
from temporalio.client import Client

from contract.converter import DATA_CONVERTER

pytest.importorskip("opentelemetry.sdk", reason="the `otel` extra is not installed")

import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from activities.tracing import ATTR_EPOCH, ATTR_SESSION, ATTR_TURN, CtxTracingInterceptor, add_trace_ids
from ctxengine.client import CtxEngineClient
from services.embedded import temporal_namespace
from tests.integration.session_helpers import session_open, stack
from worker import configure_logging

pytestmark = pytest.mark.integration


def _traces(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    by_trace: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        by_trace[span.context.trace_id].append(span)
    return by_trace


def _trace_of(spans: tuple[ReadableSpan, ...], root: str, turn: int) -> list[ReadableSpan]:
    """The spans of the trace whose workflow-side update span is for `turn`."""
    for trace in _traces(spans).values():
        if any(s.name == root and (s.attributes or {}).get(ATTR_TURN) == turn for s in trace):
            return trace
    raise AssertionError(f"no trace for turn {turn}: {sorted({s.name for s in spans})}")


async def test_one_trace_per_turn(temporal_address: str, pg_dsn: str, task_queue: str) -> None:
    """A turn with a tool call is one trace: the caller's update span, the workflow's update span, build, model
    call and tool call activities tagged with session, turn and epoch; a compaction child joins its turn's trace;
    log lines inside a span carry its trace and span ids."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    interceptor = CtxTracingInterceptor(provider.get_tracer("ctxengine-test"))
    client = await Client.connect(
        temporal_address,
        namespace=temporal_namespace(),
        data_converter=DATA_CONVERTER,
        interceptors=[interceptor],
    )
    async with stack(client, pg_dsn, task_queue):
        ctx = CtxEngineClient(client, task_queue=task_queue)
        s = await ctx.start_session(session_open(budget={"context_window": 5_000, "output_reserve": 500}))
        await s.submit_turn('/call web.fetch {"url": "fixture://weather"}')
        await s.submit_turn("hello")
        compacted_turn = None
        for i in range(40):
            result = await s.submit_turn(f"turn {i}\n/call web.fetch {json.dumps({'url': f'fixture://marker/{i}'})}")
            if (await s.state()).metrics.compactions:
                compacted_turn = result.turn
                break
    spans = tuple(exporter.get_finished_spans())
    first = _trace_of(spans, "HandleUpdate:submit_turn", 1)
    names = [sp.name for sp in first]
    roots = [sp for sp in first if sp.parent is None]
    assert [r.name for r in roots] == ["StartWorkflowUpdate:submit_turn"]
    for name in (
        "HandleUpdate:submit_turn",
        "RunActivity:context.build",
        "RunActivity:model.call",
        "RunActivity:tool.execute",
    ):
        assert name in names, names
    for sp in first:
        if sp.name.startswith(("RunActivity:", "HandleUpdate:")):
            attrs: dict[str, Any] = dict(sp.attributes or {})
            assert attrs[ATTR_SESSION] == s.session_id and attrs[ATTR_TURN] == 1 and attrs[ATTR_EPOCH] == 1, sp.name
    assert names.count("RunActivity:model.call") == 2  # the call that asked for the tool, and the answer
    second = _trace_of(spans, "HandleUpdate:submit_turn", 2)
    assert {sp.context.trace_id for sp in second}.isdisjoint({sp.context.trace_id for sp in first})
    assert "RunActivity:tool.execute" not in [sp.name for sp in second]
    assert compacted_turn is not None
    compacting_trace = _trace_of(spans, "HandleUpdate:submit_turn", compacted_turn)
    compacting = [sp.name for sp in compacting_trace]
    child = next(sp for sp in compacting_trace if sp.name == "RunWorkflow:CompactionWorkflow")
    assert dict(child.attributes or {})[ATTR_TURN] == compacted_turn
    assert "StartChildWorkflow:CompactionWorkflow" in compacting and "RunWorkflow:CompactionWorkflow" in compacting
    assert any(n.startswith("RunActivity:compaction.") for n in compacting), compacting
    # Log lines join their trace: the worker's structlog chain holds the processor, which reads the current span.
    configure_logging()
    assert add_trace_ids in structlog.get_config()["processors"]
    tracer = provider.get_tracer("ctxengine-test")
    with structlog.testing.capture_logs(processors=[add_trace_ids]) as logs, tracer.start_as_current_span("x") as sp:
        structlog.get_logger("t").warning("inside")
    assert logs[0]["trace_id"] == format(sp.get_span_context().trace_id, "032x")
    assert logs[0]["span_id"] == format(sp.get_span_context().span_id, "016x")
