"""The session's activities: open, build, call the model, run tools, write memory, close, record events.

Every side effect of a session lives here; the workflow only orchestrates. Each activity is a method of
`SessionActivities`, built once in worker.py with the store, the tokenizer and the providers. Activities
retry, so each write is idempotent and each activity returns what is stored, not what it computed.
"""

from __future__ import annotations

import asyncio
import operator
import os
from collections import OrderedDict
from collections.abc import Awaitable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import jsonschema
import structlog
from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.assembly import RequestInputs, StoredMemory, body_inputs
from activities.metrics import record_event
from activities.provider import ModelProvider, ProviderRequest, ProviderSegment
from activities.store import MAX_DELTA_CHAIN, Store
from activities.tokens import TiktokenCounter
from activities.tools import EXECUTORS, Executor
from activities.wire import WirePrefix
from contract import names
from contract.activity_interfaces import SessionActivityCalls
from contract.events import EventType
from contract.payloads import (
    BuildInput,
    BuildResult,
    CloseInput,
    DeleteMemoryInput,
    EventInput,
    MemoryDeleted,
    MemoryInput,
    MemoryResult,
    ModelInput,
    ModelResult,
    OpenInput,
    OpenResult,
    SealTurnInput,
    SessionOpen,
    ToolCallRequest,
    ToolInput,
    ToolResultSummary,
    WorkingStateInput,
    WorkingStateResult,
)
from core.budget import ContextBudget
from core.build import (
    BodyInputs,
    FrozenPrefix,
    RenderCache,
    build,
    counter_key,
    measure_working_state,
    open_prefix,
    operator_tool,
    region_a_inputs,
)
from core.compaction import Checkpoint
from core.errors import (
    ContextError,
    PrefixOverflowError,
    RouteDoesNotFitError,
    ToolTrustCeilingError,
    TurnTooLargeError,
)
from core.estimator import ModelProfile, TokenEstimator, reconcile
from core.explain import first_difference, first_wire_difference
from core.items import (
    AssistantMessage,
    HistoryItem,
    MemorySnapshotEntry,
    Region,
    ToolCall,
    ToolResult,
    TrustLevel,
    UserMessage,
    parse_history_item,
)
from core.plan import ContextPlan, Segment
from core.policy import result_trust
from core.rendering import ESCAPING_FINGERPRINT, escape_content
from core.working_state import (
    CONTROL_TOOL_NAME,
    WorkingState,
    WorkingStateUpdate,
    WorkingStateWrite,
    apply,
    fold,
    holds_tainted,
    render,
)

log = structlog.get_logger("ctxengine.activities")
T = TypeVar("T")
# Untrusted results longer than this (characters) also go to an artifact, so a pointer can always resolve to
# the original bytes. 0: every untrusted result does.
ARTIFACT_THRESHOLD = 0
# A rotation to another route must leave room for a message of this many tokens beside the minimum body.
ROUTE_CHECK_MESSAGE_TOKENS = 256


class _SessionCache:
    """Per-session, per-worker memo of immutable things: the log so far, prefixes, rendered items."""

    def __init__(self, secret: bytes) -> None:
        self.items: list[HistoryItem] = []
        self.max_seq = -1
        self.prefixes: dict[int, tuple[FrozenPrefix, ModelProfile]] = {}
        self.secret = secret
        self.renders: dict[str, RenderCache] = {}  # one memo per tokenizer: counts differ between them
        self.open: SessionOpen | None = None
        # Per segment object (segments are immutable and kept alive by the render caches): its stored JSON and
        # its provider form, made once. And the last requests built here, handed to the model call by hash.
        self.seg_json: dict[int, tuple[Segment, dict[str, Any]]] = {}
        self.seg_provider: dict[int, tuple[Segment, ProviderSegment]] = {}
        self.built: OrderedDict[str, list[Segment]] = OrderedDict()
        self.last_body: tuple[str, str, list[Segment], int] | None = None

    def json_of(self, seg: Segment) -> dict[str, Any]:
        hit = self.seg_json.get(id(seg))
        if hit is None or hit[0] is not seg:
            hit = (seg, seg.model_dump(mode="json"))
            self.seg_json[id(seg)] = hit
        return hit[1]

    def provider_of(self, seg: Segment) -> ProviderSegment:
        hit = self.seg_provider.get(id(seg))
        if hit is None or hit[0] is not seg:
            hit = (seg, _provider_segment(self.json_of(seg)))
            self.seg_provider[id(seg)] = hit
        return hit[1]

    def remember_request(
        self, sha: str, segments: list[Segment], prefix_sha: str, body: list[Segment], base: str | None
    ) -> None:
        self.built[sha] = segments
        while len(self.built) > 2:
            self.built.popitem(last=False)
        depth = self.last_body[3] + 1 if base and self.last_body is not None else 0
        self.last_body = (sha, prefix_sha, body, depth)

    def delta_base(self, prefix_sha: str, body: list[Segment]) -> tuple[str | None, int]:
        """The previous request stored from this worker, and how many leading body segments it shares with
        `body` (by identity): the new request is stored as that base plus the rest."""
        if self.last_body is None:
            return None, 0
        sha, last_prefix, last, depth = self.last_body
        if last_prefix != prefix_sha or depth >= MAX_DELTA_CHAIN:
            return None, 0
        same = list(map(operator.is_, body, last))
        keep = same.index(False) if False in same else len(same)
        return (sha, keep) if keep else (None, 0)

    def render_for(self, estimator: TokenEstimator) -> RenderCache:
        key = counter_key(estimator)
        if key not in self.renders:
            self.renders[key] = RenderCache(self.secret, key)
        return self.renders[key]


class SessionActivities(SessionActivityCalls):
    def __init__(
        self,
        store: Store,
        providers: dict[str, ModelProvider],
        *,
        search_attributes: bool = False,
        max_sessions_cached: int = 512,
        executors: Mapping[str, Executor] | None = None,
    ) -> None:
        self.executors = EXECUTORS if executors is None else executors
        self.store = store
        self.providers = providers
        self.search_attributes = search_attributes
        self._counters: dict[str, TiktokenCounter] = {}
        self._sessions: OrderedDict[str, _SessionCache] = OrderedDict()
        self._max_sessions = max_sessions_cached

    # ------------------------------------------------------------ helpers
    def reply_tainted(self, plan: dict[str, Any]) -> bool:
        """Whether a reply to the request planned as `plan` is tainted: untrusted content was in its view."""
        return bool(plan.get("untrusted_in_view", False))

    def write_tainted(self, call_tainted: bool, items: list[HistoryItem], turn: int) -> bool:
        """Whether a control-tool write is tainted: its call was, or untrusted content entered the turn's log
        before it (a write in the same reply as the fetch counts)."""
        in_turn = f"t{turn}."
        return call_tainted or any(i.taints_view() for i in items if i.id.startswith(in_turn))

    def counter(self, encoding: str) -> TiktokenCounter:
        if encoding not in self._counters:
            self._counters[encoding] = TiktokenCounter(encoding)
        return self._counters[encoding]

    async def _session(self, session_id: str) -> tuple[SessionOpen, bytes, _SessionCache]:
        row = await self.store.get_session(session_id)
        if row is None:
            raise ApplicationError(f"unknown session {session_id!r}", type="UnknownSession", non_retryable=True)
        cache = self._sessions.get(session_id)
        if cache is None or cache.secret != bytes(row["secret"]):
            cache = _SessionCache(bytes(row["secret"]))
            self._sessions[session_id] = cache
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        if cache.open is None:
            cache.open = SessionOpen.model_validate(row["open"])
        return cache.open, cache.secret, cache

    async def _items(self, session_id: str, cache: _SessionCache) -> list[HistoryItem]:
        rows = await self.store.load_items(session_id, cache.max_seq)
        for row in rows:
            cache.items.append(parse_history_item(row["payload"]))
            cache.max_seq = row["seq"]
        return cache.items

    async def _prefix(self, session_id: str, epoch: int, cache: _SessionCache) -> tuple[FrozenPrefix, ModelProfile]:
        if epoch not in cache.prefixes:
            row = await self.store.get_prefix(session_id, epoch)
            if row is None:
                raise ApplicationError(
                    f"session {session_id!r} has no prefix for epoch {epoch}",
                    type="UnknownEpoch",
                    non_retryable=True,
                )
            cache.prefixes[epoch] = (
                FrozenPrefix.model_validate(row["prefix"]),
                ModelProfile.model_validate(row["profile"]),
            )
        return cache.prefixes[epoch]

    async def _profile(self, base: ModelProfile) -> ModelProfile:
        learned = await self.store.get_calibration(base.route)
        if learned:
            return base.model_copy(update={"calibration": learned})
        # A route not seen yet starts conservatively: its published ratio or the highest any route of its
        # provider holds, whichever is higher; never optimistically (it learns downwards from usage).
        highest = await self.store.provider_calibration(base.provider)
        return base.model_copy(update={"calibration": highest}) if highest and highest > base.calibration else base

    async def _event(
        self, session_id: str, key: str, type_: EventType, turn: int, epoch: int, payload: dict[str, Any]
    ) -> None:
        if await self.store.add_event(session_id, key, type_.value, turn=turn, epoch=epoch, payload=payload):
            log.info(type_.value, session_id=session_id, turn=turn, epoch=epoch, **payload)
            record_event(type_, payload)

    def _working_state(self, writes: list[dict[str, Any]], count: Any, upto_turn: int) -> WorkingState:
        return fold([WorkingStateWrite.model_validate(w) for w in writes], count=count, upto_turn=upto_turn)

    # ------------------------------------------------------------ activities
    @activity.defn(name=names.ACTIVITY_OPEN)
    async def open_session(self, inp: OpenInput) -> OpenResult:
        """Pin the tool set and memory snapshot, measure the prefix exactly, store it for the epoch."""
        if inp.owner is None:  # scheduled by a run that predates session owners
            secret = await self.store.create_session(inp.session_id, inp.open.model_dump(mode="json"), os.urandom(32))
        else:
            secret = await self._claim(inp)
        existing = await self.store.get_prefix(inp.session_id, inp.epoch)
        if existing is not None:  # a retry, or a rotation replayed: the stored prefix is the truth
            prefix = FrozenPrefix.model_validate(existing["prefix"])
            return OpenResult(
                epoch=inp.epoch,
                prefix_sha256=prefix.sha256,
                prefix_tokens=sum(prefix.class_tokens.values()),
                tokens_by_class=prefix.class_tokens,
                pinned_tools=_tool_names(prefix),
                search_attributes=self.search_attributes,
            )
        try:
            budget = inp.open.context_budget()
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ApplicationError(
                f"session open: budget.{'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
                type="InvalidSessionOpen",
                non_retryable=True,
            ) from exc
        profile = await self._profile(inp.open.model_route.profile())
        if profile.provider not in self.providers:  # refused at open, not at every later turn
            raise ApplicationError(
                f"model_route.provider: {profile.provider!r} is not configured on this worker",
                type="ProviderNotConfigured",
                non_retryable=True,
            )
        tools = [
            operator_tool(t.name, t.description, t.input_schema) for t in inp.open.tools if t.name not in inp.revoked
        ]
        snapshot = [
            MemorySnapshotEntry(id=f"memory.{r['memory_id']}", memory_id=r["memory_id"], text=r["text"])
            for r in await self.store.snapshot_memories(inp.open.memory_scope, budget.memory_snapshot_max_items)
        ]
        estimator = TokenEstimator(profile, self.counter(profile.encoding))
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
                    break
                except PrefixOverflowError as exc:
                    # The snapshot is a selection from the scope's memories, not caller input: a scope holding
                    # more than the cap takes fewer entries (oldest first) instead of refusing every new session.
                    if exc.budget_class != "memory_snapshot" or not prefix_inputs.memory_snapshot:
                        raise
                    prefix_inputs = prefix_inputs.model_copy(
                        update={"memory_snapshot": prefix_inputs.memory_snapshot[:-1]}
                    )
        except PrefixOverflowError as exc:
            await self._event(
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
        except ValueError as exc:
            raise ApplicationError(str(exc), type="InvalidSessionOpen", non_retryable=True) from exc
        if inp.epoch > 1:
            await self._check_route_fits(inp, prefix, estimator, budget, secret)
        await self.store.put_prefix(
            inp.session_id,
            inp.epoch,
            prefix.sha256,
            inp.reason,
            profile.model_dump(mode="json"),
            prefix.model_dump(mode="json"),
            prefix_inputs.model_dump(mode="json"),
        )
        stored = await self.store.get_prefix(inp.session_id, inp.epoch)
        assert stored is not None
        prefix = FrozenPrefix.model_validate(stored["prefix"])
        if inp.epoch == 1:
            await self._event(
                inp.session_id,
                "opened",
                EventType.SESSION_OPENED,
                0,
                1,
                {"prefix_sha256": prefix.sha256, "tokens_by_class": prefix.class_tokens},
            )
        return OpenResult(
            epoch=inp.epoch,
            prefix_sha256=prefix.sha256,
            prefix_tokens=sum(prefix.class_tokens.values()),
            tokens_by_class=prefix.class_tokens,
            pinned_tools=_tool_names(prefix),
            search_attributes=self.search_attributes,
        )

    async def _claim(self, inp: OpenInput) -> bytes:
        """One owner per session id: refuse an id whose session opened before (SessionIdTaken)."""
        assert inp.owner is not None
        row, owned = await self.store.claim_session(
            inp.session_id, inp.open.model_dump(mode="json"), os.urandom(32), inp.owner
        )
        if not owned:
            opened = row["created_at"].isoformat(timespec="seconds")
            closed = row["closed_at"].isoformat(timespec="seconds") if row["closed_at"] else None
            raise ApplicationError(
                f"session id {inp.session_id!r} is taken: its session opened at {opened} and "
                + (f"closed at {closed}" if closed else "was never closed")
                + "; a session id names one session forever, start with a new id",
                {"session_id": inp.session_id, "opened_at": opened, "closed_at": closed},
                type="SessionIdTaken",
                non_retryable=True,
            )
        self._sessions.pop(inp.session_id, None)  # a replaced unopened session: nothing cached survives
        return bytes(row["secret"])

    async def _seal_orphans(self, session_id: str, upto_turn: int, reason: str) -> int:
        """Give every tool call of turns <= `upto_turn` that has no result an error result, so no later
        request carries half a pair (a failed turn, or a model reply a timed-out attempt stored late)."""
        _, _, cache = await self._session(session_id)
        items = await self._items(session_id, cache)
        answered = {i.call_id for i in items if isinstance(i, ToolResult)}
        unanswered = [i for i in items if isinstance(i, ToolCall) and i.call_id not in answered]
        if not unanswered:
            return 0
        rows = {r["payload"]["id"]: r["turn"] for r in await self.store.load_items(session_id)}
        orphans = [i for i in unanswered if rows.get(i.id, 0) <= upto_turn]
        for call in orphans:
            await self.store.append_items(
                session_id,
                rows[call.id],
                [
                    {
                        "id": f"{call.id}.result",
                        "kind": "tool_result",
                        "trust": TrustLevel.TOOL.value,
                        "call_id": call.call_id,
                        "tool_name": call.tool_name,
                        "content": f"error: not run: {reason}",
                        "is_error": True,
                        "artifact_ref": None,
                    }
                ],
            )
        if orphans:
            log.warning("turn.sealed", session_id=session_id, turn=upto_turn, calls=len(orphans), reason=reason)
        return len(orphans)

    @activity.defn(name=names.ACTIVITY_SEAL_TURN)
    async def seal_turn(self, inp: SealTurnInput) -> int:
        """A failed turn: its unanswered tool calls get error results (the pair stays atomic)."""
        return await self._seal_orphans(inp.session_id, inp.turn, f"turn {inp.turn} failed ({inp.reason})")

    @activity.defn(name=names.ACTIVITY_BUILD)
    async def build_context(self, inp: BuildInput) -> BuildResult:
        """Append the user message (once), load inputs by reference, build, store the request, return a summary."""
        bound = log.bind(session_id=inp.session_id, turn=inp.turn, epoch=inp.epoch)
        open_, secret, cache = await self._session(inp.session_id)
        user_item_id = inp.user_item_id
        if inp.user_text is not None:
            await self._seal_orphans(inp.session_id, inp.turn - 1, "an earlier turn failed before this call ran")
            user_item_id = f"u:{inp.update_id or inp.turn}"
            await self._check_turn_fits(inp, open_, secret, cache, user_item_id)
            await self.store.append_items(
                inp.session_id,
                inp.turn,
                [
                    {
                        "id": user_item_id,
                        "kind": "user_message",
                        "trust": TrustLevel.USER.value,
                        "text": inp.user_text,
                    }
                ],
            )
        prefix, profile = await self._prefix(inp.session_id, inp.epoch, cache)
        profile = await self._profile(profile)
        estimator = TokenEstimator(profile, self.counter(profile.encoding))
        if prefix.escaping_fingerprint and prefix.escaping_fingerprint != ESCAPING_FINGERPRINT:
            # This worker escapes differently from the one that opened the epoch (a Unicode or package upgrade):
            # body bytes may differ from earlier requests. Say so; the operator rotates the epoch.
            bound.warning(
                "rendering.fingerprint_changed",
                epoch_fingerprint=prefix.escaping_fingerprint,
                worker_fingerprint=ESCAPING_FINGERPRINT,
            )
        plan, ri, body_in = await self._plan(inp, open_, secret, cache, prefix, estimator, user_item_id)
        inputs = ri.model_dump(mode="json")
        body_segments = plan.segments[len(prefix.segments) :]
        base, keep = cache.delta_base(plan.prefix_sha256, body_segments)
        await self.store.put_request(
            plan.request_sha256,
            plan.prefix_sha256,
            [cache.json_of(s) for s in body_segments[keep:]],
            base=base,
            keep=keep,
        )
        cache.remember_request(plan.request_sha256, plan.segments, plan.prefix_sha256, body_segments, base)
        hashes = await self.store.record_request(
            inp.session_id,
            inp.turn,
            inp.call_index,
            epoch=inp.epoch,
            prefix_sha256=plan.prefix_sha256,
            request_sha256=plan.request_sha256,
            estimated_tokens=plan.estimated_tokens,
            raw_tokens=plan.raw_tokens,
            plan=plan.summary().model_dump(mode="json"),
            inputs=inputs,
        )
        if len(hashes) > 1 and plan.prefix_sha256 != hashes[0]["prefix_sha256"]:
            # A second prefix hash in one epoch: a defect. Name the segment and byte where it changed.
            epoch_prefix, _ = await self._prefix(inp.session_id, inp.epoch, cache)
            # What the plan actually holds as Region A, against what the epoch stored.
            sent = [seg for seg in plan.segments if seg.region is Region.A]
            diff = first_difference(epoch_prefix.segments, sent)
            await self._event(
                inp.session_id,
                f"violation:{inp.epoch}:{plan.prefix_sha256}",
                EventType.PREFIX_VIOLATION,
                inp.turn,
                inp.epoch,
                {
                    "expected": epoch_prefix.sha256,
                    "got": plan.prefix_sha256,
                    "distinct_in_epoch": len(hashes),
                    "first_difference": diff.model_dump() if diff else None,
                },
            )
        if plan.yields:
            await self._event(
                inp.session_id,
                f"yield:{inp.turn}:{inp.call_index}",
                EventType.YIELD_APPLIED,
                inp.turn,
                inp.epoch,
                {"yields": [y.model_dump(mode="json") for y in plan.yields]},
            )
        bound.info("context.built", tokens=plan.estimated_tokens, status=plan.status.value, yields=len(plan.yields))
        return BuildResult(plan=plan.summary(), user_item_id=user_item_id, turn_start_seq=body_in.turn_start_seq)

    async def _check_route_fits(
        self, inp: OpenInput, prefix: FrozenPrefix, estimator: TokenEstimator, budget: ContextBudget, secret: bytes
    ) -> None:
        """A rotation to another model route: the minimum body (a message of ROUTE_CHECK_MESSAGE_TOKENS, the
        working state, corrections, the clock) must fit under the new route's estimate, or it is refused."""
        previous = await self.store.get_prefix(inp.session_id, inp.epoch - 1)
        if previous is None or ModelProfile.model_validate(previous["profile"]).route == estimator.profile.route:
            return
        writes = await self.store.working_state_writes(inp.session_id)
        ws = self._working_state(writes, estimator.counter.count, 10**9)
        snapshot_ids = [s.item_id.removeprefix("memory.") for s in prefix.segments if s.kind == "memory_snapshot"]
        corrections = await self.store.corrections(inp.open.memory_scope, snapshot_ids)
        ri = RequestInputs(
            turn=0,
            call_index=0,
            max_seq=0,
            user_item_id="u:route-check",
            checkpoint_id=None,
            corrections=[
                StoredMemory(memory_id=r["memory_id"], text=r["text"], trust=r["trust"], corrects=r["corrects"])
                for r in corrections
            ],
            working_state=render(ws) if (ws.constraints or ws.tasks or ws.facts or ws.open_questions) else "",
            now_iso="2000-01-01T00:00:00+00:00",
            profile=estimator.profile,
            budget=budget,
        )
        message = UserMessage(id="u:route-check", seq=0, text="word " * ROUTE_CHECK_MESSAGE_TOKENS)
        try:
            build(prefix, body_inputs([message], None, ri), budget=budget, estimator=estimator, secret=secret)
        except TurnTooLargeError as exc:
            refused = RouteDoesNotFitError(
                estimator.profile.route, exc.prefix_tokens, exc.minimum_body_tokens, exc.input_limit
            )
            raise ApplicationError(str(refused), refused.details(), type="RotationRefused", non_retryable=True) from exc

    async def _check_turn_fits(
        self, inp: BuildInput, open_: SessionOpen, secret: bytes, cache: _SessionCache, user_item_id: str
    ) -> None:
        """Before the user message is logged: its minimum body (message, working state, corrections, clock)
        must fit beside the prefix, or the turn fails alone with TurnTooLarge and nothing is appended."""
        assert inp.user_text is not None
        prefix, profile = await self._prefix(inp.session_id, inp.epoch, cache)
        estimator = TokenEstimator(await self._profile(profile), self.counter(profile.encoding))
        writes = await self.store.working_state_writes(inp.session_id)
        ws = self._working_state(writes, estimator.counter.count, inp.turn + 1)
        snapshot_ids = [s.item_id.removeprefix("memory.") for s in prefix.segments if s.kind == "memory_snapshot"]
        correction_rows = await self.store.corrections(open_.memory_scope, snapshot_ids)
        ri = RequestInputs(
            turn=inp.turn,
            call_index=0,
            max_seq=0,
            user_item_id=user_item_id,
            checkpoint_id=None,
            corrections=[
                StoredMemory(memory_id=r["memory_id"], text=r["text"], trust=r["trust"], corrects=r["corrects"])
                for r in correction_rows
            ],
            working_state=render(ws) if (ws.constraints or ws.tasks or ws.facts or ws.open_questions) else "",
            now_iso=inp.now_iso,
            profile=estimator.profile,
            budget=open_.context_budget(estimator.profile),
        )
        message = UserMessage(id=user_item_id, seq=0, text=inp.user_text, trust=TrustLevel.USER)
        body = body_inputs([message], None, ri)
        try:
            build(prefix, body, budget=ri.budget, estimator=estimator, secret=secret)
        except TurnTooLargeError as exc:
            raise _turn_too_large(exc, logged=False) from exc

    async def _plan(
        self,
        inp: BuildInput,
        open_: SessionOpen,
        secret: bytes,
        cache: _SessionCache,
        prefix: FrozenPrefix,
        estimator: TokenEstimator,
        user_item_id: str | None,
    ) -> tuple[ContextPlan, RequestInputs, BodyInputs]:
        items = await self._items(inp.session_id, cache)
        checkpoint_json = await self.store.latest_checkpoint(inp.session_id)
        checkpoint = Checkpoint.model_validate(checkpoint_json) if checkpoint_json else None
        writes = await self.store.working_state_writes(inp.session_id)
        ws = self._working_state(writes, estimator.counter.count, inp.turn + 1)
        snapshot_ids = [s.item_id.removeprefix("memory.") for s in prefix.segments if s.kind == "memory_snapshot"]
        user = next((i for i in reversed(items) if i.id == user_item_id), None) if user_item_id else None
        query = user.body_text() if user is not None else ""
        recall_rows = await self.store.search_memories(open_.memory_scope, query, limit=10, exclude=snapshot_ids)
        correction_rows = await self.store.corrections(open_.memory_scope, snapshot_ids)
        ri = RequestInputs(
            turn=inp.turn,
            call_index=inp.call_index,
            max_seq=items[-1].seq if items else -1,
            user_item_id=user_item_id,
            checkpoint_id=checkpoint.checkpoint_id if checkpoint else None,
            recall=[StoredMemory(memory_id=r["memory_id"], text=r["text"], trust=r["trust"]) for r in recall_rows],
            corrections=[
                StoredMemory(memory_id=r["memory_id"], text=r["text"], trust=r["trust"], corrects=r["corrects"])
                for r in correction_rows
            ],
            working_state=render(ws) if (ws.constraints or ws.tasks or ws.facts or ws.open_questions) else "",
            working_state_tainted=holds_tainted(ws),
            now_iso=inp.now_iso,
            profile=estimator.profile,
            budget=open_.context_budget(estimator.profile),
        )
        body = body_inputs(items, checkpoint, ri)
        try:
            plan = build(
                prefix, body, budget=ri.budget, estimator=estimator, secret=secret, cache=cache.render_for(estimator)
            )
        except TurnTooLargeError as exc:
            raise _turn_too_large(exc, logged=True) from exc
        except ContextError as exc:
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc
        return plan, ri, body

    @activity.defn(name=names.ACTIVITY_MODEL)
    async def call_model(self, inp: ModelInput) -> ModelResult:
        """Send the stored request through the provider port, append the reply, record usage, reconcile."""
        open_, _, cache = await self._session(inp.session_id)
        record = await self.store.get_record(inp.session_id, inp.turn, inp.call_index)
        if record is None or record["request_sha256"] != inp.request_sha256:
            raise ApplicationError(
                f"no stored request {inp.request_sha256} for turn {inp.turn}",
                type="UnknownRequest",
                non_retryable=True,
            )
        prefix, epoch_profile = await self._prefix(inp.session_id, inp.epoch, cache)
        base = f"t{inp.turn}.m{inp.call_index}."
        logged = [i for i in await self._items(inp.session_id, cache) if i.id.startswith(base)]
        if logged and record["actual_input_tokens"] is not None:
            # A retry after the reply was stored: never ask the model twice for one request.
            return _model_result(
                logged,
                record["actual_input_tokens"],
                record["cached_tokens"] or 0,
                record["output_tokens"] or 0,
                record["estimated_tokens"],
                overrun=None,
            )
        built = cache.built.get(inp.request_sha256)
        if built is not None:  # built on this worker: no need to read the request back
            segments = [cache.provider_of(s) for s in built]
        else:
            stored = await self.store.get_request(inp.request_sha256)
            assert stored is not None
            segments = [cache.provider_of(s) for s in prefix.segments]
            segments += [_provider_segment(s) for s in stored["body"]]
        provider = self.providers.get(epoch_profile.provider)
        if provider is None:
            raise ApplicationError(
                f"provider {epoch_profile.provider!r} is not configured on this worker",
                type="ProviderNotConfigured",
                non_retryable=True,
            )
        request = ProviderRequest(
            session_id=inp.session_id,
            epoch=inp.epoch,
            provider=epoch_profile.provider,
            model=epoch_profile.model,
            prefix_sha256=prefix.sha256,
            request_sha256=inp.request_sha256,
            segments=segments,
            tools=[s.model_dump(mode="json") for s in prefix.segments if s.kind == "tool_definition"],
            usage_ratio=open_.model_route.scripted_usage_ratio,
            estimated_tokens=record["estimated_tokens"],
            max_output_tokens=open_.context_budget(epoch_profile).output_reserve,
        )
        reply = await _heartbeating(_within_attempt(provider.complete(request)))
        if reply.wire_prefix is not None:
            await self._record_wire_prefix(inp, reply.wire_prefix)
        # Usage first (the first attempt's figures win), then the reply's items, all or none of them.
        await self.store.record_usage(
            inp.session_id,
            inp.turn,
            inp.call_index,
            actual=reply.usage.input_tokens,
            cached=reply.usage.cached_tokens,
            output=reply.usage.output_tokens,
        )
        # Everything the model wrote in reply to a request with untrusted content in view may repeat or obey it.
        tainted = self.reply_tainted(record["plan"])
        new_items: list[dict[str, Any]] = []
        if reply.text:
            new_items.append(
                {
                    "id": f"{base}text",
                    "kind": "assistant_message",
                    "trust": "MODEL",
                    "tainted": tainted,
                    "text": reply.text,
                }
            )
        cap = len(reply.tool_calls) if inp.max_tool_calls is None else inp.max_tool_calls
        for j, call in enumerate(reply.tool_calls[: cap + 1]):
            new_items.append(
                {
                    "id": f"{base}call{j}",
                    "kind": "tool_call",
                    "trust": "MODEL",
                    "tainted": tainted,
                    # Our own id, unique in the session: some servers reuse `call_0` in every reply, and a
                    # reused id would pair the wrong halves. Adapters send this id back on the wire.
                    "call_id": f"call_t{inp.turn}_m{inp.call_index}_{j}",
                    "tool_name": call.name,
                    "arguments": call.arguments,
                }
            )
        if len(reply.tool_calls) > cap:
            # Past the cap: the next call is logged with its refusal (one pair the model sees); the rest are not
            # logged at all, so a reply of 10,000 calls costs the log two items, not 20,000.
            new_items.append(
                {
                    "id": f"{base}call{cap}.result",
                    "kind": "tool_result",
                    "trust": TrustLevel.TOOL.value,
                    "tainted": tainted,  # a result inherits its call's taint
                    "call_id": f"call_t{inp.turn}_m{inp.call_index}_{cap}",
                    "tool_name": reply.tool_calls[cap].name,
                    "content": f"error: refused: this reply made {len(reply.tool_calls):,} tool calls and "
                    f"{inp.tool_call_cap or 'the cap is reached'}; this call and the "
                    f"{len(reply.tool_calls) - cap - 1:,} after it were not run",
                    "is_error": True,
                    "artifact_ref": None,
                }
            )
        await self.store.append_items(inp.session_id, inp.turn, new_items, group_prefix=base)
        logged = [i for i in await self._items(inp.session_id, cache) if i.id.startswith(base)]
        record = await self.store.get_record(inp.session_id, inp.turn, inp.call_index)
        assert record is not None
        actual = record["actual_input_tokens"]
        profile = await self._profile(epoch_profile)
        learned, rec = reconcile(
            profile, raw_tokens=record["raw_tokens"], estimated_tokens=record["estimated_tokens"], actual_tokens=actual
        )
        await self.store.learn_calibration(profile.route, observed=rec.observed_ratio, first=learned.calibration)
        await self._event(
            inp.session_id,
            f"reconciled:{inp.turn}:{inp.call_index}",
            EventType.ESTIMATOR_RECONCILED,
            inp.turn,
            inp.epoch,
            {
                **rec.model_dump(mode="json"),
                "cached_tokens": record["cached_tokens"] or 0,
                # the first request of an epoch writes the cache; later ones reuse the whole prefix
                "prefix_tokens_reused": 0
                if (inp.turn, inp.call_index) == (1, 0)
                else min(record["plan"]["prefix_tokens"], actual),
            },
        )
        return _model_result(
            logged,
            actual,
            record["cached_tokens"] or 0,
            record["output_tokens"] or 0,
            record["estimated_tokens"],
            overrun=rec.overrun,
        )

    async def _record_wire_prefix(self, inp: ModelInput, wire: WirePrefix) -> None:
        """Store the request's wire prefix hash; a second distinct one in the epoch is the prefix defect
        (`context.prefix.violation`), explained at the first differing byte of what was sent."""
        distinct = await self.store.record_wire_prefix(
            inp.session_id, inp.turn, inp.call_index, epoch=inp.epoch, sha256=wire.sha256, text=wire.text
        )
        if len(distinct) > 1 and wire.sha256 != distinct[0]["sha256"]:
            diff = first_wire_difference(distinct[0]["text"], wire.text)
            await self._event(
                inp.session_id,
                f"violation:{inp.epoch}:wire:{wire.sha256}",
                EventType.PREFIX_VIOLATION,
                inp.turn,
                inp.epoch,
                {
                    "observer": "wire",
                    "expected": distinct[0]["sha256"],
                    "got": wire.sha256,
                    "distinct_in_epoch": len(distinct),
                    "first_difference": diff.model_dump() if diff else None,
                },
            )

    @activity.defn(name=names.ACTIVITY_TOOL)
    async def execute_tool(self, inp: ToolInput) -> ToolResultSummary:
        """Run one authorised call (or record its denial) and append the result as the pair's second half."""
        open_, _, cache = await self._session(inp.session_id)
        result_id = f"{inp.call.item_id}.result"
        items = await self._items(inp.session_id, cache)
        done = next((i for i in items if i.id == result_id), None)
        ws_text: str | None = None
        if isinstance(done, ToolResult):
            return _summary(done, self.counter("cl100k_base").count(done.content), None)
        call_item = next((i for i in items if i.id == inp.call.item_id), None)
        # A result inherits its call's taint: a tool can store and return text the model chose (notes.save).
        tainted = call_item.tainted if call_item is not None else True
        content, trust, is_error, artifact = await self._run_tool(inp, open_, items, tainted=tainted)
        if inp.call.name == CONTROL_TOOL_NAME and not is_error:
            writes = await self.store.working_state_writes(inp.session_id)
            ws_text = render(self._working_state(writes, self.counter("cl100k_base").count, inp.turn + 1))
        await self.store.append_items(
            inp.session_id,
            inp.turn,
            [
                {
                    "id": result_id,
                    "kind": "tool_result",
                    "trust": trust.value,
                    "tainted": tainted,
                    "call_id": inp.call.call_id,
                    "tool_name": inp.call.name,
                    "content": content,
                    "is_error": is_error,
                    "artifact_ref": artifact,
                }
            ],
        )
        stored = next(i for i in await self._items(inp.session_id, cache) if i.id == result_id)
        assert isinstance(stored, ToolResult)
        return _summary(stored, self.counter("cl100k_base").count(stored.content), ws_text)

    async def _run_tool(
        self, inp: ToolInput, open_: SessionOpen, items: list[HistoryItem], *, tainted: bool
    ) -> tuple[str, TrustLevel, bool, str | None]:
        if not inp.allowed:
            return f"error: call denied by policy: {inp.denial}", TrustLevel.TOOL, True, None
        if inp.call.name == CONTROL_TOOL_NAME:
            # Anything the model writes in a turn with untrusted content in view is tainted, even a write made
            # in the same reply as the fetch that brought the content in (docs/trust.md).
            return await self._update_working_state(inp, tainted=self.write_tainted(tainted, items, inp.turn))
        spec = next((t for t in open_.tools if t.name == inp.call.name), None)
        if spec is None:
            return (
                f"error: tool {inp.call.name!r} is not in this session's tool set",
                TrustLevel.TOOL,
                True,
                None,
            )
        try:
            jsonschema.validate(inp.call.arguments, spec.input_schema)
        except jsonschema.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path) or "(arguments)"
            return (
                f"error: arguments do not match the tool's schema at {path}: {exc.message}",
                TrustLevel.TOOL,
                True,
                None,
            )
        except jsonschema.SchemaError as exc:  # the operator's schema is broken: retrying cannot fix it
            return (
                f"error: tool {inp.call.name!r} has an invalid input schema: {exc.message}",
                TrustLevel.TOOL,
                True,
                None,
            )
        executor = self.executors.get(inp.call.name)
        if executor is None:
            return (
                f"error: no executor for tool {inp.call.name!r} on this worker",
                TrustLevel.TOOL,
                True,
                None,
            )
        try:
            out = await executor(inp.call.arguments)
        except Exception as exc:
            log.warning("tool.failed", session_id=inp.session_id, turn=inp.turn, tool=inp.call.name, error=repr(exc))
            return f"error: tool {inp.call.name!r} failed: {type(exc).__name__}: {exc}", TrustLevel.TOOL, True, None
        try:
            trust = result_trust(inp.call.name, claimed=out.trust, ceiling=TrustLevel(spec.max_trust))
        except ToolTrustCeilingError as exc:
            await self._event(
                inp.session_id,
                f"trust_refused:{inp.call.item_id}",
                EventType.TOOL_TRUST_REFUSED,
                inp.turn,
                inp.epoch,
                {"tool": exc.tool, "claimed": exc.claimed, "ceiling": exc.ceiling, "call": inp.call.item_id},
            )
            return f"error: {exc}", TrustLevel.TOOL, True, None
        content, artifact = out.content, None
        limit = await self._result_limit(inp, open_)
        count = self.counter("cl100k_base").count
        # Measured as rendered: escaping (markup above all) can double a page's token count.
        rendered_tokens = count(escape_content(content))
        if rendered_tokens > limit or (trust is TrustLevel.EXTERNAL_UNTRUSTED and len(content) > ARTIFACT_THRESHOLD):
            artifact = "artifact:" + await self.store.put_artifact(inp.session_id, content, trust=trust.value)
        if rendered_tokens > limit:
            # An active pair never yields, so a result that could never fit is cut here, at write time: the
            # head stays (same trust level), the whole is one reference away.
            keep = len(content) * limit // (rendered_tokens * 2)
            while keep > 1 and count(escape_content(content[:keep])) > limit // 2:
                keep = keep * 3 // 4
            content = (
                f"{content[:keep]}\n[truncated: {rendered_tokens:,} tokens in all; the full result is at {artifact}]"
            )
        return content, trust, out.is_error, artifact

    async def _result_limit(self, inp: ToolInput, open_: SessionOpen) -> int:
        """The most one tool result may hold: the tool-results share of the body this epoch leaves."""
        _, _, cache = await self._session(inp.session_id)
        prefix, profile = await self._prefix(inp.session_id, inp.epoch, cache)
        budget = open_.context_budget(profile)
        estimator = TokenEstimator(profile, self.counter(profile.encoding))
        body = budget.input_limit - estimator.prefix_tokens(prefix.raw_tokens, prefix.tool_count)
        return max(64, budget.tool_results_cap(body))

    async def _update_working_state(self, inp: ToolInput, *, tainted: bool) -> tuple[str, TrustLevel, bool, str | None]:
        try:
            update = WorkingStateUpdate.model_validate(inp.call.arguments)
        except ValueError as exc:
            return f"error: invalid working state update: {exc}", TrustLevel.TOOL, True, None
        if await self.store.has_working_state_write(inp.session_id, inp.call.item_id):
            return "working state updated", TrustLevel.TOOL, False, None  # a retry after the write
        open_, secret, cache = await self._session(inp.session_id)
        _, profile = await self._prefix(inp.session_id, inp.epoch, cache)
        estimator = TokenEstimator(await self._profile(profile), self.counter(profile.encoding))
        writes = await self.store.working_state_writes(inp.session_id)
        state = self._working_state(writes, estimator.counter.count, inp.turn + 1)
        untrusted = tainted  # the call was written with untrusted content in view: so is every entry it adds
        try:
            # Measured as build() will count the block, so an accepted write always fits its cap.
            apply(
                state,
                update,
                writer="model",
                count=lambda text: measure_working_state(text, estimator=estimator, secret=secret),
                untrusted_in_context=untrusted,
                token_cap=open_.context_budget(profile).working_state_tokens,
            )
        except ContextError as exc:
            await self._event(
                inp.session_id,
                f"ws_rejected:{inp.call.item_id}",
                EventType.WORKING_STATE_REJECTED,
                inp.turn,
                inp.epoch,
                {"error": str(exc)},
            )
            return f"error: {exc}", TrustLevel.TOOL, True, None
        write = WorkingStateWrite(turn=inp.turn, writer="model", untrusted_in_context=untrusted, update=update)
        await self.store.add_working_state_write(
            inp.session_id, inp.call.item_id, inp.turn, write.model_dump(mode="json")
        )
        return "working state updated", TrustLevel.TOOL, False, None

    @activity.defn(name=names.ACTIVITY_WRITE_MEMORY)
    async def write_memory(self, inp: MemoryInput) -> MemoryResult:
        """Store a memory (or a correction). It reaches recall and corrections, never the frozen snapshot.

        Refused before anything is stored: a `corrects` naming no memory of the scope (UnknownMemory), and an
        explicit `memory_id` the scope already holds with other content (MemoryIdTaken: memories are never
        overwritten; write a correction instead). The same write again (a retry) succeeds.
        """
        memory_id = inp.write.memory_id or f"{inp.session_id}:{inp.update_id}"
        if inp.write.corrects is not None and await self.store.get_memory(inp.scope, inp.write.corrects) is None:
            raise ApplicationError(
                f"write_memory: corrects: no memory {inp.write.corrects!r} in scope {inp.scope!r}",
                type="UnknownMemory",
                non_retryable=True,
            )
        taken = await self.store.get_memory(inp.scope, memory_id)
        if taken is not None and (taken["text"], taken["source_session"], taken["corrects"]) != (
            inp.write.text,
            inp.session_id,
            inp.write.corrects,
        ):
            raise ApplicationError(
                f"write_memory: memory_id: {memory_id!r} is taken in scope {inp.scope!r}; memories are never "
                "overwritten: choose another id, or write a correction (corrects)",
                type="MemoryIdTaken",
                non_retryable=True,
            )
        await self.store.write_memory(
            inp.scope,
            memory_id,
            inp.write.text,
            trust=TrustLevel.USER.value,
            session_id=inp.session_id,
            corrects=inp.write.corrects,
        )
        _, _, cache = await self._session(inp.session_id)
        prefix, _ = await self._prefix(inp.session_id, inp.epoch, cache)
        snapshot_ids = {s.item_id.removeprefix("memory.") for s in prefix.segments if s.kind == "memory_snapshot"}
        return MemoryResult(memory_id=memory_id, correction_of_snapshot=inp.write.corrects in snapshot_ids)

    @activity.defn(name=names.ACTIVITY_DELETE_MEMORY)
    async def delete_memory(self, inp: DeleteMemoryInput) -> MemoryDeleted:
        """Delete a memory from the store (and so from recall and later snapshots); a snapshot holding it gets
        a correction line that withdraws it until the session's next epoch."""
        memory_id = inp.delete.memory_id
        deleted = await self.store.delete_memory(inp.scope, memory_id, reason=inp.delete.reason)
        _, _, cache = await self._session(inp.session_id)
        prefix, _ = await self._prefix(inp.session_id, inp.epoch, cache)
        in_snapshot = any(s.kind == "memory_snapshot" and s.item_id == f"memory.{memory_id}" for s in prefix.segments)
        log.info("memory.deleted", session_id=inp.session_id, turn=inp.turn, epoch=inp.epoch, memory_id=memory_id)
        return MemoryDeleted(memory_id=memory_id, deleted=deleted, in_snapshot=in_snapshot)

    @activity.defn(name=names.ACTIVITY_WORKING_STATE_WRITE)
    async def write_working_state(self, inp: WorkingStateInput) -> WorkingStateResult:
        """A runtime write (ADR-0020 decision 14): all operations or none, logged once per update id, seen from
        the next request on. Over a cap or naming an unknown id, it fails (non-retryable) and changes nothing."""
        key = f"runtime:{inp.update_id}"
        if not await self.store.has_working_state_write(inp.session_id, key):
            open_, secret, cache = await self._session(inp.session_id)
            _, profile = await self._prefix(inp.session_id, inp.epoch, cache)
            estimator = TokenEstimator(await self._profile(profile), self.counter(profile.encoding))
            state = self._working_state(
                await self.store.working_state_writes(inp.session_id), estimator.counter.count, inp.turn + 1
            )

            def attempt(update: WorkingStateUpdate) -> None:
                apply(
                    state,
                    update,
                    writer="runtime",
                    count=lambda text: measure_working_state(text, estimator=estimator, secret=secret),
                    token_cap=open_.context_budget(profile).working_state_tokens,
                )

            try:
                attempt(inp.update)
            except ContextError as exc:
                message = f"update_working_state: {_failing_operation(inp.update, attempt)}: {exc}"
                await self._event(
                    inp.session_id,
                    f"ws_rejected:{key}",
                    EventType.WORKING_STATE_REJECTED,
                    inp.turn,
                    inp.epoch,
                    {"error": message, "writer": "runtime"},
                )
                raise ApplicationError(message, type=type(exc).__name__, non_retryable=True) from exc
            write = WorkingStateWrite(turn=inp.turn, writer="runtime", update=inp.update)
            await self.store.add_working_state_write(inp.session_id, key, inp.turn, write.model_dump(mode="json"))
        writes = await self.store.working_state_writes(inp.session_id)
        state = self._working_state(writes, self.counter("cl100k_base").count, inp.turn + 1)
        return WorkingStateResult(turn=inp.turn, working_state=render(state))

    @activity.defn(name=names.ACTIVITY_CLOSE)
    async def close_session(self, inp: CloseInput) -> None:
        await self.store.close_session(inp.session_id, inp.reason)
        self._sessions.pop(inp.session_id, None)
        log.info("session.closed", session_id=inp.session_id, turn=inp.turn, epoch=inp.epoch, reason=inp.reason)

    @activity.defn(name=names.ACTIVITY_EVENT)
    async def record_event(self, inp: EventInput) -> None:
        await self._event(inp.session_id, inp.event_key, EventType(inp.type), inp.turn, inp.epoch, inp.payload)

    def all(self) -> list[Any]:
        return [
            self.open_session,
            self.build_context,
            self.call_model,
            self.execute_tool,
            self.write_memory,
            self.close_session,
            self.record_event,
            self.write_working_state,
            self.delete_memory,
            self.seal_turn,
        ]


async def _heartbeating(work: Awaitable[T]) -> T:
    """Await `work`, heartbeating meanwhile, so a dead worker's call is retried within the heartbeat timeout."""
    task = asyncio.ensure_future(work)
    interval = (activity.info().heartbeat_timeout or timedelta(seconds=30)).total_seconds() / 3
    while True:
        done, _ = await asyncio.wait({task}, timeout=interval)
        if done:
            return task.result()
        activity.heartbeat()


async def _within_attempt(work: Awaitable[T]) -> T:
    """`work`, cut off just before this attempt's start-to-close timeout: a late reply must not be stored after
    Temporal has given up on the attempt (and the turn may have failed). A typed, retryable timeout."""
    limit = activity.info().start_to_close_timeout
    if limit is None:
        return await work
    try:
        return await asyncio.wait_for(work, timeout=max(0.1, limit.total_seconds() - 0.25))
    except TimeoutError:
        raise ApplicationError(
            f"the model did not answer within {limit.total_seconds():g} s (timeouts.model_seconds)",
            type="ModelCallTimeout",
        ) from None


def _model_result(
    logged: list[HistoryItem], actual: int, cached: int, output: int, estimated: int, *, overrun: bool | None
) -> ModelResult:
    """The model call's result as the log holds it (the log, not this attempt's reply, is the truth)."""
    text = next((i.text for i in logged if isinstance(i, AssistantMessage)), "")
    refused = {i.call_id for i in logged if isinstance(i, ToolResult)}  # answered in the reply's own group
    calls = sorted((i for i in logged if isinstance(i, ToolCall) and i.call_id not in refused), key=lambda c: c.seq)
    return ModelResult(
        refused_tool_calls=len(refused),
        text=text,
        tool_calls=[
            ToolCallRequest(item_id=c.id, call_id=c.call_id, name=c.tool_name, arguments=c.arguments) for c in calls
        ],
        input_tokens=actual,
        cached_tokens=cached,
        output_tokens=output,
        estimated_tokens=estimated,
        overrun=estimated < actual if overrun is None else overrun,
    )


def _failing_operation(update: WorkingStateUpdate, attempt: Any) -> str:
    """Names the first operation whose application (with those before it) fails: `operations[2] (add_constraint)`."""
    ops = update.operations
    for i in range(len(ops)):
        try:
            attempt(WorkingStateUpdate(operations=ops[: i + 1]))
        except ContextError:
            return f"operations[{i}] ({ops[i].op})"
    return "operations"


def _turn_too_large(exc: TurnTooLargeError, *, logged: bool) -> ApplicationError:
    """The typed, non-retryable failure of one turn: type TurnTooLarge, the sizes in its details. `logged`:
    whether the turn's message was already in the log (its tool calls' results did not fit as pointers)."""
    return ApplicationError(str(exc), {**exc.details(), "logged": logged}, type="TurnTooLarge", non_retryable=True)


def _tool_names(prefix: FrozenPrefix) -> list[str]:
    return [s.item_id.removeprefix("tool.") for s in prefix.segments if s.kind == "tool_definition"]


def _provider_segment(data: dict[str, Any]) -> ProviderSegment:
    return ProviderSegment.model_construct(
        raw_tokens=data.get("raw_tokens", 0),
        role=data["role"],
        kind=data["kind"],
        trust=data["trust"],
        region=data["region"],
        text=data["text"],
        item_id=data["item_id"],
        call_id=data.get("call_id"),
    )


def _summary(item: ToolResult, tokens: int, ws_text: str | None) -> ToolResultSummary:
    flat = " ".join(item.content.split())
    return ToolResultSummary(
        item_id=item.id,
        is_error=item.is_error,
        trust=item.trust.value,
        tokens=tokens,
        summary=flat[:120],
        working_state=ws_text,
    )
