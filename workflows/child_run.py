"""ChildRunWorkflow: the rest of a turn, run on a fresh body after summary depth 2 (ADR-0020 decision 12).

Same pinned prefix (so the same prefix hash), the working state, and pointers to the parent's checkpoints
instead of a third summary. It cannot escalate again: a child body that needs compaction past depth 2 fails
the turn with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from contract import names, retries
    from contract.payloads import ChildRunInput, ChildRunResult, GrantTool, RevokeTool, SessionMetrics

from workflows.turn import TurnRunner

PATCH_CHILD_COMPACTION_SCOPE = "child-compaction-scope"
# The key of the detail a failed child run adds to its failure: its metrics, requests it sent included, which the
# session takes although it does not adopt the rest of a failed run's state (`metrics_of_failed`).
CHILD_METRICS = "child_run_metrics"


@workflow.defn(name=names.WORKFLOW_CHILD_RUN)
class ChildRunWorkflow:
    @workflow.init
    def __init__(self, inp: ChildRunInput) -> None:
        self.state = inp.state.model_copy(deep=True)
        self.grants = inp.open.grants

    @workflow.run
    async def run(self, inp: ChildRunInput) -> ChildRunResult:
        # Its compactions are numbered in its own scope (the escalation's number, unique in the session): if it
        # fails, the session does not adopt its state, and its next compaction must not reuse a number used here.
        scope = f"-e{inp.state.metrics.escalations}" if workflow.patched(PATCH_CHILD_COMPACTION_SCOPE) else ""
        runner = TurnRunner(inp.open, self.state, escalate=None, compaction_scope=scope)
        try:
            result = await runner.run(
                inp.turn,
                text=inp.text,
                update_id=inp.update_id,
                user_item_id=inp.user_item_id,
                first_call=inp.call_index,
            )
        except (ActivityError, ChildWorkflowError, ApplicationError) as exc:
            raise _failed_with_metrics(exc, self.state.metrics) from exc
        return ChildRunResult(result=result, state=self.state)

    @workflow.signal(name=names.UPDATE_REVOKE_TOOL)
    def revoke_tool(self, req: RevokeTool) -> None:
        """The session forwards revocations made while this run is in flight: authorisation is at call time."""
        self.state.revoked_tools[req.name] = req.reason

    @workflow.signal(name=names.UPDATE_GRANT_TOOL)
    def grant_tool(self, req: GrantTool) -> None:
        """The session forwards grants too (it checked the tool is pinned): authorisation is at call time."""
        self.state.revoked_tools.pop(req.name, None)
        if self.grants is not None and req.name not in self.grants and req.name not in self.state.granted_tools:
            self.state.granted_tools.append(req.name)


def _failed_with_metrics(exc: BaseException, metrics: SessionMetrics) -> ApplicationError:
    """The run's failure as its first typed cause (type, message, details), non-retryable, with the run's metrics
    as a last detail: the model calls it made were sent and billed, whatever became of the turn."""
    typed = first_typed_cause(exc)
    return ApplicationError(
        typed.message if typed else str(exc),
        *(caller_details(typed.details) if typed else ()),
        {CHILD_METRICS: metrics.model_dump(mode="json")},
        type=(typed.type if typed else None) or retries.TURN_FAILED,
        non_retryable=True,
    )


def metrics_of_failed(exc: ChildWorkflowError) -> SessionMetrics | None:
    """The metrics a failed child run reported (None from a run that predates them)."""
    cause = exc.cause
    if isinstance(cause, ApplicationError):
        for detail in cause.details:
            if isinstance(detail, dict) and CHILD_METRICS in detail:
                return SessionMetrics.model_validate(detail[CHILD_METRICS])
    return None


def caller_details(details: Sequence[Any]) -> tuple[Any, ...]:
    """A failure's details as a caller sees them: without the metrics a failed child run adds."""
    return tuple(d for d in details if not (isinstance(d, dict) and CHILD_METRICS in d))


def first_typed_cause(exc: BaseException) -> ApplicationError | None:
    """The first ApplicationError in `exc`'s cause chain, `exc` included (a chain that loops ends the search)."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and not isinstance(cause, ApplicationError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__
    return cause if isinstance(cause, ApplicationError) else None
