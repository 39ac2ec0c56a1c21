"""One turn's loop, shared by SessionWorkflow and ChildRunWorkflow: build, (compact,) call the model,
authorise and run tools, until the model answers. Deterministic; every effect is an activity or a child."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contract.activity_interfaces import SessionActivityCalls
    from contract.payloads import (
        BuildInput,
        BuildResult,
        CompactionInput,
        CompactionOutcome,
        ModelInput,
        ModelResult,
        SessionOpen,
        SessionState,
        ToolCallOutcome,
        ToolCallRequest,
        ToolInput,
        ToolResultSummary,
        TurnResult,
    )
    from contract.retries import CONTEXT_LENGTH_EXCEEDED
    from core.compaction import CompactionDecision
    from core.plan import PlanStatus, PlanSummary
    from core.policy import authorize
    from core.working_state import CONTROL_TOOL_NAME

from workflows.compaction import CompactionWorkflow
from workflows.retry_policies import MODEL_RETRY, RETRY

MAX_MODEL_CALLS_PER_TURN = 8
MAX_COMPACTIONS_PER_REQUEST = 2
# A request the provider refused as too long is built again after the model call learned the provider's count (its
# estimate now covers it: the build yields or compacts), this many times; refused once more, it fails the turn.
MAX_REBUILDS_AFTER_REFUSAL = 1
PATCH_REBUILD_REFUSED = "rebuild-refused-request"


# (turn, user_item_id, call_index) -> the result of the rest of the turn, run in a child with a fresh body.
Escalate = Callable[[int, str, int], Awaitable[TurnResult]]


class TurnRunner:
    def __init__(
        self, open_: SessionOpen, state: SessionState, escalate: Escalate | None, compaction_scope: str = ""
    ) -> None:
        """`compaction_scope`: what this runner's compactions add to their number in their checkpoint and workflow
        ids. A child run's own (`ChildRunWorkflow`), so that a child that fails, whose state the session never
        adopts, leaves no id the session's next compaction would take again (and find its stored plan)."""
        self.open = open_
        self.state = state
        self.escalate = escalate
        self.compaction_scope = compaction_scope

    async def run(
        self,
        turn: int,
        *,
        text: str | None = None,
        update_id: str | None = None,
        user_item_id: str | None = None,
        first_call: int = 0,
    ) -> TurnResult:
        t = self.open.timeouts
        epoch = self.state.epoch
        sid = self.state.session_id
        outcomes: list[ToolCallOutcome] = []
        plan: PlanSummary | None = None
        reply = ""
        calls = 0
        call_index = first_call
        compactions = refusals = 0
        tool_calls_run = 0
        while call_index < MAX_MODEL_CALLS_PER_TURN:
            first = call_index == 0 and user_item_id is None
            built: BuildResult = await workflow.execute_activity_method(
                SessionActivityCalls.build_context,
                BuildInput(
                    session_id=sid,
                    turn=turn,
                    call_index=call_index,
                    epoch=epoch,
                    now_iso=workflow.now().isoformat(timespec="seconds"),
                    user_text=text if first else None,
                    update_id=update_id if first else None,
                    user_item_id=user_item_id,
                ),
                start_to_close_timeout=timedelta(seconds=t.build_seconds),
                heartbeat_timeout=timedelta(seconds=t.heartbeat_seconds),
                retry_policy=RETRY,
                summary=f"build turn {turn}.{call_index}",
            )
            plan = built.plan
            user_item_id = built.user_item_id
            self._track_prefix(plan)
            if plan.status is PlanStatus.NEEDS_COMPACTION:
                if compactions >= MAX_COMPACTIONS_PER_REQUEST:
                    raise ApplicationError(
                        f"turn {turn}: still {plan.deficit_tokens:,} tokens over the {plan.input_limit:,}-token "
                        "input limit after compaction; the request was not sent",
                        {"deficit_tokens": plan.deficit_tokens},
                        type="ContextNeedsCompaction",
                    )
                compactions += 1
                outcome = await self._compact(turn, built.turn_start_seq)
                if outcome.decision == CompactionDecision.ESCALATE.value:
                    if self.escalate is None or user_item_id is None:
                        raise ApplicationError(
                            f"turn {turn}: a child run's body needs compaction past depth 2",
                            type="ContextNeedsCompaction",
                        )
                    rest = await self.escalate(turn, user_item_id, call_index)
                    # The turn's result is the whole turn: the calls made here before the child run, then its own.
                    return rest.model_copy(
                        update={"tool_calls": [*outcomes, *rest.tool_calls], "model_calls": calls + rest.model_calls}
                    )
                if outcome.decision == CompactionDecision.NOTHING_TO_COMPACT.value:
                    raise ApplicationError(
                        f"turn {turn}: {plan.deficit_tokens:,} tokens over the input limit and nothing left to "
                        "compact outside the active turn",
                        {"deficit_tokens": plan.deficit_tokens},
                        type="ContextNeedsCompaction",
                    )
                continue  # build never compacts: the compactor wrote a checkpoint, so build again
            try:
                model = await self._call_model(turn, call_index, epoch, plan, tool_calls_run)
            except ActivityError as exc:
                if not (
                    _refused_as_too_long(exc)
                    and refusals < MAX_REBUILDS_AFTER_REFUSAL
                    and workflow.patched(PATCH_REBUILD_REFUSED)
                ):
                    raise
                refusals += 1
                continue  # the model call learned the provider's count: build the request again
            calls += 1
            self._count_usage(plan, model)
            reply = model.text or reply
            if not model.tool_calls and not model.refused_tool_calls:
                break
            for call in model.tool_calls:
                outcomes.append(await self._tool(turn, epoch, call))
            tool_calls_run += len(model.tool_calls)
            call_index += 1
            compactions = refusals = 0
        assert plan is not None
        self.state.last_plan = plan
        return TurnResult(
            turn=turn,
            epoch=epoch,
            text=reply,
            prefix_sha256=plan.prefix_sha256,
            plan=plan,
            tool_calls=outcomes,
            model_calls=calls,
        )

    async def _call_model(
        self, turn: int, call_index: int, epoch: int, plan: PlanSummary, tool_calls_run: int
    ) -> ModelResult:
        t = self.open.timeouts
        sid = self.state.session_id
        return await workflow.execute_activity_method(
            SessionActivityCalls.call_model,
            ModelInput(
                session_id=sid,
                turn=turn,
                call_index=call_index,
                epoch=epoch,
                request_sha256=plan.request_sha256,
                **self._tool_call_cap(tool_calls_run),
            ),
            start_to_close_timeout=timedelta(seconds=t.model_seconds),
            heartbeat_timeout=timedelta(seconds=t.model_heartbeat_seconds),
            retry_policy=MODEL_RETRY,
            summary=f"model turn {turn}.{call_index}: {plan.estimated_tokens:,} tokens, {len(plan.yields)} yield(s)",
        )

    async def _tool(self, turn: int, epoch: int, call: ToolCallRequest) -> ToolCallOutcome:
        decision = authorize(
            call.name, pinned=self.state.pinned_tools, granted=self._granted(), revoked=self.state.revoked_tools
        )
        if not decision.allowed:
            self.state.metrics.tool_denials += 1
        done: ToolResultSummary = await workflow.execute_activity_method(
            SessionActivityCalls.execute_tool,
            ToolInput(
                session_id=self.state.session_id,
                turn=turn,
                epoch=epoch,
                call=call,
                allowed=decision.allowed,
                denial=None if decision.allowed else decision.reason,
            ),
            start_to_close_timeout=timedelta(seconds=self.open.timeouts.tool_seconds),
            heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
            retry_policy=RETRY,
            summary=f"tool {call.name} turn {turn}" + ("" if decision.allowed else " (denied)"),
        )
        if done.working_state is not None:
            self.state.working_state = done.working_state
        return ToolCallOutcome(
            name=call.name,
            call_id=call.call_id,
            allowed=decision.allowed,
            is_error=done.is_error,
            trust=done.trust,
            summary=done.summary,
            tainted=done.tainted,
        )

    async def _compact(self, turn: int, keep_from_seq: int) -> CompactionOutcome:
        self.state.compaction_runs += 1  # counted before the child starts: a retry never reuses a number
        number = f"{self.state.compaction_runs}{self.compaction_scope}"
        checkpoint_id = f"cp-{number}"
        outcome: CompactionOutcome = await workflow.execute_child_workflow(
            CompactionWorkflow.run,
            CompactionInput(
                session_id=self.state.session_id,
                epoch=self.state.epoch,
                turn=turn,
                checkpoint_id=checkpoint_id,
                keep_from_seq=keep_from_seq,
                timeouts=self.open.timeouts,
            ),
            id=f"{self.state.session_id}/compaction/{number}",
            static_summary=f"compaction {number} of session {self.state.session_id} (turn {turn})",
            task_timeout=workflow.info().task_timeout,  # the caller's failover choice (docs/reliability.md)
        )
        m = self.state.metrics
        if outcome.decision == CompactionDecision.COMPACT.value:
            m.compactions += 1
            m.max_summary_depth = max(m.max_summary_depth, outcome.depth)
        elif outcome.decision == CompactionDecision.ESCALATE.value:
            m.escalations += 1
        return outcome

    def _tool_call_cap(self, run_so_far: int) -> dict[str, object]:
        """How many tool calls the next reply may make: the per-reply cap, or what the turn has left."""
        per_reply, per_turn = self.open.max_tool_calls_per_reply, self.open.max_tool_calls_per_turn
        left = max(0, per_turn - run_so_far)
        if left < per_reply:
            return {"max_tool_calls": left, "tool_call_cap": f"at most {per_turn} tool calls run per turn"}
        return {"max_tool_calls": per_reply, "tool_call_cap": f"at most {per_reply} tool calls run per reply"}

    def _granted(self) -> list[str]:
        grants = self.open.grants
        base = self.state.pinned_tools if grants is None else [*grants, CONTROL_TOOL_NAME, *self.state.granted_tools]
        return [g for g in base if g not in self.state.revoked_tools]

    def _track_prefix(self, plan: PlanSummary) -> None:
        seen = self.state.prefix_hashes.setdefault(str(plan.epoch), [])
        if plan.prefix_sha256 not in seen:
            seen.append(plan.prefix_sha256)
            if len(seen) > 1:
                self.state.metrics.prefix_hash_violations += 1

    def _count_usage(self, plan: PlanSummary, model: ModelResult) -> None:
        m = self.state.metrics
        m.requests += 1
        m.input_tokens += model.input_tokens
        m.cached_tokens += model.cached_tokens
        m.estimator_error_tokens += model.estimated_tokens - model.input_tokens
        m.estimator_overruns += int(model.overrun)
        # What the provider says it read from its cache, as far as the prefix goes (its cache starts at the
        # request's first byte): measured, never assumed (an epoch's first request, a cache the provider dropped).
        m.prefix_tokens_reused += min(plan.prefix_tokens, model.cached_tokens)


def _refused_as_too_long(exc: ActivityError) -> bool:
    """Whether a model call failed because the provider refused its request as too long for the model."""
    return isinstance(exc.cause, ApplicationError) and exc.cause.type == CONTEXT_LENGTH_EXCEEDED
