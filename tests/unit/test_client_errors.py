"""The client maps Temporal failures to typed errors by the ApplicationError type string."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ActivityError, ApplicationError, RetryState, WorkflowAlreadyStartedError

from ctxengine.client import (
    CtxEngineError,
    PrefixOverflow,
    RouteDoesNotFit,
    SessionIdTaken,
    SessionNotOpen,
    ToolNotPinned,
    TurnTooLarge,
    UnknownSession,
    UpdateIdReused,
    ValidationFailed,
    WorkingStateRejected,
    map_failure,
)


@pytest.mark.parametrize(
    ("type_", "expected"),
    [
        ("TurnTooLarge", TurnTooLarge),
        ("SessionNotOpen", SessionNotOpen),
        ("PrefixOverflowError", PrefixOverflow),
        ("RouteDoesNotFit", RouteDoesNotFit),
        ("RotationRefused", RouteDoesNotFit),
        ("SessionIdTaken", SessionIdTaken),
        ("ToolNotPinned", ToolNotPinned),
        ("WorkingStateCapError", WorkingStateRejected),
        ("ValueError", ValidationFailed),
        ("ValidationError", ValidationFailed),
        ("UpdateIdReused", UpdateIdReused),
    ],
)
def test_known_types(type_: str, expected: type[CtxEngineError]) -> None:
    """Each known type maps to its exception, keeping message, type and details."""
    err = map_failure(ApplicationError("boom", {"class": "tools"}, type=type_))
    assert (
        isinstance(err, expected) and str(err) == "boom" and err.type == type_ and err.details == ({"class": "tools"},)
    )


def test_cause_chain_is_searched() -> None:
    """A typed failure wrapped in an activity failure is found in the cause chain."""
    inner = ApplicationError("over cap", type="PrefixOverflowError")
    outer = ActivityError(
        "activity failed",
        scheduled_event_id=1,
        started_event_id=2,
        identity="w",
        activity_type="session.open",
        activity_id="1",
        retry_state=RetryState.NON_RETRYABLE_FAILURE,
    )
    outer.__cause__ = inner
    assert isinstance(map_failure(outer), PrefixOverflow)


def test_unknown_type_and_used_id() -> None:
    """An unknown type stays a CtxEngineError with its type; a used workflow id is SessionIdTaken."""
    err = map_failure(ApplicationError("odd", type="Surprise"))
    assert type(err) is CtxEngineError and err.type == "Surprise"
    assert isinstance(map_failure(WorkflowAlreadyStartedError("s-1", "SessionWorkflow")), SessionIdTaken)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("workflow execution already completed", SessionNotOpen),
        # The run ended while the update waited to be accepted (a close beside it, a start input refused in
        # SessionWorkflow.__new__): before, this was UnknownSession, as for an id no session ever had.
        ("workflow update was aborted by closing workflow", SessionNotOpen),
        ("workflow not found for ID: session-x", UnknownSession),
    ],
)
def test_not_found_is_an_ended_session_or_an_unknown_one(message: str, expected: type[CtxEngineError]) -> None:
    """Temporal's NOT_FOUND answers for an update: an ended session is SessionNotOpen, a missing one UnknownSession."""
    from temporalio.service import RPCError, RPCStatusCode

    err = map_failure(RPCError(message, RPCStatusCode.NOT_FOUND, b""))
    assert type(err) is expected and message in str(err)
