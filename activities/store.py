"""PostgreSQL, the system of record. Activities retry, so every write here is idempotent (natural keys and
ON CONFLICT); nothing stored is ever rewritten except usage filled in after a response."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
from pydantic_core import from_json

from activities.migrations import ITEM_BLOCK, ITEM_HEAD, ITEM_HEAD_FIELDS, MIGRATIONS
from activities.rows import (
    CallReads,
    EpochPrefix,
    ItemRender,
    ItemSource,
    LiveLog,
    LoggedItem,
    MemoryCandidate,
    MemoryRow,
    Outcome,
    RequestRecord,
    Resolved,
    SessionClaim,
    StoredArtifact,
    StoredEvent,
    StoredPrefix,
    StoredRequest,
    StoredSession,
    StoredWirePrefix,
    SummarizerCall,
    TurnReads,
    WrittenMemory,
    count_columns,
    joined_counts,
)
from core.compaction import run_trust
from core.estimator import CALIBRATION_GRID, TokenEstimator
from core.items import TrustLevel, parse_history_item

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_MIGRATION_LOCK = 727_020  # advisory lock id: two workers starting at once migrate one after the other

SQL_CREATE_MIGRATIONS = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""
SQL_INSERT_SESSION = """
INSERT INTO sessions (session_id, open, secret) VALUES ($1, $2, $3)
ON CONFLICT (session_id) DO NOTHING"""
SQL_GET_SESSION = "SELECT open, secret, created_at, closed_at, close_reason FROM sessions WHERE session_id = $1"
# The latest checkpoint of session $1 (the one a build shows) and the last log position it covers (-1: none).
LATEST_CHECKPOINT = """
  SELECT c.checkpoint, coalesce(c.covers_to_seq, -1) AS covers_to_seq FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (
    SELECT c.checkpoint, c.covers_to_seq FROM checkpoints c WHERE c.session_id = $1
    ORDER BY c.covers_to_seq DESC, (c.checkpoint->>'kind' = 'escalation') DESC, c.depth DESC LIMIT 1) c ON true
"""
SQL_LOAD_ITEMS = """
SELECT seq, turn, payload, rendered, tokens, segment IS NOT NULL AS referable, pointer FROM items
WHERE session_id = $1 AND seq > $2 ORDER BY seq"""


def _session_blocks(columns: Sequence[str]) -> str:
    """A subquery of session $1's sealed blocks, in `columns`: its full blocks (`item_blocks`, 256 items each; those
    with heads and render lists, which migrations 8 and 9 gave every block) and its tail blocks (`item_tail_blocks`,
    64 items each, after the last full block; migration 10). The trigger never seals a tail block where a full block
    is, nor keeps one where a full block is sealed; should one be there all the same, the full block wins."""
    cols = ", ".join(columns)
    return f"""(
    SELECT {cols} FROM item_blocks WHERE session_id = $1 AND heads IS NOT NULL AND render_list IS NOT NULL
    UNION ALL
    SELECT {cols} FROM item_tail_blocks t WHERE t.session_id = $1 AND NOT EXISTS (
      SELECT 1 FROM item_blocks f WHERE f.session_id = $1 AND f.first_seq = t.first_seq - t.first_seq % {ITEM_BLOCK})
  )"""


MAX_SEQ = 2147483647  # the largest `integer`: no log position reaches it


def _live_rows(after: str) -> str:
    """The rows `_live_log` reads (alias `i`): session $1's items after position `after` and before the blocks'
    first position (`b.first_seq`; with no blocks, all of them), then those after the blocks' last (`b.last_seq`),
    in log order, as two ranges of `items_pkey`, each bounded on both sides.

    Whatever plan PostgreSQL made: a connection plans each statement once (`SERVER_SETTINGS`), and a condition
    either range may meet (`OR`) was planned, on a table never analysed, as a scan of the session's rows by
    `session_id` alone, and, on an analysed table holding one session's log, as a sequential scan of the table.
    Bounded on both sides, at least one side by a value the plan cannot know, each range is estimated as the small
    part of the session it is (PostgreSQL's default for such a range); its `ORDER BY` leaves `items_pkey` the one
    index that needs no sort, where a young table's costs would tie it with `(session_id, item_id)`
    (tests/integration/test_live_read_plans.py)."""
    return f"""(
      (SELECT * FROM items x WHERE x.session_id = $1 AND x.seq > {after} AND x.seq < coalesce(b.first_seq, {MAX_SEQ})
       ORDER BY x.seq)
      UNION ALL
      (SELECT * FROM items x WHERE b.last_seq IS NOT NULL AND x.session_id = $1
         AND x.seq > greatest({after}, b.last_seq) AND x.seq < {MAX_SEQ} ORDER BY x.seq)
    ) i"""


def _live_log(after: str) -> str:
    """The lateral subquery `log`: of session $1's items after position `after`, the rows of those no sealed block
    holds (`head` of them before the blocks, the rest after), as parallel arrays (each payload as JSON text: arrays
    cost PostgreSQL and the client a fraction of what a JSON aggregate of the rows costs), each item's head
    (`ITEM_HEAD`) as one flat list's text; and the run of sealed blocks (`_session_blocks`: full blocks of 256
    items, then tail blocks of 64) that begins after `after`, as its first and last positions (`blocks_from`,
    `blocks_to`). The blocks themselves come as rows of their own after the query's one row (`_with_blocks`).
    Select `LIVE_LOG_COLUMNS`; read them with `_live`.

    Only the unbroken run of blocks from the first one is read as blocks (each block begins where the ones before
    it, whatever their sizes, end): should a block be missing from the middle (the trigger seals every one, but
    the tables are derived state an operator may clear) or have no heads (sealed before migration 8, which gives
    them theirs), the items from the gap on are read as rows, never skipped. The rows are read by two ranges of the
    index, before the blocks and after them (`_live_rows`): a read touches the rows outside the blocks, not the
    session's whole log."""
    return f"""LEFT JOIN LATERAL (
  SELECT r.*, b.first_seq AS blocks_from, b.last_seq AS blocks_to
  FROM (
    SELECT min(first_seq) AS first_seq, max(last_seq) AS last_seq
    FROM (
      SELECT x.first_seq, x.last_seq, min(x.first_seq) OVER () + coalesce(sum(x.last_seq - x.first_seq + 1) OVER (
                  ORDER BY x.first_seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS unbroken_at
      FROM {_session_blocks(("first_seq", "last_seq"))} x WHERE x.first_seq > {after}
    ) x WHERE x.first_seq = x.unbroken_at
  ) b, LATERAL (
    SELECT count(*) FILTER (WHERE i.seq < b.first_seq) AS head, array_agg(i.seq ORDER BY i.seq) AS seqs,
           array_agg(i.payload::text ORDER BY i.seq) AS payloads,
           string_agg({ITEM_HEAD}, ',' ORDER BY i.seq) AS heads, array_agg(i.rendered ORDER BY i.seq) AS renders,
           json_agg(i.tokens ORDER BY i.seq) AS counts, array_agg(i.segment IS NOT NULL ORDER BY i.seq) AS referable,
           json_agg(i.pointer ORDER BY i.seq) AS pointers
    FROM {_live_rows(after)}
  ) r
) log ON true"""


LIVE_LOG_COLUMNS = """log.head, log.seqs, log.payloads, log.heads, log.renders, log.counts, log.referable, log.pointers,
  log.blocks_from, log.blocks_to"""
# A sealed block's columns, as `_with_blocks` returns them (`block_first_seq` NULL: the query's own row).
BLOCK_COLUMNS = ("first_seq", "last_seq", "payloads", "heads", "render_list", "count_columns", "referable", "pointers")
_BLOCK_COLUMN_TYPES = {"first_seq": "integer", "last_seq": "integer", "render_list": "text[]"}  # others: text


def _with_blocks(select: str, rest: str) -> str:
    """A query of one row (`SELECT {select} {rest}`, whose columns end with `LIVE_LOG_COLUMNS`) and, after it, a
    row for each sealed block of the run its log names (`blocks_from`..`blocks_to`), in columns of their own
    (`BLOCK_COLUMNS`, named `block_...`; each NULL in the query's row, as the query's columns are in the blocks').

    Rows, not one aggregate: PostgreSQL sends each block's stored text as it reads it, where an aggregate of
    them builds one value of megabytes first (at 10,000 items: 17 ms of its time against 7, most of the
    difference fresh memory it faults in for every read). Read them with `Store._fetch_with_blocks`."""
    width = _top_level_count(select)
    nulls = ", ".join(["NULL"] * width)
    block_nulls = ", ".join(f"NULL::{_BLOCK_COLUMN_TYPES.get(c, 'text')} AS block_{c}" for c in BLOCK_COLUMNS)
    block_cols = ", ".join(f"b.{c}" for c in BLOCK_COLUMNS)
    return f"""WITH main AS (SELECT {select} {rest})
SELECT main.*, {block_nulls} FROM main
UNION ALL
SELECT {nulls}, {block_cols}
FROM main JOIN {_session_blocks(BLOCK_COLUMNS)} b ON b.first_seq >= main.blocks_from AND b.last_seq <= main.blocks_to"""


def _top_level_count(select: str) -> int:
    """The expressions of a select list: its commas outside parentheses, plus one (the lists given to
    `_with_blocks` have no comma or parenthesis in a string literal outside parentheses)."""
    depth, count = 0, 1
    for char in select:
        depth += (char == "(") - (char == ")")
        count += char == "," and depth == 0
    return count


# The log a worker's memo needs ($2: the position it holds): what the latest checkpoint does not cover.
SQL_LIVE_ITEMS = _with_blocks(
    "cp.covers_to_seq, " + LIVE_LOG_COLUMNS,
    "FROM (" + LATEST_CHECKPOINT + ") cp\n" + _live_log("greatest($2, cp.covers_to_seq)"),
)


def _append_ctes(entries: str, turn: str, group: str, after: str) -> str:
    """The CTEs that log items once each, in order, at the next positions of session $1, with their stored
    render: `entries` a jsonb array of {item, rendered, tokens, segment, pointer}; the items not logged yet (by id,
    after position `after`: a reply's request's, else that of the read before the append, a build's, a tool's or a
    seal's; -1 looks in the whole log) are appended; a group already begun (`group`: its id prefix, looked for after
    `after`) adds nothing. Positions race only with another append to the same session at the same instant (the
    workflow serialises them): the primary key refuses it and the store retries the statement. Read the outcome
    with `APPENDED`.

    A reply's lookups cost what was logged since its request, whatever plan PostgreSQL made: each item's is bounded
    by `after` as well as keyed by id, and the group's takes the first match in log order (`ORDER BY seq LIMIT 1`,
    which only `items_pkey` gives without a sort). A connection plans each statement once (`SERVER_SETTINGS`): on a
    table never analysed, or holding one session's log, the lookups by id alone and the group's `EXISTS` were
    planned as scans of the session's rows or of the whole table (tests/integration/test_append_plans.py)."""
    return f"""input AS (
    SELECT e.value AS entry, e.ordinality AS ord FROM jsonb_array_elements({entries}) WITH ORDINALITY AS e
), existing AS (  -- one index lookup per input item (a join may read the session's whole log)
    SELECT e.item_id, e.seq FROM (
        SELECT input.entry->'item'->>'id' AS item_id,
               (SELECT x.seq FROM items x
                WHERE x.session_id = $1 AND x.seq > {after} AND x.item_id = input.entry->'item'->>'id') AS seq
        FROM input
    ) e WHERE e.seq IS NOT NULL
), grouped AS (
    SELECT {group} IS NOT NULL AND (
        SELECT seq FROM items WHERE session_id = $1 AND seq > {after} AND starts_with(item_id, {group})
        ORDER BY seq LIMIT 1
    ) IS NOT NULL AS logged
), fresh AS (
    SELECT input.entry, (SELECT coalesce(max(seq) + 1, 0) FROM items WHERE session_id = $1)
        + row_number() OVER (ORDER BY input.ord) - 1 AS seq
    FROM input
    WHERE NOT EXISTS (SELECT 1 FROM existing WHERE existing.item_id = input.entry->'item'->>'id')
      AND NOT (SELECT logged FROM grouped)
), inserted AS (
    INSERT INTO items (session_id, seq, item_id, kind, trust, turn, payload, rendered, tokens, segment, pointer)
    SELECT $1, seq, entry->'item'->>'id', entry->'item'->>'kind', entry->'item'->>'trust', {turn},
           (entry->'item') || jsonb_build_object('seq', seq), entry->>'rendered', entry->'tokens', entry->'segment',
           entry->'pointer'
    FROM fresh
    ON CONFLICT (session_id, item_id) DO NOTHING
    RETURNING item_id, seq
)"""


APPENDED = """(SELECT logged FROM grouped) AS logged,
       coalesce((SELECT jsonb_object_agg(item_id, seq) FROM existing), '{}'::jsonb) AS existing,
       coalesce((SELECT jsonb_object_agg(item_id, seq) FROM inserted), '{}'::jsonb) AS inserted"""
# Items appended alone: $2 the entries, $3 the turn, $4 the group's id prefix, $5 where the group is looked for.
SQL_APPEND_ITEMS = "WITH " + _append_ctes("$2::jsonb", "$3", "$4::text", "$5") + "\nSELECT " + APPENDED
APPEND_ATTEMPTS = 5
SQL_PUT_ARTIFACT = """
INSERT INTO artifacts (session_id, sha256, trust, media_type, content) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (session_id, sha256) DO NOTHING"""
SQL_GET_ARTIFACT = "SELECT trust, media_type, content FROM artifacts WHERE session_id = $1 AND sha256 = $2"
SQL_ARTIFACT_OWNED_ELSEWHERE = "SELECT 1 FROM artifacts WHERE sha256 = $1 AND session_id <> $2 LIMIT 1"
SQL_ITEM_PAYLOAD = "SELECT payload FROM items WHERE session_id = $1 AND item_id = $2"
# What the tool results that refer to an artifact say of it. An artifact is stored once per content and session,
# with the trust of the first result that stored it: the content is untrusted if any of them was, and tainted if
# any of them was (`run_trust`'s rule for a run of items).
SQL_ARTIFACT_REFERRERS = """
SELECT coalesce(bool_or(trust = 'EXTERNAL_UNTRUSTED'), false) AS untrusted,
       coalesce(bool_or((payload->>'tainted')::boolean), false) AS tainted
FROM items WHERE session_id = $1 AND kind = 'tool_result' AND payload->>'artifact_ref' = $2"""
SQL_PUT_COMPACTION_PLAN = """
INSERT INTO compaction_plans (session_id, checkpoint_id, plan) VALUES ($1, $2, $3)
ON CONFLICT (session_id, checkpoint_id) DO NOTHING"""
SQL_GET_COMPACTION_PLAN = "SELECT plan FROM compaction_plans WHERE session_id = $1 AND checkpoint_id = $2"
# One chunk of a stored plan and the summary size each chunk gets: a summarizer call reads its chunk, not the plan.
SQL_GET_COMPACTION_CHUNK = """
SELECT plan->'chunks'->($3::int) AS chunk, (plan->>'summary_tokens_per_chunk')::int AS summary_tokens
FROM compaction_plans WHERE session_id = $1 AND checkpoint_id = $2"""
SQL_PUT_SUMMARY = """
INSERT INTO summarizer_calls (session_id, checkpoint_id, chunk_index, input, summary) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (session_id, checkpoint_id, chunk_index) DO NOTHING"""
SQL_GET_SUMMARY = """
SELECT summary FROM summarizer_calls WHERE session_id = $1 AND checkpoint_id = $2 AND chunk_index = $3"""
SQL_SUMMARIES = """
SELECT chunk_index, input, summary FROM summarizer_calls WHERE session_id = $1 AND checkpoint_id = $2
ORDER BY chunk_index"""
SQL_ITEMS_IN_RANGE = "SELECT payload FROM items WHERE session_id = $1 AND seq BETWEEN $2 AND $3 ORDER BY seq"
SQL_ALL_SUMMARIZER_INPUTS = (
    "SELECT checkpoint_id, chunk_index, input, summary FROM summarizer_calls WHERE session_id = $1"
)
SQL_CHECKPOINTS = "SELECT checkpoint FROM checkpoints WHERE session_id = $1 ORDER BY created_at, checkpoint_id"
SQL_PUT_CANDIDATE = """
INSERT INTO memory_candidates (session_id, fact_id, text, accepted, gate, reason, memory_id)
VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (session_id, fact_id) DO NOTHING"""
SQL_CANDIDATES = "SELECT * FROM memory_candidates WHERE session_id = $1 ORDER BY fact_id"
SQL_MEMORY_EXISTS = "SELECT 1 FROM memories WHERE scope = $1 AND memory_id = $2"
SQL_MEMORY_TEXTS = "SELECT text FROM memories WHERE scope = $1"
SQL_PUT_PREFIX = """
INSERT INTO prefixes (session_id, epoch, sha256, reason, profile, prefix, inputs) VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (session_id, epoch) DO NOTHING"""
SQL_GET_PREFIX = "SELECT sha256, reason, profile, prefix, inputs FROM prefixes WHERE session_id = $1 AND epoch = $2"
SQL_GET_CHECKPOINT = "SELECT checkpoint FROM checkpoints WHERE session_id = $1 AND checkpoint_id = $2"
# A request and the bases its delta body links to, nearest first, in one round trip (at most $2 of them).


def _chain_cte(sha: str, limit: str) -> str:
    """The CTE `chain`: request `sha` and the bases its delta body links to, nearest first (at most `limit`)."""
    return f"""chain AS (
    SELECT sha256, prefix_sha256, body, 1 AS depth FROM rendered_requests WHERE sha256 = {sha}
    UNION ALL
    SELECT r.sha256, r.prefix_sha256, r.body, chain.depth + 1 FROM chain
    JOIN rendered_requests r ON jsonb_typeof(chain.body) = 'object' AND r.sha256 = chain.body->>'base'
    WHERE chain.depth < {limit}
)"""


def _stored_segment(row: str) -> str:
    """The segment stored with the items row `row`, its count the link's counter's (`k.counter`, SQL)."""
    return f"{row}.segment || jsonb_build_object('text', {row}.rendered, 'raw_tokens', {row}.tokens -> k.counter)"


# A link of the chain with the items its tail refers to replaced by their segments, made of what was stored with
# each item when it was logged (its segment's fields, its text, its count by the link's counter): a reference
# ({"ref": item id}) by one, a run ({"seqs": [first, last]}: the items at those log positions and between) by the
# run's items in log order, when every position holds an item stored with its segment and that count. A reference
# or run that does not resolve stays as it is (`_whole` names it). The link's session, counter and tail are taken
# once (`k`, kept apart from the rest by `OFFSET 0`): a large body is stored out of line, and each use of
# `chain.body` in the per-entry expressions would read it whole again (1 s for a body of 10,000 references).
_EXPANDED_BODY = """CASE WHEN jsonb_typeof(chain.body) = 'object' AND chain.body ? 'session'
THEN jsonb_set(chain.body, '{tail}', (
    SELECT coalesce(jsonb_agg(x.seg ORDER BY t.o, x.n), '[]'::jsonb)
    FROM (SELECT chain.body->>'session' AS session, chain.body->>'counter' AS counter, chain.body->'tail' AS tail
          OFFSET 0) k
    CROSS JOIN LATERAL jsonb_array_elements(k.tail) WITH ORDINALITY AS t(e, o)
    LEFT JOIN items i ON t.e ? 'ref' AND i.session_id = k.session AND i.item_id = t.e->>'ref'
    CROSS JOIN LATERAL jsonb_array_elements(CASE
        WHEN t.e ? 'seqs' THEN coalesce((
            SELECT jsonb_agg({r} ORDER BY r.seq) FROM items r
            WHERE r.session_id = k.session AND r.seq BETWEEN (t.e->'seqs'->>0)::int AND (t.e->'seqs'->>1)::int
            HAVING count(*) = (t.e->'seqs'->>1)::int - (t.e->'seqs'->>0)::int + 1
               AND bool_and(r.segment IS NOT NULL AND r.tokens ? k.counter)
        ), jsonb_build_array(t.e))
        WHEN i.segment IS NOT NULL AND i.tokens ? k.counter THEN jsonb_build_array({i})
        ELSE jsonb_build_array(t.e) END) WITH ORDINALITY AS x(seg, n)
)) ELSE chain.body END"""
EXPANDED_BODY = _EXPANDED_BODY.replace("{r}", _stored_segment("r")).replace("{i}", _stored_segment("i"))
SQL_REQUEST_CHAIN = (
    "WITH RECURSIVE "
    + _chain_cte("$1", "$2")
    + "\nSELECT prefix_sha256, "
    + EXPANDED_BODY
    + " AS body FROM chain ORDER BY depth"
)
# A built request in one round trip: its body (content-addressed), its record, the turn's message when it is
# logged with it ($12: append entries, possibly none; looked for after position $13), and the distinct prefix hashes
# of its epoch with this request's counted (first seen first).
SQL_STORE_REQUEST = (
    """
WITH body AS (
    INSERT INTO rendered_requests (sha256, prefix_sha256, body) VALUES ($6, $5, $11) ON CONFLICT (sha256) DO NOTHING
), record AS (
    INSERT INTO request_records (session_id, turn, call_index, epoch, prefix_sha256, request_sha256,
                                 estimated_tokens, raw_tokens, plan, inputs)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
    ON CONFLICT (session_id, turn, call_index) DO UPDATE
    SET epoch = EXCLUDED.epoch, prefix_sha256 = EXCLUDED.prefix_sha256, request_sha256 = EXCLUDED.request_sha256,
        estimated_tokens = EXCLUDED.estimated_tokens, raw_tokens = EXCLUDED.raw_tokens, plan = EXCLUDED.plan,
        inputs = EXCLUDED.inputs
    WHERE request_records.actual_input_tokens IS NULL
    RETURNING *
), seen AS (
    INSERT INTO request_prefixes (session_id, epoch, prefix_sha256, first_turn, first_call_index)
    VALUES ($1, $4, $5, $2, $3) ON CONFLICT DO NOTHING
), """
    + _append_ctes("$12::jsonb", "$2", "NULL::text", "$13")
    + """
SELECT (
    SELECT jsonb_agg(jsonb_build_object('prefix_sha256', p.prefix_sha256, 'first_turn', p.first_turn)
                     ORDER BY p.first_turn)
    FROM (
        SELECT prefix_sha256, min(first_turn) AS first_turn FROM (
            SELECT prefix_sha256, first_turn FROM request_prefixes
            WHERE session_id = $1 AND epoch = $4 AND NOT (first_turn = $2 AND first_call_index = $3)
            UNION ALL SELECT $5, $2
        ) AS r GROUP BY prefix_sha256
    ) AS p
) AS prefixes, (SELECT to_jsonb(r) FROM record r) AS record, """
    + APPENDED
)
SQL_GET_RECORD = "SELECT * FROM request_records WHERE session_id = $1 AND turn = $2 AND call_index = $3"
# A request built for a turn that cannot go on (its message's id was logged by an earlier turn): never sent.
SQL_DROP_UNSENT_RECORD = """
DELETE FROM request_records
WHERE session_id = $1 AND turn = $2 AND call_index = $3 AND actual_input_tokens IS NULL"""
SQL_ITEM_TURN = "SELECT turn FROM items WHERE session_id = $1 AND item_id = $2"
SQL_RECORDS = "SELECT * FROM request_records WHERE session_id = $1 ORDER BY turn, call_index"
SQL_RECORD_WIRE = """
UPDATE request_records SET wire_prefix_sha256 = $4
WHERE session_id = $1 AND turn = $2 AND call_index = $3 AND wire_prefix_sha256 IS NULL"""
SQL_PUT_WIRE_PREFIX = """
INSERT INTO wire_prefixes (session_id, epoch, sha256, text, first_turn) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (session_id, epoch, sha256) DO NOTHING"""
SQL_WIRE_PREFIXES = """
SELECT sha256, text, first_turn FROM wire_prefixes WHERE session_id = $1 AND epoch = $2 ORDER BY position"""
SQL_ADD_EVENT = """
INSERT INTO events (session_id, event_key, type, turn, epoch, payload) VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (session_id, event_key) DO NOTHING RETURNING 1"""
SQL_EVENT = "SELECT payload FROM events WHERE session_id = $1 AND event_key = $2"
SQL_EVENTS = (
    "SELECT event_key, type, turn, epoch, payload, created_at FROM events WHERE session_id = $1 ORDER BY created_at"
)
SQL_WRITE_MEMORY = """
INSERT INTO memories (scope, memory_id, text, trust, source_session, corrects) VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (scope, memory_id) DO NOTHING"""
SQL_SNAPSHOT = """
SELECT memory_id, text, trust FROM memories WHERE scope = $1 AND corrects IS NULL
ORDER BY created_at, memory_id LIMIT $2"""


def recall_sql(scope: str, terms: str, exclude: str, limit: str) -> str:
    """The scope's memories matching `terms`, best first, at most `limit`: (memory_id, text, trust, rank). A match
    stands for its correction tree (the memory at the top of its `corrects` chain, and every correction below it,
    corrections of corrections too), which is recalled once, as its newest memory: a corrected fact never comes
    back with its old text, whether the match is the fact or an older correction of it. A tree whose top is in
    `exclude` (the snapshot's, in view with its correction line) is not recalled. The trees of the best `4 *
    limit` matches are looked at."""
    return f"""
SELECT memory_id, text, trust, rank FROM (
    SELECT DISTINCT ON (cur.root_id) cur.memory_id, cur.text, cur.trust, hit.rank
    FROM (
        SELECT m.memory_id, m.scope, ts_rank(m.tsv, q) AS rank
        FROM memories m CROSS JOIN websearch_to_tsquery('english', {terms}) AS q
        WHERE m.scope = {scope} AND m.tsv @@ q AND NOT starts_with(m.memory_id, 'withdrawn:')
        ORDER BY rank DESC, m.memory_id LIMIT 4 * {limit}
    ) hit
    CROSS JOIN LATERAL (
        WITH RECURSIVE up(memory_id, corrects, depth) AS (
            SELECT u.memory_id, u.corrects, 0 FROM memories u WHERE u.scope = hit.scope AND u.memory_id = hit.memory_id
            UNION ALL
            SELECT p.memory_id, p.corrects, up.depth + 1 FROM up JOIN memories p
            ON p.scope = hit.scope AND p.memory_id = up.corrects WHERE up.depth < {CORRECTION_DEPTH}
        ), root AS (SELECT memory_id FROM up ORDER BY depth DESC LIMIT 1),
        down(memory_id, depth) AS (
            SELECT memory_id, 0 FROM root
            UNION ALL
            SELECT c.memory_id, down.depth + 1 FROM down JOIN memories c
            ON c.scope = hit.scope AND c.corrects = down.memory_id
            WHERE down.depth < {CORRECTION_DEPTH} AND NOT starts_with(c.memory_id, 'withdrawn:')
        )
        SELECT (SELECT memory_id FROM root) AS root_id, x.memory_id, x.text, x.trust
        FROM down JOIN memories x ON x.scope = hit.scope AND x.memory_id = down.memory_id
        ORDER BY x.created_at DESC, x.memory_id DESC LIMIT 1
    ) cur
    WHERE NOT (cur.root_id = ANY({exclude}))
    ORDER BY cur.root_id, hit.rank DESC
) hits ORDER BY rank DESC, memory_id LIMIT {limit}"""


def corrections_sql(scope: str, ids: str) -> str:
    """Each of the memories `ids` (a snapshot's) that has corrections, by the newest memory of its correction tree
    (corrections of corrections too; a withdrawal counts): (memory_id, text, trust, corrects: the snapshot memory,
    created_at). One line per corrected memory, however many corrections its scope holds."""
    return f"""
WITH RECURSIVE tree(root, memory_id, depth) AS (
    SELECT c.corrects, c.memory_id, 1 FROM memories c WHERE c.scope = {scope} AND c.corrects = ANY({ids})
    UNION ALL
    SELECT tree.root, c.memory_id, tree.depth + 1 FROM tree JOIN memories c
    ON c.scope = {scope} AND c.corrects = tree.memory_id WHERE tree.depth < {CORRECTION_DEPTH}
)
SELECT DISTINCT ON (tree.root) m.memory_id, m.text, m.trust, tree.root AS corrects, m.created_at
FROM tree JOIN memories m ON m.scope = {scope} AND m.memory_id = tree.memory_id
ORDER BY tree.root, m.created_at DESC, m.memory_id DESC"""


CORRECTION_DEPTH = 32  # a correction chain is followed this far (each link is a write of another correction)


SQL_SEARCH = recall_sql("$1", "$2", "$3::text[]", "$4")
# A snapshot memory's correction line is the newest memory of its correction tree (`corrections_sql`): one line
# per corrected snapshot memory, however many corrections its scope holds.
SQL_CORRECTIONS = f"""
SELECT memory_id, text, trust, corrects FROM ({corrections_sql("$1", "$2::text[]")}) latest
ORDER BY created_at, memory_id"""
SQL_ADD_WS_WRITE = """
INSERT INTO working_state_writes (session_id, write_key, turn, write) VALUES ($1, $2, $3, $4)
ON CONFLICT (session_id, write_key) DO NOTHING"""
SQL_WS_WRITE_TURN = "SELECT turn FROM working_state_writes WHERE session_id = $1 AND write_key = $2"
SQL_WS_WRITES = "SELECT write FROM working_state_writes WHERE session_id = $1 ORDER BY position"
SQL_GET_CALIBRATION = "SELECT calibration FROM calibrations WHERE route = $1"
SQL_PROVIDER_CALIBRATION = "SELECT max(calibration) FROM calibrations WHERE route LIKE $1"
SQL_SET_CALIBRATION = """
INSERT INTO calibrations (route, calibration) VALUES ($1, $2)
ON CONFLICT (route) DO UPDATE SET calibration = EXCLUDED.calibration, updated_at = now()"""
SQL_PUT_CHECKPOINT = """
INSERT INTO checkpoints (session_id, checkpoint_id, parent_id, depth, covers_from_seq, covers_to_seq, checkpoint)
VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (session_id, checkpoint_id) DO NOTHING"""
# The build's reads in one round trip (Store.turn_reads): $1 session, $2 log position already memoised, $3 epoch,
# $4 whether to return the prefix row, $5 the recall query (NULL: none), $6 the recall limit.
SQL_TURN_READS = _with_blocks(
    """s.open, s.secret, s.created_at, s.closed_at, s.close_reason,
  {LIVE_LOG_COLUMNS},
  p.sha256 AS prefix_sha256, p.reason AS prefix_reason,
  CASE WHEN $4 THEN p.profile END AS profile, CASE WHEN $4 THEN p.prefix END AS prefix,
  CASE WHEN $4 THEN p.inputs END AS inputs,
  (SELECT calibration FROM calibrations WHERE route = (p.profile->>'provider') || '/' || (p.profile->>'model'))
    AS calibration,
  (SELECT max(calibration) FROM calibrations WHERE route LIKE (p.profile->>'provider') || '/%')
    AS provider_calibration,
  (SELECT coalesce(jsonb_agg(w.write ORDER BY w.position), '[]') FROM working_state_writes w
     WHERE w.session_id = $1) AS working_state_writes,
  cp.checkpoint,
  CASE WHEN EXISTS (  -- most snapshots have no correction: the trees are walked only when one has
    SELECT 1 FROM memories c WHERE c.scope = s.open->>'memory_scope' AND c.corrects = ANY(snap.ids)
  ) THEN (SELECT coalesce(jsonb_agg(jsonb_build_object('memory_id', m.memory_id, 'text', m.text, 'trust', m.trust,
                                                      'corrects', m.corrects) ORDER BY m.created_at, m.memory_id),
                          '[]')
          FROM ({CORRECTIONS}) m)  -- as SQL_CORRECTIONS
  ELSE '[]'::jsonb END AS corrections,
  CASE WHEN $5::text IS NOT NULL THEN (
    SELECT coalesce(jsonb_agg(jsonb_build_object('memory_id', r.memory_id, 'text', r.text, 'trust', r.trust)
                              ORDER BY r.rank DESC, r.memory_id), '[]')
    FROM ({RECALL}) r
  ) END AS recall""".replace("{LIVE_LOG_COLUMNS}", LIVE_LOG_COLUMNS)
    .replace("{RECALL}", recall_sql("s.open->>'memory_scope'", "$5::text", "snap.ids", "$6"))
    .replace("{CORRECTIONS}", corrections_sql("s.open->>'memory_scope'", "snap.ids")),
    """FROM sessions s
LEFT JOIN LATERAL ({LATEST_CHECKPOINT}) cp ON true
{LIVE_LOG}
LEFT JOIN prefixes p ON p.session_id = s.session_id AND p.epoch = $3
LEFT JOIN LATERAL (
  SELECT coalesce(array_agg(substr(seg->>'item_id', 8)), '{}') AS ids
  FROM jsonb_array_elements(coalesce(p.prefix->'segments', '[]'::jsonb)) AS seg
  WHERE seg->>'kind' = 'memory_snapshot'
) snap ON true
WHERE s.session_id = $1""".replace("{LATEST_CHECKPOINT}", LATEST_CHECKPOINT).replace(
        "{LIVE_LOG}", _live_log("greatest($2, cp.covers_to_seq)")
    ),
)
# The model call's reads in one round trip (Store.call_reads): $1 session, $2 turn, $3 call index, $4 log position
# already memoised, $5 epoch, $6 the request whose body to read (NULL: this worker built it), $7 the chain limit.
# The body's links come as stored: the worker's memo holds the logged items their references name.
SQL_CALL_READS = _with_blocks(
    """s.open, s.secret, s.created_at, s.closed_at, s.close_reason,
  (SELECT to_jsonb(r) FROM request_records r WHERE r.session_id = $1 AND r.turn = $2 AND r.call_index = $3)
    AS record,
  cp.covers_to_seq,
  (SELECT calibration FROM calibrations WHERE route = (p.profile->>'provider') || '/' || (p.profile->>'model'))
    AS calibration,
  (SELECT max(calibration) FROM calibrations WHERE route LIKE (p.profile->>'provider') || '/%')
    AS provider_calibration,
  CASE WHEN $6::text IS NOT NULL THEN (
    WITH RECURSIVE """
    + _chain_cte("$6::text", "$7")
    + """
    SELECT json_agg(json_build_object('prefix_sha256', prefix_sha256, 'body', body) ORDER BY depth) FROM chain
  ) END AS chain,
  """
    + LIVE_LOG_COLUMNS,
    "FROM sessions s\nLEFT JOIN LATERAL ("
    + LATEST_CHECKPOINT
    + ") cp ON true\n"
    + _live_log("greatest($4, cp.covers_to_seq)")
    + """
LEFT JOIN prefixes p ON p.session_id = s.session_id AND p.epoch = $5
WHERE s.session_id = $1""",
)


def next_calibration_sql(stored: str, target: str) -> str:
    """`core.estimator.next_calibration` in SQL, on the stored calibration: the same float8 operations in the same
    order, so the two agree to the bit (tests/integration/test_calibrations.py checks)."""
    relax, grid = f"{TokenEstimator.RELAX!r}::float8", f"{CALIBRATION_GRID}::float8"
    return (
        f"CASE WHEN {target} > {stored} THEN {target} "
        f"ELSE greatest({target}, floor(({stored} + {relax} * ({target} - {stored})) * {grid} + 0.5::float8) / {grid}) "
        "END"
    )


_NEXT_CALIBRATION = next_calibration_sql("calibrations.calibration", "$8::float8")
# A model call's outcome in one round trip: its usage (the first attempt's figures win), the estimator's
# reconciliation, its event (stored once, by key) and the reply's items, one group ($14: append entries, $15: the
# group's id prefix, $16: the request's last log position). The reconciliation ($8: the observed ratio on the
# calibration grid) is applied to the stored calibration in the statement, so concurrent sessions on a route never
# lose an upward move. The route's row is updated only when the rule moves it: a response whose ratio the stored
# calibration already covers neither writes nor locks the row every session on the route shares (a row lock would
# queue their commits one behind another). A route not stored yet is created with $9. It returns the route's
# calibration after it, and its provider's highest (as a build reads them: SQL_TURN_READS).
SQL_RECORD_OUTCOME = (
    """
WITH usage AS (
    UPDATE request_records SET actual_input_tokens = $4, cached_tokens = $5, output_tokens = $6
    WHERE session_id = $1 AND turn = $2 AND call_index = $3 AND actual_input_tokens IS NULL RETURNING 1
), moved AS (
    UPDATE calibrations SET calibration = """
    + _NEXT_CALIBRATION
    + """, updated_at = now()
    WHERE route = $7 AND """
    + _NEXT_CALIBRATION
    + """ <> calibrations.calibration
    RETURNING calibration
), learned AS (
    INSERT INTO calibrations (route, calibration) SELECT $7::text, $9::float8
    WHERE NOT EXISTS (SELECT 1 FROM calibrations WHERE route = $7)
    ON CONFLICT (route) DO UPDATE SET calibration = """
    + _NEXT_CALIBRATION
    + """, updated_at = now()
    RETURNING calibration
), calibrated AS (
    SELECT coalesce((SELECT calibration FROM moved), (SELECT calibration FROM learned),
                    (SELECT calibration FROM calibrations WHERE route = $7)) AS calibration
), event AS (
    INSERT INTO events (session_id, event_key, type, turn, epoch, payload) VALUES ($1, $10, $11, $2, $12, $13)
    ON CONFLICT (session_id, event_key) DO NOTHING RETURNING 1
), """
    + _append_ctes("$14::jsonb", "$2", "$15::text", "$16")
    + """
SELECT EXISTS (SELECT 1 FROM usage) AS usage_recorded, EXISTS (SELECT 1 FROM event) AS event_added,
       (SELECT calibration FROM calibrated) AS calibration,
       greatest((SELECT calibration FROM calibrated), (SELECT max(calibration) FROM calibrations
                 WHERE route LIKE split_part($7, '/', 1) || '/%' AND route <> $7)) AS provider_calibration, """
    + APPENDED
)
# A request the provider refused as too long, learned in one round trip: the route's calibration lifted to $2 (never
# lowered: a refusal says only that the estimate was too low) and the event (stored once, by key).
SQL_RECORD_REFUSAL = """
WITH learned AS (
    INSERT INTO calibrations (route, calibration) VALUES ($1, $2::float8)
    ON CONFLICT (route) DO UPDATE SET calibration = EXCLUDED.calibration, updated_at = now()
    WHERE calibrations.calibration < EXCLUDED.calibration
), event AS (
    INSERT INTO events (session_id, event_key, type, turn, epoch, payload) VALUES ($3, $4, $5, $6, $7, $8)
    ON CONFLICT (session_id, event_key) DO NOTHING RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM event)"""
SQL_LATEST_CHECKPOINT = """
SELECT checkpoint FROM checkpoints WHERE session_id = $1
ORDER BY covers_to_seq DESC, (checkpoint->>'kind' = 'escalation') DESC, depth DESC LIMIT 1"""
# An escalation over a summary with nothing new to cover ties on covers_to_seq: the escalation is the later one.
SQL_INSERT_OWNED_SESSION = """
INSERT INTO sessions (session_id, open, secret, owner) VALUES ($1, $2, $3, $4)
ON CONFLICT (session_id) DO NOTHING"""
SQL_SESSION_FOR_CLAIM = """
SELECT open, secret, owner, created_at, closed_at FROM sessions WHERE session_id = $1 FOR UPDATE"""
SQL_SESSION_OPENED = "SELECT 1 FROM prefixes WHERE session_id = $1 LIMIT 1"
SQL_ADOPT_SESSION = "UPDATE sessions SET owner = $2 WHERE session_id = $1 AND owner IS NULL"
SQL_REPLACE_SESSION = """
UPDATE sessions SET open = $2, secret = $3, owner = $4, created_at = now(), closed_at = NULL, close_reason = NULL
WHERE session_id = $1"""
# What a run that failed before it opened may have left, removed before its id is reused.
SQL_CLEAR_UNOPENED = tuple(
    f"DELETE FROM {table} WHERE session_id = $1"
    for table in (
        "items",
        "request_records",
        "working_state_writes",
        "checkpoints",
        "compaction_plans",
        "summarizer_calls",
        "memory_candidates",
        "artifacts",
    )
)
SQL_GET_MEMORY = "SELECT memory_id, text, source_session, corrects FROM memories WHERE scope = $1 AND memory_id = $2"
SQL_CLOSE_SESSION = """
UPDATE sessions SET closed_at = now(), close_reason = $2 WHERE session_id = $1 AND closed_at IS NULL"""

SQL_DELETE_MEMORY = "DELETE FROM memories WHERE scope = $1 AND memory_id = $2 RETURNING 1"
# A deleted memory's corrections, and theirs, go with it: they restate what it said (a tombstone stays).
SQL_DELETE_CORRECTIONS = """
WITH RECURSIVE fixes AS (
    SELECT memory_id FROM memories WHERE scope = $1 AND corrects = $2 AND NOT starts_with(memory_id, 'withdrawn:')
    UNION
    SELECT m.memory_id FROM memories m JOIN fixes f ON m.scope = $1 AND m.corrects = f.memory_id
    WHERE NOT starts_with(m.memory_id, 'withdrawn:')
)
DELETE FROM memories WHERE scope = $1 AND memory_id IN (SELECT memory_id FROM fixes)"""
SQL_WITHDRAWN = "SELECT 1 FROM memories WHERE scope = $1 AND memory_id = $2"
# Tables whose rows are a session's, by a `session_id` column: found in the catalogue, so a table added later
# is purged too. `sessions` goes last (the others reference it).
SQL_SESSION_TABLES = """
SELECT table_name FROM information_schema.columns
WHERE table_schema = current_schema() AND column_name = 'session_id'
  AND table_name NOT IN ('sessions', 'purged_sessions')
ORDER BY table_name"""
# A purged session's id stays taken (a session id names one session forever): its dates, nothing else.
SQL_PURGED_TOMBSTONE = """
INSERT INTO purged_sessions (session_id, opened_at, closed_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"""
SQL_PURGED = "SELECT opened_at AS created_at, closed_at, ''::bytea AS secret FROM purged_sessions WHERE session_id = $1"
SQL_ID_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('ctxengine.session_id:' || $1, 0))"
SQL_PURGE_REQUESTS = """
DELETE FROM rendered_requests WHERE sha256 IN (SELECT request_sha256 FROM request_records WHERE session_id = $1)
   OR prefix_sha256 IN (SELECT sha256 FROM prefixes WHERE session_id = $1)"""
SQL_PURGE_MEMORIES = "DELETE FROM memories WHERE source_session = $1"
SQL_PURGE_SESSION = "DELETE FROM sessions WHERE session_id = $1"
WITHDRAWN_PREFIX = "withdrawn:"  # a tombstone memory: the correction line of a deleted memory still in a snapshot


def search_terms(query: str) -> str | None:
    """The words of `query` a memory search matches (any of them), or None when it has none."""
    words = re.findall(r"\w{3,}", query.lower())[:32]
    return " or ".join(words) if words else None


MAX_DELTA_CHAIN = 32  # a request stored as a delta is at most this many links from a whole one


class SessionNotClosedError(RuntimeError):
    """A purge of a session that is still open: close it first."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(f"session {session_id!r} is not closed; close it before purging it")


class ForeignReferenceError(PermissionError):
    """A pointer or artifact reference that belongs to another session."""

    def __init__(self, session_id: str, reference: str) -> None:
        self.session_id = session_id
        self.reference = reference
        super().__init__(f"reference {reference!r} does not belong to session {session_id!r}; refused")


R = TypeVar("R", bound="DataclassInstance")
_COLUMNS: dict[type, tuple[str, ...]] = {}


def _row(cls: type[R], record: Mapping[str, Any]) -> R:
    """`record` as the typed row `cls`: its columns named by the dataclass's fields (others are not read)."""
    names = _COLUMNS.get(cls)
    if names is None:
        names = _COLUMNS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls(**{name: record[name] for name in names})


def _record(data: Mapping[str, Any] | None) -> RequestRecord | None:
    """A request record read as JSON (`to_jsonb` of its row)."""
    if data is None:
        return None
    return _row(RequestRecord, {**data, "created_at": datetime.fromisoformat(data["created_at"])})


def _all(cls: type[R], records: Sequence[Mapping[str, Any]]) -> list[R]:
    return [_row(cls, r) for r in records]


def _rows(status: str) -> int:
    """Rows affected, from asyncpg's command status (`DELETE 3`)."""
    return int(status.rsplit(" ", 1)[-1])


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# Each connection of the store's pool plans its prepared statements once, generically: PostgreSQL's default
# plans each of a connection's first five executions of a statement for its parameters (1-2.3 ms for a build's
# read), the cold worker's case, before it may settle on a generic plan (docs/operations.md).
SERVER_SETTINGS = {"plan_cache_mode": "force_generic_plan"}


async def _init_connection(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


class _StoreConnection(asyncpg.Connection):  # type: ignore[misc]
    """A connection of the store's pool. The store keeps no session state on a connection (no SET, LISTEN,
    cursor or session-level advisory lock outlives a call), so a connection goes back to the pool without
    asyncpg's reset query (`get_reset_query`): one round trip less for every use. asyncpg still ends a
    transaction left open."""

    def get_reset_query(self) -> str:
        return ""


class Store:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @classmethod
    @asynccontextmanager
    async def from_dsn(cls, dsn: str, *, min_size: int = 1, max_size: int = 10) -> AsyncIterator[Store]:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            init=_init_connection,
            connection_class=_StoreConnection,
            server_settings=SERVER_SETTINGS,
        )
        try:
            yield cls(pool)
        finally:
            await pool.close()

    async def migrate(self) -> int:
        """Apply pending migrations under an advisory lock; returns the database's schema version.

        That is `len(MIGRATIONS)` unless a newer release has migrated the database further: its migrations stay (a
        migration is never undone) and the version returned is theirs, which the caller reports (`worker.py`)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute(SQL_CREATE_MIGRATIONS)
            done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
            for version, ddl in enumerate(MIGRATIONS, start=1):
                if version not in done:
                    await conn.execute(ddl)
                    await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            return max(len(MIGRATIONS), *done) if done else len(MIGRATIONS)

    # ------------------------------------------------------------ sessions
    async def create_session(self, session_id: str, open_json: dict[str, Any], secret: bytes) -> bytes:
        """Create once; a retry gets the secret the first attempt stored."""
        async with self.pool.acquire() as conn:
            await conn.execute(SQL_INSERT_SESSION, session_id, open_json, secret)
            row = await conn.fetchrow(SQL_GET_SESSION, session_id)
        return bytes(row["secret"])

    async def claim_session(
        self, session_id: str, open_json: dict[str, Any], secret: bytes, owner: str
    ) -> SessionClaim:
        """Claim `session_id` for the run `owner`: whether `owner` holds it, and the session holding the id.

        A retry of the owner's open finds its own row. A row of another run is replaced when that run never
        opened (it failed before a prefix was stored), adopted when it predates owners and is still open, and
        otherwise left alone: a session id names one session forever.
        """
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(SQL_ID_LOCK, session_id)  # against a purge of the id in flight (purge_session)
            purged = await conn.fetchrow(SQL_PURGED, session_id)
            if purged is not None:  # its session was purged: the id stays its
                return _claim(purged, owned=False)
            await conn.execute(SQL_INSERT_OWNED_SESSION, session_id, open_json, secret, owner)
            row = await conn.fetchrow(SQL_SESSION_FOR_CLAIM, session_id)
            if row["owner"] == owner:
                return _claim(row, owned=True)
            if (
                row["owner"] is None
                and row["closed_at"] is None
                and await conn.fetchval(SQL_SESSION_OPENED, session_id)
            ):
                await conn.execute(SQL_ADOPT_SESSION, session_id, owner)  # a session opened before owners existed
                return _claim(row, owned=True)
            if await conn.fetchval(SQL_SESSION_OPENED, session_id):
                return _claim(row, owned=False)
            for sql in SQL_CLEAR_UNOPENED:
                await conn.execute(sql, session_id)
            await conn.execute(SQL_REPLACE_SESSION, session_id, open_json, secret, owner)
            return _claim(await conn.fetchrow(SQL_SESSION_FOR_CLAIM, session_id), owned=True)

    async def get_memory(self, scope: str, memory_id: str) -> WrittenMemory | None:
        row = await self.pool.fetchrow(SQL_GET_MEMORY, scope, memory_id)
        return _row(WrittenMemory, row) if row is not None else None

    async def get_session(self, session_id: str) -> StoredSession | None:
        row = await self.pool.fetchrow(SQL_GET_SESSION, session_id)
        return _row(StoredSession, row) if row is not None else None

    async def close_session(self, session_id: str, reason: str) -> None:
        await self.pool.execute(SQL_CLOSE_SESSION, session_id, reason)

    # ------------------------------------------------------------ the session log
    async def append_items(
        self,
        session_id: str,
        turn: int,
        items: Sequence[dict[str, Any]],
        *,
        group_prefix: str | None = None,
        group_after_seq: int = -1,
        renders: Sequence[ItemRender] | None = None,
    ) -> list[int]:
        """Append items (dicts with `id`, `kind`, `trust`; `seq` is assigned here) once each, in order, in one
        round trip.

        Returns each item's seq; an item whose id is already logged keeps its first seq and payload. With
        `group_prefix`, the items are one group: if any item with that id prefix is logged, none is added
        (a retried model call must not mix two replies); the group and its items are looked for after
        `group_after_seq` (a reply is logged after the request it answers was built), so the checks cost what was
        logged since. `renders`, beside each item: its render (`ItemRender`), stored with it (render once, at write
        time).
        """
        entries = _entries(items, renders)
        row = await self._positioned(SQL_APPEND_ITEMS, session_id, entries, turn, group_prefix, group_after_seq)
        return _appended(row, items)

    async def _positioned(self, sql: str, *args: Any) -> Any:
        """One statement that appends items, retried when a concurrent append took the same position (the
        statement as a whole failed, so nothing of it was written)."""
        for attempt in range(APPEND_ATTEMPTS):
            try:
                return await self.pool.fetchrow(sql, *args)
            except asyncpg.UniqueViolationError as exc:
                if exc.constraint_name != "items_pkey" or attempt == APPEND_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def load_items(self, session_id: str, after_seq: int = -1) -> list[LoggedItem]:
        return _all(LoggedItem, await self.pool.fetch(SQL_LOAD_ITEMS, session_id, after_seq))

    async def load_live_items(self, session_id: str, after_seq: int = -1) -> tuple[int, LiveLog]:
        """The log after `after_seq` that the latest checkpoint does not cover, and the last position it covers
        (-1: no checkpoint): what a worker's memo of the session needs, in one round trip."""
        read = await self._fetch_with_blocks(SQL_LIVE_ITEMS, session_id, after_seq)
        assert read is not None
        row, blocks = read
        return int(row["covers_to_seq"]), _live(row, blocks)

    async def _fetch_with_blocks(
        self, sql: str, *args: Any
    ) -> tuple[Mapping[str, Any], list[Mapping[str, Any]]] | None:
        """A query made by `_with_blocks`, in one round trip: its own row (None: none) and its sealed blocks' rows
        in log order."""
        rows = await self.pool.fetch(sql, *args)
        own = [r for r in rows if r["block_first_seq"] is None]
        if not own:
            return None
        blocks = sorted((r for r in rows if r["block_first_seq"] is not None), key=_block_first)
        return own[0], blocks

    # ------------------------------------------------------------ content-addressed content
    async def put_artifact(self, session_id: str, content: str, *, trust: str, media_type: str = "text/plain") -> str:
        sha = sha256_text(content)
        await self.pool.execute(SQL_PUT_ARTIFACT, session_id, sha, trust, media_type, content)
        return sha

    async def get_artifact(self, session_id: str, sha: str) -> StoredArtifact | None:
        row = await self.pool.fetchrow(SQL_GET_ARTIFACT, session_id, sha)
        return _row(StoredArtifact, row) if row is not None else None

    async def resolve(self, session_id: str, reference: str) -> Resolved:
        """The original content, trust level and taint behind a pointer's reference, inside its own session only.

        Raises ForeignReferenceError for a reference owned by another session (whoever asks) and
        LookupError for one that does not exist.
        """
        kind, _, key = reference.partition(":")
        if kind == "artifact":
            row = await self.get_artifact(session_id, key)
            if row is None:
                if await self.pool.fetchval(SQL_ARTIFACT_OWNED_ELSEWHERE, key, session_id):
                    raise ForeignReferenceError(session_id, reference)
                raise LookupError(f"no artifact {key!r} in session {session_id!r}")
            referrers = await self.pool.fetchrow(SQL_ARTIFACT_REFERRERS, session_id, reference)
            trust = TrustLevel.EXTERNAL_UNTRUSTED.value if referrers["untrusted"] else row.trust
            return Resolved(row.content, trust, referrers["tainted"])
        if kind == "item":
            payload = await self.pool.fetchval(SQL_ITEM_PAYLOAD, session_id, key)
            if payload is None:
                raise LookupError(f"no item {key!r} in session {session_id!r}")
            text = payload.get("content", payload.get("text", ""))
            return Resolved(str(text), str(payload["trust"]), bool(payload.get("tainted", False)))
        if kind == "span":
            first, _, last = key.partition("-")
            rows = await self.pool.fetch(SQL_ITEMS_IN_RANGE, session_id, int(first), int(last))
            if not rows:
                raise LookupError(f"no items {key!r} in session {session_id!r}")
            items = [parse_history_item(r["payload"]) for r in rows]
            return Resolved(
                "\n".join(i.body_text() for i in items), run_trust(items).value, any(i.tainted for i in items)
            )
        raise LookupError(f"unknown reference form {reference!r} (expected artifact:SHA, item:ID or span:SEQ-SEQ)")

    # ------------------------------------------------------------ compaction
    async def put_compaction_plan(self, session_id: str, checkpoint_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        """Store once; a retry gets the plan the first attempt stored."""
        async with self.pool.acquire() as conn:
            await conn.execute(SQL_PUT_COMPACTION_PLAN, session_id, checkpoint_id, plan)
            return dict(await conn.fetchval(SQL_GET_COMPACTION_PLAN, session_id, checkpoint_id))

    async def get_compaction_chunk(
        self, session_id: str, checkpoint_id: str, index: int
    ) -> tuple[dict[str, Any], int] | None:
        """Chunk `index` of a stored compaction plan (JSON) and the summary tokens each chunk gets; None when the
        plan or the chunk does not exist."""
        row = await self.pool.fetchrow(SQL_GET_COMPACTION_CHUNK, session_id, checkpoint_id, index)
        if row is None or row["chunk"] is None:
            return None
        return dict(row["chunk"]), int(row["summary_tokens"])

    async def get_compaction_plan(self, session_id: str, checkpoint_id: str) -> dict[str, Any] | None:
        value = await self.pool.fetchval(SQL_GET_COMPACTION_PLAN, session_id, checkpoint_id)
        return dict(value) if value is not None else None

    async def put_summary(self, session_id: str, checkpoint_id: str, index: int, input_text: str, summary: str) -> str:
        async with self.pool.acquire() as conn:
            await conn.execute(SQL_PUT_SUMMARY, session_id, checkpoint_id, index, input_text, summary)
            return str(await conn.fetchval(SQL_GET_SUMMARY, session_id, checkpoint_id, index))

    async def get_summary(self, session_id: str, checkpoint_id: str, index: int) -> str | None:
        value = await self.pool.fetchval(SQL_GET_SUMMARY, session_id, checkpoint_id, index)
        return str(value) if value is not None else None

    async def summaries(self, session_id: str, checkpoint_id: str) -> list[SummarizerCall]:
        """The checkpoint's summarizer calls, by chunk."""
        rows = await self.pool.fetch(SQL_SUMMARIES, session_id, checkpoint_id)
        return [_row(SummarizerCall, {**r, "checkpoint_id": checkpoint_id}) for r in rows]

    async def summarizer_inputs(self, session_id: str) -> list[SummarizerCall]:
        return _all(SummarizerCall, await self.pool.fetch(SQL_ALL_SUMMARIZER_INPUTS, session_id))

    async def checkpoints(self, session_id: str) -> list[dict[str, Any]]:
        return [dict(r["checkpoint"]) for r in await self.pool.fetch(SQL_CHECKPOINTS, session_id)]

    # ------------------------------------------------------------ memory formation
    async def put_candidate(
        self,
        session_id: str,
        fact_id: str,
        text: str,
        *,
        accepted: bool,
        gate: str | None,
        reason: str,
        memory_id: str | None,
    ) -> None:
        await self.pool.execute(SQL_PUT_CANDIDATE, session_id, fact_id, text, accepted, gate, reason, memory_id)

    async def candidates(self, session_id: str) -> list[MemoryCandidate]:
        return _all(MemoryCandidate, await self.pool.fetch(SQL_CANDIDATES, session_id))

    async def memory_exists(self, scope: str, memory_id: str) -> bool:
        return bool(await self.pool.fetchval(SQL_MEMORY_EXISTS, scope, memory_id))

    async def memory_texts(self, scope: str) -> set[str]:
        """The texts of the scope's memories, as written (a caller that compares them folds case itself)."""
        return {r["text"] for r in await self.pool.fetch(SQL_MEMORY_TEXTS, scope)}

    async def put_prefix(
        self,
        session_id: str,
        epoch: int,
        sha: str,
        reason: str,
        profile: dict[str, Any],
        prefix: dict[str, Any],
        inputs: dict[str, Any],
    ) -> None:
        await self.pool.execute(SQL_PUT_PREFIX, session_id, epoch, sha, reason, profile, prefix, inputs)

    async def get_prefix(self, session_id: str, epoch: int) -> StoredPrefix | None:
        row = await self.pool.fetchrow(SQL_GET_PREFIX, session_id, epoch)
        return _row(StoredPrefix, row) if row is not None else None

    async def get_request(self, sha: str) -> StoredRequest | None:
        """The request with its body whole, following delta links (at most MAX_DELTA_CHAIN), in one round trip."""
        return _whole(sha, await self.pool.fetch(SQL_REQUEST_CHAIN, sha, MAX_DELTA_CHAIN + 1))

    # ------------------------------------------------------------ request records
    async def store_request(
        self,
        session_id: str,
        turn: int,
        call_index: int,
        *,
        epoch: int,
        prefix_sha256: str,
        request_sha256: str,
        estimated_tokens: int,
        raw_tokens: int,
        plan: dict[str, Any],
        inputs: dict[str, Any],
        body: list[dict[str, Any]],
        counter: str,
        base: str | None = None,
        keep: int = 0,
        append: Sequence[dict[str, Any]] = (),
        renders: Sequence[ItemRender] | None = None,
        append_after_seq: int = -1,
    ) -> tuple[list[EpochPrefix], list[int], RequestRecord | None]:
        """The request's body and record, and `append` (the turn's message, when it is logged with the request),
        in one round trip. Returns the epoch's distinct prefix hashes, the appended items' seqs (as `append_items`
        does) and the record as stored (None when it was not written: the call was already answered).

        `append` is looked for as already logged after `append_after_seq` (-1: in the whole log): a build passes
        the position its read brought the worker's memo to, before which the memo holds every logged item the
        latest checkpoint does not cover (and no checkpoint covers the turn's message). So the lookup costs what
        was logged since the read, whatever plan PostgreSQL made: from -1, a table never analysed had it scan the
        session's rows (tests/integration/test_append_plans.py).

        The body is stored as a link: the first `keep` segments of request `base` (None: none), then `body`, whose
        entries are segments or references to a logged item's stored segment (`{"ref": item id}`, its count
        the one stored under `counter`), expanded when the request is read (`EXPANDED_BODY`)."""
        stored = {"base": base, "keep": keep, "tail": body, "session": session_id, "counter": counter}
        row = await self._positioned(
            SQL_STORE_REQUEST,
            session_id,
            turn,
            call_index,
            epoch,
            prefix_sha256,
            request_sha256,
            estimated_tokens,
            raw_tokens,
            plan,
            inputs,
            stored,
            _entries(append, renders),
            append_after_seq,
        )
        return [EpochPrefix(**p) for p in row["prefixes"]], _appended(row, append), _record(row["record"])

    async def drop_unsent_record(self, session_id: str, turn: int, call_index: int) -> None:
        """Delete the record of a request that was never sent (no usage), as if it had never been built."""
        await self.pool.execute(SQL_DROP_UNSENT_RECORD, session_id, turn, call_index)

    async def item_turn(self, session_id: str, item_id: str) -> int | None:
        """The turn that logged the item `item_id`; None: not logged."""
        turn = await self.pool.fetchval(SQL_ITEM_TURN, session_id, item_id)
        return None if turn is None else int(turn)

    async def get_record(self, session_id: str, turn: int, call_index: int) -> RequestRecord | None:
        row = await self.pool.fetchrow(SQL_GET_RECORD, session_id, turn, call_index)
        return _row(RequestRecord, row) if row is not None else None

    async def records(self, session_id: str) -> list[RequestRecord]:
        return _all(RequestRecord, await self.pool.fetch(SQL_RECORDS, session_id))

    async def call_reads(
        self, session_id: str, turn: int, call_index: int, *, after_seq: int, epoch: int, request: str | None = None
    ) -> CallReads | None:
        """What a model call reads, in one round trip (SQL_CALL_READS); None for an unknown session. `request`: the
        request whose body to read whole too (a worker that did not build it)."""
        read = await self._fetch_with_blocks(
            SQL_CALL_READS, session_id, turn, call_index, after_seq, epoch, request, MAX_DELTA_CHAIN + 1
        )
        if read is None:
            return None
        row, blocks = read
        return CallReads(
            session=_row(StoredSession, row),
            record=_record(row["record"]),
            items=_live(row, blocks),
            covers_to_seq=int(row["covers_to_seq"]),
            calibration=float(row["calibration"]) if row["calibration"] is not None else None,
            provider_calibration=float(row["provider_calibration"])
            if row["provider_calibration"] is not None
            else None,
            request=_composed(request, row["chain"] or []) if request is not None else None,
        )

    async def record_outcome(
        self,
        session_id: str,
        turn: int,
        call_index: int,
        *,
        actual: int,
        cached: int,
        output: int,
        route: str,
        target: float,
        first: float,
        event_key: str,
        event_type: str,
        epoch: int,
        payload: dict[str, Any],
        append: Sequence[dict[str, Any]] = (),
        group_prefix: str | None = None,
        group_after_seq: int = -1,
        renders: Sequence[ItemRender] | None = None,
    ) -> Outcome:
        """Usage, calibration, the reconciliation event and the reply's items (`append`, one group, as
        `append_items` logs them) in one round trip (`Outcome`).
        Usage already recorded by an earlier attempt stays (the first attempt's figures win). `target`: the observed
        ratio on the calibration grid (`core.estimator.calibration_target`), applied to the route's stored
        calibration by `next_calibration`'s rule; `first`: the route's calibration if it has none stored yet."""
        row = await self._positioned(
            SQL_RECORD_OUTCOME,
            session_id,
            turn,
            call_index,
            actual,
            cached,
            output,
            route,
            target,
            first,
            event_key,
            event_type,
            epoch,
            payload,
            _entries(append, renders),
            group_prefix,
            group_after_seq,
        )
        return Outcome(
            bool(row["usage_recorded"]),
            bool(row["event_added"]),
            _appended(row, append),
            float(row["calibration"]),
            float(row["provider_calibration"]),
        )

    async def record_wire_prefix(
        self, session_id: str, turn: int, call_index: int, *, epoch: int, sha256: str, text: str
    ) -> list[StoredWirePrefix]:
        """Record a request's wire prefix hash (the first attempt's wins) and keep each distinct wire prefix of
        the epoch once; returns the epoch's distinct wire prefixes, first seen first."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(SQL_RECORD_WIRE, session_id, turn, call_index, sha256)
            await conn.execute(SQL_PUT_WIRE_PREFIX, session_id, epoch, sha256, text, turn)
            return _all(StoredWirePrefix, await conn.fetch(SQL_WIRE_PREFIXES, session_id, epoch))

    async def wire_prefixes(self, session_id: str, epoch: int) -> list[StoredWirePrefix]:
        return _all(StoredWirePrefix, await self.pool.fetch(SQL_WIRE_PREFIXES, session_id, epoch))

    # ------------------------------------------------------------ events
    async def record_refusal(
        self,
        session_id: str,
        *,
        route: str,
        calibration: float,
        event_key: str,
        event_type: str,
        turn: int,
        epoch: int,
        payload: dict[str, Any],
    ) -> bool:
        """A request the provider refused as too long: the route's calibration lifted to `calibration` (a higher one
        stored stays) and the event, in one round trip. True when this call stored the event."""
        return bool(
            await self.pool.fetchval(
                SQL_RECORD_REFUSAL, route, calibration, session_id, event_key, event_type, turn, epoch, payload
            )
        )

    async def add_event(
        self, session_id: str, event_key: str, type_: str, *, turn: int, epoch: int, payload: dict[str, Any]
    ) -> bool:
        """True when this call stored the event (a retry finds it there and returns False)."""
        return bool(await self.pool.fetchval(SQL_ADD_EVENT, session_id, event_key, type_, turn, epoch, payload))

    async def event_payload(self, session_id: str, event_key: str) -> dict[str, Any] | None:
        """The payload of the session's event stored under `event_key`, or None."""
        payload: dict[str, Any] | None = await self.pool.fetchval(SQL_EVENT, session_id, event_key)
        return payload

    async def events(self, session_id: str) -> list[StoredEvent]:
        return _all(StoredEvent, await self.pool.fetch(SQL_EVENTS, session_id))

    # ------------------------------------------------------------ memories
    async def write_memory(
        self,
        scope: str,
        memory_id: str,
        text: str,
        *,
        trust: str,
        session_id: str | None,
        corrects: str | None,
    ) -> None:
        await self.pool.execute(SQL_WRITE_MEMORY, scope, memory_id, text, trust, session_id, corrects)

    async def snapshot_memories(self, scope: str, limit: int) -> list[MemoryRow]:
        rows = await self.pool.fetch(SQL_SNAPSHOT, scope, limit)
        return [MemoryRow(memory_id=r["memory_id"], text=r["text"], trust=r["trust"]) for r in rows]

    async def search_memories(
        self, scope: str, query: str, *, limit: int, exclude: Sequence[str] = ()
    ) -> list[MemoryRow]:
        """The scope's memories matching `query`, best first (`exclude`: the snapshot's, already in view)."""
        terms = search_terms(query)
        if terms is None:
            return []
        return [
            MemoryRow(memory_id=r["memory_id"], text=r["text"], trust=r["trust"])
            for r in await self.pool.fetch(SQL_SEARCH, scope, terms, list(exclude), limit)
        ]

    async def turn_reads(
        self, session_id: str, *, after_seq: int, epoch: int, with_prefix: bool, recall_query: str | None, limit: int
    ) -> TurnReads | None:
        """What a build reads, in one round trip (SQL_TURN_READS); None for an unknown session. `recall_query`:
        the turn's message, searched in the scope's memories outside the snapshot (None: not searched here)."""
        terms = search_terms(recall_query) if recall_query is not None else None
        read = await self._fetch_with_blocks(SQL_TURN_READS, session_id, after_seq, epoch, with_prefix, terms, limit)
        if read is None:
            return None
        row, blocks = read
        prefix = None
        if with_prefix and row["prefix_sha256"] is not None:
            prefix = StoredPrefix(
                sha256=row["prefix_sha256"],
                reason=row["prefix_reason"],
                profile=row["profile"],
                prefix=row["prefix"],
                inputs=row["inputs"],
            )
        recall: list[MemoryRow] | None = None
        if recall_query is not None:
            recall = [MemoryRow(**r) for r in row["recall"]] if terms else []
        return TurnReads(
            session=_row(StoredSession, row),
            items=_live(row, blocks),
            prefix=prefix,
            calibration=float(row["calibration"]) if row["calibration"] is not None else None,
            provider_calibration=float(row["provider_calibration"])
            if row["provider_calibration"] is not None
            else None,
            working_state_writes=list(row["working_state_writes"]),
            checkpoint=dict(row["checkpoint"]) if row["checkpoint"] is not None else None,
            corrections=[MemoryRow(**r) for r in row["corrections"]],
            recall=recall,
        )

    async def corrections(self, scope: str, memory_ids: Sequence[str]) -> list[MemoryRow]:
        return _all(MemoryRow, await self.pool.fetch(SQL_CORRECTIONS, scope, list(memory_ids)))

    async def delete_memory(self, scope: str, memory_id: str, *, reason: str) -> bool:
        """Delete a memory and its corrections (theirs too: they restate it); leave a tombstone that corrects it, so
        a frozen snapshot that still holds it shows a correction line until its next epoch. True when it was
        deleted, now or by an earlier attempt.

        The tombstone names no session (a later purge of the deleting session must not bring the memory back).
        """
        tombstone = f"{WITHDRAWN_PREFIX}{memory_id}"
        async with self.pool.acquire() as conn, conn.transaction():
            if await conn.fetchval(SQL_DELETE_MEMORY, scope, memory_id):
                await conn.execute(SQL_DELETE_CORRECTIONS, scope, memory_id)
                text = f"withdrawn ({reason}); disregard this memory"
                await conn.execute(SQL_WRITE_MEMORY, scope, tombstone, text, "USER", None, memory_id)
                return True
            return bool(await conn.fetchval(SQL_WITHDRAWN, scope, tombstone))

    # ------------------------------------------------------------ erasure
    async def purge_session(self, session_id: str, *, require_closed: bool = True) -> dict[str, int]:
        """Erase a closed session from PostgreSQL: every row keyed by it, the requests rendered for it and the
        memories it formed. Returns rows deleted per table. Raises LookupError, and SessionNotClosedError
        unless the caller checked otherwise that it ended (a session that failed to open is never closed)."""
        counts: dict[str, int] = {}
        async with self.pool.acquire() as conn, conn.transaction():
            # A start claiming the id waits for this purge's tombstone, and sees it (claim_session).
            await conn.execute(SQL_ID_LOCK, session_id)
            row = await conn.fetchrow(
                "SELECT created_at, closed_at FROM sessions WHERE session_id = $1 FOR UPDATE", session_id
            )
            if row is None:
                raise LookupError(f"no session {session_id!r} in this database")
            if require_closed and row["closed_at"] is None:
                raise SessionNotClosedError(session_id)
            counts["rendered_requests"] = _rows(await conn.execute(SQL_PURGE_REQUESTS, session_id))
            counts["memories"] = _rows(await conn.execute(SQL_PURGE_MEMORIES, session_id))
            for table in [r["table_name"] for r in await conn.fetch(SQL_SESSION_TABLES)]:
                deleted = await conn.execute(f'DELETE FROM "{table}" WHERE session_id = $1', session_id)
                counts[table] = _rows(deleted)
            counts["sessions"] = _rows(await conn.execute(SQL_PURGE_SESSION, session_id))
            await conn.execute(SQL_PURGED_TOMBSTONE, session_id, row["created_at"], row["closed_at"])
        return counts

    # ------------------------------------------------------------ working state
    async def add_working_state_write(self, session_id: str, write_key: str, turn: int, write: dict[str, Any]) -> None:
        await self.pool.execute(SQL_ADD_WS_WRITE, session_id, write_key, turn, write)

    async def working_state_write_turn(self, session_id: str, write_key: str) -> int | None:
        """The turn the write `write_key` was logged for (the first whose requests see it); None: not logged."""
        turn = await self.pool.fetchval(SQL_WS_WRITE_TURN, session_id, write_key)
        return None if turn is None else int(turn)

    async def has_working_state_write(self, session_id: str, write_key: str) -> bool:
        return await self.working_state_write_turn(session_id, write_key) is not None

    async def working_state_writes(self, session_id: str) -> list[dict[str, Any]]:
        return [r["write"] for r in await self.pool.fetch(SQL_WS_WRITES, session_id)]

    # ------------------------------------------------------------ estimator calibration
    async def get_calibration(self, route: str) -> float | None:
        value = await self.pool.fetchval(SQL_GET_CALIBRATION, route)
        return float(value) if value is not None else None

    async def provider_calibration(self, provider: str) -> float | None:
        """The highest calibration any route of `provider` holds: where a new route of it starts (never lower)."""
        value = await self.pool.fetchval(SQL_PROVIDER_CALIBRATION, provider + "/%")
        return float(value) if value is not None else None

    async def set_calibration(self, route: str, calibration: float) -> None:
        await self.pool.execute(SQL_SET_CALIBRATION, route, calibration)

    # ------------------------------------------------------------ checkpoints
    async def put_checkpoint(self, session_id: str, checkpoint: dict[str, Any]) -> None:
        await self.pool.execute(
            SQL_PUT_CHECKPOINT,
            session_id,
            checkpoint["checkpoint_id"],
            checkpoint.get("parent_id"),
            checkpoint["depth"],
            checkpoint["covers_from_seq"],
            checkpoint["covers_to_seq"],
            checkpoint,
        )

    async def get_checkpoint(self, session_id: str, checkpoint_id: str) -> dict[str, Any] | None:
        row = await self.pool.fetchval(SQL_GET_CHECKPOINT, session_id, checkpoint_id)
        return dict(row) if row is not None else None

    async def latest_checkpoint(self, session_id: str) -> dict[str, Any] | None:
        row = await self.pool.fetchval(SQL_LATEST_CHECKPOINT, session_id)
        return dict(row) if row is not None else None


def _entries(items: Sequence[dict[str, Any]], renders: Sequence[ItemRender] | None) -> list[dict[str, Any]]:
    """Items to append, each with its render when given (the `input` of `_append_ctes`)."""
    if renders is not None and len(renders) != len(items):
        raise ValueError(f"{len(renders)} renders for {len(items)} items")
    if not renders:
        return [{"item": item} for item in items]
    pairs = zip(items, renders, strict=True)
    return [
        {"item": item, "rendered": r.text, "tokens": r.tokens, "segment": r.segment, "pointer": r.pointer}
        for item, r in pairs
    ]


def _live(row: Mapping[str, Any], blocks: Sequence[Mapping[str, Any]]) -> LiveLog:
    """The log read by `_live_log` (`row`) and `_with_blocks` (`blocks`, in log order), parsed: the rows before the
    blocks, the blocks, the rows after them. The heads in one pass (a flat list, `ITEM_HEAD_FIELDS` elements an
    item), the blocks' renders as the arrays they came as, their counts a column per counter key, their other
    columns each in one pass; the rows' as they came; the payloads are not parsed (each block's, and each row's,
    is its items' source)."""
    seqs = row["seqs"] or []
    if not blocks and not seqs:
        return LiveLog()
    head = int(row["head"])  # 0 without blocks

    def joined(column: str) -> str:
        """The blocks' `column` (each a flat JSON list's text, without brackets) as one such text."""
        return ",".join([b[column] for b in blocks])

    def around(rows: list[Any] | None, column: str) -> list[Any]:
        rows = rows or []
        return [*rows[:head], *from_json("[" + joined(column) + "]"), *rows[head:]] if blocks else rows

    row_sources = [(text, seq) for text, seq in zip(row["payloads"] or [], seqs, strict=True)]
    block_seqs: list[int] = []
    block_sources: list[ItemSource] = []
    block_renders: list[str | None] = []
    for block in blocks:
        first, last = block["block_first_seq"], block["block_last_seq"]
        block_seqs += range(first, last + 1)
        block_sources += [(block["block_payloads"], first)] * (last - first + 1)
        block_renders += block["block_render_list"]
    # The rows' heads, then the blocks': one flat list, parsed in one pass and put in log order.
    heads = from_json("[" + ",".join(filter(None, (row["heads"], joined("block_heads")))) + "]")
    n = ITEM_HEAD_FIELDS
    row_heads, block_heads = heads[: n * len(seqs)], heads[n * len(seqs) :]
    around_heads = [*row_heads[: n * head], *block_heads, *row_heads[n * head :]]
    renders = row["renders"] or []
    counts = row["counts"] or []
    return LiveLog(
        seqs=[*seqs[:head], *block_seqs, *seqs[head:]],
        ids=around_heads[0::n],
        kinds=around_heads[1::n],
        trusts=around_heads[2::n],
        call_ids=around_heads[3::n],
        taints=around_heads[4::n],
        sources=[*row_sources[:head], *block_sources, *row_sources[head:]],
        renders=[*renders[:head], *block_renders, *renders[head:]],
        counts=joined_counts(
            [
                (head, count_columns(counts[:head])),
                *(
                    (b["block_last_seq"] - b["block_first_seq"] + 1, from_json(b["block_count_columns"]))
                    for b in blocks
                ),
                (len(seqs) - head, count_columns(counts[head:])),
            ]
        ),
        referable=around(row["referable"], "block_referable"),
        pointers=around(row["pointers"], "block_pointers"),
    )


_block_first = operator.itemgetter("block_first_seq")


def _appended(row: Mapping[str, Any], items: Sequence[dict[str, Any]]) -> list[int]:
    """The seqs of `items` after an append (`APPENDED`): none when their group was already logged."""
    if row["logged"]:
        return []
    seqs = {**row["existing"], **row["inserted"]}
    return [seqs[item["id"]] for item in items if item["id"] in seqs]


def _whole(sha: str, rows: Sequence[Mapping[str, Any]]) -> StoredRequest | None:
    """A request's body whole, from its chain (`_chain_cte`, nearest first, references expanded)."""
    request = _composed(sha, rows)
    if request is None:
        return None
    unresolved = [seg for seg in request.body if "ref" in seg or "seqs" in seg]
    if unresolved:
        raise LookupError(f"request {sha} refers to items not logged with their segment: {_named(unresolved)[:5]}")
    return request


def _named(refs: list[dict[str, Any]]) -> list[str]:
    """References to logged items, named: an item by its id, a run of log positions as `#first-last` (runs that
    follow one another as one)."""
    names: list[str] = []
    run: list[int] = []  # the open run's first and last positions
    for ref in [*refs, {}]:
        seqs = ref.get("seqs")
        if seqs and run and seqs[0] == run[1] + 1:
            run[1] = seqs[1]
            continue
        if run:
            names.append(f"#{run[0]}" if run[0] == run[1] else f"#{run[0]}-{run[1]}")
            run = []
        if seqs:
            run = [seqs[0], seqs[1]]
        elif "ref" in ref:
            names.append(ref["ref"])
    return names


def _composed(sha: str, rows: Sequence[Mapping[str, Any]]) -> StoredRequest | None:
    """A request's body, from its chain (`_chain_cte`, nearest first): a whole body (a list, or a link with no
    base) and each delta on top. A reference left in a link (`{"ref": item id}`, or a run `{"seqs": [first,
    last]}`, standing for the items at those positions) comes with the link's session and counter (`{"ref" or
    "seqs", "session", "counter"}`): what it names is that session's item, counted by that counter."""
    if not rows:
        return None
    links: list[dict[str, Any]] = []
    body: list[dict[str, Any]] | None = None
    for row in rows:
        if isinstance(row["body"], list):
            body = row["body"]
            break
        links.append(row["body"])
        if links[-1]["base"] is None:
            body = []
            break
    if body is None:
        raise LookupError(f"request {sha} refers to a missing base {links[-1]['base']}")
    for link in reversed(links):
        body = _head(body, link["keep"]) + _tagged(link)
    return StoredRequest(prefix_sha256=rows[0]["prefix_sha256"], body=body)


def _head(body: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """A body's first `keep` segments, a run (`{"seqs": [first, last], ...}`) counting as the segments it stands
    for, cut where `keep` ends inside it."""
    if True not in map(operator.contains, body, repeat("seqs")):
        return body[:keep]
    out: list[dict[str, Any]] = []
    done = 0
    for entry in body:
        if done >= keep:
            break
        seqs = entry.get("seqs")
        size = seqs[1] - seqs[0] + 1 if seqs else 1
        if done + size > keep:
            assert seqs is not None  # only a run stands for more than one segment
            entry = {**entry, "seqs": [seqs[0], seqs[0] + keep - done - 1]}
            size = keep - done
        out.append(entry)
        done += size
    return out


def _tagged(link: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A link's tail, each reference and run in it with the link's session and counter."""
    tail: list[dict[str, Any]] = link["tail"]
    if "session" not in link:  # stored before references were: whole segments only
        return tail
    where = {"session": link["session"], "counter": link["counter"]}
    return [{**seg, **where} if "ref" in seg or "seqs" in seg else seg for seg in tail]


def _claim(row: Mapping[str, Any], *, owned: bool) -> SessionClaim:
    return SessionClaim(
        owned=owned, secret=bytes(row["secret"]), created_at=row["created_at"], closed_at=row["closed_at"]
    )
