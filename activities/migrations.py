"""Schema migrations: an append-only list whose position is the version. Never edit a shipped entry."""

from __future__ import annotations

ITEM_BLOCK = 256  # the items a sealed block holds (migration 7)
ITEM_TAIL_BLOCK = 64  # the items a sealed tail block holds (migration 10): the log after its last full block

# An item's head (migration 8): its id, kind, trust, call id and segment's taint, as the text of a flat JSON list's
# five elements (no brackets), so heads joined by commas are one flat list (`activities.store._live`).
ITEM_HEAD = (
    "concat_ws(',', to_json(item_id), to_json(kind), to_json(trust), coalesce(payload->'call_id', 'null'), "
    "coalesce(segment->'taints', 'null'))"
)
ITEM_HEAD_FIELDS = 5  # the elements of an item's head

MIGRATIONS: tuple[str, ...] = (
    # 1: the session log and everything a request is rebuilt from
    """
    CREATE TABLE IF NOT EXISTS sessions (
        session_id text PRIMARY KEY,
        open jsonb NOT NULL,
        secret bytea NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        closed_at timestamptz,
        close_reason text
    );
    CREATE TABLE IF NOT EXISTS items (
        session_id text NOT NULL REFERENCES sessions (session_id),
        seq integer NOT NULL,
        item_id text NOT NULL,
        kind text NOT NULL,
        trust text NOT NULL,
        turn integer NOT NULL,
        payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, seq),
        UNIQUE (session_id, item_id)
    );
    CREATE TABLE IF NOT EXISTS artifacts (
        session_id text NOT NULL REFERENCES sessions (session_id),
        sha256 text NOT NULL,
        trust text NOT NULL,
        media_type text NOT NULL,
        content text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, sha256)
    );
    CREATE TABLE IF NOT EXISTS prefixes (
        session_id text NOT NULL REFERENCES sessions (session_id),
        epoch integer NOT NULL,
        sha256 text NOT NULL,
        reason text NOT NULL,
        profile jsonb NOT NULL,
        prefix jsonb NOT NULL,
        inputs jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, epoch)
    );
    CREATE TABLE IF NOT EXISTS rendered_requests (
        sha256 text PRIMARY KEY,
        prefix_sha256 text NOT NULL,
        body jsonb NOT NULL
    );
    CREATE TABLE IF NOT EXISTS request_records (
        session_id text NOT NULL REFERENCES sessions (session_id),
        turn integer NOT NULL,
        call_index integer NOT NULL,
        epoch integer NOT NULL,
        prefix_sha256 text NOT NULL,
        request_sha256 text NOT NULL,
        estimated_tokens integer NOT NULL,
        raw_tokens integer NOT NULL,
        plan jsonb NOT NULL,
        inputs jsonb NOT NULL,
        actual_input_tokens integer,
        cached_tokens integer,
        output_tokens integer,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, turn, call_index)
    );
    CREATE INDEX IF NOT EXISTS request_records_epoch ON request_records (session_id, epoch);
    CREATE TABLE IF NOT EXISTS checkpoints (
        session_id text NOT NULL REFERENCES sessions (session_id),
        checkpoint_id text NOT NULL,
        parent_id text,
        depth integer NOT NULL,
        covers_from_seq integer NOT NULL,
        covers_to_seq integer NOT NULL,
        checkpoint jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, checkpoint_id)
    );
    CREATE TABLE IF NOT EXISTS events (
        session_id text NOT NULL,
        event_key text NOT NULL,
        type text NOT NULL,
        turn integer NOT NULL,
        epoch integer NOT NULL,
        payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, event_key)
    );
    CREATE INDEX IF NOT EXISTS events_type ON events (type, created_at);
    CREATE TABLE IF NOT EXISTS memories (
        scope text NOT NULL,
        memory_id text NOT NULL,
        text text NOT NULL,
        trust text NOT NULL,
        source_session text,
        corrects text,
        created_at timestamptz NOT NULL DEFAULT now(),
        tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', text)) STORED,
        PRIMARY KEY (scope, memory_id)
    );
    CREATE INDEX IF NOT EXISTS memories_tsv ON memories USING gin (tsv);
    CREATE TABLE IF NOT EXISTS working_state_writes (
        session_id text NOT NULL REFERENCES sessions (session_id),
        write_key text NOT NULL,
        turn integer NOT NULL,
        position bigserial,
        write jsonb NOT NULL,
        PRIMARY KEY (session_id, write_key)
    );
    CREATE TABLE IF NOT EXISTS compaction_plans (
        session_id text NOT NULL REFERENCES sessions (session_id),
        checkpoint_id text NOT NULL,
        plan jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, checkpoint_id)
    );
    CREATE TABLE IF NOT EXISTS summarizer_calls (
        session_id text NOT NULL REFERENCES sessions (session_id),
        checkpoint_id text NOT NULL,
        chunk_index integer NOT NULL,
        input text NOT NULL,
        summary text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, checkpoint_id, chunk_index)
    );
    CREATE TABLE IF NOT EXISTS memory_candidates (
        session_id text NOT NULL REFERENCES sessions (session_id),
        fact_id text NOT NULL,
        text text NOT NULL,
        accepted boolean NOT NULL,
        gate text,
        reason text NOT NULL,
        memory_id text,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, fact_id)
    );
    CREATE TABLE IF NOT EXISTS calibrations (
        route text PRIMARY KEY,
        calibration double precision NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    """,
    # 2: the cacheable prefix as the adapters sent it (activities/wire.py): its hash per request, and each
    # distinct wire prefix of an epoch once, for the cache-break explainer
    """
    ALTER TABLE request_records ADD COLUMN IF NOT EXISTS wire_prefix_sha256 text;
    CREATE TABLE IF NOT EXISTS wire_prefixes (
        session_id text NOT NULL REFERENCES sessions (session_id),
        epoch integer NOT NULL,
        sha256 text NOT NULL,
        text text NOT NULL,
        first_turn integer NOT NULL,
        position bigserial,
        PRIMARY KEY (session_id, epoch, sha256)
    );
    """,
    # 3: one owner per session id (docs/reliability.md): the first run id of the workflow that opened it
    """
    ALTER TABLE sessions ADD COLUMN IF NOT EXISTS owner text;
    """,
    # 4: render once, at write time (docs/operations.md, "Schema and migrations"): each item's rendered segment
    # and its token count per counter, so a worker that has not seen the session reads them instead of escaping
    # and counting again
    """
    ALTER TABLE items ADD COLUMN IF NOT EXISTS rendered text;
    ALTER TABLE items ADD COLUMN IF NOT EXISTS tokens jsonb;
    """,
    # 5: each distinct prefix hash of an epoch once, with the request that first sent it, so a build checks its
    # prefix against the epoch's few hashes instead of reading every request record of the epoch; and request
    # bodies stored uncompressed (a whole body, as a worker that has not seen the session writes it, costs pglz
    # more CPU than the disk it saves: 16 ms against 9.5 ms for 400 kB, docs/benchmarks.md)
    """
    ALTER TABLE rendered_requests ALTER COLUMN body SET STORAGE EXTERNAL;
    CREATE TABLE IF NOT EXISTS request_prefixes (
        session_id text NOT NULL REFERENCES sessions (session_id),
        epoch integer NOT NULL,
        prefix_sha256 text NOT NULL,
        first_turn integer NOT NULL,
        first_call_index integer NOT NULL,
        PRIMARY KEY (session_id, epoch, prefix_sha256)
    );
    INSERT INTO request_prefixes (session_id, epoch, prefix_sha256, first_turn, first_call_index)
    SELECT DISTINCT ON (session_id, epoch, prefix_sha256) session_id, epoch, prefix_sha256, turn, call_index
    FROM request_records ORDER BY session_id, epoch, prefix_sha256, turn, call_index
    ON CONFLICT DO NOTHING;
    """,
    # 6: each item's segment fields (all but its text and count) beside its render, so a stored request body
    # refers to the items' renders ({"ref": item id}) instead of copying them: a worker that has not seen the
    # session writes a few bytes per item, not the whole body; and a tool result's pointer, rendered and counted,
    # so such a worker's build under pressure reads its pointers too (docs/operations.md, "Schema and migrations")
    """
    ALTER TABLE items ADD COLUMN IF NOT EXISTS segment jsonb;
    ALTER TABLE items ADD COLUMN IF NOT EXISTS pointer jsonb;
    """,
    # 7: the log also in blocks of 256 items (docs/operations.md, "Schema and migrations"): each full block of a
    # session's log, sealed by a trigger when its last item is inserted, holds what a worker's memo reads of its
    # items (payloads, renders, counts, whether referable, pointers) as JSON text, so a worker that has not seen
    # the session reads one row per 256 items instead of converting each item's columns to text; the session's
    # full blocks logged before this migration are sealed by it
    """
    CREATE TABLE IF NOT EXISTS item_blocks (
        session_id text NOT NULL REFERENCES sessions (session_id),
        first_seq integer NOT NULL,
        last_seq integer NOT NULL,
        payloads text NOT NULL,
        renders text NOT NULL,
        counts text NOT NULL,
        referable text NOT NULL,
        pointers text NOT NULL,
        PRIMARY KEY (session_id, first_seq)
    );
    CREATE OR REPLACE FUNCTION item_block_seal(sid text, first integer) RETURNS void LANGUAGE sql AS $$
        INSERT INTO item_blocks (session_id, first_seq, last_seq, payloads, renders, counts, referable, pointers)
        SELECT sid, first, first + 255,
               string_agg(payload::text, ',' ORDER BY seq),
               string_agg(coalesce(to_json(rendered)::text, 'null'), ',' ORDER BY seq),
               string_agg(coalesce(tokens::text, 'null'), ',' ORDER BY seq),
               string_agg(CASE WHEN segment IS NULL THEN 'false' ELSE 'true' END, ',' ORDER BY seq),
               string_agg(coalesce(pointer::text, 'null'), ',' ORDER BY seq)
        FROM items WHERE session_id = sid AND seq BETWEEN first AND first + 255
        HAVING count(*) = 256
        ON CONFLICT DO NOTHING
    $$;
    CREATE OR REPLACE FUNCTION items_seal_block() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM item_block_seal(NEW.session_id, NEW.seq - 255);
        RETURN NULL;
    END
    $$;
    DROP TRIGGER IF EXISTS items_seal_block ON items;
    CREATE TRIGGER items_seal_block AFTER INSERT ON items FOR EACH ROW WHEN (NEW.seq % 256 = 255)
        EXECUTE FUNCTION items_seal_block();
    SELECT item_block_seal(session_id, seq - 255) FROM items WHERE seq % 256 = 255;
    """,
    # 8: each block also holds its items' heads (docs/operations.md, "Schema and migrations"): per item its id,
    # kind, trust, call id and whether its segment taints the view (null: no segment stored), as a flat JSON
    # list's text, so a worker that has not seen the session makes the items' segments from the heads and their
    # renders, and makes an item of a block's payloads only when a caller looks into it; the blocks sealed before
    # this migration get theirs from their items
    f"""
    ALTER TABLE item_blocks ADD COLUMN IF NOT EXISTS heads text;
    CREATE OR REPLACE FUNCTION item_block_seal(sid text, first integer) RETURNS void LANGUAGE sql AS $$
        INSERT INTO item_blocks (session_id, first_seq, last_seq, payloads, renders, counts, referable, pointers, heads)
        SELECT sid, first, first + 255,
               string_agg(payload::text, ',' ORDER BY seq),
               string_agg(coalesce(to_json(rendered)::text, 'null'), ',' ORDER BY seq),
               string_agg(coalesce(tokens::text, 'null'), ',' ORDER BY seq),
               string_agg(CASE WHEN segment IS NULL THEN 'false' ELSE 'true' END, ',' ORDER BY seq),
               string_agg(coalesce(pointer::text, 'null'), ',' ORDER BY seq),
               string_agg({ITEM_HEAD}, ',' ORDER BY seq)
        FROM items WHERE session_id = sid AND seq BETWEEN first AND first + 255
        HAVING count(*) = 256
        ON CONFLICT DO NOTHING
    $$;
    UPDATE item_blocks b SET heads = (
        SELECT string_agg({ITEM_HEAD}, ',' ORDER BY seq) FROM items
        WHERE items.session_id = b.session_id AND items.seq BETWEEN b.first_seq AND b.last_seq
    ) WHERE b.heads IS NULL;
    """,
    # 9: blocks in the columns a cold read parses least, stored uncompressed (docs/operations.md, "Schema and
    # migrations"): the items' renders as a text array (`render_list`: PostgreSQL sends each one as it is, where the
    # JSON list's text must be unescaped), their counts by counter (`count_columns`: a JSON object of one list per
    # counter key, where `counts` holds an object per item); and a block's columns stored as they are, since pglz
    # costs a cold read more CPU than the disk it saves (docs/benchmarks.md). `renders` and `counts` are still
    # written, compressed, for the workers of the release before, which read them; the blocks sealed before this
    # migration get the new columns from their items, by the functions the seal uses (so the two cannot differ)
    f"""
    ALTER TABLE item_blocks ADD COLUMN IF NOT EXISTS render_list text[], ADD COLUMN IF NOT EXISTS count_columns text;
    ALTER TABLE item_blocks ALTER COLUMN payloads SET STORAGE EXTERNAL, ALTER COLUMN heads SET STORAGE EXTERNAL,
        ALTER COLUMN referable SET STORAGE EXTERNAL, ALTER COLUMN pointers SET STORAGE EXTERNAL,
        ALTER COLUMN render_list SET STORAGE EXTERNAL, ALTER COLUMN count_columns SET STORAGE EXTERNAL;
    CREATE OR REPLACE FUNCTION item_block_render_list(sid text, first integer) RETURNS text[] LANGUAGE sql AS $$
        SELECT array_agg(rendered ORDER BY seq) FROM items WHERE session_id = sid AND seq BETWEEN first AND first + 255
    $$;
    CREATE OR REPLACE FUNCTION item_block_count_columns(sid text, first integer) RETURNS text LANGUAGE sql AS $$
        SELECT coalesce(json_object_agg(k.key, (
                   SELECT json_agg(i.tokens -> k.key ORDER BY i.seq) FROM items i
                   WHERE i.session_id = sid AND i.seq BETWEEN first AND first + 255
               ) ORDER BY k.key), '{{}}')::text
        FROM (SELECT DISTINCT jsonb_object_keys(tokens) AS key FROM items
              WHERE session_id = sid AND seq BETWEEN first AND first + 255 AND tokens IS NOT NULL) k
    $$;
    CREATE OR REPLACE FUNCTION item_block_seal(sid text, first integer) RETURNS void LANGUAGE sql AS $$
        INSERT INTO item_blocks (session_id, first_seq, last_seq, payloads, renders, counts, referable, pointers, heads,
                                 render_list, count_columns)
        SELECT sid, first, first + 255,
               string_agg(payload::text, ',' ORDER BY seq),
               string_agg(coalesce(to_json(rendered)::text, 'null'), ',' ORDER BY seq),
               string_agg(coalesce(tokens::text, 'null'), ',' ORDER BY seq),
               string_agg(CASE WHEN segment IS NULL THEN 'false' ELSE 'true' END, ',' ORDER BY seq),
               string_agg(coalesce(pointer::text, 'null'), ',' ORDER BY seq),
               string_agg({ITEM_HEAD}, ',' ORDER BY seq),
               item_block_render_list(sid, first),
               item_block_count_columns(sid, first)
        FROM items WHERE session_id = sid AND seq BETWEEN first AND first + 255
        HAVING count(*) = 256
        ON CONFLICT DO NOTHING
    $$;
    UPDATE item_blocks b SET render_list = item_block_render_list(b.session_id, b.first_seq),
        count_columns = item_block_count_columns(b.session_id, b.first_seq)
    WHERE b.render_list IS NULL;
    """,
    # 10: the log after its last full block in tail blocks of 64 items (docs/operations.md, "Schema and
    # migrations"): a cold read of a session whose log ends up to 255 items past a full block read each of them as a
    # row (the bench's 1,000-item session: 232); now at most 63. A tail block holds what a block holds for a
    # worker of this release (no `renders` or `counts`), in a table of its own: the workers of the release before
    # read `item_blocks` as blocks of 256 items, and never see these. The trigger seals a tail block as its last
    # item is logged, and the full block in its place as that block's last item is, removing its tail blocks
    # in the same statement; a tail block is never sealed where a full block is. Its columns are made by the
    # functions that make a block's, of its own run (`item_run_render_list`, `item_run_count_columns`, which the
    # block's now call too). The tails logged before this migration are sealed by it
    f"""
    CREATE TABLE IF NOT EXISTS item_tail_blocks (
        session_id text NOT NULL REFERENCES sessions (session_id),
        first_seq integer NOT NULL,
        last_seq integer NOT NULL,
        payloads text NOT NULL,
        heads text NOT NULL,
        render_list text[] NOT NULL,
        count_columns text NOT NULL,
        referable text NOT NULL,
        pointers text NOT NULL,
        PRIMARY KEY (session_id, first_seq)
    );
    ALTER TABLE item_tail_blocks ALTER COLUMN payloads SET STORAGE EXTERNAL,
        ALTER COLUMN heads SET STORAGE EXTERNAL, ALTER COLUMN render_list SET STORAGE EXTERNAL,
        ALTER COLUMN count_columns SET STORAGE EXTERNAL, ALTER COLUMN referable SET STORAGE EXTERNAL,
        ALTER COLUMN pointers SET STORAGE EXTERNAL;
    CREATE OR REPLACE FUNCTION item_run_render_list(sid text, first integer, last integer) RETURNS text[]
    LANGUAGE sql AS $$
        SELECT array_agg(rendered ORDER BY seq) FROM items WHERE session_id = sid AND seq BETWEEN first AND last
    $$;
    CREATE OR REPLACE FUNCTION item_run_count_columns(sid text, first integer, last integer) RETURNS text
    LANGUAGE sql AS $$
        SELECT coalesce(json_object_agg(k.key, (
                   SELECT json_agg(i.tokens -> k.key ORDER BY i.seq) FROM items i
                   WHERE i.session_id = sid AND i.seq BETWEEN first AND last
               ) ORDER BY k.key), '{{}}')::text
        FROM (SELECT DISTINCT jsonb_object_keys(tokens) AS key FROM items
              WHERE session_id = sid AND seq BETWEEN first AND last AND tokens IS NOT NULL) k
    $$;
    CREATE OR REPLACE FUNCTION item_block_render_list(sid text, first integer) RETURNS text[] LANGUAGE sql AS $$
        SELECT item_run_render_list(sid, first, first + {ITEM_BLOCK - 1})
    $$;
    CREATE OR REPLACE FUNCTION item_block_count_columns(sid text, first integer) RETURNS text LANGUAGE sql AS $$
        SELECT item_run_count_columns(sid, first, first + {ITEM_BLOCK - 1})
    $$;
    CREATE OR REPLACE FUNCTION item_tail_block_seal(sid text, first integer) RETURNS void LANGUAGE sql AS $$
        INSERT INTO item_tail_blocks (session_id, first_seq, last_seq, payloads, heads, render_list, count_columns,
                                      referable, pointers)
        SELECT sid, first, first + {ITEM_TAIL_BLOCK - 1},
               string_agg(payload::text, ',' ORDER BY seq),
               string_agg({ITEM_HEAD}, ',' ORDER BY seq),
               item_run_render_list(sid, first, first + {ITEM_TAIL_BLOCK - 1}),
               item_run_count_columns(sid, first, first + {ITEM_TAIL_BLOCK - 1}),
               string_agg(CASE WHEN segment IS NULL THEN 'false' ELSE 'true' END, ',' ORDER BY seq),
               string_agg(coalesce(pointer::text, 'null'), ',' ORDER BY seq)
        FROM items WHERE session_id = sid AND seq BETWEEN first AND first + {ITEM_TAIL_BLOCK - 1}
        HAVING count(*) = {ITEM_TAIL_BLOCK} AND NOT EXISTS (
            SELECT 1 FROM item_blocks b WHERE b.session_id = sid AND b.first_seq = first - first % {ITEM_BLOCK}
        )
        ON CONFLICT DO NOTHING
    $$;
    CREATE OR REPLACE FUNCTION items_seal_block() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.seq % {ITEM_BLOCK} = {ITEM_BLOCK - 1} THEN
            PERFORM item_block_seal(NEW.session_id, NEW.seq - {ITEM_BLOCK - 1});
            DELETE FROM item_tail_blocks
            WHERE session_id = NEW.session_id AND first_seq BETWEEN NEW.seq - {ITEM_BLOCK - 1} AND NEW.seq;
        ELSE
            PERFORM item_tail_block_seal(NEW.session_id, NEW.seq - {ITEM_TAIL_BLOCK - 1});
        END IF;
        RETURN NULL;
    END
    $$;
    DROP TRIGGER IF EXISTS items_seal_block ON items;
    CREATE TRIGGER items_seal_block AFTER INSERT ON items FOR EACH ROW
        WHEN (NEW.seq % {ITEM_TAIL_BLOCK} = {ITEM_TAIL_BLOCK - 1}) EXECUTE FUNCTION items_seal_block();
    SELECT item_tail_block_seal(i.session_id, i.seq - {ITEM_TAIL_BLOCK - 1}) FROM items i
    WHERE i.seq % {ITEM_TAIL_BLOCK} = {ITEM_TAIL_BLOCK - 1} AND i.seq % {ITEM_BLOCK} <> {ITEM_BLOCK - 1}
      AND NOT EXISTS (
        SELECT 1 FROM item_blocks b WHERE b.session_id = i.session_id AND b.first_seq = i.seq - i.seq % {ITEM_BLOCK}
      );
    """,
    # 11: a memory's corrections, latest first: its correction line, and recall of a corrected memory (its latest).
    """
    CREATE INDEX IF NOT EXISTS memories_corrects ON memories (scope, corrects, created_at DESC, memory_id DESC)
        WHERE corrects IS NOT NULL;
    """,
    # 12: the ids of purged sessions (nothing else of them): a session id names one session forever, purged too.
    """
    CREATE TABLE IF NOT EXISTS purged_sessions (
        session_id text PRIMARY KEY,
        opened_at timestamptz NOT NULL,
        closed_at timestamptz,
        purged_at timestamptz NOT NULL DEFAULT now()
    );
    """,
)
