"""What the workflows call: every activity's permanent name, input and result, as method signatures.

Workflows call these by reference (`workflow.execute_activity_method(SessionActivityCalls.build_context, ...)`),
so a renamed activity or a changed input or result type is a type error, not a failure at run time. The
implementations in `activities/` subclass these classes and register under the same names; workflows never
import them (docs/architecture.md).
"""

from __future__ import annotations

from temporalio import activity

from contract import names
from contract.payloads import (
    BuildInput,
    BuildResult,
    CloseInput,
    CompactionInput,
    CompactionOutcome,
    CompactionStep,
    DeleteMemoryInput,
    EventInput,
    FormationInput,
    FormationResult,
    MemoryDeleted,
    MemoryInput,
    MemoryResult,
    ModelInput,
    ModelResult,
    OpenInput,
    OpenResult,
    SealTurnInput,
    SummarizeInput,
    ToolInput,
    ToolResultSummary,
    WorkingStateInput,
    WorkingStateResult,
)


class SessionLifecycleCalls:
    """Open an epoch, seal a failed turn, close (implemented in `activities/lifecycle.py`)."""

    @activity.defn(name=names.ACTIVITY_OPEN)
    async def open_session(self, inp: OpenInput) -> OpenResult:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_SEAL_TURN)
    async def seal_turn(self, inp: SealTurnInput) -> int:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_CLOSE)
    async def close_session(self, inp: CloseInput) -> None:
        raise NotImplementedError


class BuildCalls:
    """Build a request (implemented in `activities/build.py`)."""

    @activity.defn(name=names.ACTIVITY_BUILD)
    async def build_context(self, inp: BuildInput) -> BuildResult:
        raise NotImplementedError


class ModelCalls:
    """Call the model (implemented in `activities/model_call.py`)."""

    @activity.defn(name=names.ACTIVITY_MODEL)
    async def call_model(self, inp: ModelInput) -> ModelResult:
        raise NotImplementedError


class ToolCalls:
    """Run a tool call (implemented in `activities/tool_calls.py`)."""

    @activity.defn(name=names.ACTIVITY_TOOL)
    async def execute_tool(self, inp: ToolInput) -> ToolResultSummary:
        raise NotImplementedError


class MemoryCalls:
    """The runtime's writes: memories and the working state (implemented in `activities/memory.py`)."""

    @activity.defn(name=names.ACTIVITY_WRITE_MEMORY)
    async def write_memory(self, inp: MemoryInput) -> MemoryResult:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_DELETE_MEMORY)
    async def delete_memory(self, inp: DeleteMemoryInput) -> MemoryDeleted:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_WORKING_STATE_WRITE)
    async def write_working_state(self, inp: WorkingStateInput) -> WorkingStateResult:
        raise NotImplementedError


class EventCalls:
    """Record an event the workflow decides (implemented in `activities/events.py`)."""

    @activity.defn(name=names.ACTIVITY_EVENT)
    async def record_event(self, inp: EventInput) -> None:
        raise NotImplementedError


class SessionActivityCalls(SessionLifecycleCalls, BuildCalls, ModelCalls, ToolCalls, MemoryCalls, EventCalls):
    """Every session activity, one family per base class: what the session and turn workflows call."""


class CompactionActivityCalls:
    """Compaction and memory formation (implemented by `activities.compaction.CompactionActivities`)."""

    @activity.defn(name=names.ACTIVITY_COMPACTION_PLAN)
    async def plan(self, inp: CompactionInput) -> CompactionStep:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_COMPACTION_SUMMARIZE)
    async def summarize(self, inp: SummarizeInput) -> int:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_COMPACTION_COMMIT)
    async def commit(self, inp: CompactionInput) -> CompactionOutcome:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_COMPACTION_ESCALATE)
    async def escalate(self, inp: CompactionInput) -> CompactionOutcome:
        raise NotImplementedError

    @activity.defn(name=names.ACTIVITY_MEMORY_FORM)
    async def form_memories(self, inp: FormationInput) -> FormationResult:
        raise NotImplementedError
