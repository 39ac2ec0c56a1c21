"""The worker's workflow runner (`worker.SandboxedRunner`): the payload codec's serialization-context lookups go
straight to the sandboxed instance instead of through a line of code run in the sandbox, and give what the SDK's
own sandboxed runner gives. Checked on a real Temporal server: a codec that records the context of every payload
sequence it is given, the same session run under each runner."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import CommandType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import (
    ActivitySerializationContext,
    PayloadCodec,
    SerializationContext,
    WithSerializationContext,
    WorkflowSerializationContext,
)
from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails, WorkflowRunner
from temporalio.worker._command_aware_visitor import CommandInfo
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox._runner import _Instance as SandboxedInstance
from temporalio.workflow import _Definition

from contract import names
from tests.integration.session_helpers import stack, start, turn
from worker import DirectLookups, SandboxedRunner
from workflows.session import SessionWorkflow

pytestmark = pytest.mark.integration

Seen = tuple[str, str | None, bool | None]  # a context's kind, its activity type, whether local


class RecordingCodec(PayloadCodec, WithSerializationContext):
    """Changes nothing; notes the serialization context it was given for each payload sequence it encodes or
    decodes (workflow and activity ids left out: they differ between sessions)."""

    def __init__(self, seen: list[Seen], context: SerializationContext | None = None) -> None:
        self.seen, self.context = seen, context

    def with_context(self, context: SerializationContext) -> RecordingCodec:
        return RecordingCodec(self.seen, context)

    def _note(self) -> None:
        ctx = self.context
        if isinstance(ctx, ActivitySerializationContext):
            self.seen.append(("activity", ctx.activity_type, ctx.is_local))
        else:
            self.seen.append((type(ctx).__name__, None, None))

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        self._note()
        return list(payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        self._note()
        return list(payloads)


class NoActivityContexts(SandboxedRunner):
    """The fault: lookups that miss the activities' contexts (a codec keyed by activity would then use the
    workflow's)."""

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        instance = super().create_instance(det)
        lookup = instance.get_serialization_context

        def missing(command_info: CommandInfo | None) -> Any:
            found = lookup(command_info)
            return None if isinstance(found, ActivitySerializationContext) else found

        instance.get_serialization_context = missing  # type: ignore[method-assign]
        return instance


async def _contexts(client: Client, dsn: str, task_queue: str, runner: WorkflowRunner) -> Counter[Seen]:
    """The contexts a codec saw over a session's opening turn and one plain turn, run under `runner`."""
    seen: list[Seen] = []
    converter = dataclasses.replace(pydantic_data_converter, payload_codec=RecordingCodec(seen))
    config = client.config()
    config["data_converter"] = converter
    recording = Client(**config)
    async with stack(recording, dsn, task_queue, workflow_runner=runner):
        handle = await start(recording, task_queue)
        for text in ("Open the session.", "A plain turn: acknowledge."):
            result = await turn(handle, text)
            assert result.text and result.model_calls == 1
        await handle.terminate(reason="test done")
    return Counter(seen)


async def test_the_runner_gives_the_sdk_runners_contexts(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    stock = await _contexts(temporal_client, pg_dsn, task_queue + "-sdk", SandboxedWorkflowRunner())
    direct = await _contexts(temporal_client, pg_dsn, task_queue + "-direct", SandboxedRunner())
    # The turn's activities were encoded and decoded with their own contexts, by the workflow and the activity.
    assert stock[("activity", names.ACTIVITY_BUILD, False)] > 0 and stock[("activity", names.ACTIVITY_MODEL, False)] > 0
    assert direct == stock
    # The fault is seen: without the activities' contexts the codec sees other contexts than the SDK's runner.
    broken = await _contexts(temporal_client, pg_dsn, task_queue + "-broken", NoActivityContexts())
    assert broken != stock
    assert broken[("activity", names.ACTIVITY_BUILD, False)] < stock[("activity", names.ACTIVITY_BUILD, False)]


CREATED: list[WorkflowInstance] = []


class Captured(SandboxedRunner):
    """The runner, keeping the instances it creates (the SDK creates one to check a workflow at registration)."""

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        instance = super().create_instance(det)
        CREATED.append(instance)
        return instance


async def test_the_lookups_skip_the_sandbox_and_answer_as_it_does() -> None:
    """The fast path is taken (an SDK release that renames the sandboxed instance fails here, not silently slows
    down), and each lookup answers what the same lookup run through the sandbox answers."""
    Captured().prepare_workflow(_Definition.must_from_class(SessionWorkflow))
    instance = CREATED[-1]
    assert isinstance(instance, DirectLookups) and instance.in_sandbox is not None
    commands = [
        None,
        CommandInfo(command_type=CommandType.COMMAND_TYPE_SCHEDULE_ACTIVITY_TASK, command_seq=1),
        CommandInfo(command_type=CommandType.COMMAND_TYPE_START_CHILD_WORKFLOW_EXECUTION, command_seq=1),
    ]
    for command in commands:
        direct = instance.get_serialization_context(command)
        assert direct == SandboxedInstance.get_serialization_context(instance, command)
        assert instance.get_external_store_context(command) == SandboxedInstance.get_external_store_context(
            instance, command
        )
    assert isinstance(instance.get_serialization_context(None), WorkflowSerializationContext)
