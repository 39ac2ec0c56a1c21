"""Rebuild recorded requests from their stored inputs with the pure builder, optionally under other settings.

With no changed setting every rebuild must reproduce the recorded `prefix_sha256`, request hash and token
estimate: that is the determinism check. Read-only: nothing here writes to the session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from activities.assembly import RequestInputs, body_inputs
from activities.rows import RequestRecord
from activities.store import Store
from core.budget import ContextBudget
from core.build import FrozenPrefix, PrefixInputs, RenderCache, build, counter_key, open_prefix
from core.compaction import Checkpoint
from core.errors import ContextError
from core.estimator import ModelProfile, TokenCounter, TokenEstimator
from core.items import HistoryItem, parse_history_item
from core.plan import ContextPlan


class RebuiltRequest(BaseModel):
    turn: int
    call_index: int
    epoch: int
    recorded_prefix_sha256: str
    prefix_sha256: str | None
    recorded_request_sha256: str
    request_sha256: str | None
    recorded_estimated_tokens: int
    estimated_tokens: int | None
    actual_input_tokens: int | None
    input_limit: int | None
    status: str  # fits / needs_compaction / error
    deficit_tokens: int = 0
    tokens_by_class: dict[str, int] = {}
    yields: list[str] = []
    error: str | None = None

    @property
    def reproduced(self) -> bool:
        return (
            self.prefix_sha256 == self.recorded_prefix_sha256
            and self.request_sha256 == self.recorded_request_sha256
            and self.estimated_tokens == self.recorded_estimated_tokens
        )


class Overrides(BaseModel):
    budget: dict[str, Any] = {}
    profile: ModelProfile | None = None

    @property
    def empty(self) -> bool:
        return not self.budget and self.profile is None


async def rebuild_session(
    store: Store,
    session_id: str,
    counter_for: Callable[[str], TokenCounter],
    overrides: Overrides | None = None,
    *,
    observe: Callable[[RequestRecord, FrozenPrefix, ContextPlan], None] | None = None,
) -> list[RebuiltRequest]:
    """Every recorded request of the session, rebuilt in order. `observe`, when given, sees each record with the
    prefix and the plan rebuilt for it (a gate compares what was stored with them)."""
    overrides = overrides or Overrides()
    session = await store.get_session(session_id)
    if session is None:
        raise LookupError(f"no session {session_id!r} in this database")
    secret = session.secret
    items: list[HistoryItem] = [parse_history_item(r.payload) for r in await store.load_items(session_id)]
    prefixes: dict[tuple[int, str], FrozenPrefix | str] = {}
    checkpoints: dict[str, Checkpoint] = {}
    caches: dict[str, RenderCache] = {}
    out: list[RebuiltRequest] = []
    for rec in await store.records(session_id):
        ri = RequestInputs.model_validate(rec.inputs)
        profile = overrides.profile or ri.profile
        budget = ContextBudget.model_validate({**ri.budget.model_dump(), **overrides.budget})
        estimator = TokenEstimator(profile, counter_for(profile.encoding), rules=ri.estimate_rules)
        base = RebuiltRequest(
            turn=rec.turn,
            call_index=rec.call_index,
            epoch=rec.epoch,
            recorded_prefix_sha256=rec.prefix_sha256,
            prefix_sha256=None,
            recorded_request_sha256=rec.request_sha256,
            request_sha256=None,
            recorded_estimated_tokens=rec.estimated_tokens,
            estimated_tokens=None,
            actual_input_tokens=rec.actual_input_tokens,
            input_limit=budget.input_limit,
            status="error",
        )
        key = (rec.epoch, profile.model_dump_json() + budget.model_dump_json())
        if key not in prefixes:
            prefixes[key] = await _prefix(store, session_id, rec.epoch, overrides, budget, estimator, secret)
        prefix = prefixes[key]
        if isinstance(prefix, str):
            out.append(base.model_copy(update={"error": prefix}))
            continue
        checkpoint = None
        if ri.checkpoint_id:
            if ri.checkpoint_id not in checkpoints:
                cp = await store.get_checkpoint(session_id, ri.checkpoint_id)
                assert cp is not None, f"checkpoint {ri.checkpoint_id} is missing"
                checkpoints[ri.checkpoint_id] = Checkpoint.model_validate(cp)
            checkpoint = checkpoints[ri.checkpoint_id]
        try:
            plan = build(
                prefix,
                body_inputs(items, checkpoint, ri),
                budget=budget,
                estimator=estimator,
                secret=secret,
                cache=caches.setdefault(counter_key(estimator), RenderCache(secret, counter_key(estimator))),
            )
        except ContextError as exc:
            out.append(base.model_copy(update={"error": str(exc), "prefix_sha256": prefix.sha256}))
            continue
        if observe is not None:
            observe(rec, prefix, plan)
        out.append(
            base.model_copy(
                update={
                    "prefix_sha256": plan.prefix_sha256,
                    "request_sha256": plan.request_sha256,
                    "estimated_tokens": plan.estimated_tokens,
                    "status": plan.status.value,
                    "deficit_tokens": plan.deficit_tokens,
                    "tokens_by_class": plan.tokens_by_class,
                    "yields": [f"{y.step.value}:{y.reason}:{len(y.item_ids)}" for y in plan.yields],
                }
            )
        )
    return out


async def _prefix(
    store: Store,
    session_id: str,
    epoch: int,
    overrides: Overrides,
    budget: ContextBudget,
    estimator: TokenEstimator,
    secret: bytes,
) -> FrozenPrefix | str:
    row = await store.get_prefix(session_id, epoch)
    if row is None:
        return f"no prefix stored for epoch {epoch}"
    if overrides.empty:
        return FrozenPrefix.model_validate(row.prefix)
    try:  # other settings: measure the same Region A again, as a session open would
        return open_prefix(PrefixInputs.model_validate(row.inputs), budget=budget, estimator=estimator, secret=secret)
    except ContextError as exc:
        return str(exc)
