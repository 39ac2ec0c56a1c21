"""Cold builds for `ctxengine bench turns`: a worker process that has never seen the session builds its context.

`seed()` opens a session through the open activity (no workflow: the session row and its epoch-1 prefix, as a
real open stores them) and appends a history of `items` items through the store, in the proportions of the
build bench's history (`harness.bench.build_bench`): plain exchanges, and one turn in five with a tool pair.

`measure()` runs in a fresh Python process (`python -m harness.bench.cold_build`): it imports the worker's code,
builds one untimed context on a throwaway session (imports, tokenizer, connection pool), then times `rounds`
builds of the seeded session, each by a fresh activities object, so each is what a worker that has not seen
the session does (after a crash, on a second worker, after its cache evicted the session): read the session
from PostgreSQL, build, store the request. Each round is a new turn (its user message is appended first). The
PostgreSQL round trips of each build are counted by the same pool wrapper as the rest of the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from typing import Any

from temporalio.testing import ActivityEnvironment

from activities.providers import build_providers
from activities.session import SessionActivities
from activities.store import Store
from activities.tools import DEMO_TOOLS
from contract.payloads import BuildInput, OpenInput, SessionOpen
from harness.bench.measure import CountingPool, DbCounts, percentile
from worker import tuned_gc

NOW = "2026-01-01T00:00:00+00:00"
TOOL_EVERY = 5  # one turn in five makes one tool call (a call and its result)
APPEND_BATCH = 500
ROUTE = {"provider": "scripted", "model": "bench-cold"}


def session_open() -> SessionOpen:
    return SessionOpen.model_validate(
        {
            "agent_instructions": "You are a careful research assistant. Answer briefly and cite what tools return.",
            "tools": DEMO_TOOLS,
            "model_route": ROUTE,
        }
    )


def _history(items: int) -> list[tuple[int, dict[str, Any]]]:
    """`items` (turn, item) pairs: a user message and a reply per turn, a tool pair in one turn of five."""
    out: list[tuple[int, dict[str, Any]]] = []
    turn = 0
    while len(out) < items:
        turn += 1
        out.append(
            (
                turn,
                {
                    "id": f"u:{turn}",
                    "kind": "user_message",
                    "trust": "USER",
                    "text": f"Turn {turn}: please check the migration status of shard {turn % 17} and summarise it.",
                },
            )
        )
        if turn % TOOL_EVERY == 0:
            call_id = f"call_t{turn}_m0_0"
            out.append(
                (
                    turn,
                    {
                        "id": f"t{turn}.m0.call0",
                        "kind": "tool_call",
                        "trust": "MODEL",
                        "call_id": call_id,
                        "tool_name": "notes.save",
                        "arguments": {"text": f"shard {turn % 17} checked at turn {turn}"},
                    },
                )
            )
            out.append(
                (
                    turn,
                    {
                        "id": f"t{turn}.m0.call0.result",
                        "kind": "tool_result",
                        "trust": "TOOL",
                        "call_id": call_id,
                        "tool_name": "notes.save",
                        "content": f"saved note {turn}: shard {turn % 17} is migrated; 0 rows behind.",
                        "is_error": False,
                        "artifact_ref": None,
                    },
                )
            )
        out.append(
            (
                turn,
                {
                    "id": f"t{turn}.m{1 if turn % TOOL_EVERY == 0 else 0}.text",
                    "kind": "assistant_message",
                    "trust": "MODEL",
                    "text": f"Shard {turn % 17} is migrated and nothing is behind; I noted it (turn {turn}).",
                },
            )
        )
    return out[:items]


async def seed(store: Store, items: int, open_: SessionOpen | None = None) -> tuple[str, int]:
    """A session opened (as `open_`, `session_open()` by default) by the open activity with `items` logged items.
    Returns its id and its last turn."""
    session_id = f"bench-cold-{items}-{uuid.uuid4().hex[:8]}"
    acts = SessionActivities(store, build_providers())
    await ActivityEnvironment().run(
        acts.lifecycle.open_session,
        OpenInput(session_id=session_id, open=open_ or session_open(), owner=f"run-{session_id}"),
    )
    _, _, cache = await acts.state.session(session_id)
    history = _history(items)
    for start in range(0, len(history), APPEND_BATCH):
        batch = history[start : start + APPEND_BATCH]
        by_turn: dict[int, list[dict[str, Any]]] = {}
        for turn, item in batch:
            by_turn.setdefault(turn, []).append(item)
        for turn, turn_items in by_turn.items():
            # As the activities log them: each item with its render and count (render once, at write time).
            await acts.state.append(session_id, turn, turn_items, cache)
    return session_id, history[-1][0]


async def _measure(dsn: str, session_id: str, last_turn: int, rounds: int) -> dict[str, Any]:
    async with Store.from_dsn(dsn) as store:
        with tuned_gc():  # a started worker's garbage-collector settings (worker.py: once its worker started)
            return await _timed_builds(store, session_id, last_turn, rounds)


async def _timed_builds(store: Store, session_id: str, last_turn: int, rounds: int) -> dict[str, Any]:
    """`rounds` builds of the seeded session, each by a fresh activities object (a worker that has not seen it)."""
    db = DbCounts()
    counted = Store(CountingPool(store.pool, db))
    providers = build_providers()
    # Untimed: the process's first build (imports, tokenizer, pool) on a throwaway session.
    warm_id, warm_turn = await seed(store, 20)
    await ActivityEnvironment().run(
        SessionActivities(counted, providers).build.build_context,
        BuildInput(session_id=warm_id, turn=warm_turn + 1, call_index=0, epoch=1, now_iso=NOW, user_text="hi"),
    )
    times: list[float] = []
    trips: list[int] = []
    for r in range(rounds):
        acts = SessionActivities(counted, providers)  # a worker that has never seen the session
        turn = last_turn + 1 + r
        inp = BuildInput(
            session_id=session_id,
            turn=turn,
            call_index=0,
            epoch=1,
            now_iso=NOW,
            user_text=f"Turn {turn}: anything new on the migration?",
            update_id=f"cold-{turn}",
        )
        before = sum(db.snapshot()[0].values())
        t0 = time.perf_counter()
        await ActivityEnvironment().run(acts.build.build_context, inp)
        times.append(time.perf_counter() - t0)
        trips.append(sum(db.snapshot()[0].values()) - before)
    return {
        "p50_ms": round(percentile(times, 50) * 1000, 2),
        "p95_ms": round(percentile(times, 95) * 1000, 2),
        "rounds": rounds,
        "pg_round_trips": round(sum(trips) / len(trips), 2),
    }


def measure(dsn: str, session_id: str, last_turn: int, rounds: int) -> dict[str, Any]:
    """Run `_measure` in a fresh Python process (a worker that has never seen the session)."""
    proc = subprocess.run(
        [sys.executable, "-m", "harness.bench.cold_build", dsn, session_id, str(last_turn), str(rounds)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cold build process failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dsn")
    parser.add_argument("session_id")
    parser.add_argument("last_turn", type=int)
    parser.add_argument("rounds", type=int)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(_measure(args.dsn, args.session_id, args.last_turn, args.rounds))))


if __name__ == "__main__":
    main()
