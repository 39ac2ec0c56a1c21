"""A route's calibration in PostgreSQL: the statement applies `core.estimator.next_calibration` to the stored value
(bit for bit), writes the row only when the rule moves it, and so neither waits for nor blocks the other sessions
on the route when a response's ratio is already covered, while an upward move is still applied after a concurrent
writer commits."""

from __future__ import annotations

import asyncio
import random

import asyncpg
import pytest

from activities.store import Store, next_calibration_sql
from core.estimator import CALIBRATION_GRID, calibration_target, next_calibration
from harness.bench import cold_build

pytestmark = pytest.mark.integration

ROUTE = "scripted/shared-route"


def _pairs() -> list[tuple[float, float]]:
    """(stored, target) pairs: both sides of every branch, points of the grid and off it, near ties."""
    rng = random.Random(20)
    pairs = [(1.0, 1.0), (1.2, 1.2), (1.2, 1.1995), (1.2, 1.1996), (1.3, 1.2951), (1.45, 1.0), (0.99908331, 0.9991)]
    for _ in range(600):
        stored = rng.choice([round(rng.uniform(0.5, 2.0), 4), rng.uniform(0.5, 2.0)])
        observed = stored + rng.choice([rng.uniform(-0.002, 0.002), rng.uniform(-0.5, 0.5)])
        pairs.append((stored, calibration_target(max(observed, 0.01))))
    return pairs


async def test_the_statement_applies_the_rule_of_the_core_bit_for_bit(pg_dsn: str) -> None:
    """The store's SQL form of the rule and the core's give the same float for 607 pairs: the event a model call
    stores (the core's figure) says what the route's row holds."""
    pairs = _pairs()
    conn = await asyncpg.connect(pg_dsn)
    try:
        got = await conn.fetch(
            f"SELECT {next_calibration_sql('x.c', 'x.t')} AS next FROM unnest($1::float8[], $2::float8[]) "
            "WITH ORDINALITY AS x(c, t, n) ORDER BY x.n",
            [c for c, _ in pairs],
            [t for _, t in pairs],
        )
    finally:
        await conn.close()
    assert [r["next"] for r in got] == [next_calibration(c, t) for c, t in pairs]
    moved = sum(1 for c, t in pairs if next_calibration(c, t) != c)
    assert 0 < moved < len(pairs)  # both branches ran


async def _outcome(store: Store, session_id: str, turn: int, target: float) -> None:
    await store.record_outcome(
        session_id,
        turn,
        0,
        actual=1_000,
        cached=0,
        output=10,
        route=ROUTE,
        target=target,
        first=target,
        event_key=f"reconciled:{turn}:0",
        event_type="context.estimator.reconciled",
        epoch=1,
        payload={"turn": turn},
    )


async def test_a_covered_ratio_does_not_wait_for_the_routes_row_and_an_upward_move_is_not_lost(pg_dsn: str) -> None:
    """Another transaction holds the route's row (an uncommitted write, as a concurrent session's outcome would).
    A response whose ratio the stored calibration covers completes without waiting for it; an upward move waits,
    then applies to what that transaction committed (it is not lost)."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, _ = await cold_build.seed(store, 2)
        await store.set_calibration(ROUTE, 1.2)
        holder = await asyncpg.connect(pg_dsn)
        try:
            tx = holder.transaction()
            await tx.start()
            await holder.execute("UPDATE calibrations SET calibration = 1.22 WHERE route = $1", ROUTE)

            await asyncio.wait_for(_outcome(store, session_id, 1, 1.2), timeout=10)  # covered: no wait
            await asyncio.wait_for(_outcome(store, session_id, 2, 1.1998), timeout=10)  # a step too small to take

            upward = asyncio.create_task(_outcome(store, session_id, 3, 1.25))
            await asyncio.sleep(1.0)
            assert not upward.done(), "an upward move must wait for the transaction that holds the row"
            await tx.commit()
            await asyncio.wait_for(upward, timeout=10)
        finally:
            await holder.close()
        assert await store.get_calibration(ROUTE) == 1.25
        events = await store.pool.fetchval(
            "SELECT count(*) FROM events WHERE session_id = $1 AND type = 'context.estimator.reconciled'", session_id
        )
        assert events == 3  # every response is reconciled and its event stored; only the row's writes are skipped


async def test_a_steady_ratio_stops_writing_the_route(pg_dsn: str) -> None:
    """From the anthropic profile's 1.45 towards a steady 1.1: the row moves a tenth of the way per response, then,
    at most 5 points of the grid above the ratio, stays (its row version unchanged)."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, _ = await cold_build.seed(store, 2)
        await store.set_calibration(ROUTE, 1.45)
        target = calibration_target(1.100037)
        versions = []
        for turn in range(1, 121):
            await _outcome(store, session_id, turn, target)
            versions.append(await store.pool.fetchval("SELECT xmin::text FROM calibrations WHERE route = $1", ROUTE))
        settled = await store.get_calibration(ROUTE)
        assert settled is not None and target <= settled <= target + 5 / CALIBRATION_GRID + 1e-12
        assert len(set(versions[-40:])) == 1, "a steady ratio must stop writing the route's row"
        assert len(set(versions)) > 30  # it moved while it was far from the ratio
