"""Writes the runtime makes between turns: a memory (or a correction), a memory's deletion, and a working-state
update. Each is idempotent (by memory id, or by update id) and refused, changing nothing, when it cannot apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.minimum_body import working_state_cap
from activities.session_state import SessionState, snapshot_ids, working_state
from activities.store import WITHDRAWN_PREFIX
from contract import names
from contract.activity_interfaces import MemoryCalls
from contract.events import EventType
from contract.payloads import (
    DeleteMemoryInput,
    MemoryDeleted,
    MemoryInput,
    MemoryResult,
    WorkingStateInput,
    WorkingStateResult,
)
from core.build import measure_working_state
from core.errors import ContextError
from core.estimator import TokenEstimator
from core.items import TrustLevel
from core.working_state import WorkingStateUpdate, WorkingStateWrite, apply, render

log = structlog.get_logger("ctxengine.activities")


class MemoryActivities(MemoryCalls):
    def __init__(self, state: SessionState) -> None:
        self.state = state

    @activity.defn(name=names.ACTIVITY_WRITE_MEMORY)
    async def write_memory(self, inp: MemoryInput) -> MemoryResult:
        """Store a memory (or a correction). It reaches recall and corrections, never the frozen snapshot.

        Refused before anything is stored: a `corrects` naming no memory of the scope (UnknownMemory), and an
        explicit `memory_id` the scope already holds with other content, or held and withdrew (MemoryIdTaken:
        memories are never overwritten; write a correction instead). The same write again (a retry) succeeds.
        """
        store = self.state.store
        memory_id = inp.write.memory_id or f"{inp.session_id}:{inp.update_id}"
        if inp.write.corrects is not None and await store.get_memory(inp.scope, inp.write.corrects) is None:
            raise ApplicationError(
                f"write_memory: corrects: no memory {inp.write.corrects!r} in scope {inp.scope!r}",
                type="UnknownMemory",
                non_retryable=True,
            )
        if await store.get_memory(inp.scope, WITHDRAWN_PREFIX + memory_id) is not None:
            raise ApplicationError(
                f"write_memory: memory_id: {memory_id!r} was used and withdrawn in scope {inp.scope!r}: its "
                "withdrawal is still shown to sessions whose snapshot held it, and would withdraw the new memory "
                "too; choose another id",
                type="MemoryIdTaken",
                non_retryable=True,
            )
        taken = await store.get_memory(inp.scope, memory_id)
        if taken is not None and (taken.text, taken.source_session, taken.corrects) != (
            inp.write.text,
            inp.session_id,
            inp.write.corrects,
        ):
            raise ApplicationError(
                f"write_memory: memory_id: {memory_id!r} is taken in scope {inp.scope!r}; memories are never "
                "overwritten: choose another id, or write a correction (corrects)",
                type="MemoryIdTaken",
                non_retryable=True,
            )
        await store.write_memory(
            inp.scope,
            memory_id,
            inp.write.text,
            trust=TrustLevel.USER.value,
            session_id=inp.session_id,
            corrects=inp.write.corrects,
        )
        _, _, cache = await self.state.session(inp.session_id)
        prefix, _ = await self.state.prefix(inp.session_id, inp.epoch, cache)
        return MemoryResult(memory_id=memory_id, correction_of_snapshot=inp.write.corrects in snapshot_ids(prefix))

    @activity.defn(name=names.ACTIVITY_DELETE_MEMORY)
    async def delete_memory(self, inp: DeleteMemoryInput) -> MemoryDeleted:
        """Delete a memory from the store (and so from recall and later snapshots); a snapshot holding it gets
        a correction line that withdraws it until the session's next epoch."""
        memory_id = inp.delete.memory_id
        deleted = await self.state.store.delete_memory(inp.scope, memory_id, reason=inp.delete.reason)
        _, _, cache = await self.state.session(inp.session_id)
        prefix, _ = await self.state.prefix(inp.session_id, inp.epoch, cache)
        in_snapshot = any(s.kind == "memory_snapshot" and s.item_id == f"memory.{memory_id}" for s in prefix.segments)
        log.info("memory.deleted", session_id=inp.session_id, turn=inp.turn, epoch=inp.epoch, memory_id=memory_id)
        return MemoryDeleted(memory_id=memory_id, deleted=deleted, in_snapshot=in_snapshot)

    @activity.defn(name=names.ACTIVITY_WORKING_STATE_WRITE)
    async def write_working_state(self, inp: WorkingStateInput) -> WorkingStateResult:
        """A runtime write (ADR-0020 decision 14): all operations or none, logged once per update id, seen from
        the next request on. Over a cap or naming an unknown id, it fails (non-retryable) and changes nothing."""
        state, store = self.state, self.state.store
        key = f"runtime:{inp.update_id}"
        written = await store.working_state_write_turn(inp.session_id, key)  # a retry's: the turn first logged
        if written is None:
            open_, secret, cache = await state.session(inp.session_id)
            prefix, profile = await state.prefix(inp.session_id, inp.epoch, cache)
            estimator = TokenEstimator(await state.profile(profile), state.counter(profile.encoding))
            budget = open_.context_budget(profile)
            cap = await working_state_cap(state, inp.session_id, open_.memory_scope, prefix, estimator, budget, secret)
            ws = working_state(await store.working_state_writes(inp.session_id), estimator.counter.count, inp.turn + 1)

            def attempt(update: WorkingStateUpdate) -> None:
                apply(
                    ws,
                    update,
                    writer="runtime",
                    count=lambda text: measure_working_state(text, estimator=estimator, secret=secret),
                    token_cap=cap,
                )

            try:
                attempt(inp.update)
            except ContextError as exc:
                message = f"update_working_state: {_failing_operation(inp.update, attempt)}: {exc}"
                await state.event(
                    inp.session_id,
                    f"ws_rejected:{key}",
                    EventType.WORKING_STATE_REJECTED,
                    inp.turn,
                    inp.epoch,
                    {"error": message, "writer": "runtime"},
                )
                raise ApplicationError(message, type=type(exc).__name__, non_retryable=True) from exc
            write = WorkingStateWrite(turn=inp.turn, writer="runtime", update=inp.update)
            await store.add_working_state_write(inp.session_id, key, inp.turn, write.model_dump(mode="json"))
            written = inp.turn
        writes = await store.working_state_writes(inp.session_id)
        ws = working_state(writes, state.counter("cl100k_base").count, inp.turn + 1)
        return WorkingStateResult(turn=written, working_state=render(ws))

    def all(self) -> list[Any]:
        return [self.write_memory, self.delete_memory, self.write_working_state]


def _failing_operation(update: WorkingStateUpdate, attempt: Callable[[WorkingStateUpdate], None]) -> str:
    """Names the first operation whose application (with those before it) fails: `operations[2] (add_constraint)`."""
    ops = update.operations
    for i in range(len(ops)):
        try:
            attempt(WorkingStateUpdate(operations=ops[: i + 1]))
        except ContextError:
            return f"operations[{i}] ({ops[i].op})"
    return "operations"
