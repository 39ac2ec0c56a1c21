"""A worker with a fault the chaos gate must catch (test harness only): every tool result is also appended a
second time under a fresh id, as a non-idempotent write would on a retry. Run as a script, like worker.py."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import activities.store as store_module

_append = store_module.Store.append_items


async def _doubled(self: Any, session_id: str, turn: int, items: Any, **kw: Any) -> Any:
    seqs = await _append(self, session_id, turn, items, **kw)
    again = [{**i, "id": f"{i['id']}.{uuid.uuid4().hex[:6]}"} for i in items if i.get("kind") == "tool_result"]
    if again:
        await _append(self, session_id, turn, again)
    return seqs


store_module.Store.append_items = _doubled  # type: ignore[method-assign]

import worker  # noqa: E402

if __name__ == "__main__":
    asyncio.run(worker.main())
