"""SessionWorkflow: one agent session, durable. Deterministic orchestration only; every effect is an activity.

State lives in one `SessionState` model, set in `@workflow.init` because an Update can arrive before the
run method starts. Turns are serialised by a lock. Long sessions continue-as-new once Temporal suggests it
(or after `continue_as_new_after_turns`), after every handler has finished.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel, ValidationError

    from contract import bounds, names, retries
    from contract.activity_interfaces import CompactionActivityCalls, SessionActivityCalls
    from contract.events import EventType
    from contract.payloads import (
        ChildRunInput,
        ChildRunResult,
        CloseInput,
        CloseSession,
        DeleteMemory,
        DeleteMemoryInput,
        EventInput,
        FormationInput,
        GrantTool,
        MemoryDeleted,
        MemoryInput,
        MemoryResult,
        OpenInput,
        OpenResult,
        RevokeTool,
        RotateEpoch,
        SealTurnInput,
        SessionOpen,
        SessionState,
        TurnFailure,
        TurnInput,
        TurnResult,
        WorkingStateInput,
        WorkingStateResult,
        WriteMemory,
    )
    from core.working_state import CONTROL_TOOL_NAME, WorkingStateUpdate, write_problem

from workflows.child_run import ChildRunWorkflow, caller_details, first_typed_cause, metrics_of_failed
from workflows.retry_policies import RETRY, SEAL_RETRY
from workflows.turn import TurnRunner

SA_TURNS_EVERY = 10
SA_EPOCH = SearchAttributeKey.for_int(names.SA_EPOCH)
SA_TURNS = SearchAttributeKey.for_int(names.SA_TURNS)
SA_PREFIX = SearchAttributeKey.for_keyword(names.SA_PREFIX_HASH)
# Patches (docs/reliability.md): new commands on existing paths, so recorded histories still replay.
PATCH_FAILED_TURN = "failed-turn-sealed"
PATCH_TURN_IN_CHILD = "long-run-turn-in-child"
PATCH_CLOSE_ONCE = "close-once"
PATCH_REFUSE_CARRIED_START = "refuse-carried-start"
PATCH_SEAL_BRIEFLY = "seal-failed-turn-briefly"  # a failed turn is sealed with SEAL_RETRY, not RETRY
PATCH_FINISHED_CHILD = "forward-to-finished-child"  # a change that finds its child run finished fails nothing
PATCH_EARLY_TOOL_NAMES = "early-tool-names-checked"  # names sent before the open are checked once it opens
PATCH_FAILED_CHILD_METRICS = "failed-child-metrics"  # a failed child run's metrics are taken
PATCH_ANSWER_BEFORE_FAILING = "answer-updates-before-failing"  # a run that fails answers the updates it accepted
PATCH_ROTATE_OPEN_ONLY = "rotate-open-session-only"  # a rotation that waited for a close's lock rotates nothing
PATCH_CLOSING_KEEPS_TOOLS = "closing-keeps-tools"  # a grant or revocation beside a close that went first is refused
# The failure type of a signal to a workflow that has closed (or never existed): sdk-core's failure for the
# `SignalExternalWorkflowExecutionFailed` event.
CHILD_GONE = "ExternalWorkflowExecutionNotFound"
# The start input's default when a client sends none: a payload without an encoding (see `_start_input`).
NO_START_INPUT = RawValue(Payload())


_Input = TypeVar("_Input", bound=BaseModel)


def _given(req: _Input | None, update: str, model: type[_Input]) -> _Input:
    """An update's input, or its refusal when none was sent, it was null, or it decoded to something else (a binary
    payload decodes to bytes whatever the handler's type): a typed, non-retryable ValueError from the validator,
    before the update is accepted (the handler calls it too, so no path reads a field of a None or of bytes)."""
    if isinstance(req, model):
        return req
    what = "no input was sent, or it was null" if req is None else f"its input is {type(req).__name__}, not an object"
    raise _refused(f"{update}: {what}; send one {model.__name__} as a JSON object")


def _refused(message: str) -> ApplicationError:
    """A validator's refusal of input that is malformed or does not apply to the session: typed as the contract
    says (`ValueError`) and non-retryable, since the same input gets the same answer. (The one retryable refusal,
    a run about to continue as new, stays a plain `ValueError`.)"""
    return ApplicationError(message, type="ValueError", non_retryable=True)


def _why(exc: Exception) -> str:
    """A refused start input's failure in one line, for the updates such a run refuses: its type and message."""
    if isinstance(exc, ApplicationError):
        return f"{exc.type}: {exc.message}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]


def _update_failure(exc: ActivityError) -> ApplicationError:
    """An activity's typed failure as the update's own, so a caller sees its type and message first-hand."""
    cause = exc.cause if isinstance(exc.cause, ApplicationError) else None
    if cause is None:
        return ApplicationError(str(exc), type="ActivityFailed", non_retryable=True)
    return ApplicationError(cause.message, *cause.details, type=cause.type, non_retryable=True)


# The start input is decoded by the workflow itself (`_start_input`): whatever a client sends (no input, null,
# bytes, an unknown encoding, JSON that is not a SessionOpen) the run fails at once, typed, instead of failing its
# first task over and over, a run that never ends and whose queries never answer (docs/reliability.md).
@workflow.defn(name=names.WORKFLOW_SESSION, failure_exception_types=[ValidationError])
class SessionWorkflow:
    def __new__(cls, *args: Any) -> SessionWorkflow:
        """Several start arguments reach __init__ undecoded and in excess (a TypeError, which fails the task, not
        the run): refused here, where an ApplicationError fails the run."""
        if len(args) > 1:
            raise ApplicationError(
                f"start input: expected one SessionOpen, got {len(args)} arguments",
                type="InvalidSessionOpen",
                non_retryable=True,
            )
        return super().__new__(cls)

    @workflow.init
    def __init__(self, start: RawValue = NO_START_INPUT) -> None:
        open_ = _start_input(start)
        if (
            isinstance(open_, SessionOpen)
            and _carries(open_)
            and workflow.info().continued_run_id is None
            and workflow.patched(PATCH_REFUSE_CARRIED_START)  # a run started so before this check goes on as it did
        ):
            # What a run carries is handed over by continue-as-new only: a start that sends it would skip the open
            # (and its refusal of a used session id) and take up a closed session's state.
            open_ = ApplicationError(
                "start input: carried, carried_results, carried_failures and carried_update_ids are set by the "
                "session itself when it continues as new; a start must leave them out",
                type="InvalidSessionOpen",
                non_retryable=True,
            )
        # A refused start input: the run fails first thing; meanwhile queries answer and updates are refused.
        self.refused: Exception | None = open_ if isinstance(open_, Exception) else None
        if isinstance(open_, Exception):
            open_ = SessionOpen(agent_instructions="(start input refused)")
        carried = open_.carried
        self.continued = carried is not None
        self.open: SessionOpen = open_.model_copy(
            update={"carried": None, "carried_results": {}, "carried_failures": {}, "carried_update_ids": []}
        )
        self.state = carried or SessionState(session_id=workflow.info().workflow_id, model_route=open_.route)
        if self.refused is not None:
            self.state.status = "failed"
        # Temporal de-duplicates update ids within a run only; recent results cross continue-as-new with us.
        self.results: dict[str, TurnResult] = dict(open_.carried_results)
        self.failures: dict[str, TurnFailure] = dict(open_.carried_failures)
        # Each carried answer's size, so what crosses continue-as-new stays under bounds.CARRIED_RESULTS_BYTES.
        self.answer_bytes: dict[str, int] = {
            key: len(answer.model_dump_json()) for key, answer in [*self.results.items(), *self.failures.items()]
        }
        self.updates_this_run = 0  # accepted updates, against Temporal's per-run limit (bounds.UPDATES_*)
        # rotate_epoch, revoke_tool and grant_tool update ids already applied, carried too: a retry in a later run
        # answers with the state instead of applying again (a second epoch, for a rotation).
        self.applied: dict[str, None] = dict.fromkeys(open_.carried_update_ids)
        self.lock = asyncio.Lock()
        self.ready = carried is not None or self.refused is not None
        self.closing = False
        # Why the open failed (or the start input was refused), for the updates the run is asked to take.
        self.open_failure: str | None = _why(self.refused) if self.refused is not None else None
        self.turns_at_start = self.state.turns
        self.published: tuple[int, str, int] | None = None
        self.child: workflow.ChildWorkflowHandle[ChildRunWorkflow, ChildRunResult] | None = None

    # ------------------------------------------------------------ run
    @workflow.run
    async def run(self, start: RawValue = NO_START_INPUT) -> SessionState:
        """Start input: one SessionOpen (its `carried` is the state a continue-as-new hands to the next run)."""
        if self.refused is not None:
            await self._answer_accepted_updates()
            raise self.refused
        if not self.continued:
            try:
                opened = await self._open(epoch=1, reason="session_open")
            except ActivityError as exc:
                self.state.status = "failed"
                cause = exc.cause if isinstance(exc.cause, ApplicationError) else None
                failure = ApplicationError(
                    f"session failed to open: {cause.message if cause else exc}",
                    *(cause.details if cause else ()),
                    type=cause.type if cause else "SessionOpenFailed",
                    non_retryable=True,
                )
                self.open_failure = failure.message
                await self._answer_accepted_updates()
                raise failure from exc
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
            self.open.model_copy(
                update={
                    "carried": self.state,
                    "carried_results": self.results,
                    "carried_failures": self.failures,
                    "carried_update_ids": list(self.applied),
                }
            )
        )

    async def _answer_accepted_updates(self) -> None:
        """Before a run fails, the updates it accepted while it opened are answered (SessionNotOpen, `_opened`).
        Before, the run failed with them unanswered: their callers got "workflow execution already completed", an
        RPC error that is no update's answer, and Temporal warned of unfinished handlers."""
        if workflow.patched(PATCH_ANSWER_BEFORE_FAILING):
            self.ready = True
            await workflow.wait_condition(workflow.all_handlers_finished)

    async def _opened(self) -> None:
        """An update waits until the session has opened; one the run accepted before it failed to open is refused."""
        await workflow.wait_condition(lambda: self.ready)
        if self.state.status == "failed":
            raise ApplicationError(
                f"{self._failed_to_open()}; start a new session", type="SessionNotOpen", non_retryable=True
            )

    def _failed_to_open(self) -> str:
        return "the session failed to open" + (f": {self.open_failure}" if self.open_failure else "")

    async def _refuse_when_closing(self, update: str) -> None:
        """A tool grant or revocation accepted in the workflow task a close was, after it, waits for the close: if the
        session closed, it is refused; if the close failed (the session stays open), it applies. Before, it was
        applied to the closing session's state (and answered `status: open`)."""
        if (self.closing or self.state.status != "open") and workflow.patched(PATCH_CLOSING_KEEPS_TOOLS):
            await workflow.wait_condition(lambda: not self.closing or self.state.status != "open")
            if self.state.status != "open":
                raise ApplicationError(
                    f"{update}: the session is {self.state.status}; start a new session",
                    type="SessionNotOpen",
                    non_retryable=True,
                )

    def _continue_as_new_due(self) -> bool:
        if self.lock.locked():
            return False
        limit = self.open.continue_as_new_after_turns
        if limit is not None and self.state.turns - self.turns_at_start >= limit:
            return True
        if self.updates_this_run >= bounds.UPDATES_CONTINUE_AS_NEW:
            return True  # Temporal refuses a run's 2,001st update (contract/bounds.py)
        if workflow.info().get_current_history_length() >= bounds.HISTORY_CONTINUE_AS_NEW:
            return True  # our own bound, whatever the server's suggestion threshold (contract/bounds.py)
        return workflow.info().is_continue_as_new_suggested()

    # ------------------------------------------------------------ query
    @workflow.query(name=names.QUERY_STATE)
    def state_query(self) -> SessionState:
        return self.state

    # ------------------------------------------------------------ submit_turn
    @workflow.update(name=names.UPDATE_SUBMIT_TURN)
    async def submit_turn(self, turn: TurnInput | None = None) -> TurnResult:
        turn = _given(turn, "submit_turn", TurnInput)
        self.updates_this_run += 1
        update_id = workflow.current_update_info().id  # type: ignore[union-attr]
        if update_id in self.results:
            return self.results[update_id]
        failed = self.failures.get(update_id)
        if failed is not None:  # a turn that failed in an earlier run: the same answer, not a new turn
            raise ApplicationError(failed.message, *failed.details, type=failed.type, non_retryable=True)
        await self._opened()
        async with self.lock:
            if self.state.status != "open":
                raise ApplicationError(
                    f"the session is {self.state.status}; start a new session",
                    type="SessionNotOpen",
                    non_retryable=True,
                )
            self.state.turns += 1
            try:
                result = await self._turn(self.state.turns, turn.text, update_id)
            except (ActivityError, ChildWorkflowError, ApplicationError) as exc:
                if not workflow.patched(PATCH_FAILED_TURN):
                    raise
                failure = await self._turn_failed(self.state.turns, exc)
                self._remember_failure(update_id, failure)
                raise failure from exc
            self._remember(update_id, result)
            self._publish()
            return result

    @submit_turn.validator
    def _validate_turn(self, turn: TurnInput | None = None) -> None:
        turn = _given(turn, "submit_turn", TurnInput)
        self._validate_open()
        self._validate_room()
        if not turn.text.strip():
            raise _refused("submit_turn: text must not be blank")

    async def _turn(self, turn: int, text: str, update_id: str) -> TurnResult:
        if workflow.info().get_current_history_length() >= bounds.HISTORY_TURN_IN_CHILD and workflow.patched(
            PATCH_TURN_IN_CHILD
        ):
            return await self._turn_in_child(turn, text, update_id)
        runner = TurnRunner(self.open, self.state, escalate=self._escalate)
        try:
            return await runner.run(turn, text=text, update_id=update_id)
        except (ActivityError, ChildWorkflowError) as exc:
            raise _retyped(exc, "TurnTooLarge")  # noqa: B904 (_retyped chains a new error to exc, never exc to itself)

    async def _turn_in_child(self, turn: int, text: str, update_id: str) -> TurnResult:
        """A turn of a long run, in a ChildRunWorkflow: its events go to a fresh history (contract/bounds.py)."""
        self.child = await workflow.start_child_workflow(
            ChildRunWorkflow.run,
            ChildRunInput(
                open=self.open,
                state=self.state,
                turn=turn,
                user_item_id=None,
                call_index=0,
                text=text,
                update_id=update_id,
            ),
            id=f"{self.state.session_id}/turn-run/{turn}",
            static_summary=f"turn {turn} of session {self.state.session_id}, in a child run (long history)",
            task_timeout=workflow.info().task_timeout,
        )
        try:
            done: ChildRunResult = await self.child
        except ChildWorkflowError as exc:
            self._count_failed(exc)
            raise
        finally:
            self.child = None
        return self._adopt(done)

    async def _turn_failed(self, turn: int, exc: BaseException) -> ApplicationError:
        """A failed turn fails its update, typed, not the session: its unanswered tool calls get error results
        (so every later request stays valid) and the turn lock is released by the caller's `async with`."""
        cause = first_typed_cause(exc)
        type_ = cause.type if isinstance(cause, ApplicationError) and cause.type else retries.TURN_FAILED
        message = cause.message if isinstance(cause, ApplicationError) else str(exc)
        try:
            await workflow.execute_activity_method(
                SessionActivityCalls.seal_turn,
                SealTurnInput(
                    session_id=self.state.session_id,
                    turn=turn,
                    epoch=self.state.epoch,
                    reason=f"{type_}: {message}"[:300],
                ),
                start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
                retry_policy=SEAL_RETRY if workflow.patched(PATCH_SEAL_BRIEFLY) else RETRY,
                summary=f"seal failed turn {turn}",
            )
        except ActivityError:
            pass  # the next turn's build seals it (activities/lifecycle.py `seal_orphans`)
        self._publish()
        details = caller_details(cause.details) if isinstance(cause, ApplicationError) else ()
        return ApplicationError(f"turn {turn} failed: {message}", *details, type=type_, non_retryable=True)

    async def _escalate(self, turn: int, user_item_id: str, call_index: int) -> TurnResult:
        """Continue the turn in a ChildRunWorkflow on a fresh body; adopt the state it returns."""
        number = self.state.metrics.escalations
        sent = (dict(self.state.revoked_tools), list(self.state.granted_tools))  # what the child's input carries
        self.child = await workflow.start_child_workflow(
            ChildRunWorkflow.run,
            ChildRunInput(
                open=self.open, state=self.state, turn=turn, user_item_id=user_item_id, call_index=call_index
            ),
            id=f"{self.state.session_id}/child-run/{number}",
            static_summary=f"child run {number} of session {self.state.session_id} (turn {turn})",
            task_timeout=workflow.info().task_timeout,  # the caller's failover choice (docs/reliability.md)
        )
        # A revocation or grant that arrived while the child was starting found no child to forward to, and the
        # child's input predates it: forward it now (a second delivery of one is harmless).
        for name, reason in self.state.revoked_tools.items():
            if name not in sent[0]:
                await self._forward(ChildRunWorkflow.revoke_tool, RevokeTool(name=name, reason=reason))
        regranted = [n for n in sent[0] if n not in self.state.revoked_tools]
        granted = [n for n in self.state.granted_tools if n not in sent[1] and n not in self.state.revoked_tools]
        for name in dict.fromkeys([*regranted, *granted]):
            await self._forward(ChildRunWorkflow.grant_tool, GrantTool(name=name))
        try:
            done: ChildRunResult = await self.child
        except ChildWorkflowError as exc:
            self._count_failed(exc)
            raise
        finally:
            self.child = None
        return self._adopt(done)

    def _count_failed(self, exc: ChildWorkflowError) -> None:
        """A failed child run's state is not adopted, but its metrics are: the model calls it made were sent."""
        metrics = metrics_of_failed(exc)
        if metrics is not None and workflow.patched(PATCH_FAILED_CHILD_METRICS):
            self.state.metrics = metrics

    def _adopt(self, done: ChildRunResult) -> TurnResult:
        """Take the state a child run returns. Its authorisation is the session's: the session saw every
        revocation and grant (the child only receives them by signal, and one that came after it finished never
        reached it), so the session's view wins."""
        done.state.revoked_tools = dict(self.state.revoked_tools)
        done.state.granted_tools = list(self.state.granted_tools)
        self.state = done.state
        return done.result

    async def _forward(self, signal: Any, change: RevokeTool | GrantTool) -> None:
        """Send an authorisation change to the running child run. The child may have finished already (its result
        not yet seen here): it made its calls without the change, and the state adopted from it takes the
        session's view of authorisation (`_adopt`), so the change is not lost and the turn goes on."""
        assert self.child is not None
        try:
            await self.child.signal(signal, change)
        except ApplicationError as exc:
            if exc.type != CHILD_GONE or not workflow.patched(PATCH_FINISHED_CHILD):
                raise
            workflow.logger.info("child run finished before %s reached it", type(change).__name__)

    def _remember(self, update_id: str, result: TurnResult) -> None:
        self.results[update_id] = result
        self._bound_answers(update_id, result)

    def _remember_failure(self, update_id: str, failure: ApplicationError) -> None:
        type_ = failure.type or retries.TURN_FAILED
        answer = TurnFailure(type=type_, message=failure.message, details=[*failure.details])
        self.failures[update_id] = answer
        self._bound_answers(update_id, answer)

    def _bound_answers(self, update_id: str, answer: TurnResult | TurnFailure) -> None:
        self.answer_bytes[update_id] = len(answer.model_dump_json())
        bound_answers(self.results, self.failures, self.answer_bytes)

    # ------------------------------------------------------------ other updates
    @workflow.update(name=names.UPDATE_REVOKE_TOOL)
    async def revoke_tool(self, req: RevokeTool | None = None) -> SessionState:
        req = _given(req, "revoke_tool", RevokeTool)
        self.updates_this_run += 1
        await self._opened()
        if self._applied_before():
            return self.state
        await self._refuse_when_closing("revoke_tool")
        if workflow.patched(PATCH_EARLY_TOOL_NAMES):  # an update sent before the session opened skipped the check
            self._check_pinned("revoke_tool", [req.name])
        self._mark_applied()
        self.state.revoked_tools[req.name] = req.reason
        if self.child is not None:  # a turn running in a child run authorises against its own copy
            await self._forward(ChildRunWorkflow.revoke_tool, req)
        self._publish()
        return self.state

    @revoke_tool.validator
    def _validate_revoke(self, req: RevokeTool | None = None) -> None:
        req = _given(req, "revoke_tool", RevokeTool)
        self._validate_open()
        self._validate_room()
        if self.ready:
            self._check_pinned("revoke_tool", [req.name])
        if req.name == CONTROL_TOOL_NAME:
            raise _refused(f"revoke_tool: {CONTROL_TOOL_NAME} is the working-state control tool and stays granted")

    @workflow.update(name=names.UPDATE_GRANT_TOOL)
    async def grant_tool(self, req: GrantTool | None = None) -> SessionState:
        """Authorisation changes at call time both ways (ADR-0020 decision 4): the prefix is untouched."""
        req = _given(req, "grant_tool", GrantTool)
        self.updates_this_run += 1
        await self._opened()
        if self._applied_before():
            return self.state
        await self._refuse_when_closing("grant_tool")
        self._check_grantable(req.name)
        self._mark_applied()
        self.state.revoked_tools.pop(req.name, None)
        left_out = self.open.grants is not None and req.name not in self.open.grants
        if left_out and req.name not in self.state.granted_tools:
            self.state.granted_tools.append(req.name)
        if self.child is not None:  # a turn running in a child run authorises against its own copy
            await self._forward(ChildRunWorkflow.grant_tool, req)
        self._publish()
        return self.state

    @grant_tool.validator
    def _validate_grant(self, req: GrantTool | None = None) -> None:
        req = _given(req, "grant_tool", GrantTool)
        self._validate_open()
        self._validate_room()
        if self.ready:
            self._check_grantable(req.name)

    def _check_grantable(self, name: str) -> None:
        if name not in self.state.pinned_tools or name in self.state.removed_tools:
            raise ApplicationError(
                f"grant_tool: {name!r} is not in this epoch's pinned tool set "
                f"({', '.join(t for t in self.state.pinned_tools if t not in self.state.removed_tools)}); "
                "adding a tool changes the prefix and needs an epoch rotation",
                type="ToolNotPinned",
                non_retryable=True,
            )

    @workflow.update(name=names.UPDATE_WORKING_STATE)
    async def update_working_state(self, req: WorkingStateUpdate | None = None) -> WorkingStateResult:
        """Runtime writes to the working state (ADR-0020 decision 14), between turns: serialised with them."""
        req = _given(req, "update_working_state", WorkingStateUpdate)
        self.updates_this_run += 1
        await self._opened()
        update_id = workflow.current_update_info().id  # type: ignore[union-attr]
        async with self.lock:
            if self.state.status != "open":
                raise ApplicationError(
                    f"the session is {self.state.status}; start a new session",
                    type="SessionNotOpen",
                    non_retryable=True,
                )
            try:
                result: WorkingStateResult = await workflow.execute_activity_method(
                    SessionActivityCalls.write_working_state,
                    WorkingStateInput(
                        session_id=self.state.session_id,
                        update_id=update_id,
                        turn=self.state.turns + 1,
                        epoch=self.state.epoch,
                        update=req,
                    ),
                    start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                    retry_policy=RETRY,
                    summary=f"runtime working-state write: {', '.join(op.op for op in req.operations)}",
                )
            except ActivityError as exc:
                raise _update_failure(exc) from exc
            self.state.working_state = result.working_state
            self._publish()
            return result

    @update_working_state.validator
    def _validate_working_state(self, req: WorkingStateUpdate | None = None) -> None:
        req = _given(req, "update_working_state", WorkingStateUpdate)
        self._validate_open()
        self._validate_room()
        problem = write_problem(req)
        if problem is not None:
            raise _refused(f"update_working_state: {problem}")

    @workflow.update(name=names.UPDATE_DELETE_MEMORY)
    async def delete_memory(self, req: DeleteMemory | None = None) -> MemoryDeleted:
        req = _given(req, "delete_memory", DeleteMemory)
        self.updates_this_run += 1
        await self._opened()
        update_id = workflow.current_update_info().id  # type: ignore[union-attr]
        try:
            result: MemoryDeleted = await workflow.execute_activity_method(
                SessionActivityCalls.delete_memory,
                DeleteMemoryInput(
                    session_id=self.state.session_id,
                    scope=self.open.memory_scope,
                    delete=req,
                    update_id=update_id,
                    turn=self.state.turns,
                    epoch=self.state.epoch,
                ),
                start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                retry_policy=RETRY,
                summary=f"delete memory {req.memory_id}",
            )
        except ActivityError as exc:
            raise _update_failure(exc) from exc
        return result

    @delete_memory.validator
    def _validate_delete_memory(self, req: DeleteMemory | None = None) -> None:
        _given(req, "delete_memory", DeleteMemory)
        self._validate_open()
        self._validate_room()

    @workflow.update(name=names.UPDATE_ROTATE_EPOCH)
    async def rotate_epoch(self, req: RotateEpoch | None = None) -> SessionState:
        req = _given(req, "rotate_epoch", RotateEpoch)
        self.updates_this_run += 1
        await self._opened()
        if self._applied_before():
            return self.state
        if workflow.patched(PATCH_EARLY_TOOL_NAMES):  # an update sent before the session opened skipped the check
            self._check_pinned("rotate_epoch", req.revoke_tools)
        async with self.lock:
            if self.state.status != "open" and workflow.patched(PATCH_ROTATE_OPEN_ONLY):
                # Accepted beside a close that took the lock first: the session closed meanwhile. Before, the
                # rotation then opened a new epoch of the closed session (a prefix stored, an event recorded).
                raise ApplicationError(
                    f"rotate_epoch: the session is {self.state.status}; start a new session",
                    type="SessionNotOpen",
                    non_retryable=True,
                )
            old = self.state.epoch
            new = old + 1
            new_open = self.open.model_copy(update={"model_route": req.model_route}) if req.model_route else self.open
            removed = sorted({*self.state.removed_tools, *req.revoke_tools})
            # Nothing changes unless the new prefix opens: a failed rotation leaves the session as it was.
            try:
                opened = await self._open(epoch=new, reason=req.reason, revoked=removed, open_=new_open)
            except ActivityError as exc:
                # Whatever the open refused it for (RotationRefused, ProviderNotConfigured, InvalidSessionOpen), typed.
                raise _retyped(exc, None)  # noqa: B904 (_retyped chains a new error to exc, never exc to itself)
            self.open = new_open
            self.state.model_route = new_open.route
            self.state.removed_tools = removed
            for name in req.revoke_tools:
                self.state.revoked_tools[name] = f"forced revocation ({req.reason})"
            self.state.epoch = new
            self.state.prefix_hashes[str(new)] = [opened.prefix_sha256]
            self.state.metrics.epochs += 1
            self._mark_applied()
            await workflow.execute_activity_method(
                SessionActivityCalls.record_event,
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
                heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
                retry_policy=RETRY,
                summary=f"epoch {old} -> {new}: {req.reason}",
            )
            self._publish()
            return self.state

    @rotate_epoch.validator
    def _validate_rotate(self, req: RotateEpoch | None = None) -> None:
        req = _given(req, "rotate_epoch", RotateEpoch)
        self._validate_open()
        self._validate_room()
        if req.reason == "model_route_changed" and req.model_route is None:
            raise _refused("rotate_epoch: reason model_route_changed needs model_route")
        if req.reason == "forced_revocation" and not req.revoke_tools:
            raise _refused("rotate_epoch: reason forced_revocation needs revoke_tools")
        if self.ready:
            self._check_pinned("rotate_epoch", req.revoke_tools)
        if req.model_route is not None:
            # Checked with the session's budget here: a route it does not fit would otherwise fail the open
            # activity's input (retried until its attempts ran out, then reported as the activity's failure).
            # Only the route and the budget are judged: the rest of the start input was accepted when it came.
            try:
                SessionOpen.model_validate({**self.open.model_dump(), "model_route": req.model_route.model_dump()})
            except ValidationError as exc:
                for error in exc.errors():
                    if error["loc"] and error["loc"][0] in ("model_route", "budget"):
                        msg = str(error["msg"]).removeprefix("Value error, ")
                        if error["loc"][0] == "model_route":
                            msg = ".".join(str(p) for p in error["loc"]) + f": {msg}"
                        raise _refused(f"rotate_epoch: with this model_route, {msg}") from None

    def _applied_before(self) -> bool:
        """Whether this update's id was applied in an earlier run (Temporal de-duplicates within a run only)."""
        return workflow.current_update_info().id in self.applied  # type: ignore[union-attr]

    def _mark_applied(self) -> None:
        """Remember this update's id, across continue-as-new too: the last bounds.RECENT_UPDATES ids are kept."""
        self.applied[workflow.current_update_info().id] = None  # type: ignore[union-attr]
        while len(self.applied) > bounds.RECENT_UPDATES:
            del self.applied[next(iter(self.applied))]

    def _check_pinned(self, update: str, tools: list[str]) -> None:
        """Tool names an update names must be in the session's pinned tool set (known once the session opened)."""
        unknown = [n for n in tools if n not in self.state.pinned_tools]
        if unknown:
            raise _refused(
                f"{update}: not in this session's tool set: {', '.join(unknown)} "
                f"(its tools: {', '.join(self.state.pinned_tools)})"
            )

    @workflow.update(name=names.UPDATE_WRITE_MEMORY)
    async def write_memory(self, req: WriteMemory | None = None) -> MemoryResult:
        req = _given(req, "write_memory", WriteMemory)
        self.updates_this_run += 1
        await self._opened()
        update_id = workflow.current_update_info().id  # type: ignore[union-attr]
        try:
            return await self._write_memory(req, update_id)
        except ActivityError as exc:  # the update fails with the activity's typed refusal (MemoryIdTaken, ...)
            cause = exc.cause if isinstance(exc.cause, ApplicationError) else None
            if cause is None:
                raise
            raise ApplicationError(cause.message, *cause.details, type=cause.type, non_retryable=True) from exc

    async def _write_memory(self, req: WriteMemory, update_id: str) -> MemoryResult:
        result: MemoryResult = await workflow.execute_activity_method(
            SessionActivityCalls.write_memory,
            MemoryInput(
                session_id=self.state.session_id,
                scope=self.open.memory_scope,
                write=req,
                update_id=update_id,
                turn=self.state.turns,
                epoch=self.state.epoch,
            ),
            start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
            heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
            retry_policy=RETRY,
            summary="write memory" + (f" correcting {req.corrects}" if req.corrects else ""),
        )
        return result

    @write_memory.validator
    def _validate_memory(self, req: WriteMemory | None = None) -> None:
        req = _given(req, "write_memory", WriteMemory)
        self._validate_open()
        self._validate_room()
        if not req.text.strip():
            raise _refused("write_memory: text must not be blank")

    @workflow.update(name=names.UPDATE_CLOSE_SESSION)
    async def close_session(self, req: CloseSession | None = None) -> SessionState:
        req = _given(CloseSession() if req is None else req, "close_session", CloseSession)  # none: the defaults
        self.updates_this_run += 1
        await self._opened()
        # Two closes accepted in one workflow task both pass the validator: only the first closes.
        if self.closing and workflow.patched(PATCH_CLOSE_ONCE):
            raise ApplicationError(
                "close_session: the session is already closing", type="SessionNotOpen", non_retryable=True
            )
        self.closing = True
        try:
            async with self.lock:
                # Established facts become memory candidates at the session boundary (ADR-0020 decision 15).
                await workflow.execute_activity_method(
                    CompactionActivityCalls.form_memories,
                    FormationInput(
                        session_id=self.state.session_id,
                        scope=self.open.memory_scope,
                        turn=self.state.turns,
                        epoch=self.state.epoch,
                    ),
                    start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                    heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
                    retry_policy=RETRY,
                    summary="memory formation",
                )
                await workflow.execute_activity_method(
                    SessionActivityCalls.close_session,
                    CloseInput(
                        session_id=self.state.session_id,
                        reason=req.reason,
                        turn=self.state.turns,
                        epoch=self.state.epoch,
                    ),
                    start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
                    heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
                    retry_policy=RETRY,
                    summary="close session",
                )
                self.state.status = "closed"
                self._publish()
                return self.state
        except Exception:
            # A close whose activities failed (PostgreSQL down past their retries) leaves the session open, so the
            # same close can be sent again; before, the session stayed "closing" for good: no close, turn or purge.
            self.closing = False
            raise

    @close_session.validator
    def _validate_close(self, req: CloseSession | None = None) -> None:
        _given(CloseSession() if req is None else req, "close_session", CloseSession)  # bytes, a number: refused
        if self.closing or self.state.status == "closed":  # typed as any update to a closing or closed session
            already = "closed" if self.state.status == "closed" else "closing"
            raise ApplicationError(
                f"close_session: the session is already {already}", type="SessionNotOpen", non_retryable=True
            )
        if self.state.status == "failed":
            raise ApplicationError(
                f"close_session: {self._failed_to_open()}", type="SessionNotOpen", non_retryable=True
            )

    def _validate_open(self) -> None:
        # Typed, so a caller tells "start a new session" from malformed input (docs/contract.md).
        if self.closing or self.state.status == "closed":
            raise ApplicationError(
                "the session is closed; start a new session", type="SessionNotOpen", non_retryable=True
            )
        if self.state.status == "failed":
            raise ApplicationError(self._failed_to_open(), type="SessionNotOpen", non_retryable=True)

    def _validate_room(self) -> None:
        """Refused while the run's history, or its count of updates, is long and waits to continue as new
        (contract/bounds.py)."""
        if (
            workflow.info().get_current_history_length() >= bounds.HISTORY_ADMIT_LIMIT
            or self.updates_this_run >= bounds.UPDATES_ADMIT_LIMIT
        ):
            raise ValueError("the session is continuing as new (its history is long); retry in a few seconds")

    # ------------------------------------------------------------ helpers
    async def _open(
        self, *, epoch: int, reason: str, revoked: list[str] | None = None, open_: SessionOpen | None = None
    ) -> OpenResult:
        result: OpenResult = await workflow.execute_activity_method(
            SessionActivityCalls.open_session,
            OpenInput(
                session_id=self.state.session_id,
                open=open_ or self.open,
                epoch=epoch,
                reason=reason,
                revoked=revoked or [],
                owner=workflow.info().first_execution_run_id,
            ),
            start_to_close_timeout=timedelta(seconds=self.open.timeouts.build_seconds),
            heartbeat_timeout=timedelta(seconds=self.open.timeouts.heartbeat_seconds),
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
            # Each upsert is a history event: write when the epoch or prefix changes, turns every tenth turn.
            published = (s.epoch, hashes[-1], s.turns // SA_TURNS_EVERY)
            if published != self.published:
                self.published = published
                workflow.upsert_search_attributes(
                    [
                        SA_EPOCH.value_set(s.epoch),
                        SA_TURNS.value_set(s.turns),
                        SA_PREFIX.value_set(hashes[-1]),
                    ]
                )


def bound_answers(
    results: dict[str, TurnResult],
    failures: dict[str, TurnFailure],
    sizes: dict[str, int],
    *,
    count: int = bounds.RECENT_UPDATES,
    max_bytes: int = bounds.CARRIED_RESULTS_BYTES,
) -> None:
    """Trim the recent answers a session carries across continue-as-new, in place: at most `count` results and as
    many failures, and under `max_bytes` together by `sizes` (each answer's JSON size), the oldest dropped first.
    A continue-as-new input over Temporal's 2 MB payload limit would fail its workflow task for good."""
    for answers in (results, failures):
        while len(answers) > count:
            dropped = next(iter(answers))
            del answers[dropped]
            sizes.pop(dropped, None)
    while sum(sizes.values()) > max_bytes and len(sizes) > 1:
        oldest = next(iter(sizes))
        del sizes[oldest]
        results.pop(oldest, None)
        failures.pop(oldest, None)


def _carries(open_: SessionOpen) -> bool:
    """Whether a start input holds what only a continue-as-new hands to the next run."""
    return bool(open_.carried or open_.carried_results or open_.carried_failures or open_.carried_update_ids)


def _start_input(start: RawValue) -> SessionOpen | Exception:
    """The start input as a SessionOpen, or the error the run fails with: pydantic's ValidationError (it names the
    field) or a typed, non-retryable InvalidSessionOpen naming what arrived instead."""
    json_null = start.payload.metadata.get("encoding") == b"json/plain" and start.payload.data.strip() == b"null"
    if not start.payload.metadata or json_null:  # none, or JSON null (the stock CLI's `--input null`)
        return ApplicationError(
            "start input: none was sent; send one SessionOpen", type="InvalidSessionOpen", non_retryable=True
        )
    try:
        open_ = workflow.payload_converter().from_payload(start.payload, SessionOpen)
    except ValidationError as exc:
        return exc
    except Exception as exc:  # an encoding this worker has no converter for, or one that cannot decode it
        what = f"{type(exc).__name__}: {exc}"
    else:
        if isinstance(open_, SessionOpen):
            return open_
        what = f"a {type(open_).__name__}, not a SessionOpen"
    return ApplicationError(f"start input: {what}"[:500], type="InvalidSessionOpen", non_retryable=True)


def _retyped(exc: ActivityError | ChildWorkflowError, type_: str | None) -> Exception:
    """`exc` as `_typed` makes it, chained to it when it is a new error (never to itself: a failure whose cause
    is itself would send the failed-turn handler round a cycle)."""
    typed = _typed(exc, type_)
    if typed is not exc:
        typed.__cause__ = exc
    return typed


def _typed(exc: ActivityError | ChildWorkflowError, type_: str | None) -> Exception:
    """An activity's (or a child run's activity's) typed failure of this type (None: of any type, when it is
    non-retryable: a refusal), re-raised as the update's own ApplicationError (type and details intact), so the
    caller sees it directly; any other failure unchanged."""
    cause: BaseException | None = exc.cause
    while isinstance(cause, ActivityError | ChildWorkflowError):
        cause = cause.cause
    if not isinstance(cause, ApplicationError) or not cause.type:
        return exc
    if cause.type == type_ or (type_ is None and cause.non_retryable):
        return ApplicationError(cause.message, *caller_details(cause.details), type=cause.type, non_retryable=True)
    return exc
