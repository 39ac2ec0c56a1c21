"""Test-only worker interceptors that hold a child run's start open, to make the authorisation races
deterministic: the session's `start_child_workflow` returns only once the revocation (or re-grant) reached the
session, and the child run waits (up to a bound) for it to reach it too before it takes its first step."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.worker import (
    ExecuteWorkflowInput,
    Interceptor,
    StartChildWorkflowInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

TOOL = "web.fetch"
CHILD_WAITS = timedelta(seconds=5)


def _revoked() -> bool:
    return TOOL in workflow.instance().state.revoked_tools


def _granted() -> bool:
    return not _revoked()


def _holding(until: Callable[[], bool], child_waits: bool = True) -> type[Interceptor]:
    """An interceptor that holds a child run's start open until `until()` holds in the session, then (if
    `child_waits`) makes the child wait (up to a bound) until it holds there too: without forwarding, the child
    goes on unchanged."""

    class Outbound(WorkflowOutboundInterceptor):
        async def start_child_workflow(self, input: StartChildWorkflowInput) -> workflow.ChildWorkflowHandle[Any, Any]:
            handle = await super().start_child_workflow(input)
            if input.workflow == "ChildRunWorkflow":
                await workflow.wait_condition(until, timeout=timedelta(seconds=60))
            return handle

    class Inbound(WorkflowInboundInterceptor):
        def init(self, outbound: WorkflowOutboundInterceptor) -> None:
            super().init(Outbound(outbound))

        async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
            if child_waits and workflow.info().workflow_type == "ChildRunWorkflow":
                try:  # without the fix the change never comes: go on after the bound
                    await workflow.wait_condition(until, timeout=CHILD_WAITS)
                except TimeoutError:
                    pass
            return await super().execute_workflow(input)

    class Hold(Interceptor):
        def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
            return Inbound

    return Hold


HoldChildStart = _holding(_revoked)
"""Holds the start until the tool is revoked in the session (the revocation race)."""
HoldChildStartForGrant = _holding(_granted)
"""Holds the start until the tool is granted again in the session (the re-grant race)."""
HoldChildStartPastItsEnd = _holding(_granted, child_waits=False)
"""Holds the start until the tool is granted again in the session; the child does not wait, so a test can grant
once the child has finished (the forwarded grant finds no running child)."""
