"""ctxengine's metrics, through the Temporal SDK's meter: one Prometheus endpoint on the worker serves the
SDK's own metrics and these (worker.py configures it). Recorded where events are first stored, so an
activity retry never counts twice."""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.common import MetricCounter, MetricHistogram, MetricMeter

from contract.events import EventType

# Instruments by name and by the attributes the SDK gives an activity's meter (`activity.metric_meter()`: a new meter
# for each activity run, with its namespace, task queue and activity type): made from the first run's meter of a
# label set and used by every later run with those labels (and the same kind of meter: a no-op meter's instrument,
# as in tests without a runtime, never serves a real one). Bounded by names x task queues x activity types.
_instruments: dict[tuple[type, str, str, str, str], Any] = {}


def _key(meter: MetricMeter, name: str) -> tuple[type, str, str, str, str]:
    info = activity.info()
    return (type(meter), name, info.namespace, info.task_queue, info.activity_type)


def _counter(meter: MetricMeter, name: str, description: str, unit: str = "1") -> MetricCounter:
    key = _key(meter, name)
    if key not in _instruments:
        _instruments[key] = meter.create_counter(name, description, unit)
    instrument: MetricCounter = _instruments[key]
    return instrument


def _histogram(meter: MetricMeter, name: str, description: str, unit: str = "1") -> MetricHistogram:
    key = _key(meter, name)
    if key not in _instruments:
        _instruments[key] = meter.create_histogram(name, description, unit)
    instrument: MetricHistogram = _instruments[key]
    return instrument


def record_event(type_: EventType, payload: dict[str, Any]) -> None:
    """Count what an event says. Outside an activity (tools, tests of the store) there is no meter: skip."""
    try:
        meter = activity.metric_meter()
    except RuntimeError:
        return
    if type_ is EventType.PREFIX_VIOLATION:
        _counter(meter, "ctxengine_prefix_hash_violations", "Second distinct prefix hashes within one epoch").add(1)
    elif type_ is EventType.EPOCH_ROTATED:
        _counter(meter, "ctxengine_epochs_opened", "Prefix epochs opened (sessions plus rotations)").add(1)
    elif type_ is EventType.SESSION_OPENED:
        _counter(meter, "ctxengine_sessions_opened", "Sessions opened").add(1)
        _counter(meter, "ctxengine_epochs_opened", "Prefix epochs opened (sessions plus rotations)").add(1)
    elif type_ is EventType.COMPACTION_COMPLETED:
        escalated = payload.get("decision") == "escalate"
        name = "ctxengine_escalations" if escalated else "ctxengine_compactions"
        _counter(meter, name, "Compactions written" if not escalated else "Escalations to a child run").add(1)
        if not escalated:
            _histogram(meter, "ctxengine_summary_depth", "Summary depth of each checkpoint").record(
                int(payload.get("depth", 0))
            )
    elif type_ is EventType.ESTIMATOR_RECONCILED:
        error = int(payload.get("error_tokens", 0))
        _counter(meter, "ctxengine_requests", "Model requests reconciled").add(1)
        _counter(meter, "ctxengine_input_tokens", "Input tokens reported by providers", "tokens").add(
            int(payload.get("actual_tokens", 0))
        )
        _counter(meter, "ctxengine_cached_tokens", "Cached input tokens reported by providers", "tokens").add(
            int(payload.get("cached_tokens", 0))
        )
        _counter(meter, "ctxengine_prefix_tokens_reused", "Prefix tokens of requests after the first", "tokens").add(
            int(payload.get("prefix_tokens_reused", 0))
        )
        _histogram(meter, "ctxengine_estimator_error_tokens", "Estimate minus actual, when not an overrun").record(
            max(error, 0)
        )
        if error < 0:
            _counter(meter, "ctxengine_estimator_overruns", "Requests whose estimate was below actual usage").add(1)
            _histogram(meter, "ctxengine_estimator_overrun_tokens", "Actual minus estimate, overruns").record(-error)
    elif type_ is EventType.YIELD_APPLIED:
        _counter(meter, "ctxengine_yields", "Requests that needed a yield").add(1)
