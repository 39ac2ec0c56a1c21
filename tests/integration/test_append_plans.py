"""The reply's append costs what was logged since its request, and the build's lookup of the turn's message (and
the lookup of a tool's or a sealed call's result) what was logged since the read before it, whatever plan PostgreSQL
made for them: on a real PostgreSQL, each statement planned once on an empty table (as a store connection plans it,
`SERVER_SETTINGS`) and run against a session of 2,000 items, before and after the table is analysed. PostgreSQL's
own count of the rows it read and threw away (`EXPLAIN ANALYZE`) is the measure; the plain lookups, put back, and
the message or a result looked for in the whole log read the session's whole log."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from activities.session_state import SessionState
from activities.store import SERVER_SETTINGS, SQL_APPEND_ITEMS, SQL_STORE_REQUEST, Store

pytestmark = pytest.mark.integration

ITEMS = 2_000
AFTER = ITEMS - 10  # the request's last position: 9 items were logged after it
# Each of the three lookups (two items, one group) may read what was logged after the request, no more.
BOUND = 3 * (ITEMS - 1 - AFTER)

# The lookups as they were: by id alone, and the group by EXISTS (test_the_plain_lookups_read_the_whole_log).
PLAIN = (
    ("x.session_id = $1 AND x.seq > $5 AND x.item_id", "x.session_id = $1 AND x.item_id"),
    (
        """(
        SELECT seq FROM items WHERE session_id = $1 AND seq > $5 AND starts_with(item_id, $4::text)
        ORDER BY seq LIMIT 1
    ) IS NOT NULL""",
        """EXISTS (
        SELECT 1 FROM items WHERE session_id = $1 AND seq > $5 AND starts_with(item_id, $4::text)
    )""",
    ),
)


def _entry(item_id: str) -> dict[str, Any]:
    item = {"id": item_id, "kind": "assistant_message", "trust": "MODEL", "text": "a reply"}
    return {"item": item, "rendered": "a reply", "tokens": {"c": 2}, "segment": None, "pointer": None}


def _rows_thrown_away(plan: Any) -> tuple[int, list[str]]:
    """Rows of `items` PostgreSQL read and removed by filter (per loop times loops), and the scans of `items`."""
    removed, scans = 0, []

    def walk(node: dict[str, Any]) -> None:
        nonlocal removed
        if node.get("Relation Name") == "items":
            removed += int(node.get("Rows Removed by Filter", 0)) * int(node.get("Actual Loops", 1))
            scans.append(f"{node['Node Type']} {node.get('Index Name') or ''} {node.get('Index Cond') or ''}")
        for child in node.get("Plans", []):
            walk(child)

    walk((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    return removed, scans


async def _log(conn: asyncpg.Connection) -> None:
    """ITEMS items of session 's', one row each (the trigger seals them into blocks as they are logged)."""
    await conn.execute(
        """INSERT INTO items (session_id, seq, item_id, kind, trust, turn, payload, rendered, tokens)
        SELECT 's', g, 'i' || g, 'user_message', 'USER', g / 2,
               jsonb_build_object('id', 'i' || g, 'kind', 'user_message', 'trust', 'USER', 'text', 'hi', 'seq', g),
               'hi', '{"c": 1}'::jsonb
        FROM generate_series(0, $1 - 1) AS g""",
        ITEMS,
    )


def _reply(after: int) -> str:
    """The append of a two-item reply to the request built after position `after` (EXPLAIN takes no parameters:
    the values as literals)."""
    entries = json.dumps([_entry("t999.m0.text"), _entry("t999.m0.call0")])
    return f"'s', $e${entries}$e$, 999, 't999.m0.', {after}"


def _result(after: int) -> str:
    """The append of a tool call's result (no group), looked for after position `after`."""
    entries = json.dumps([_entry("t999.m0.call0.result")])
    return f"'s', $e${entries}$e$, 999, NULL, {after}"


def _turn_message(after: int) -> str:
    """A build's write of its request with the turn's message, looked for after position `after`."""
    entries = json.dumps([_entry("u:999")])
    body = json.dumps({"base": None, "keep": 0, "tail": [], "session": "s", "counter": "c"})
    return f"'s', 999, 0, 0, 'p', 'r', 10, 10, '{{}}', '{{}}', $b${body}$b$, $e${entries}$e$, {after}"


async def _thrown_away(dsn: str, sql: str, args: str) -> list[tuple[int, list[str]]]:
    """`sql` run with `args` (its parameters' values as literals), planned on the empty table: the rows it read
    and threw away, with the table young (never analysed) and then analysed."""
    async with Store.from_dsn(dsn) as store:
        await store.migrate()
    conn = await asyncpg.connect(dsn, server_settings=SERVER_SETTINGS)
    try:
        await conn.execute("INSERT INTO sessions (session_id, open, secret) VALUES ('s', '{}'::jsonb, '\\x00'::bytea)")
        params = (await conn.prepare(sql)).get_parameters()
        await conn.execute(f"PREPARE append({', '.join(t.name for t in params)}) AS {sql}")

        async def explain() -> tuple[int, list[str]]:
            tx = conn.transaction()
            await tx.start()
            try:  # run, measured, and rolled back
                plan = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE append({args})")
            finally:
                await tx.rollback()
            return _rows_thrown_away(plan)

        await explain()  # the plan: made now, on the empty table, and kept
        await _log(conn)
        young = await explain()
        await conn.execute("ANALYZE items")  # a new plan: one session's log is the whole table
        return [young, await explain()]
    finally:
        await conn.close()


async def test_a_reply_append_reads_what_was_logged_since_its_request(pg_dsn: str) -> None:
    for removed, scans in await _thrown_away(pg_dsn, SQL_APPEND_ITEMS, _reply(AFTER)):
        assert removed <= BOUND, scans
        assert not any(scan.startswith("Seq Scan") for scan in scans), scans


# The lookups bounded by the position of the read before them: the build's of the turn's message (logged with its
# request), and a tool's or a sealed call's result's (`SessionState.append`).
AFTER_THE_READ = pytest.mark.parametrize(
    ("sql", "args"), [(SQL_STORE_REQUEST, _turn_message), (SQL_APPEND_ITEMS, _result)], ids=["message", "result"]
)


@AFTER_THE_READ
async def test_a_lookup_after_the_read_reads_what_was_logged_since(pg_dsn: str, sql: str, args: Any) -> None:
    """Looked for after the position the read brought the memo to (all of the log, here): no row thrown away."""
    for removed, scans in await _thrown_away(pg_dsn, sql, args(ITEMS - 1)):
        assert removed == 0, scans
        assert not any(scan.startswith("Seq Scan") for scan in scans), scans


@AFTER_THE_READ
async def test_a_lookup_in_the_whole_log_reads_it(pg_dsn: str, sql: str, args: Any) -> None:
    """The measure sees the fault: looked for in the whole log (-1, as before), the young table's plan reads the
    session's rows."""
    young, _ = await _thrown_away(pg_dsn, sql, args(-1))
    assert young[0] >= ITEMS, young


async def test_the_plain_lookups_read_the_whole_log(pg_dsn: str) -> None:
    """The measure sees the fault: the lookups as they were read the session's log, young and analysed."""
    sql = SQL_APPEND_ITEMS
    for new, old in PLAIN:
        assert new in sql
        sql = sql.replace(new, old)
    young, analysed = await _thrown_away(pg_dsn, sql, _reply(AFTER))
    assert young[0] >= ITEMS and analysed[0] >= ITEMS


class _Recorded:
    """A store's pool whose single-row statements (the appends) are recorded with their arguments."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.rows: list[tuple[str, tuple[Any, ...]]] = []

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        self.rows.append((sql, args))
        return await self.pool.fetchrow(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


async def test_a_result_is_looked_for_after_the_memos_position(pg_dsn: str) -> None:
    """`SessionState.append` (a tool's result, a sealed call's) passes the position its caller's read brought the
    memo to: the statement it sends looks after the log's last item, not in the whole log (-1)."""
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        async with store.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO sessions (session_id, open, secret) VALUES ('s', $1::jsonb, '\\x00'::bytea)",
                {"agent_instructions": "be brief"},  # the store's connections encode JSON themselves
            )
            await _log(conn)
        recorded = _Recorded(store.pool)
        state = SessionState(Store(recorded), {})
        _, _, cache = await state.session("s")
        await state.items("s", cache)  # the caller's read
        result: dict[str, Any] = {"id": "t999.m0.call0.result", "kind": "tool_result", "trust": "TOOL"}
        result |= {
            "call_id": "call0",
            "tool_name": "notes.read",
            "content": "ok",
            "is_error": False,
            "artifact_ref": None,
        }
        seqs = await state.append("s", 999, [result], cache)
    appends = [args for sql, args in recorded.rows if sql == SQL_APPEND_ITEMS]
    assert seqs == [ITEMS] and len(appends) == 1
    assert appends[0][-1] == ITEMS - 1, appends[0][-1]  # group_after_seq: the log's last position
