"""A build on a worker whose memo is current runs on its guess of what the read will bring while the read is on its
way (`SessionState.guess_reads`), and keeps it only when the read brought exactly that (`guessed_right`). On a real
PostgreSQL, the activities in an ActivityEnvironment (no Temporal): another worker changes what the next build reads
(the log, the working state, a memory recall finds, the route's calibration, the checkpoint, a correction of a
snapshot memory) between two builds of this worker, whose memo cannot know; the build must show the change. With
the read's confirmation taken away (the fault: every guess taken as right), each check fails."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import session_state
from activities.providers import build_providers
from activities.rows import RequestRecord, TurnReads
from activities.session import SessionActivities
from activities.session_state import SessionState
from activities.store import Store
from contract.payloads import BuildInput, MemoryInput, ModelInput, WorkingStateInput
from core.compaction import Checkpoint
from core.working_state import WorkingStateUpdate
from harness.bench import cold_build
from harness.bench.cold_build import session_open
from harness.bench.turns_bench import _plain_text
from tests.integration import session_helpers

pytestmark = pytest.mark.integration

NOW = "2026-01-01T00:00:00+00:00"


class Verdicts:
    """The read's verdicts on the guesses (`SessionState.guessed_right`), recorded; `trusting`: every guess is
    taken as right (the fault)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, trusting: bool) -> None:
        self.seen: list[bool] = []
        judge = SessionState.guessed_right

        def guessed_right(guess: TurnReads, reads: TurnReads) -> bool:
            verdict = judge(guess, reads)
            self.seen.append(verdict)
            return True if trusting else verdict

        monkeypatch.setattr(SessionState, "guessed_right", staticmethod(guessed_right))


async def _turn(acts: SessionActivities, session_id: str, turn: int, text: str) -> str:
    """One turn on `acts`: its build and its model call. Returns the request's hash."""
    built = await ActivityEnvironment().run(
        acts.build.build_context,
        BuildInput(
            session_id=session_id, turn=turn, call_index=0, epoch=1, now_iso=NOW, user_text=text, update_id=f"u{turn}"
        ),
    )
    sha = built.plan.request_sha256
    await ActivityEnvironment().run(
        acts.model_call.call_model,
        ModelInput(session_id=session_id, turn=turn, call_index=0, epoch=1, request_sha256=sha),
    )
    return sha


async def _record(store: Store, session_id: str, turn: int) -> RequestRecord:
    record = await store.get_record(session_id, turn, 0)
    assert record is not None
    return record


# Each change another worker makes between two builds of this one: (make it, check that the next build shows it).
Change = Callable[[SessionActivities, str, int], Awaitable[Any]]
Check = Callable[[SessionActivities, Store, str, int, Any], Awaitable[None]]


async def _log_item(other: SessionActivities, session_id: str, turn: int) -> str:
    """A reply logged by the other worker (as a late attempt's would be)."""
    _, _, memo = await other.state.session(session_id)
    await other.state.items(session_id, memo)
    item = {"id": f"late{turn}", "kind": "assistant_message", "trust": "MODEL", "text": "A late reply."}
    await other.state.append(session_id, turn - 1, [item], memo)
    return item["id"]


async def _shows_item(acts: SessionActivities, store: Store, session_id: str, turn: int, item_id: str) -> None:
    record = await _record(store, session_id, turn)
    memo = acts.state.cached(session_id)
    assert memo is not None
    built = memo.built[record.request_sha256]
    assert item_id in [s.item_id for s in built.segments], "the build did not show the item logged since its memo"


async def _write_working_state(other: SessionActivities, session_id: str, turn: int) -> str:
    text = "Trains only, never flights."
    await ActivityEnvironment().run(
        other.memory.write_working_state,
        WorkingStateInput(
            session_id=session_id,
            update_id=f"ws{turn}",
            turn=turn,
            epoch=1,
            update=WorkingStateUpdate.model_validate({"operations": [{"op": "add_constraint", "text": text}]}),
        ),
    )
    return text


async def _shows_working_state(acts: SessionActivities, store: Store, session_id: str, turn: int, text: str) -> None:
    record = await _record(store, session_id, turn)
    assert text in record.inputs["working_state"], "the build did not show the working-state write"


async def _memory(other: SessionActivities, session_id: str, turn: int, write: dict[str, Any]) -> str:
    """A memory written by the other worker in the session's scope (an update's write); its id."""
    open_, _, _ = await other.state.session(session_id)
    await ActivityEnvironment().run(
        other.memory.write_memory,
        MemoryInput.model_validate(
            {
                "session_id": session_id,
                "scope": open_.memory_scope,
                "write": write,
                "update_id": f"mem{turn}",
                "turn": turn,
                "epoch": 1,
            }
        ),
    )
    return str(write["memory_id"])


async def _memory_ids(store: Store, session_id: str, turn: int, shown_as: str) -> list[str]:
    """The memories turn `turn`'s build showed as `shown_as` (its record's inputs: "recall" or "corrections")."""
    record = await _record(store, session_id, turn)
    return [m["memory_id"] for m in record.inputs[shown_as]]


async def _write_memory(other: SessionActivities, session_id: str, turn: int) -> str:
    return await _memory(
        other, session_id, turn, {"text": "The user travels by night train to Vienna.", "memory_id": f"m{turn}"}
    )


async def _recalls_memory(acts: SessionActivities, store: Store, session_id: str, turn: int, memory_id: str) -> None:
    recalled = await _memory_ids(store, session_id, turn, "recall")
    assert memory_id in recalled, "the build did not recall the memory written since its memo"


async def _correct_memory(other: SessionActivities, session_id: str, turn: int) -> str:
    """A correction of the session's snapshot memory (`SNAPSHOT_MEMORY`), written by the other worker."""
    write = {"text": "The user moved to Oslo.", "memory_id": f"c{turn}", "corrects": SNAPSHOT_MEMORY}
    return await _memory(other, session_id, turn, write)


async def _shows_correction(acts: SessionActivities, store: Store, session_id: str, turn: int, memory_id: str) -> None:
    corrections = await _memory_ids(store, session_id, turn, "corrections")
    assert memory_id in corrections, "the build did not show the correction of its snapshot memory"


async def _write_checkpoint(other: SessionActivities, session_id: str, turn: int) -> str:
    """A checkpoint over the session's first two turns (positions 0-3), as another worker's compaction writes one."""
    checkpoint = Checkpoint(
        checkpoint_id=f"cp{turn}", depth=1, covers_from_seq=0, covers_to_seq=3, summary="The user asked about shards."
    )
    await other.state.store.put_checkpoint(session_id, checkpoint.model_dump(mode="json"))
    return checkpoint.checkpoint_id


async def _shows_checkpoint(acts: SessionActivities, store: Store, session_id: str, turn: int, cp: str) -> None:
    record = await _record(store, session_id, turn)
    assert record.inputs["checkpoint_id"] == cp, "the build did not take the checkpoint written since its memo"


async def _move_calibration(other: SessionActivities, session_id: str, turn: int) -> float:
    _, _, memo = await other.state.session(session_id)
    _, profile = await other.state.prefix(session_id, 1, memo)
    await other.state.store.set_calibration(profile.route, 1.375)
    return 1.375


async def _calibrated(acts: SessionActivities, store: Store, session_id: str, turn: int, value: float) -> None:
    record = await _record(store, session_id, turn)
    assert record.inputs["profile"]["calibration"] == value, "the build did not take the route's new calibration"


CHANGES: dict[str, tuple[Change, Check]] = {
    "logged_item": (_log_item, _shows_item),
    "working_state": (_write_working_state, _shows_working_state),
    "memory": (_write_memory, _recalls_memory),
    "calibration": (_move_calibration, _calibrated),
    "checkpoint": (_write_checkpoint, _shows_checkpoint),
    "correction": (_correct_memory, _shows_correction),
}
SNAPSHOT_MEMORY = "home"


async def _seeded(store: Store) -> tuple[str, int, SessionActivities, SessionActivities]:
    """A session of 12 logged items, in a memory scope of its own whose one memory (`SNAPSHOT_MEMORY`) its open took
    into its snapshot; its next turn; this worker's activities and the other's."""
    await store.migrate()
    scope = f"guess-{uuid.uuid4().hex[:8]}"
    await store.write_memory(
        scope, SNAPSHOT_MEMORY, "The user lives in Bergen.", trust="USER", session_id=None, corrects=None
    )
    session_id, last = await cold_build.seed(store, 12, session_open().model_copy(update={"memory_scope": scope}))
    providers = build_providers()
    return session_id, last + 1, SessionActivities(store, providers), SessionActivities(store, providers)


async def test_a_current_memo_builds_on_its_guess_and_the_request_is_a_cold_workers(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turns on one worker: from the second on (its memo current) the read confirms the guess each time and the
    guessed build is kept; its request is the one a worker that has never seen the session builds of the same
    turn from what is stored (the same hash)."""
    verdicts = Verdicts(monkeypatch, trusting=False)
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, acts, _ = await _seeded(store)
        for k in range(4):
            await _turn(acts, session_id, turn + k, f"What is the status of order {k}?")
        assert verdicts.seen[-3:] == [True, True, True]
        # The next turn, built here on the guess, then again (its message logged) by a fresh worker.
        last = turn + 4
        built = await ActivityEnvironment().run(
            acts.build.build_context,
            BuildInput(session_id=session_id, turn=last, call_index=0, epoch=1, now_iso=NOW, user_text="And now?"),
        )
        assert verdicts.seen[-1] is True
        cold = SessionActivities(store, build_providers())
        again = await ActivityEnvironment().run(
            cold.build.build_context,
            BuildInput(session_id=session_id, turn=last, call_index=0, epoch=1, now_iso=NOW, user_item_id=f"u:{last}"),
        )
        assert again.plan.request_sha256 == built.plan.request_sha256


async def _changed_then_built(
    store: Store, monkeypatch: pytest.MonkeyPatch, change: str, *, trusting: bool
) -> tuple[list[bool], Callable[[], Awaitable[None]]]:
    """Two turns on this worker, `change` made by the other, a third turn built here: the verdicts, and the
    change's check of the third turn's build (raising when the build could not be made)."""
    make, check = CHANGES[change]
    verdicts = Verdicts(monkeypatch, trusting=trusting)
    session_id, turn, acts, other = await _seeded(store)
    await _turn(acts, session_id, turn, "What is the status of my order?")
    await _turn(acts, session_id, turn + 1, "Which trains go there?")
    made = await make(other, session_id, turn + 2)
    await _turn(acts, session_id, turn + 2, "Which night trains go to Vienna?")

    async def checked() -> None:
        await check(acts, store, session_id, turn + 2, made)

    return verdicts.seen, checked


@pytest.mark.parametrize("change", sorted(CHANGES))
async def test_a_change_the_memo_cannot_know_is_shown(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The read finds what changed since the memo's last read: the guess is refused, and the build made of what
    was read shows the change."""
    async with Store.from_dsn(pg_dsn) as store:
        seen, checked = await _changed_then_built(store, monkeypatch, change, trusting=False)
        assert seen[-1] is False  # the third build's guess, refused by its read
        await checked()


@pytest.mark.parametrize("change", sorted(CHANGES))
async def test_taking_every_guess_misses_the_change(pg_dsn: str, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """The fault: every guess taken as right. The build made of the memo misses the change, and the check above
    says so (a logged item fails the build's write instead: the log moved under it)."""
    async with Store.from_dsn(pg_dsn) as store:
        try:
            _, checked = await _changed_then_built(store, monkeypatch, change, trusting=True)
        except ApplicationError as exc:
            assert change == "logged_item" and exc.type == "LogMoved"
            return
        with pytest.raises(AssertionError, match="the build did not"):
            await checked()


async def test_a_worker_guesses_only_as_the_activity_its_run_scheduled_next_after_its_last(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activity ids as a workflow run gives them (its activities' sequence numbers): a build guesses when it is the
    activity the run scheduled next after this worker's last (its own model call), not after another worker ran
    one in between (whose writes its memo has not seen), nor in another run of the session."""
    verdicts = Verdicts(monkeypatch, trusting=False)
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, here, there = await _seeded(store)
        ids = itertools.count(1)

        async def run(acts: SessionActivities, k: int, *, run_id: str = "run-1") -> None:
            """Turn `turn + k`'s build on this worker, its model call on `acts`, with the run's next activity ids."""
            envs = [ActivityEnvironment(), ActivityEnvironment()]
            for env in envs:
                env.info = dataclasses.replace(env.info, workflow_run_id=run_id, activity_id=str(next(ids)))
            built = await envs[0].run(
                here.build.build_context,
                BuildInput(
                    session_id=session_id, turn=turn + k, call_index=0, epoch=1, now_iso=NOW, user_text=f"Turn {k}?"
                ),
            )
            await envs[1].run(
                acts.model_call.call_model,
                ModelInput(
                    session_id=session_id,
                    turn=turn + k,
                    call_index=0,
                    epoch=1,
                    request_sha256=built.plan.request_sha256,
                ),
            )

        await run(here, 0)  # activities 1, 2: the memo's first read
        await run(there, 1)  # 3 guesses (after 2, here); 4 runs on the other worker
        assert verdicts.seen == [True]
        await run(here, 2)  # 5 does not guess: 4 ran elsewhere (and logged the reply); 6 runs here
        assert verdicts.seen == [True]
        await run(here, 3)  # 7 guesses again
        assert verdicts.seen == [True, True]
        await run(here, 4, run_id="run-2")  # a new run of the session (continue-as-new): its first build reads first
        assert verdicts.seen == [True, True]


async def test_a_session_on_one_worker_builds_each_turn_after_its_first_on_the_guess(
    temporal_client: Client, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's workflow on one worker (the real Temporal server and its activity ids): from its second turn
    on, each build is the activity after its turn's model call before, guesses, and the read confirms the guess."""
    verdicts = Verdicts(monkeypatch, trusting=False)
    queue = f"guess-{uuid.uuid4().hex[:8]}"
    async with session_helpers.stack(temporal_client, pg_dsn, queue):
        handle = await session_helpers.start(temporal_client, queue)
        for k in range(4):
            await session_helpers.turn(handle, _plain_text(k))
    assert verdicts.seen == [True, True, True]


async def test_a_worker_running_other_activities_does_not_guess(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that runs other activities meanwhile (other sessions' turns) does not guess: they take its loop while
    the read is on its way, and their model calls move the route's calibration under the guess. With only the build
    running, the same memo guesses."""
    verdicts = Verdicts(monkeypatch, trusting=False)
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, acts, _ = await _seeded(store)
        await _turn(acts, session_id, turn, "What is the status of my order?")
        monkeypatch.setattr(session_state, "activities_running", lambda: 3)
        await _turn(acts, session_id, turn + 1, "Which trains go there?")
        assert verdicts.seen == []
        monkeypatch.setattr(session_state, "activities_running", lambda: 1)
        await _turn(acts, session_id, turn + 2, "Which night trains go to Vienna?")
        assert verdicts.seen == [True]


async def test_a_build_of_the_request_built_last_reads_first(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request this worker built last, built again (as the turn does after a compaction or the provider's
    refusal, because what its read brings changed), reads before it builds: its guess, the last read, would be wrong
    by design. It is the same request here (nothing changed), and the next turn's build guesses again."""
    verdicts = Verdicts(monkeypatch, trusting=False)
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, acts, _ = await _seeded(store)
        await _turn(acts, session_id, turn, "What is the status of my order?")
        build = BuildInput(
            session_id=session_id, turn=turn + 1, call_index=0, epoch=1, now_iso=NOW, user_text="And the trains?"
        )
        first = await ActivityEnvironment().run(acts.build.build_context, build)
        assert verdicts.seen == [True]
        again = await ActivityEnvironment().run(
            acts.build.build_context,
            build.model_copy(update={"user_text": None, "user_item_id": first.user_item_id}),
        )
        assert verdicts.seen == [True]  # read first: no guess to judge
        assert again.plan.request_sha256 == first.plan.request_sha256
        await _turn(acts, session_id, turn + 2, "Which night trains go to Vienna?")
        assert verdicts.seen == [True, True]


async def test_a_build_cancelled_while_its_read_is_on_its_way_ends_the_read_first(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled (as Temporal cancels an activity) once its read is sent and before it builds on its guess: the read
    is over when the build's call ends, and its connection back in the pool. Before, the read was cancelled and left
    to end later, holding a connection past the activity (a race with the pool's close at the worker's shutdown)."""
    async with Store.from_dsn(pg_dsn) as store:
        session_id, turn, acts, _ = await _seeded(store)
        await _turn(acts, session_id, turn, "What is the status of my order?")
        env = ActivityEnvironment()
        reading: list[asyncio.Task[Any]] = []
        read_turn = acts.state.read_turn

        async def cancelled_read(*args: Any, **kwargs: Any) -> TurnReads:
            reading.append(asyncio.current_task())  # type: ignore[arg-type]
            env.cancel()  # the build has sent its read and waits for its turn to build
            return await read_turn(*args, **kwargs)

        monkeypatch.setattr(acts.state, "read_turn", cancelled_read)
        with pytest.raises(asyncio.CancelledError):
            await env.run(
                acts.build.build_context,
                BuildInput(session_id=session_id, turn=turn + 1, call_index=0, epoch=1, now_iso=NOW, user_text="Hi?"),
            )
        assert len(reading) == 1 and reading[0].done()
        assert store.pool.get_idle_size() == store.pool.get_size()
