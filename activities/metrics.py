"""ctxengine's metrics, through the Temporal SDK's meter: one Prometheus endpoint on the worker serves the
SDK's own metrics and these (worker.py configures it). Recorded where events are first stored, so an
activity retry never counts twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from temporalio import activity
from temporalio.common import MetricCounter, MetricHistogram, MetricMeter

from contract.events import EventType

Instrument = TypeVar("Instrument")

# Instruments by name and by the attributes the SDK gives an activity's meter (`activity.metric_meter()`: a new meter
# for each activity run, with its namespace, task queue and activity type): made from the first run's meter of a
# label set and used by every later run with those labels into the same runtime. Bounded by names x task queues x
# activity types x runtimes.
_instruments: dict[tuple[int, str, str, str, str], Any] = {}


def _runtime_of(meter: MetricMeter) -> int:
    """What `meter` records into: the runtime's meter behind the per-run one (the SDK's `_MetricMeter` keeps it as
    `_core_meter`; kept alive by the instruments made from it, so its id stays its own), else the meter itself (the
    no-op meter of a test without a runtime). Two runtimes in one process never share an instrument."""
    return id(getattr(meter, "_core_meter", meter))


def _made(meter: MetricMeter, name: str, make: Callable[[], Instrument]) -> Instrument:
    """The instrument `name` of this activity run's label set and runtime: `make()` the first time, kept after."""
    info = activity.info()
    key = (_runtime_of(meter), name, info.namespace, info.task_queue, info.activity_type)
    if key not in _instruments:
        _instruments[key] = make()
    instrument: Instrument = _instruments[key]
    return instrument


def _counter(meter: MetricMeter, name: str, description: str, unit: str = "1") -> MetricCounter:
    return _made(meter, name, lambda: meter.create_counter(name, description, unit))


def _histogram(meter: MetricMeter, name: str, description: str, unit: str = "1") -> MetricHistogram:
    return _made(meter, name, lambda: meter.create_histogram(name, description, unit))


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
        _counter(
            meter, "ctxengine_prefix_tokens_reused", "Prefix tokens the provider read from its cache", "tokens"
        ).add(int(payload.get("prefix_tokens_reused", 0)))
        _histogram(meter, "ctxengine_estimator_error_tokens", "Estimate minus actual, when not an overrun").record(
            max(error, 0)
        )
        if error < 0:
            _counter(meter, "ctxengine_estimator_overruns", "Requests whose estimate was below actual usage").add(1)
            _histogram(meter, "ctxengine_estimator_overrun_tokens", "Actual minus estimate, overruns").record(-error)
    elif type_ is EventType.ESTIMATOR_REFUSED:
        _counter(meter, "ctxengine_requests_refused", "Requests a provider refused as too long for its model").add(1)
    elif type_ is EventType.YIELD_APPLIED:
        _counter(meter, "ctxengine_yields", "Requests that needed a yield").add(1)
