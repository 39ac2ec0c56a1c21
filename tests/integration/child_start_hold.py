"""A test-only worker interceptor that holds a child run's start open, to make the revocation race
deterministic: the session's `start_child_workflow` returns only once the revocation reached the session,
and the child run waits (up to a bound) for the revocation to reach it before it takes its first step."""

from __future__ import annotations

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


class HoldChildStart(Interceptor):
    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _Inbound


class _Inbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        if workflow.info().workflow_type == "ChildRunWorkflow":
            try:  # without the fix the revocation never comes: go on after the bound, and the call is allowed
                await workflow.wait_condition(_revoked, timeout=CHILD_WAITS)
            except TimeoutError:
                pass
        return await super().execute_workflow(input)


class _Outbound(WorkflowOutboundInterceptor):
    async def start_child_workflow(self, input: StartChildWorkflowInput) -> workflow.ChildWorkflowHandle[Any, Any]:
        handle = await super().start_child_workflow(input)
        if input.workflow == "ChildRunWorkflow":
            await workflow.wait_condition(_revoked, timeout=timedelta(seconds=60))
        return handle
