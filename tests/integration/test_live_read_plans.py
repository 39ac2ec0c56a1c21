"""A build's read of the log costs what was logged since the worker's memo, whatever plan PostgreSQL made for it:
on a real PostgreSQL, the read (`SQL_LIVE_ITEMS`, whose log part every build and model call read shares) planned
once on an empty table, as a store connection plans it (`SERVER_SETTINGS`), and run against a session of 2,000
items sealed into blocks by the trigger, before and after the table is analysed. PostgreSQL's own count of the
rows it read and threw away (`EXPLAIN ANALYZE`, measured as `test_append_plans` measures the appends) is the
measure; the read as it was (one condition either range may meet), put back, reads the session's whole log on the
young table."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from activities.store import SERVER_SETTINGS, SQL_LIVE_ITEMS, Store, _live_rows
from tests.integration.test_append_plans import ITEMS, _log, _thrown_away

pytestmark = pytest.mark.integration

AFTER_EXPR = "greatest($2, cp.covers_to_seq)"  # the read's position: the memo's, or the checkpoint's when later
# Memo positions: none, inside the first block, before a block (its rows, the blocks, the rows after them), in the
# unsealed tail (the warm path: 9 items since the memo), at the end, past it.
POSITIONS = (-1, 100, 1_000, ITEMS - 10, ITEMS - 1, ITEMS + 100)
# The rows of a read after the tail blocks: at most what no block holds (a tail block seals every 64 items).
BOUND = 64
WARM = f"'s', {ITEMS - 10}"  # the read of the 9 items after position ITEMS - 10 (its parameters, as literals)
# The read as it was: one condition either range may meet.
OR_FORM = f"""items i WHERE i.session_id = $1
      AND (i.seq > {AFTER_EXPR} AND i.seq < coalesce(b.first_seq, 2147483647)
           OR i.seq > greatest({AFTER_EXPR}, b.last_seq))"""


def _or_form(sql: str) -> str:
    rows = _live_rows(AFTER_EXPR)
    assert rows in sql
    return sql.replace(rows, OR_FORM)


async def _reads(conn: asyncpg.Connection, sql: str) -> dict[int, list[dict[str, Any]]]:
    return {after: [dict(r) for r in await conn.fetch(sql, "s", after)] for after in POSITIONS}


async def test_a_read_touches_what_was_logged_since_the_memo(pg_dsn: str) -> None:
    for removed, scans in await _thrown_away(pg_dsn, SQL_LIVE_ITEMS, WARM):
        assert removed <= BOUND, scans
        assert scans and not any(scan.startswith("Seq Scan") for scan in scans), scans


async def test_the_ranges_read_what_the_condition_read(pg_dsn: str) -> None:
    """The same rows and blocks, in the same order, from every memo position (blocks before, between, after)."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
    conn = await asyncpg.connect(pg_dsn, server_settings=SERVER_SETTINGS)
    try:
        await conn.execute("INSERT INTO sessions (session_id, open, secret) VALUES ('s', '{}'::jsonb, '\\x00'::bytea)")
        await _log(conn)
        assert await conn.fetchval("SELECT count(*) FROM item_tail_blocks") > 0  # blocks, tail blocks, then rows
        ranges, either = await _reads(conn, SQL_LIVE_ITEMS), await _reads(conn, _or_form(SQL_LIVE_ITEMS))
    finally:
        await conn.close()
    assert ranges == either
    main = {after: rows[0] for after, rows in ranges.items()}  # the query's own row, then the blocks' rows
    assert main[ITEMS - 10]["seqs"] == list(range(ITEMS - 9, ITEMS)) and main[ITEMS + 100]["seqs"] is None
    read = main[1_000]  # rows up to the next full block, the blocks, the rows after them
    head = read["head"]
    assert read["seqs"][:head] == list(range(1_001, read["blocks_from"]))
    assert read["seqs"][head:] == list(range(read["blocks_to"] + 1, ITEMS))
    assert len(ranges[1_000]) > 1  # the blocks' rows


async def test_the_condition_reads_the_whole_log(pg_dsn: str) -> None:
    """The measure sees the fault: the read as it was scans the session's rows on the young table."""
    young, _ = await _thrown_away(pg_dsn, _or_form(SQL_LIVE_ITEMS), WARM)
    assert young[0] >= ITEMS - 64, young
