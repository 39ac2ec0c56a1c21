"""OpenTelemetry traces through `temporalio.contrib.opentelemetry` (optional extra `otel`; docs/tracing.md).

`CtxTracingInterceptor` is the SDK's `TracingInterceptor` with two changes:
- every span of a session carries `ctxengine.session_id`, `ctxengine.turn` and `ctxengine.epoch` (read from the
  activity's or child workflow's input, or from the session's state for an update);
- an update's spans are parented by the caller's span that sent it (its header), not by the workflow's start:
  a session lives for days, so one trace per turn is what a person can read. The SDK's default would hang every
  turn of a session under the span that started it.

Workflow-side spans are the SDK's replay-safe, zero-duration markers; activity spans have real durations.
Only the worker registers this module (workflows never import it). Nothing here runs without the extra.
"""

from __future__ import annotations

from typing import Any

import opentelemetry.trace
import temporalio.worker
from temporalio import activity, workflow
from temporalio.contrib.opentelemetry import TracingInterceptor, TracingWorkflowInboundInterceptor
from temporalio.contrib.opentelemetry._context import attached_context  # the SDK's own safe attach/detach

from contract.settings import settings

ATTR_SESSION = "ctxengine.session_id"
ATTR_TURN = "ctxengine.turn"
ATTR_EPOCH = "ctxengine.epoch"
ENV_OTLP = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def session_attributes(arg: Any) -> dict[str, str | int]:
    """`ctxengine.*` attributes from a payload with session_id / turn / epoch (or a `state` holding them)."""
    state = getattr(arg, "state", None)
    out: dict[str, str | int] = {}
    for key, attr, sources in (
        (ATTR_SESSION, "session_id", (arg, state)),
        (ATTR_TURN, "turn", (arg,)),
        (ATTR_EPOCH, "epoch", (arg, state)),
    ):
        for source in sources:
            value = getattr(source, attr, None) if source is not None else None
            if isinstance(value, str | int) and not isinstance(value, bool):
                out[key] = value
                break
    return out


class _AnnotateActivity(temporalio.worker.ActivityInboundInterceptor):
    """Runs inside the RunActivity span: tags it with the session, turn and epoch of the activity's input."""

    async def execute_activity(self, input: temporalio.worker.ExecuteActivityInput) -> Any:
        span = opentelemetry.trace.get_current_span()
        attrs = session_attributes(input.args[0]) if input.args else {}
        workflow_id = activity.info().workflow_id
        if not attrs and workflow_id:  # children are named `{session_id}/...`
            attrs = {ATTR_SESSION: workflow_id.split("/")[0]}
        span.set_attributes(attrs)
        return await super().execute_activity(input)


class _WorkflowInbound(TracingWorkflowInboundInterceptor):
    async def execute_workflow(self, input: temporalio.worker.ExecuteWorkflowInput) -> Any:
        with self._top_level_workflow_context(success_is_complete=True):
            self._completed_span(
                f"RunWorkflow:{workflow.info().workflow_type}",
                kind=opentelemetry.trace.SpanKind.SERVER,
                additional_attributes=session_attributes(input.args[0]) if input.args else None,
            )
            return await temporalio.worker.WorkflowInboundInterceptor.execute_workflow(self, input)

    async def handle_update_handler(self, input: temporalio.worker.HandleUpdateInput) -> Any:
        header = input.headers.get(self.header_key)
        carrier = self.payload_converter.from_payloads([header])[0] if header else None
        if not carrier:  # an untraced caller: the SDK's behaviour (the workflow's own context, if any)
            return await super().handle_update_handler(input)
        context = self._set_on_context(self.text_map_propagator.extract(carrier))
        with attached_context(context):
            self._completed_span(
                f"HandleUpdate:{input.update}",
                kind=opentelemetry.trace.SpanKind.SERVER,
                additional_attributes=_update_attributes(input.update),
            )
            return await temporalio.worker.WorkflowInboundInterceptor.handle_update_handler(self, input)


def _update_attributes(update: str) -> dict[str, str | int]:
    state = getattr(workflow.instance(), "state", None)
    attrs: dict[str, str | int] = {ATTR_SESSION: workflow.info().workflow_id}
    if state is not None:
        # The turn an update concerns: the next one for submit_turn (it may wait for a running turn first).
        attrs[ATTR_TURN] = state.turns + (1 if update == "submit_turn" else 0)
        attrs[ATTR_EPOCH] = state.epoch
    return attrs


class CtxTracingInterceptor(TracingInterceptor):
    """Client and worker interceptor: put it on the client (`ctxengine.client.connect(tracing=True)`) so a
    turn's trace starts at the caller, and on the worker (`running_worker(interceptors=...)`)."""

    def intercept_activity(
        self, next: temporalio.worker.ActivityInboundInterceptor
    ) -> temporalio.worker.ActivityInboundInterceptor:
        return super().intercept_activity(_AnnotateActivity(next))

    def workflow_interceptor_class(
        self, input: temporalio.worker.WorkflowInterceptorClassInput
    ) -> type[TracingWorkflowInboundInterceptor]:
        super().workflow_interceptor_class(input)  # registers the span extern
        return _WorkflowInbound


def add_trace_ids(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: the current span's trace and span ids, so a log line joins its trace."""
    ctx = opentelemetry.trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def interceptors_from_env(service_name: str = "ctxengine-worker") -> list[CtxTracingInterceptor]:
    """With OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT set, export spans over OTLP/HTTP and return the interceptor;
    otherwise nothing (tracing off). The exporter reads the other standard OTEL_* variables itself."""
    config = settings()
    if not (config.otel_exporter_otlp_endpoint or config.otel_exporter_otlp_traces_endpoint):
        return []
    # The exporter is imported only when one is configured (it pulls in protobuf and an HTTP client).
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": config.otel_service_name or service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    opentelemetry.trace.set_tracer_provider(provider)
    return [CtxTracingInterceptor()]
