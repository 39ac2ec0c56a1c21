"""A typed async client for orchestration services (docs/contract.md): one place for update names, result
types, the data converter, id reuse and idempotency, so a service does not re-derive them.

    async with connect() as ctx:                       # TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, CTXENGINE_DATABASE_URL
        session = await ctx.start_session(
            SessionOpen(agent_instructions="...", model_route=ModelRoute(provider="openai", model="gpt-4o")),
            session_id="s-1",
        )
        result = await session.submit_turn("hello", idempotency_key="req-42")   # a retry returns the same result

Failures arrive as the typed errors below, mapped from Temporal's by the ApplicationError `type` string the
workflow and activities raise. `inspect` and `purge` read PostgreSQL and need a database URL.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributeKey, WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, FailureError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.store import SessionNotClosedError, Store
from contract import names
from contract.converter import DATA_CONVERTER
from contract.payloads import (
    CloseSession,
    DeleteMemory,
    GrantTool,
    MemoryDeleted,
    MemoryResult,
    ModelRoute,
    RevokeTool,
    RotateEpoch,
    SessionOpen,
    SessionState,
    TurnInput,
    TurnResult,
    WorkingStateResult,
    WriteMemory,
)
from contract.retries import UPDATE_ID_REUSED
from contract.settings import settings
from core.working_state import WorkingStateUpdate, write_problem
from ctxengine.inspection import inspect_session

R = TypeVar("R")
ENV_TASK_QUEUE = "CTXENGINE_TASK_QUEUE"
HISTORY_NOTE = (
    "Temporal keeps the workflow histories of this session until the namespace's retention period expires; "
    "purge erases PostgreSQL only"
)


# ---------------------------------------------------------------- errors


class CtxEngineError(Exception):
    """A failure reported by a session, with the ApplicationError type it arrived as."""

    def __init__(self, message: str, *, type_: str = "", details: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.type = type_
        self.details = details


class SessionIdTaken(CtxEngineError):
    """The session id was used before: a session id names one session forever."""


class SessionNotOpen(CtxEngineError):
    """The session is closed (or failed to open): start a new one."""


class UnknownSession(CtxEngineError):
    """No session with this id (or its history passed the namespace's retention)."""


class TurnTooLarge(CtxEngineError):
    """The turn's input cannot fit the context window; send it as an artifact or split it."""


class PrefixOverflow(CtxEngineError):
    """A prefix class exceeds its ceiling: the session cannot open (or an epoch cannot rotate)."""


class RouteDoesNotFit(CtxEngineError):
    """The route's window leaves no room for a turn beside the prefix: the session cannot open on it
    (`RouteDoesNotFit`), or a rotation to it is refused and the old epoch stays (`RotationRefused`)."""


class ToolNotPinned(CtxEngineError):
    """The tool is not in the pinned tool set: adding it needs an epoch rotation."""


class WorkingStateRejected(CtxEngineError):
    """A working-state write over a cap or naming an unknown id; nothing changed."""


class MemoryIdTaken(CtxEngineError):
    """A memory id already used in the scope."""


class ValidationFailed(CtxEngineError):
    """Malformed input, rejected by the update's validator before anything ran."""


class UpdateIdReused(CtxEngineError):
    """The idempotency key (update id) named an earlier update this call is not a retry of: nothing was applied;
    send it with a new key."""


class SessionNotClosed(CtxEngineError):
    """Purge needs a closed session."""


ERROR_TYPES: dict[str, type[CtxEngineError]] = {
    "SessionIdTaken": SessionIdTaken,
    "SessionNotOpen": SessionNotOpen,
    "UnknownSession": UnknownSession,
    "TurnTooLarge": TurnTooLarge,
    "PrefixOverflowError": PrefixOverflow,
    "RouteDoesNotFit": RouteDoesNotFit,
    "RotationRefused": RouteDoesNotFit,
    "ToolNotPinned": ToolNotPinned,
    "WorkingStateCapError": WorkingStateRejected,
    "WorkingStateError": WorkingStateRejected,
    "MemoryIdTaken": MemoryIdTaken,
    "ValueError": ValidationFailed,
    "ValidationError": ValidationFailed,
    "InvalidSessionOpen": ValidationFailed,
    "ModelRouteRequired": ValidationFailed,
    "InvalidInput": ValidationFailed,
    UPDATE_ID_REUSED: UpdateIdReused,
}


_ENDED_MESSAGES = ("completed", "closing workflow")
# The updates whose answer is the session's state.
_ANSWERS_A_STATE = (
    names.UPDATE_CLOSE_SESSION,
    names.UPDATE_GRANT_TOOL,
    names.UPDATE_REVOKE_TOOL,
    names.UPDATE_ROTATE_EPOCH,
)


def _reused(name: str, key: str | None) -> UpdateIdReused:
    """Temporal answers an update id with the first update's outcome, whatever the update: a key used before by an
    update of another kind gets that update's answer, not this one's."""
    return UpdateIdReused(
        f"{name}: idempotency key {key!r} was used by an earlier update of another kind, whose answer this is; "
        "nothing was applied by this call; send it with a new key",
        type_=UPDATE_ID_REUSED,
    )


def map_failure(exc: BaseException) -> CtxEngineError:
    """The typed error for a Temporal failure: the first ApplicationError in its cause chain whose type is
    known; otherwise the innermost ApplicationError's type and message as a plain CtxEngineError."""
    if isinstance(exc, WorkflowAlreadyStartedError):
        return SessionIdTaken(f"session id {exc.workflow_id!r} was used before", type_="SessionIdTaken")
    if isinstance(exc, RPCError):
        # The run ended before the update was answered: "workflow execution already completed", or, when it ended
        # while the update waited to be accepted, "workflow update was aborted by closing workflow".
        if exc.status == RPCStatusCode.NOT_FOUND and any(m in exc.message for m in _ENDED_MESSAGES):
            return SessionNotOpen(f"the session has ended: {exc.message}", type_="SessionNotOpen")
        if exc.status == RPCStatusCode.NOT_FOUND:
            return UnknownSession(exc.message, type_="UnknownSession")
        return CtxEngineError(exc.message, type_=exc.status.name if exc.status else "RPCError")
    innermost: ApplicationError | None = None
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ApplicationError):
            innermost = cause
            if cause.type in ERROR_TYPES:
                return ERROR_TYPES[cause.type](cause.message, type_=cause.type, details=tuple(cause.details))
        cause = (
            cause.cause if isinstance(cause, FailureError | WorkflowUpdateFailedError | WorkflowFailureError) else None
        )
    if innermost is not None:
        return CtxEngineError(innermost.message, type_=innermost.type or "", details=tuple(innermost.details))
    return CtxEngineError(str(exc), type_=type(exc).__name__)


# ---------------------------------------------------------------- results


class SessionSummary(BaseModel):
    """One session as the Temporal list shows it (search attributes CtxEpoch, CtxTurns, CtxPrefixHash)."""

    session_id: str
    run_id: str | None = None
    status: str  # Temporal's execution status, lower case: running, completed, failed, terminated, ...
    start_time: datetime | None = None
    epoch: int | None = None
    turns: int | None = None
    prefix_sha256: str | None = None


class PurgeResult(BaseModel):
    session_id: str
    rows_deleted: dict[str, int]
    temporal_history: str = HISTORY_NOTE


_SA_EPOCH = SearchAttributeKey.for_int(names.SA_EPOCH)
_SA_TURNS = SearchAttributeKey.for_int(names.SA_TURNS)
_SA_PREFIX = SearchAttributeKey.for_keyword(names.SA_PREFIX_HASH)


# ---------------------------------------------------------------- the client


class Session:
    """One session's handle: every update and the `state` query, typed."""

    def __init__(self, handle: WorkflowHandle[Any, Any]) -> None:
        self.handle = handle
        self.session_id = handle.id

    async def _update(
        self, name: str, arg: BaseModel, result_type: type[R], update_id: str | None = None, *, chosen: bool = True
    ) -> R:
        """`chosen`: the caller chose `update_id` (an idempotency key), so another update may have used it before."""
        try:
            result: R = await self.handle.execute_update(name, arg, id=update_id, result_type=result_type)
        except (WorkflowUpdateFailedError, RPCError, ApplicationError) as exc:
            raise map_failure(exc) from exc
        except ValidationError as exc:
            if update_id is None or not chosen:  # a fresh id: the answer is this update's own, unreadable here
                raise CtxEngineError(
                    f"{name}: its answer did not decode as {result_type.__name__} (the update may have been applied; "
                    f"a worker of another release?): {exc}",
                    type_="InvalidAnswer",
                ) from exc
            raise _reused(name, update_id) from exc
        if chosen and name in _ANSWERS_A_STATE:
            closed = getattr(result, "status", None) == "closed"
            if closed is not (name == names.UPDATE_CLOSE_SESSION):
                # A close answers a closed state, a grant, revocation or rotation never does (refused once the
                # session closes): this answer is another update's.
                raise _reused(name, update_id)
        return result

    async def submit_turn(self, text: str, *, idempotency_key: str | None = None) -> TurnResult:
        """Send one turn. The idempotency key is the update id: a retry with the same key returns the first
        result and appends nothing, within a run and across continue-as-new (the last 32 turns' results)."""
        key = idempotency_key or str(uuid.uuid4())
        req = _validated(TurnInput, {"text": text})
        return await self._update(names.UPDATE_SUBMIT_TURN, req, TurnResult, key, chosen=idempotency_key is not None)

    # Every update takes an idempotency key, its update id: a retry with the same key (after a timeout, say) is
    # answered as the first call was and applies nothing again (docs/contract.md, "Ids and idempotency").

    async def revoke_tool(
        self, name: str, reason: str = "revoked by operator", *, idempotency_key: str | None = None
    ) -> SessionState:
        req = _validated(RevokeTool, {"name": name, "reason": reason})
        return await self._update(names.UPDATE_REVOKE_TOOL, req, SessionState, idempotency_key)

    async def grant_tool(
        self, name: str, reason: str = "granted by operator", *, idempotency_key: str | None = None
    ) -> SessionState:
        """Re-grant a revoked tool or grant a pinned one the open left out; the prefix is untouched."""
        req = _validated(GrantTool, {"name": name, "reason": reason})
        return await self._update(names.UPDATE_GRANT_TOOL, req, SessionState, idempotency_key)

    async def rotate_epoch(
        self,
        reason: str,
        *,
        model_route: ModelRoute | None = None,
        revoke_tools: list[str] | None = None,
        idempotency_key: str | None = None,
    ) -> SessionState:
        req = _validated(
            RotateEpoch, {"reason": reason, "model_route": model_route, "revoke_tools": revoke_tools or []}
        )
        return await self._update(names.UPDATE_ROTATE_EPOCH, req, SessionState, idempotency_key)

    async def write_memory(
        self,
        text: str,
        *,
        memory_id: str | None = None,
        corrects: str | None = None,
        idempotency_key: str | None = None,
    ) -> MemoryResult:
        req = _validated(WriteMemory, {"text": text, "memory_id": memory_id, "corrects": corrects})
        return await self._update(names.UPDATE_WRITE_MEMORY, req, MemoryResult, idempotency_key)

    async def delete_memory(
        self, memory_id: str, *, reason: str = "withdrawn by the user", idempotency_key: str | None = None
    ) -> MemoryDeleted:
        req = _validated(DeleteMemory, {"memory_id": memory_id, "reason": reason})
        return await self._update(names.UPDATE_DELETE_MEMORY, req, MemoryDeleted, idempotency_key)

    async def update_working_state(
        self, update: WorkingStateUpdate | dict[str, Any], *, idempotency_key: str | None = None
    ) -> WorkingStateResult:
        """A runtime write: the control tool's operations, plus removing a constraint (runtime only)."""
        req = update if isinstance(update, WorkingStateUpdate) else _validated(WorkingStateUpdate, update)
        problem = write_problem(req)
        if problem is not None:  # refused here as the workflow's validator would refuse it
            raise ValidationFailed(f"update_working_state: {problem}", type_="ValueError")
        return await self._update(names.UPDATE_WORKING_STATE, req, WorkingStateResult, idempotency_key)

    async def close(self, reason: str = "closed by caller", *, idempotency_key: str | None = None) -> SessionState:
        req = _validated(CloseSession, {"reason": reason})
        return await self._update(names.UPDATE_CLOSE_SESSION, req, SessionState, idempotency_key)

    async def state(self) -> SessionState:
        try:
            result: SessionState = await self.handle.query(names.QUERY_STATE, result_type=SessionState)
        except RPCError as exc:
            raise map_failure(exc) from exc
        return result


class CtxEngineClient:
    """Sessions on one namespace and task queue; with a store, also `inspect` and `purge`."""

    def __init__(self, client: Client, *, task_queue: str | None = None, store: Store | None = None) -> None:
        self.client = client
        self.task_queue = task_queue or settings().task_queue
        self.store = store

    async def start_session(
        self,
        open_: SessionOpen,
        *,
        session_id: str | None = None,
        wait_open: bool = True,
        timeout: float = 30.0,
        task_timeout: timedelta | None = None,
    ) -> Session:
        """Start a session. A used id is refused (SessionIdTaken), whether its session is running or ended; an id
        whose start failed before the session opened (PrefixOverflow, an invalid budget) may be used again
        (docs/contract.md, "Ids and idempotency").

        With `wait_open`, returns once the prefix is open, so an open that fails (PrefixOverflow, an invalid
        budget) raises here rather than at the first turn. `task_timeout`: the session's workflow task timeout
        (Temporal's 10 s when None), which its compactions and child runs take too: how long a turn waits for a
        workflow task a dead worker held (docs/reliability.md, "Failover").
        """
        sid = session_id or f"session-{uuid.uuid4().hex}"
        try:
            handle = await self.client.start_workflow(
                names.WORKFLOW_SESSION,
                open_,
                id=sid,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                static_summary=f"ctxengine session {sid}",
                task_timeout=task_timeout,
            )
        except (WorkflowAlreadyStartedError, RPCError) as exc:
            raise map_failure(exc) from exc
        session = Session(self.client.get_workflow_handle(sid))
        if wait_open:
            await self._wait_open(session, handle, timeout)
        return session

    async def _wait_open(self, session: Session, handle: WorkflowHandle[Any, Any], timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            desc = await handle.describe()
            if desc.status not in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW):
                try:
                    await handle.result()
                except WorkflowFailureError as exc:
                    raise map_failure(exc) from exc
                raise SessionNotOpen(f"session ended while opening ({desc.status})", type_="SessionNotOpen")
            if (await session.state()).status == "open":
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"session {session.session_id!r} did not open within {timeout:.0f} s")
            await asyncio.sleep(0.05)

    def session(self, session_id: str) -> Session:
        """A handle on an existing session (its latest run: continue-as-new is invisible to callers)."""
        return Session(self.client.get_workflow_handle(session_id))

    async def list_sessions(
        self,
        *,
        status: str | None = "running",
        epoch: int | None = None,
        prefix_sha256: str | None = None,
        limit: int = 100,
    ) -> list[SessionSummary]:
        """Sessions by Temporal visibility. Epoch and prefix filters need the search attributes registered
        (the embedded dev server does; on a cluster, `temporal operator search-attribute create`)."""
        clauses = [f"WorkflowType = '{names.WORKFLOW_SESSION}'"]
        if status:
            clauses.append(f"ExecutionStatus = '{status.replace('_', ' ').title().replace(' ', '')}'")
        else:
            clauses.append("ExecutionStatus != 'ContinuedAsNew'")
        if epoch is not None:
            clauses.append(f"{names.SA_EPOCH} = {int(epoch)}")
        if prefix_sha256 is not None:
            clauses.append(f"{names.SA_PREFIX_HASH} = '{_quoted(prefix_sha256)}'")
        out: list[SessionSummary] = []
        async for wf in self.client.list_workflows(" AND ".join(clauses), limit=limit):
            sa = wf.typed_search_attributes
            out.append(
                SessionSummary(
                    session_id=wf.id,
                    run_id=wf.run_id,
                    status=wf.status.name.lower() if wf.status else "unknown",
                    start_time=wf.start_time,
                    epoch=sa.get(_SA_EPOCH),
                    turns=sa.get(_SA_TURNS),
                    prefix_sha256=sa.get(_SA_PREFIX),
                )
            )
        return out

    async def inspect(self, session_id: str, *, turn: int | None = None) -> dict[str, Any]:
        """One request's context window, as `ctxengine inspect --json` prints it."""
        try:
            return await inspect_session(self._store(), session_id, turn)
        except LookupError as exc:
            raise UnknownSession(str(exc), type_="UnknownSession") from exc

    async def purge(self, session_id: str) -> PurgeResult:
        """Erase an ended session from PostgreSQL (log, artifacts, requests, checkpoints, events, the memories
        it formed). Temporal's history of it follows the namespace's retention."""
        store = self._store()
        try:
            desc = await self.client.get_workflow_handle(session_id).describe()
            running = desc.status == WorkflowExecutionStatus.RUNNING
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise map_failure(exc) from exc
            running = False  # past retention: Temporal no longer knows it, PostgreSQL may
        if running:
            raise SessionNotClosed(f"session {session_id!r} is still running; close it first", type_="SessionNotClosed")
        try:
            rows = await store.purge_session(session_id, require_closed=False)
        except LookupError as exc:
            raise UnknownSession(str(exc), type_="UnknownSession") from exc
        except SessionNotClosedError as exc:
            raise SessionNotClosed(str(exc), type_="SessionNotClosed") from exc
        return PurgeResult(session_id=session_id, rows_deleted=rows)

    def _store(self) -> Store:
        if self.store is None:
            raise RuntimeError("this client has no database: pass database_url to connect() for inspect and purge")
        return self.store


@asynccontextmanager
async def connect(
    address: str | None = None,
    *,
    namespace: str | None = None,
    task_queue: str | None = None,
    database_url: str | None = None,
    tracing: bool = False,
) -> AsyncIterator[CtxEngineClient]:
    """A client from arguments or the environment (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, CTXENGINE_TASK_QUEUE,
    CTXENGINE_DATABASE_URL); the database is optional (inspect and purge need it). With `tracing` (the `otel`
    extra), each call starts a span under the caller's current one, and a turn's trace starts here."""
    interceptors: list[Any] = []
    if tracing:
        from activities.tracing import CtxTracingInterceptor  # the `otel` extra is optional

        interceptors.append(CtxTracingInterceptor())
    client = await Client.connect(
        address or settings().temporal_address or "localhost:7233",
        namespace=namespace or settings().temporal_namespace,
        data_converter=DATA_CONVERTER,
        interceptors=interceptors,
    )
    dsn = database_url or settings().database_url
    if dsn is None:
        yield CtxEngineClient(client, task_queue=task_queue)
        return
    # No floor of open connections: a client reads the store only to inspect or purge, and a pool that must keep
    # one logs a traceback for each try to restore it while PostgreSQL is down. One query now, so that a wrong DSN
    # or an unreachable database is reported here, as before.
    async with Store.from_dsn(dsn, min_size=0, max_size=2) as store:
        await store.pool.fetchval("SELECT 1")
        yield CtxEngineClient(client, task_queue=task_queue, store=store)


def _validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """`model` from `data`, or ValidationFailed naming the field: input the workflow would refuse is refused
    here, with the error the workflow's refusal maps to (docs/contract.md, "Error types")."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValidationFailed(f"{model.__name__}: {where}: {first['msg']}", type_="ValidationError") from exc


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")
