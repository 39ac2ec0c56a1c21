"""What one request is built from, stored with its record so the request can be rebuilt byte for byte.

`RequestInputs` is everything build() needs beyond the session log, the checkpoint and the frozen prefix;
`body_inputs()` turns it and the log into the pure builder's `BodyInputs`. The build activity and
`ctxengine replay` / the determinism gate share this one path.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from operator import attrgetter

from pydantic import BaseModel, Field

from core.budget import ContextBudget
from core.build import WORKING_STATE_ID, BodyInputs
from core.compaction import Checkpoint
from core.estimator import ModelProfile
from core.history import LoggedHistory
from core.items import (
    CorrectionLine,
    CurrentUserMessage,
    HistoryItem,
    RecallItem,
    TrustLevel,
    TurnContext,
    UserMessage,
    WorkingStateBlock,
)

_seq = attrgetter("seq")


class StoredMemory(BaseModel):
    memory_id: str
    text: str
    trust: TrustLevel
    corrects: str | None = None


class RequestInputs(BaseModel):
    turn: int
    call_index: int
    max_seq: int  # the log as it was: items up to this seq
    user_item_id: str | None
    checkpoint_id: str | None
    recall: list[StoredMemory] = Field(default_factory=list)
    corrections: list[StoredMemory] = Field(default_factory=list)
    working_state: str = ""
    working_state_tainted: bool = False  # some entry was written with untrusted content in view
    now_iso: str
    profile: ModelProfile
    budget: ContextBudget
    # The estimator's rules this request was built under (core/estimator.py, ESTIMATE_RULES_VERSION); records
    # written before the rules were versioned were built under rules 1.
    estimate_rules: int = 1


def body_inputs(
    items: LoggedHistory | Sequence[HistoryItem], checkpoint: Checkpoint | None, ri: RequestInputs
) -> BodyInputs:
    """The builder's Region B inputs for one request (pure). `items`: the session log in log order (by seq), as
    the memo holds it (`SessionCache.logged`) or as items; only the items up to `ri.max_seq` are the request's.
    The work is what the active turn holds, not the log's length: slices, and a walk back to the turn's message."""
    log = items if isinstance(items, LoggedHistory) else LoggedHistory.of(items)
    seqs = log.seqs
    k = bisect.bisect_right(seqs, ri.max_seq) if seqs and seqs[-1] > ri.max_seq else len(seqs)
    at = -1
    if ri.user_item_id:
        ids = log.ids
        at = next((j for j in range(k - 1, -1, -1) if ids[j] == ri.user_item_id), -1)
    user = log.item(at) if at >= 0 else None
    turn_start = user.seq if user is not None else (seqs[k - 1] + 1 if k else 0)
    current: CurrentUserMessage | None = None
    history = log.head(k)
    if ri.call_index == 0 and isinstance(user, UserMessage):
        history = log.without(at, k)
        current = CurrentUserMessage(id=user.id, seq=user.seq, text=user.text)
    # Built from typed values: validating the history again would cost a pass over the whole log per request.
    return BodyInputs.model_construct(
        history=history,
        checkpoint=checkpoint,
        turn_start_seq=turn_start,
        current=current,
        recall=[
            RecallItem(id=f"recall.{m.memory_id}", memory_id=m.memory_id, rank=rank, text=m.text)
            for rank, m in enumerate(ri.recall)
        ],
        corrections=[
            CorrectionLine(id=f"correction.{m.memory_id}", memory_id=m.corrects or "", text=m.text)
            for m in ri.corrections
        ],
        working_state=WorkingStateBlock(
            id=WORKING_STATE_ID, text=ri.working_state, holds_tainted=ri.working_state_tainted
        )
        if ri.working_state
        else None,
        turn_context=TurnContext(
            id=f"clock.{ri.turn}.{ri.call_index}", text=f"Current date and time (UTC): {ri.now_iso}"
        ),
    )
