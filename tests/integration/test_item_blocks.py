"""The log in sealed blocks (migrations 7 and 10) on a real PostgreSQL: a trigger seals each full block of 256 items
as its last item is logged, and each tail block of 64 after the last full block, and what a worker's memo reads
through the blocks equals what the items' own rows hold, from any position; no Temporal (the activities run in an
ActivityEnvironment)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities import store as store_module
from activities.migrations import ITEM_BLOCK, ITEM_TAIL_BLOCK, MIGRATIONS
from activities.providers import build_providers
from activities.rows import LiveLog
from activities.session import SessionActivities
from activities.session_state import SessionCache
from activities.store import Store
from contract.payloads import BuildInput
from core.build import segment_of
from core.items import parse_history_item
from core.plan import SEGMENT
from harness.bench import cold_build

pytestmark = pytest.mark.integration

NOW = "2026-01-01T00:00:00+00:00"
SQL_BLOCKS = "SELECT * FROM item_blocks WHERE session_id = $1 ORDER BY first_seq"
SQL_TAIL_BLOCKS = "SELECT * FROM item_tail_blocks WHERE session_id = $1 ORDER BY first_seq"


async def _blocks(store: Store, session_id: str) -> list[tuple[int, int]]:
    return [(r["first_seq"], r["last_seq"]) for r in await store.pool.fetch(SQL_BLOCKS, session_id)]


async def _tail_blocks(store: Store, session_id: str) -> list[tuple[int, int]]:
    return [(r["first_seq"], r["last_seq"]) for r in await store.pool.fetch(SQL_TAIL_BLOCKS, session_id)]


def _columns(log: LiveLog) -> list[Any]:
    heads = [log.seqs, log.ids, log.kinds, log.trusts, log.call_ids, log.taints]
    return [[i.model_dump() for i in log.items], *heads, log.renders, log.counts, log.referable, log.pointers]


async def _from_rows(store: Store, session_id: str, after: int) -> list[Any]:
    """The log after `after` from the items' own rows (`load_items`), in the memo's columns."""
    rows = await store.load_items(session_id, after)
    # The segment's other fields stored with a referable item are the ones `segment_of` makes of it.
    segments = [
        SEGMENT.dump_python(segment_of(parse_history_item(r.payload), "", 0), mode="json") if r.referable else None
        for r in rows
    ]
    return _columns(
        LiveLog.of_payloads(
            [r.payload for r in rows],
            segments=segments,
            renders=[r.rendered for r in rows],
            counts=[r.tokens for r in rows],
            pointers=[r.pointer for r in rows],
        )
    )


def _memo(cache: SessionCache) -> list[Any]:
    log = cache.items
    heads = [log.seqs, log.ids, log.kinds, log.trusts, log.call_ids, log.taints]
    return [[i.model_dump() for i in log], *heads, log.renders, log.counts, log.referable, log.pointers]


async def test_full_blocks_are_sealed_and_a_read_through_them_equals_the_rows_from_any_position(pg_dsn: str) -> None:
    """Items logged a few at a time, then 300 in one statement: every full block is sealed, and every tail block of
    64 after the last full one, the last (partial) one not; the log read from any position (before the blocks, on a
    block's first or last item, inside one, after the last) equals the items' rows, item by item and column by
    column (tool results' pointers included); a purge erases the blocks with the items."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, last = await cold_build.seed(store, 700)
        assert await _blocks(store, session_id) == [(0, 255), (256, 511)]
        assert await _tail_blocks(store, session_id) == [(512, 575), (576, 639)]
        acts = SessionActivities(store, build_providers())
        _, _, cache = await acts.state.session(session_id)
        await acts.state.items(session_id, cache)
        batch = [
            {"id": f"bulk.{n}", "kind": "user_message", "trust": "USER", "text": f"note {n}: shard {n % 17} is done"}
            for n in range(300)
        ]
        seqs = await acts.state.append(session_id, last + 1, batch, cache)
        assert seqs == list(range(700, 1000))
        # The full block sealed in the tail blocks' place (the workers of the release before read only full blocks).
        assert await _blocks(store, session_id) == [(0, 255), (256, 511), (512, 767)]
        assert await _tail_blocks(store, session_id) == [(768, 831), (832, 895), (896, 959)]
        for after in (-1, 0, 100, 254, 255, 256, 300, 511, 512, 767, 768, 800, 831, 959, 960, 998, 999):
            _, live = await store.load_live_items(session_id, after)
            assert _columns(live) == await _from_rows(store, session_id, after), after
        _, live = await store.load_live_items(session_id)
        assert [i.seq for i in live.items] == list(range(1000))
        assert any(p is not None for p in live.pointers)  # the tool results' pointers came through the blocks
        # A purge erases the session's blocks with its items.
        deleted = await store.purge_session(session_id, require_closed=False)
        assert deleted["item_blocks"] == 3 and deleted["item_tail_blocks"] == 3 and deleted["items"] == 1000
        assert await _blocks(store, session_id) == [] and await _tail_blocks(store, session_id) == []


async def test_a_block_missing_from_the_middle_leaves_its_items_read_as_rows_never_skipped(pg_dsn: str) -> None:
    """Blocks are derived state: with one cleared from the middle of the run (an operator's repair, say), full or
    tail, the log read from any position still equals the items' rows: the blocks after the gap are read as rows
    too."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, _ = await cold_build.seed(store, 1100)
        assert await _blocks(store, session_id) == [(0, 255), (256, 511), (512, 767), (768, 1023)]
        await store.pool.execute("DELETE FROM item_blocks WHERE session_id = $1 AND first_seq = 256", session_id)
        for after in (-1, 0, 255, 256, 300, 511, 512, 600, 767, 1023, 1099):
            _, live = await store.load_live_items(session_id, after)
            assert _columns(live) == await _from_rows(store, session_id, after), after
        _, live = await store.load_live_items(session_id)
        assert [i.seq for i in live.items] == list(range(1100))
        # A tail block missing after the full blocks, a later one kept: read as rows from the gap on.
        second, _ = await cold_build.seed(store, 700)
        assert await _tail_blocks(store, second) == [(512, 575), (576, 639)]
        await store.pool.execute("DELETE FROM item_tail_blocks WHERE session_id = $1 AND first_seq = 512", second)
        for after in (-1, 511, 512, 575, 576, 699):
            _, live = await store.load_live_items(second, after)
            assert _columns(live) == await _from_rows(store, second, after), after


def _item_rows_touched(plan: Any) -> int:
    """The rows of table `items` an `EXPLAIN (ANALYZE, FORMAT JSON)` plan read: those its scans returned and
    those their filters removed (PostgreSQL's own counts)."""
    touched = 0
    for node in plan.get("Plans", []):
        touched += _item_rows_touched(node)
    if plan.get("Relation Name") == "items":
        loops = plan.get("Actual Loops", 1)
        touched += round((plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)) * loops)
    return touched


async def test_a_read_through_the_blocks_reads_only_the_item_rows_outside_them(pg_dsn: str) -> None:
    """A cold read of a long session touches the item rows the blocks do not hold, not the whole log: PostgreSQL's
    own row counts for the read (EXPLAIN ANALYZE) stay at the rows outside the blocks (full and tail), from any
    position."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, _ = await cold_build.seed(store, 1100)
        assert await _blocks(store, session_id) == [(0, 255), (256, 511), (512, 767), (768, 1023)]
        assert await _tail_blocks(store, session_id) == [(1024, 1087)]
        # The 12 after the tail block, and those before the first block after the position.
        for after, outside in ((-1, 12), (100, 155 + 12), (1023, 12), (1050, 49), (1087, 12)):
            (plan,) = await store.pool.fetchrow(  # json: decoded by the store's codec
                "EXPLAIN (ANALYZE, FORMAT JSON) " + store_module.SQL_LIVE_ITEMS, session_id, after
            )
            assert _item_rows_touched(plan[0]["Plan"]) == outside, after


async def test_workers_that_have_not_seen_the_session_read_it_through_the_blocks_as_the_writer_holds_it(
    pg_dsn: str,
) -> None:
    """A build and a model call on workers that have not seen a 700-item session (their reads go through two
    sealed blocks) bring their memos to exactly what the worker that logged the items holds in its own."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, last = await cold_build.seed(store, 700)
        providers = build_providers()
        writer = SessionActivities(store, providers)
        _, _, held = await writer.state.session(session_id)
        await writer.state.items(session_id, held)
        builder = SessionActivities(store, providers)
        turn = last + 1
        built = await ActivityEnvironment().run(
            builder.build.build_context,
            BuildInput(session_id=session_id, turn=turn, call_index=0, epoch=1, now_iso=NOW, user_text="status?"),
        )
        await writer.state.items(session_id, held)  # the turn's message, logged by the build
        built_memo = builder.state.cached(session_id)
        assert built_memo is not None and _memo(built_memo) == _memo(held)
        caller = SessionActivities(store, providers)
        _, call_memo, reads = await caller.state.call_reads(
            session_id, turn, 0, 1, built.plan.request_sha256, first_attempt=True
        )
        assert reads.record is not None and reads.record.request_sha256 == built.plan.request_sha256
        assert _memo(call_memo) == _memo(held)


async def test_the_migration_seals_the_blocks_of_items_logged_before_it(pg_dsn: str) -> None:
    """The session's blocks removed (items logged before migration 7), the migrations run again seal them as the
    trigger had, byte for byte, heads, render lists and count columns included (migrations 8 and 9 give the blocks
    sealed before them their heads, and their render lists and count columns; until then they are read as rows),
    and migration 10 its tail blocks; they are re-runnable."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, _ = await cold_build.seed(store, 600)
        sealed = [dict(r) for r in await store.pool.fetch(SQL_BLOCKS, session_id)]
        assert [(r["first_seq"], r["last_seq"]) for r in sealed] == [(0, 255), (256, 511)]
        assert all(r["heads"] for r in sealed)
        await store.pool.execute("DELETE FROM item_blocks WHERE session_id = $1", session_id)
        _, rows_only = await store.load_live_items(session_id)
        await store.pool.execute(MIGRATIONS[6])  # seals the blocks as migration 7's trigger did: no heads
        assert [r["heads"] for r in await store.pool.fetch(SQL_BLOCKS, session_id)] == [None, None]
        _, without_heads = await store.load_live_items(session_id)
        assert _columns(without_heads) == _columns(rows_only)
        await store.pool.execute(MIGRATIONS[7])  # gives them their heads, as migration 8 did: no render list yet
        assert [r["render_list"] for r in await store.pool.fetch(SQL_BLOCKS, session_id)] == [None, None]
        _, without_lists = await store.load_live_items(session_id)
        assert _columns(without_lists) == _columns(rows_only)
        await store.pool.execute(MIGRATIONS[8])
        assert [dict(r) for r in await store.pool.fetch(SQL_BLOCKS, session_id)] == sealed
        _, through_blocks = await store.load_live_items(session_id)
        assert _columns(through_blocks) == _columns(rows_only)
        # Migration 10 seals the tail blocks of the items logged before it, as its trigger does, and the trigger
        # (which migration 7, run again above, had put back as it was) seals tail blocks again.
        tails = [dict(r) for r in await store.pool.fetch(SQL_TAIL_BLOCKS, session_id)]
        assert [(r["first_seq"], r["last_seq"]) for r in tails] == [(512, 575)]
        await store.pool.execute("DELETE FROM item_tail_blocks WHERE session_id = $1", session_id)
        await store.pool.execute(MIGRATIONS[9])
        assert [dict(r) for r in await store.pool.fetch(SQL_TAIL_BLOCKS, session_id)] == tails
        _, through_tails = await store.load_live_items(session_id)
        assert _columns(through_tails) == _columns(rows_only)
        acts = SessionActivities(store, build_providers())
        _, _, cache = await acts.state.session(session_id)
        await acts.state.items(session_id, cache)
        more = [{"id": f"more.{n}", "kind": "user_message", "trust": "USER", "text": f"note {n}"} for n in range(40)]
        assert await acts.state.append(session_id, 1000, more, cache) == list(range(600, 640))
        assert await _tail_blocks(store, session_id) == [(512, 575), (576, 639)]


async def test_tail_blocks_are_sealed_after_the_last_full_block_and_give_way_to_it(pg_dsn: str) -> None:
    """The log after its last full block is sealed in tail blocks of 64 as their last items are logged (a few items
    at a time, or many in one statement); when a full block is sealed the tail blocks in its place are removed in
    the same statement, and no tail block is sealed where a full block is. Read from any position, the log equals
    the items' rows at each step; at two full blocks a cold read touches no item row."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, last = await cold_build.seed(store, 300)
        assert await _blocks(store, session_id) == [(0, 255)]
        assert await _tail_blocks(store, session_id) == []  # 256..299: not full
        acts = SessionActivities(store, build_providers())
        _, _, cache = await acts.state.session(session_id)
        await acts.state.items(session_id, cache)
        logged = 300
        for size, tails in ((20, [(256, 319)]), (100, [(256, 319), (320, 383)]), (92, [])):
            batch = [
                {"id": f"more.{logged + n}", "kind": "user_message", "trust": "USER", "text": f"note {logged + n}"}
                for n in range(size)
            ]
            last += 1
            assert await acts.state.append(session_id, last, batch, cache) == list(range(logged, logged + size))
            logged += size
            assert await _tail_blocks(store, session_id) == tails, logged
            for after in (-1, 255, 256, 300, 319, 320, logged - 2):
                _, live = await store.load_live_items(session_id, after)
                assert _columns(live) == await _from_rows(store, session_id, after), (logged, after)
        assert await _blocks(store, session_id) == [(0, 255), (256, 511)]
        await store.pool.execute("SELECT item_tail_block_seal($1, 320)", session_id)
        assert await _tail_blocks(store, session_id) == []
        (plan,) = await store.pool.fetchrow(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + store_module.SQL_LIVE_ITEMS, session_id, -1
        )
        assert _item_rows_touched(plan[0]["Plan"]) == 0
        _, live = await store.load_live_items(session_id)
        assert _through_blocks(live) == 2 and len(live.seqs) == 2 * ITEM_BLOCK


async def test_a_cold_read_touches_fewer_item_rows_than_a_tail_block_holds(pg_dsn: str) -> None:
    """At every log length from one full block to the next, a cold read from the start touches fewer item rows than
    a tail block holds: the rows past the last tail block (PostgreSQL's own row counts)."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, last = await cold_build.seed(store, ITEM_BLOCK)
        acts = SessionActivities(store, build_providers())
        _, _, cache = await acts.state.session(session_id)
        await acts.state.items(session_id, cache)
        for logged in range(ITEM_BLOCK + 1, 2 * ITEM_BLOCK + 2, 9):
            pad = logged - len(cache.items.seqs)
            batch = [
                {"id": f"pad.{logged}.{n}", "kind": "user_message", "trust": "USER", "text": "ok"} for n in range(pad)
            ]
            last += 1
            await acts.state.append(session_id, last, batch, cache)
            (plan,) = await store.pool.fetchrow(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + store_module.SQL_LIVE_ITEMS, session_id, -1
            )
            assert _item_rows_touched(plan[0]["Plan"]) == (logged - ITEM_BLOCK) % ITEM_TAIL_BLOCK, logged


BLOCK_READ_COLUMNS = ("payloads", "heads", "render_list", "count_columns", "referable", "pointers")


async def test_blocks_are_stored_uncompressed_and_a_compressed_one_reads_the_same(pg_dsn: str) -> None:
    """Since migration 9 a sealed block's columns are stored as they are (a cold read decompresses none of them);
    a block sealed before it, compressed, reads the same as the items' rows."""
    compression = ", ".join(f"pg_column_compression({c}) AS {c}" for c in BLOCK_READ_COLUMNS)
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        session_id, _ = await cold_build.seed(store, 600)
        rows = await store.pool.fetch(f"SELECT {compression} FROM item_blocks WHERE session_id = $1", session_id)
        assert len(rows) == 2 and all(r[c] is None for r in rows for c in BLOCK_READ_COLUMNS), [dict(r) for r in rows]
        _, uncompressed = await store.load_live_items(session_id, -1)
        assert _through_blocks(uncompressed) == 2
        assert _columns(uncompressed) == await _from_rows(store, session_id, -1)
        # Compressed as PostgreSQL compresses by default (a table of the default storage), then copied as stored.
        async with store.pool.acquire() as conn, conn.transaction():
            await conn.execute("CREATE TEMP TABLE packed (LIKE item_blocks) ON COMMIT DROP")
            # Each value made anew (a copy keeps its stored form), so the table's default storage compresses it.
            texts = ", ".join(
                f"{c} || {'ARRAY[]::text[]' if c == 'render_list' else repr('')}" for c in BLOCK_READ_COLUMNS
            )
            columns = ", ".join(BLOCK_READ_COLUMNS)
            await conn.execute(
                f"INSERT INTO packed (session_id, first_seq, last_seq, renders, counts, {columns}) "
                f"SELECT session_id, first_seq, last_seq, renders, counts, {texts} FROM item_blocks "
                "WHERE session_id = $1",
                session_id,
            )
            sets = ", ".join(f"{c} = p.{c}" for c in BLOCK_READ_COLUMNS)
            await conn.execute(
                f"UPDATE item_blocks b SET {sets} FROM packed p "
                "WHERE b.session_id = p.session_id AND b.first_seq = p.first_seq"
            )
        packed = await store.pool.fetch(f"SELECT {compression} FROM item_blocks WHERE session_id = $1", session_id)
        assert {r["render_list"] for r in packed} == {r["payloads"] for r in packed} == {"pglz"}, packed
        _, through_packed = await store.load_live_items(session_id, -1)
        assert _through_blocks(through_packed) == 2
        assert _columns(through_packed) == await _from_rows(store, session_id, -1)


def _through_blocks(log: LiveLog) -> int:
    """How many blocks `log` was read through (a block's 256 items share its payloads as their source; an item read
    from its row has a source of its own)."""
    return sum(1 for n in Counter(map(id, log.sources)).values() if n == ITEM_BLOCK)
