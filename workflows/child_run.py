"""ChildRunWorkflow: the rest of a turn, run on a fresh body after summary depth 2 (ADR-0020 decision 12).

Same pinned prefix (so the same prefix hash), the working state, and pointers to the parent's checkpoints
instead of a third summary. It cannot escalate again: a child body that needs compaction past depth 2 fails
the turn with a clear error.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from ctxengine import names
    from ctxengine.contract import ChildRunInput, ChildRunResult

from workflows.turn import TurnRunner


@workflow.defn(name=names.WORKFLOW_CHILD_RUN)
class ChildRunWorkflow:
    @workflow.run
    async def run(self, inp: ChildRunInput) -> ChildRunResult:
        state = inp.state.model_copy(deep=True)
        runner = TurnRunner(inp.open, state, escalate=None)
        result = await runner.run(inp.turn, user_item_id=inp.user_item_id, first_call=inp.call_index)
        return ChildRunResult(result=result, state=state)
