"""ChildRunWorkflow: the rest of a turn, run on a fresh body after summary depth 2 (ADR-0020 decision 12).

Same pinned prefix (so the same prefix hash), the working state, and pointers to the parent's checkpoints
instead of a third summary. It cannot escalate again: a child body that needs compaction past depth 2 fails
the turn with a clear error.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contract import names
    from contract.payloads import ChildRunInput, ChildRunResult, GrantTool, RevokeTool

from workflows.turn import TurnRunner

PATCH_CHILD_COMPACTION_SCOPE = "child-compaction-scope"


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
        result = await runner.run(
            inp.turn, text=inp.text, update_id=inp.update_id, user_item_id=inp.user_item_id, first_call=inp.call_index
        )
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
