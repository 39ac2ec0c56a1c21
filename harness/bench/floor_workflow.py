"""The floor for `ctxengine bench turns`: the least a durable turn can cost on Temporal.

`FloorWorkflow` (type `BenchFloorWorkflow`) is a bare session: its turn is an Update that runs two no-op
activities one after the other, the irreducible shape of an engine turn (build the context, call the
model), and returns. No store, no build, no provider, no search attributes, no current details. The
engine's `SessionWorkflow` does the same two round trips per plain turn plus the real work, so the
difference between the two, measured side by side on the same server and worker settings, is what the
engine costs.

Like `SessionWorkflow`, state is set in `@workflow.init` (an Update can arrive before the run method
starts), turns are serialised by a lock, and the run continues-as-new when Temporal suggests it, after
every handler has finished, so a long floor session stays within Temporal's history limits too.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.common import RetryPolicy

WORKFLOW_FLOOR = "BenchFloorWorkflow"
ACTIVITY_NOOP_BUILD = "bench.noop_build"
ACTIVITY_NOOP_MODEL = "bench.noop_model"
UPDATE_TURN = "turn"
UPDATE_CLOSE = "close"

# The same retry policy and timeouts the engine's turn activities use (workflows/session.py).
RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
)
TIMEOUT = timedelta(seconds=30)


class FloorInput(BaseModel):
    turns: int = 0  # carried across continue-as-new


class FloorTurn(BaseModel):
    text: str


class FloorStep(BaseModel):
    turn: int
    text: str


class FloorTurnResult(BaseModel):
    turn: int
    text: str


@activity.defn(name=ACTIVITY_NOOP_BUILD)
async def noop_build(step: FloorStep) -> FloorStep:
    """Stands in for build_context: returns its input, touches nothing."""
    return step


@activity.defn(name=ACTIVITY_NOOP_MODEL)
async def noop_model(step: FloorStep) -> FloorStep:
    """Stands in for call_model: returns its input, touches nothing."""
    return step


FLOOR_ACTIVITIES = [noop_build, noop_model]


@workflow.defn(name=WORKFLOW_FLOOR)
class FloorWorkflow:
    @workflow.init
    def __init__(self, inp: FloorInput) -> None:
        self.turns = inp.turns
        self.closed = False
        self.lock = asyncio.Lock()

    @workflow.run
    async def run(self, inp: FloorInput) -> int:
        await workflow.wait_condition(
            lambda: self.closed or (not self.lock.locked() and workflow.info().is_continue_as_new_suggested())
        )
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self.closed:
            return self.turns
        workflow.continue_as_new(FloorInput(turns=self.turns))

    @workflow.update(name=UPDATE_TURN)
    async def turn(self, inp: FloorTurn) -> FloorTurnResult:
        async with self.lock:
            self.turns += 1
            step = FloorStep(turn=self.turns, text=inp.text)
            # By name with a result type, as the engine calls its activities.
            built: FloorStep = await workflow.execute_activity(
                ACTIVITY_NOOP_BUILD, step, start_to_close_timeout=TIMEOUT, retry_policy=RETRY, result_type=FloorStep
            )
            replied: FloorStep = await workflow.execute_activity(
                ACTIVITY_NOOP_MODEL, built, start_to_close_timeout=TIMEOUT, retry_policy=RETRY, result_type=FloorStep
            )
            return FloorTurnResult(turn=replied.turn, text=replied.text)

    @turn.validator
    def _validate_turn(self, inp: FloorTurn) -> None:
        if self.closed:
            raise ValueError("the floor session is closed")
        if not inp.text.strip():
            raise ValueError("turn: text must not be blank")

    @workflow.update(name=UPDATE_CLOSE)
    async def close(self) -> int:
        async with self.lock:
            self.closed = True
            return self.turns
