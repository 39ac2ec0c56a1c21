"""The seal of calls left without a result (`activities.lifecycle.seal_orphans`) on a worker whose memo saw a call
but not its result before a checkpoint covered both: the call is answered, not an orphan, and the memo forgets it;
a covered call that was never answered is still sealed. On a real PostgreSQL, the log written as other workers
would write it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from activities.lifecycle import seal_orphans
from activities.session_state import SessionState
from activities.store import Store

pytestmark = pytest.mark.integration


def _call(item_id: str, call_id: str) -> dict[str, Any]:
    return {"id": item_id, "kind": "tool_call", "trust": "MODEL", "call_id": call_id, "tool_name": "notes.read"}


def _result(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"{call['id']}.result",
        "kind": "tool_result",
        "trust": "TOOL",
        "call_id": call["call_id"],
        "tool_name": call["tool_name"],
        "content": "ok",
        "is_error": False,
        "artifact_ref": None,
    }


def _user(turn: int) -> dict[str, Any]:
    return {"id": f"u:{turn}", "kind": "user_message", "trust": "USER", "text": f"turn {turn}"}


async def test_a_call_answered_out_of_the_memos_view_is_not_sealed_and_is_forgotten(pg_dsn: str) -> None:
    answered, unanswered = _call("t1.m0.call0", "c-answered"), _call("t1.m0.call1", "c-unanswered")
    async with Store.from_dsn(pg_dsn) as store:
        await store.migrate()
        await store.pool.execute(
            "INSERT INTO sessions (session_id, open, secret) VALUES ('s', $1::jsonb, '\\x00'::bytea)",
            {"agent_instructions": "be brief"},  # the store's connections encode JSON themselves
        )
        state = SessionState(store, {})
        _, _, cache = await state.session("s")
        await store.append_items("s", 1, [_user(1), answered, unanswered])
        await state.items("s", cache)  # this worker's read: both calls open
        # Another worker answers one call and runs turn 2; a checkpoint covers turn 1 (positions 0-3).
        await store.append_items("s", 1, [_result(answered)])
        await store.append_items("s", 2, [_user(2)])
        await store.pool.execute(
            """INSERT INTO checkpoints (session_id, checkpoint_id, parent_id, depth, covers_from_seq, covers_to_seq,
            checkpoint) VALUES ('s', 'cp-1', NULL, 1, 0, 3, $1::jsonb)""",
            {"kind": "summary"},
        )
        await state.items("s", cache)  # this worker's next read: both calls covered, the result never seen
        assert {c.call_id for c in cache.unanswered_calls()} == {"c-answered", "c-unanswered"}

        sealed = await seal_orphans(state, "s", 2, "a test", cache=cache)

        assert sealed == 1
        rows = {r.payload["id"]: r.payload for r in await store.load_items("s")}
        assert rows["t1.m0.call0.result"]["content"] == "ok"  # the answer stays as it was logged
        assert rows["t1.m0.call1.result"]["is_error"] and "a test" in rows["t1.m0.call1.result"]["content"]
        assert len(rows) == 6, json.dumps(sorted(rows))
        assert cache.unanswered_calls() == []
        assert await seal_orphans(state, "s", 2, "a test", cache=cache) == 0
