"""Event types ctxengine persists (Postgres `events`) and logs. Names follow `context.epoch.rotated`."""

from enum import StrEnum


class EventType(StrEnum):
    EPOCH_ROTATED = "context.epoch.rotated"
    PREFIX_VIOLATION = "context.prefix.violation"
    COMPACTION_STARTED = "context.compaction.started"
    COMPACTION_COMPLETED = "context.compaction.completed"
    YIELD_APPLIED = "context.yield.applied"
    SESSION_OPEN_FAILED = "context.session.open_failed"
    ESTIMATOR_RECONCILED = "context.estimator.reconciled"
    ESTIMATOR_REFUSED = "context.estimator.refused"
    WORKING_STATE_REJECTED = "context.working_state.rejected"
    SESSION_OPENED = "context.session.opened"
    TOOL_TRUST_REFUSED = "context.tool.trust_refused"
