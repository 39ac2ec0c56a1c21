"""SessionWorkflow: one agent session, durable. Deterministic orchestration only; every effect is an activity.

State lives in one `SessionState` model, set in `@workflow.init` because an Update can arrive before the
run method starts. Turns are serialised by a lock. Long sessions continue-as-new once Temporal suggests it
(or after `continue_as_new_after_turns`), after every handler has finished.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from core.plan import PlanStatus, PlanSummary
    from core.policy import authorize
    from core.working_state import CONTROL_TOOL_NAME
    from ctxengine import names
    from ctxengine.contract import (
        BuildInput,
        BuildResult,
        CloseInput,
        CloseSession,
        EventInput,
        MemoryInput,
        MemoryResult,
        ModelInput,
        ModelResult,
        OpenInput,
        OpenResult,
        RevokeTool,
        RotateEpoch,
        SessionOpen,
        SessionState,
        ToolCallOutcome,
        ToolInput,
        ToolResultSummary,
        TurnInput,
        TurnResult,
        WriteMemory,
    )
    from ctxengine.events import EventType

MAX_MODEL_CALLS_PER_TURN = 8
RECENT_UPDATES = 32  # turn results remembered, by update id, across continue-as-new
RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
)
SA_EPOCH = SearchAttributeKey.for_int(names.SA_EPOCH)
SA_TURNS = SearchAttributeKey.for_int(names.SA_TURNS)
SA_PREFIX = SearchAttributeKey.for_keyword(names.SA_PREFIX_HASH)


class SessionFailed(ApplicationError):
    """Raised to fail the whole session (a prefix over its ceiling at open)."""


@workflow.defn(name=names.WORKFLOW_SESSION)
class SessionWorkflow:
    @workflow.init
    def __init__(self, open_: SessionOpen) -> None:
        carried = open_.carried
        self.open: SessionOpen = open_.model_copy(update={"carried": None, "carried_results": {}})
        self.state = carried or SessionState(session_id=workflow.info().workflow_id, model_route=open_.model_route)
        # Temporal de-duplicates update ids within a run only; recent results cross continue-as-new with us.
        self.results: dict[str, TurnResult] = dict(open_.carried_results)
        self.lock = asyncio.Lock()
        self.ready = carried is not None
        self.closing = False
        self.turns_at_start = self.state.turns

    # ------------------------------------------------------------ run
    @workflow.run
    async def run(self, open_: SessionOpen) -> SessionState:
        """Start input: a SessionOpen (its `carried` is the state a continue-as-new hands to the next run)."""
        if open_.carried is None:
            try:
                opened = await self._open(epoch=1, reason="session_open")
            except ActivityError as exc:
                self.state.status = "failed"
                cause = exc.cause if isinstance(exc.cause, ApplicationError) else None
                raise ApplicationError(
                    f"session failed to open: {cause.message if cause else exc}",
                    *(cause.details if cause else ()),
                    type=cause.type if cause else "SessionOpenFailed",
                    non_retryable=True,
                ) from exc
            self.state.pinned_tools = opened.pinned_tools
            self.state.search_attributes = opened.search_attributes
            self.state.prefix_hashes = {"1": [opened.prefix_sha256]}
            self.state.status = "open"
        self.ready = True
        self._publish()
        await workflow.wait_condition(lambda: self.state.status == "closed" or self._continue_as_new_due())
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self.state.status == "closed":
            return self.state
        workflow.continue_as_new(
            self.open.model_copy(update={"carried": self.state, "carried_results": self.results})
        )

    def _continue_as_new_due(self) -> bool:
        if self.lock.locked():
            return False
        limit = self.open.continue_as_new_after_turns
        if limit is not None and self.state.turns - self.turns_at_start >= limit:
            return True
        return workflow.info().is_continue_as_new_suggested()

    # ------------------------------------------------------------ query
    @workflow.query(name=names.QUERY_STATE)
    def state_query(self) -> SessionState:
        return self.state

    # ------------------------------------------------------------ submit_turn
    @workflow.update(name=names.UPDATE_SUBMIT_TURN)
    async def submit_turn(self, turn: TurnInput) -> TurnResult:
        update_id = workflow.current_update_info().id  # type: ignore[union-attr]
        if update_id in self.results:
            return self.results[update_id]
        await workflow.wait_condition(lambda: self.ready)
        async with self.lock:
            if self.state.status != "open":
                raise ApplicationError(f"session is {self.state.status}", type="SessionNotOpen")
            self.state.turns += 1
            result = await self._turn(self.state.turns, turn.text, update_id)
            self._remember(update_id, result)
            self._publish()
            return result

    @submit_turn.validator
    def _validate_turn(self, turn: TurnInput) -> None:
        self._validate_open()
        if not turn.text.strip():
            raise ValueError("submit_turn: text must not be blank")

    async def _turn(self, turn: int, text: str, update_id: str) -> TurnResult:
        t = self.open.timeouts
        epoch = self.state.epoch
        outcomes: list[ToolCallOutcome] = []
        user_item_id: str | None = None
        plan: PlanSummary | None = None
        reply = ""
        calls = 0
        for call_index in range(MAX_MODEL_CALLS_PER_TURN):
            built: BuildResult = await workflow.execute_activity(
                names.ACTIVITY_BUILD,
                BuildInput(
                    session_id=self.state.session_id,
                    turn=turn,
                    call_index=call_index,
                    epoch=epoch,
                    now_iso=workflow.now().isoformat(timespec="seconds"),
                    user_text=text if call_index == 0 else None,
                    update_id=update_id if call_index == 0 else None,
                    user_item_id=user_item_id,
                ),
                result_type=BuildResult,
                start_to_close_timeout=timedelta(seconds=t.build_seconds),
                retry_policy=RETRY,
                summary=f"build turn {turn}.{call_index}",
            )
            plan = built.plan
            user_item_id = built.user_item_id
            self._track_prefix(plan)
            if plan.status is PlanStatus.NEEDS_COMPACTION:
                raise ApplicationError(
                    f"turn {turn}: the context needs compaction ({plan.deficit_tokens:,} tokens over the "
                    f"{plan.input_limit:,}-token input limit after recall and tool-result yields); "
                    "the request was not sent",
                    {"deficit_tokens": plan.deficit_tokens},
                    type="ContextNeedsCompaction",
                )
            model: ModelResult = await workflow.execute_activity(
                names.ACTIVITY_MODEL,
                ModelInput(
                    session_id=self.state.session_id,
                    turn=turn,
                    call_index=call_index,
                    epoch=epoch,
                    request_sha256=plan.request_sha256,
                ),
                result_type=ModelResult,
                start_to_close_timeout=timedelta(seconds=t.model_seconds),
                heartbeat_timeout=timedelta(seconds=t.model_heartbeat_seconds),
                retry_policy=RETRY,
                summary=f"model turn {turn}.{call_index}: {plan.estimated_tokens:,} tokens, "
                f"{len(plan.yields)} yield(s)",
            )
            calls += 1
            self._count_usage(plan, model)
            reply = model.text or reply
            if not model.tool_calls:
                break
            for call in model.tool_calls:
                decision = authorize(
                    call.name,
                    pinned=self.state.pinned_tools,
                    granted=self._granted(),
                    revoked=self.state.revoked_tools,
                )
                if not decision.allowed:
                    self.state.metrics.tool_denials += 1
                done: ToolResultSummary = await workflow.execute_activity(
                    names.ACTIVITY_TOOL,
                    ToolInput(
                        session_id=self.state.session_id,
                        turn=turn,
                        epoch=epoch,
                        call=call,
                        allowed=decision.allowed,
                        denial=None if decision.allowed else decision.reason,
                    ),
                    result_type=ToolResultSummary,
                    start_to_close_timeout=timedelta(seconds=t.tool_seconds),
                    retry_policy=RETRY,
                    summary=f"tool {call.name} turn {turn}" + ("" if decision.allowed else " (denied)"),
                )
                if done.working_state is not None:
                    self.state.working_state = done.working_state
                outcomes.append(
                    ToolCallOutcome(
                        name=call.name,
                        call_id=call.call_id,
                        allowed=decision.allowed,
                        is_error=done.is_error,
                        trust=done.trust,
                        summary=done.summary,
                    )
                )
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

    def _granted(self) -> list[str]:
        grants = self.open.grants
        base = self.state.pinned_tools if grants is None else [*grants, CONTROL_TOOL_NAME]
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
        if m.requests > 1:  # the first request of a session writes the cache; later ones reuse the prefix
            m.prefix_tokens_reused += min(plan.prefix_tokens, model.input_tokens)

    def _remember(self, update_id: str, result: TurnResult) -> None:
        self.results[update_id] = result
        while len(self.results) > RECENT_UPDATES:
            del self.results[next(iter(self.results))]

    # ------------------------------------------------------------ other updates
    @workflow.update(name=names.UPDATE_REVOKE_TOOL)
    async def revoke_tool(self, req: RevokeTool) -> SessionState:
        await workflow.wait_condition(lambda: self.ready)
        self.state.revoked_tools[req.name] = req.reason
        self._publish()
        return self.state

    @revoke_tool.validator
    def _validate_revoke(self, req: RevokeTool) -> None:
        self._validate_open()
        if self.ready and req.name not in self.state.pinned_tools:
            raise ValueError(
                f"revoke_tool: {req.name!r} is not in this session's tool set ({', '.join(self.state.pinned_tools)})"
            )
        if req.name == CONTROL_TOOL_NAME:
            raise ValueError(f"revoke_tool: {CONTROL_TOOL_NAME} is the working-state control tool and stays granted")

    @workflow.update(name=names.UPDATE_ROTATE_EPOCH)
    async def rotate_epoch(self, req: RotateEpoch) -> SessionState:
        await workflow.wait_condition(lambda: self.ready)
        async with self.lock:
            old = self.state.epoch
            if req.model_route is not None:
                self.open = self.open.model_copy(update={"model_route": req.model_route})
                self.state.model_route = req.model_route
            for name in req.revoke_tools:
                self.state.revoked_tools[name] = f"forced revocation ({req.reason})"
            new = old + 1
            opened = await self._open(
                epoch=new,
                reason=req.reason,
                revoked=list(self.state.revoked_tools) if req.revoke_tools else [],
            )
            self.state.epoch = new
            self.state.prefix_hashes[str(new)] = [opened.prefix_sha256]
            self.state.metrics.epochs += 1
            await workflow.execute_activity(
                names.ACTIVITY_EVENT,
                EventInput(
                    session_id=self.state.session_id,
                    event_key=f"epoch:{new}",
                    type=EventType.EPOCH_ROTATED.value,
                    turn=self.state.turns,
                    epoch=new,
                    payload={
                        "from_epoch": old,
                        "to_epoch": new,
                        "reason": req.reason,
                        "prefix_sha256": opened.prefix_sha256,
                    },
                ),
                start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                retry_policy=RETRY,
                summary=f"epoch {old} -> {new}: {req.reason}",
            )
            self._publish()
            return self.state

    @rotate_epoch.validator
    def _validate_rotate(self, req: RotateEpoch) -> None:
        self._validate_open()
        if req.reason == "model_route_changed" and req.model_route is None:
            raise ValueError("rotate_epoch: reason model_route_changed needs model_route")
        if req.reason == "forced_revocation" and not req.revoke_tools:
            raise ValueError("rotate_epoch: reason forced_revocation needs revoke_tools")
        unknown = [n for n in req.revoke_tools if self.ready and n not in self.state.pinned_tools]
        if unknown:
            raise ValueError(f"rotate_epoch: not in this session's tool set: {', '.join(unknown)}")

    @workflow.update(name=names.UPDATE_WRITE_MEMORY)
    async def write_memory(self, req: WriteMemory) -> MemoryResult:
        await workflow.wait_condition(lambda: self.ready)
        update_id = workflow.current_update_info().id  # type: ignore[union-attr]
        result: MemoryResult = await workflow.execute_activity(
            names.ACTIVITY_WRITE_MEMORY,
            MemoryInput(
                session_id=self.state.session_id,
                scope=self.open.memory_scope,
                write=req,
                update_id=update_id,
                turn=self.state.turns,
                epoch=self.state.epoch,
            ),
            result_type=MemoryResult,
            start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
            retry_policy=RETRY,
            summary="write memory" + (f" correcting {req.corrects}" if req.corrects else ""),
        )
        return result

    @write_memory.validator
    def _validate_memory(self, req: WriteMemory) -> None:
        self._validate_open()
        if not req.text.strip():
            raise ValueError("write_memory: text must not be blank")

    @workflow.update(name=names.UPDATE_CLOSE_SESSION)
    async def close_session(self, req: CloseSession) -> SessionState:
        await workflow.wait_condition(lambda: self.ready)
        self.closing = True
        async with self.lock:
            await workflow.execute_activity(
                names.ACTIVITY_CLOSE,
                CloseInput(
                    session_id=self.state.session_id,
                    reason=req.reason,
                    turn=self.state.turns,
                    epoch=self.state.epoch,
                ),
                start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                retry_policy=RETRY,
                summary="close session",
            )
            self.state.status = "closed"
            self._publish()
            return self.state

    @close_session.validator
    def _validate_close(self, req: CloseSession) -> None:
        if self.closing or self.state.status == "closed":
            raise ValueError("close_session: the session is already closed")
        if self.state.status == "failed":
            raise ValueError("close_session: the session failed to open")

    def _validate_open(self) -> None:
        if self.closing or self.state.status == "closed":
            raise ValueError("the session is closed; start a new session")
        if self.state.status == "failed":
            raise ValueError("the session failed to open")

    # ------------------------------------------------------------ helpers
    async def _open(self, *, epoch: int, reason: str, revoked: list[str] | None = None) -> OpenResult:
        result: OpenResult = await workflow.execute_activity(
            names.ACTIVITY_OPEN,
            OpenInput(
                session_id=self.state.session_id,
                open=self.open,
                epoch=epoch,
                reason=reason,
                revoked=revoked or [],
            ),
            result_type=OpenResult,
            start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
            retry_policy=RETRY,
            summary=f"open epoch {epoch} ({reason})",
        )
        return result

    def _publish(self) -> None:
        """Live state for the Temporal UI: current details (markdown) and, when registered, search attributes."""
        s = self.state
        hashes = s.prefix_hashes.get(str(s.epoch), [])
        lines = [
            f"**ctxengine session** `{s.session_id}` — {s.status}",
            f"- epoch **{s.epoch}**, turns **{s.turns}**, prefix `{hashes[-1][:16] if hashes else '-'}`"
            f" ({len(hashes)} distinct in epoch)",
            f"- tools pinned: {len(s.pinned_tools)}; revoked: {', '.join(s.revoked_tools) or 'none'}",
        ]
        if s.last_plan is not None:
            p = s.last_plan
            lines.append(
                f"- last plan: {p.estimated_tokens:,} / {p.input_limit:,} tokens, {p.status.value}, "
                f"{len(p.yields)} yield(s)"
            )
            lines.append("")
            lines.append("| class | tokens |")
            lines.append("|---|---:|")
            lines += [f"| {k} | {v:,} |" for k, v in p.tokens_by_class.items()]
        workflow.set_current_details("\n".join(lines))
        if s.search_attributes and hashes:
            workflow.upsert_search_attributes(
                [
                    SA_EPOCH.value_set(s.epoch),
                    SA_TURNS.value_set(s.turns),
                    SA_PREFIX.value_set(hashes[-1]),
                ]
            )
