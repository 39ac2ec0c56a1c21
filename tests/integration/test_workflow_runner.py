"""The worker's workflow runner (`worker.SandboxedRunner`): the payload codec's serialization-context lookups go
straight to the sandboxed instance instead of through a line of code run in the sandbox, and give what the SDK's
own sandboxed runner gives. Checked on a real Temporal server: a codec that records the context of every payload
sequence it is given, the same session run under each runner."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import CommandType
from temporalio.client import Client
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
from contract.converter import DATA_CONVERTER
from tests.integration.session_helpers import stack, start, turn
from worker import DirectLookups, SandboxedRunner
from workflows.session import SessionWorkflow

pytestmark = pytest.mark.integration

Seen = tuple[str, str | None, bool | None]  # a context's kind, its activity type, whether local


class RecordingCodec(PayloadCodec, WithSerializationContext):
    """Changes nothing; notes, for each payload it encodes or decodes (by its bytes), the serialization context it
    was given (workflow and activity ids left out: they differ between sessions)."""

    def __init__(self, seen: dict[bytes, set[Seen]], context: SerializationContext | None = None) -> None:
        self.seen, self.context = seen, context

    def with_context(self, context: SerializationContext) -> RecordingCodec:
        return RecordingCodec(self.seen, context)

    def _note(self, payloads: Sequence[Payload]) -> list[Payload]:
        ctx = self.context
        kind: Seen = (
            ("activity", ctx.activity_type, ctx.is_local)
            if isinstance(ctx, ActivitySerializationContext)
            else (type(ctx).__name__, None, None)
        )
        for payload in payloads:
            self.seen.setdefault(payload.data, set()).add(kind)
        return list(payloads)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return self._note(payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return self._note(payloads)


class WorkflowContextForActivities(SandboxedRunner):
    """The fault: lookups that answer the workflow's context for an activity's command (a codec keyed by activity
    would then encode the activity's input with another key than the activity worker decodes it with)."""

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        instance = super().create_instance(det)
        lookup = instance.get_serialization_context

        def wrong(command_info: CommandInfo | None) -> Any:
            found = lookup(command_info)
            return lookup(None) if isinstance(found, ActivitySerializationContext) else found

        instance.get_serialization_context = wrong  # type: ignore[method-assign]
        return instance


async def _contexts(client: Client, dsn: str, task_queue: str, runner: WorkflowRunner) -> list[frozenset[Seen]]:
    """Over a session's opening turn and one plain turn run under `runner`: for each payload that names the
    session (the activities' inputs), the contexts it was encoded and decoded with, by the workflow, the activity
    worker and the client. How many workflow tasks a session takes depends on timing; what each payload is coded
    with does not."""
    seen: dict[bytes, set[Seen]] = {}
    converter = dataclasses.replace(DATA_CONVERTER, payload_codec=RecordingCodec(seen))
    config = client.config()
    config["data_converter"] = converter
    recording = Client(**config)
    async with stack(recording, dsn, task_queue, workflow_runner=runner):
        handle = await start(recording, task_queue)
        for text in ("Open the session.", "A plain turn: acknowledge."):
            result = await turn(handle, text)
            assert result.text and result.model_calls == 1
        await handle.terminate(reason="test done")
    return sorted((frozenset(kinds) for data, kinds in seen.items() if handle.id.encode() in data), key=sorted)


async def test_the_runner_gives_the_sdk_runners_contexts(temporal_client: Client, pg_dsn: str, task_queue: str) -> None:
    stock = await _contexts(temporal_client, pg_dsn, task_queue + "-sdk", SandboxedWorkflowRunner())
    # Each activity's input is coded with that activity's context, by the workflow and the activity alike.
    assert all(len(kinds) == 1 for kinds in stock)
    assert frozenset({("activity", names.ACTIVITY_BUILD, False)}) in stock
    assert frozenset({("activity", names.ACTIVITY_MODEL, False)}) in stock
    direct = await _contexts(temporal_client, pg_dsn, task_queue + "-direct", SandboxedRunner())
    assert direct == stock
    # The fault is seen: the workflow encodes the inputs with its own context, the activity decodes them with theirs.
    broken = await _contexts(temporal_client, pg_dsn, task_queue + "-broken", WorkflowContextForActivities())
    assert broken != stock
    mixed = {("WorkflowSerializationContext", None, None), ("activity", names.ACTIVITY_BUILD, False)}
    assert frozenset(mixed) in broken


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
