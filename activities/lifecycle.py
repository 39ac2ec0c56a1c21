"""A session's life: open an epoch (pin tools and memory snapshot, measure and store the prefix), seal a
failed turn's unanswered tool calls, close.

An open is idempotent: a retry, or a rotation replayed, finds the stored prefix and returns it.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.minimum_body import check_route_fits
from activities.openai_provider import UnconfiguredProvider
from activities.session_state import SessionCache, SessionState
from contract import names
from contract.activity_interfaces import SessionLifecycleCalls
from contract.events import EventType
from contract.payloads import CloseInput, OpenInput, OpenResult, SealTurnInput
from core.build import FrozenPrefix, open_prefix, operator_tool, region_a_inputs
from core.errors import PrefixOverflowError, RouteDoesNotFitError
from core.estimator import TokenEstimator
from core.items import MemorySnapshotEntry, TrustLevel

log = structlog.get_logger("ctxengine.activities")


class LifecycleActivities(SessionLifecycleCalls):
    def __init__(self, state: SessionState) -> None:
        self.state = state

    @activity.defn(name=names.ACTIVITY_OPEN)
    async def open_session(self, inp: OpenInput) -> OpenResult:
        """Pin the tool set and memory snapshot, measure the prefix exactly, store it for the epoch."""
        state, store = self.state, self.state.store
        if inp.open.model_route is None and not state.scripted_by_default:  # before anything is stored
            raise ApplicationError(
                "model_route: required on this worker: name the provider and model that serve the session "
                '(e.g. {"provider": "openai", "model": "gpt-4o"}); only a worker on the embedded dev services '
                "gives a session without one the scripted model",
                type="ModelRouteRequired",
                non_retryable=True,
            )
        if inp.owner is None:  # scheduled by a run that predates session owners
            secret = await store.create_session(inp.session_id, inp.open.model_dump(mode="json"), os.urandom(32))
        else:
            secret = await self._claim(inp)
        existing = await store.get_prefix(inp.session_id, inp.epoch)
        if existing is not None:  # a retry, or a rotation replayed: the stored prefix is the truth
            return self._result(inp, FrozenPrefix.model_validate(existing.prefix))
        try:
            budget = inp.open.context_budget()
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "output_reserve"  # the reserve-under-window check
            raise ApplicationError(
                f"session open: budget.{field}: {str(first['msg']).removeprefix('Value error, ')}",
                type="InvalidSessionOpen",
                non_retryable=True,
            ) from exc
        if budget.output_reserve < 1:  # refused here, at the door: sessions opened before decode as they did
            raise ApplicationError(
                "session open: budget.output_reserve: must be at least 1: it is each request's maximum output "
                "tokens (`max_tokens`), which providers refuse at 0",
                type="InvalidSessionOpen",
                non_retryable=True,
            )
        route = inp.open.route
        provider = state.providers.get(route.provider)
        if provider is None or isinstance(provider, UnconfiguredProvider):  # refused at open, not at every turn
            unset = provider.message if provider is not None else f"{route.provider!r} is not configured on this worker"
            raise ApplicationError(
                f"model_route.provider: {unset}",
                {"provider": route.provider},
                type="ProviderNotConfigured",
                non_retryable=True,
            )
        try:  # the provider's options, and what they say of the route's profile (a published usage ratio)
            published = provider.route_profile(route.profile(), route.provider_options)
        except ValueError as exc:
            reason = _first_error(exc)
            raise ApplicationError(
                f"model_route.provider_options{reason}", type="InvalidSessionOpen", non_retryable=True
            ) from exc
        profile = await state.profile(published)
        tools = [
            operator_tool(t.name, t.description, t.input_schema) for t in inp.open.tools if t.name not in inp.revoked
        ]
        snapshot = [
            MemorySnapshotEntry(id=f"memory.{r.memory_id}", memory_id=r.memory_id, text=r.text)
            for r in await store.snapshot_memories(inp.open.memory_scope, budget.memory_snapshot_max_items)
        ]
        estimator = TokenEstimator(profile, state.counter(profile.encoding))
        prefix_inputs = region_a_inputs(
            epoch=inp.epoch,
            platform_policy=inp.open.platform_policy,
            agent_instructions=inp.open.agent_instructions,
            tools=tools,
            memory_snapshot=snapshot,
        )
        try:
            while True:
                try:
                    prefix = open_prefix(prefix_inputs, budget=budget, estimator=estimator, secret=secret)
                    last = not prefix_inputs.memory_snapshot
                    await check_route_fits(state, inp, prefix, estimator, budget, secret, last_resort=last)
                    break
                except (PrefixOverflowError, RouteDoesNotFitError) as exc:
                    # The snapshot is a selection from the scope's memories, not caller input: a scope holding more
                    # than the snapshot's cap, or more than leaves the route room for a turn (a memory's corrections
                    # count: they render while it is in the snapshot), gives fewer entries instead of refusing every
                    # new session (or rotation) on the scope. The longest goes first (the newest of equals), so one
                    # oversized memory does not empty the snapshot.
                    snapshot_over = isinstance(exc, RouteDoesNotFitError) or exc.budget_class == "memory_snapshot"
                    if not snapshot_over or not prefix_inputs.memory_snapshot:
                        raise
                    prefix_inputs = prefix_inputs.model_copy(
                        update={"memory_snapshot": _without_longest(prefix_inputs.memory_snapshot)}
                    )
        except PrefixOverflowError as exc:
            await state.event(
                inp.session_id,
                f"open_failed:{inp.epoch}",
                EventType.SESSION_OPEN_FAILED,
                0,
                inp.epoch,
                {"class": exc.budget_class, "tokens": exc.tokens, "cap": exc.cap, "unit": exc.unit},
            )
            raise ApplicationError(
                str(exc),
                {"class": exc.budget_class, "tokens": exc.tokens, "cap": exc.cap},
                type="PrefixOverflowError",
                non_retryable=True,
            ) from exc
        except RouteDoesNotFitError as exc:
            if inp.epoch == 1:
                await state.event(inp.session_id, "open_failed:1", EventType.SESSION_OPEN_FAILED, 0, 1, exc.details())
            raise ApplicationError(str(exc), exc.details(), type=exc.error_type, non_retryable=True) from exc
        except ValueError as exc:
            raise ApplicationError(str(exc), type="InvalidSessionOpen", non_retryable=True) from exc
        await store.put_prefix(
            inp.session_id,
            inp.epoch,
            prefix.sha256,
            inp.reason,
            profile.model_dump(mode="json"),
            prefix.model_dump(mode="json"),
            prefix_inputs.model_dump(mode="json"),
        )
        stored = await store.get_prefix(inp.session_id, inp.epoch)
        assert stored is not None
        prefix = FrozenPrefix.model_validate(stored.prefix)
        if inp.epoch == 1:
            await state.event(
                inp.session_id,
                "opened",
                EventType.SESSION_OPENED,
                0,
                1,
                {"prefix_sha256": prefix.sha256, "tokens_by_class": prefix.class_tokens},
            )
        return self._result(inp, prefix)

    def _result(self, inp: OpenInput, prefix: FrozenPrefix) -> OpenResult:
        return OpenResult(
            epoch=inp.epoch,
            prefix_sha256=prefix.sha256,
            prefix_tokens=sum(prefix.class_tokens.values()),
            tokens_by_class=prefix.class_tokens,
            pinned_tools=[s.item_id.removeprefix("tool.") for s in prefix.segments if s.kind == "tool_definition"],
            search_attributes=self.state.search_attributes,
        )

    async def _claim(self, inp: OpenInput) -> bytes:
        """One owner per session id: refuse an id whose session opened before (SessionIdTaken)."""
        assert inp.owner is not None
        claim = await self.state.store.claim_session(
            inp.session_id, inp.open.model_dump(mode="json"), os.urandom(32), inp.owner
        )
        if not claim.owned:
            opened = claim.created_at.isoformat(timespec="seconds")
            closed = claim.closed_at.isoformat(timespec="seconds") if claim.closed_at else None
            raise ApplicationError(
                f"session id {inp.session_id!r} is taken: its session opened at {opened} and "
                + (f"closed at {closed}" if closed else "was never closed")
                + "; a session id names one session forever, start with a new id",
                {"session_id": inp.session_id, "opened_at": opened, "closed_at": closed},
                type="SessionIdTaken",
                non_retryable=True,
            )
        self.state.forget(inp.session_id)  # a replaced unopened session: nothing cached survives
        return claim.secret

    @activity.defn(name=names.ACTIVITY_SEAL_TURN)
    async def seal_turn(self, inp: SealTurnInput) -> int:
        """A failed turn: its unanswered tool calls get error results (the pair stays atomic)."""
        return await seal_orphans(
            self.state, inp.session_id, inp.turn, f"its turn ({inp.turn}) failed first ({inp.reason})"
        )

    @activity.defn(name=names.ACTIVITY_CLOSE)
    async def close_session(self, inp: CloseInput) -> None:
        await self.state.store.close_session(inp.session_id, inp.reason)
        self.state.forget(inp.session_id)
        log.info("session.closed", session_id=inp.session_id, turn=inp.turn, epoch=inp.epoch, reason=inp.reason)

    def all(self) -> list[Any]:
        return [self.open_session, self.seal_turn, self.close_session]


def _without_longest(snapshot: list[MemorySnapshotEntry]) -> list[MemorySnapshotEntry]:
    """The snapshot less its longest entry (of equals, the newest: the last in the list, which is oldest first)."""
    drop = max(range(len(snapshot)), key=lambda i: (len(snapshot[i].text), i))
    return snapshot[:drop] + snapshot[drop + 1 :]


def _first_error(exc: ValueError) -> str:
    """`.usage_ratio: Input should be greater than 0`, or `: <message>` for an error not from pydantic."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return "".join(f".{p}" for p in first["loc"]) + f": {first['msg']}"
    return f": {exc}"


async def seal_orphans(
    state: SessionState, session_id: str, upto_turn: int, reason: str, *, cache: SessionCache | None = None
) -> int:
    """Give every tool call of turns <= `upto_turn` that has no result an error result, so no later request
    carries half a pair (a failed turn, or a model reply a timed-out attempt stored late). `cache`: the
    session's memo, already brought up to date by the caller's read."""
    if cache is None:
        _, _, cache = await state.session(session_id)
        await state.items(session_id, cache)
    unanswered = cache.unanswered_calls()
    if not unanswered:
        return 0
    # The log from the first of them on (not the whole log): each call's turn, and the results the memo has not
    # seen. A result logged since the caller's read is one; so is a result a checkpoint covered, with its call,
    # before this worker read it (the memo kept the call, from an earlier read, as covered and unanswered).
    rows = {r.payload["id"]: r.turn for r in await state.store.load_items(session_id, unanswered[0].seq - 1)}
    answered = {i.call_id for i in unanswered if f"{i.id}.result" in rows}
    cache.answered_unseen(answered)
    orphans = [i for i in unanswered if i.call_id not in answered and rows.get(i.id, 0) <= upto_turn]
    for call in orphans:
        await state.append(
            session_id,
            rows[call.id],
            [
                {
                    "id": f"{call.id}.result",
                    "kind": "tool_result",
                    "trust": TrustLevel.TOOL.value,
                    "call_id": call.call_id,
                    "tool_name": call.tool_name,
                    "content": f"error: no result was logged for this call (the tool may have run): {reason}",
                    "is_error": True,
                    "artifact_ref": None,
                }
            ],
            cache,
        )
    if orphans:
        log.warning("turn.sealed", session_id=session_id, turn=upto_turn, calls=len(orphans), reason=reason)
    return len(orphans)
