"""The build activity: log the turn's user message (once), load the request's inputs by reference, run the
pure builder, store the request and its record, and report a second prefix hash in an epoch as a defect.

`BuildActivities._plan` is the one step from stored inputs to a plan; the harness's prefix fault overrides it
(harness/faults.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.assembly import RequestInputs, StoredMemory, body_inputs
from activities.lifecycle import seal_orphans
from activities.minimum_body import beside_stand_in, check_fits_escalated, turn_too_large
from activities.rows import ItemRender, TurnReads
from activities.session_state import (
    RECALL_LIMIT,
    BodyForm,
    BuiltRequest,
    SessionCache,
    SessionState,
    calibrated,
    snapshot_ids,
    working_state,
)
from contract import names
from contract.activity_interfaces import BuildCalls
from contract.bounds import RECENT_UPDATES
from contract.events import EventType
from contract.payloads import BuildInput, BuildResult, SessionOpen
from contract.retries import UPDATE_ID_REUSED
from core.build import BodyInputs, FrozenPrefix, build, counter_key
from core.compaction import Checkpoint
from core.errors import ContextError, TurnTooLargeError
from core.estimator import TokenEstimator
from core.explain import first_difference
from core.items import Region, TrustLevel, UserMessage, parse_history_item
from core.plan import ContextPlan, PlanStatus, Segment
from core.rendering import ESCAPING_FINGERPRINT
from core.working_state import holds_tainted, render

log = structlog.get_logger("ctxengine.activities")


class _Prepared(NamedTuple):
    """What a build made of its read, ready for its write (`BuildActivities._prepare`)."""

    user_item_id: str | None
    message: list[dict[str, Any]]  # the turn's message, when this call logs it
    renders: list[ItemRender]  # the message's, stored with it
    estimator: TokenEstimator
    prefix: FrozenPrefix
    plan: ContextPlan
    inputs: RequestInputs
    body: BodyInputs
    body_segments: list[Segment]
    form: BodyForm  # how the request's body is stored


class BuildActivities(BuildCalls):
    def __init__(self, state: SessionState) -> None:
        self.state = state

    @activity.defn(name=names.ACTIVITY_BUILD)
    async def build_context(self, inp: BuildInput) -> BuildResult:
        """Append the user message (once), load inputs by reference, build, store the request, return a summary."""
        state, store = self.state, self.state.store
        bound = log.bind(session_id=inp.session_id, turn=inp.turn, epoch=inp.epoch)
        # One read: the session, the log since this worker's memo, the epoch, the calibration, the working state,
        # the checkpoint, the corrections and the recall for the turn's message (when the message is known here).
        # When the memo can guess what it will bring, the build runs on the guess while the read is on its way, and
        # is kept when the read confirms the guess (else it runs again on what was read).
        before = state.cached(inp.session_id)
        query = self._recall_query(inp)
        guess = state.guess_reads(
            before,
            inp.epoch,
            query,
            self._message_id(inp) if inp.user_text is not None else None,
            (inp.turn, inp.call_index),
        )
        if guess is None or before is None:  # (a guess implies a memo; `before` named for the type checker)
            open_, secret, cache, reads = await state.turn_reads(inp.session_id, inp.epoch, query)
            ready = await self._prepare(inp, open_, secret, cache, reads)
        else:
            reading = asyncio.ensure_future(state.read_turn(inp.session_id, inp.epoch, query, before))
            try:
                await asyncio.sleep(0)  # the read's statement sent before the build takes the loop
                assert before.open is not None  # guessed only for a memo of the session
                try:
                    ahead: _Prepared | None = await self._prepare(inp, before.open, before.secret, before, guess)
                except Exception:  # the guess may be wrong: the build on what is read says what is
                    ahead = None
                reads = await reading
            finally:
                if not reading.done():  # this call was cancelled first: the read ends (its connection back in the
                    reading.cancel()  # pool, its error taken) before the call does
                    await asyncio.gather(reading, return_exceptions=True)
            open_, secret, cache = await state.adopt(inp.session_id, inp.epoch, before, reads)
            if ahead is not None and cache is before and state.guessed_right(guess, reads):
                ready = ahead
            else:
                ready = await self._prepare(inp, open_, secret, cache, reads)
        state.ran(cache, built=(inp.turn, inp.call_index))
        user_item_id, message, renders, estimator, prefix, plan, ri, body_in, body_segments, form = ready
        if prefix.escaping_fingerprint and prefix.escaping_fingerprint != ESCAPING_FINGERPRINT:
            # This worker escapes differently from the one that opened the epoch (a Unicode or package upgrade):
            # body bytes may differ from earlier requests. Say so; the operator rotates the epoch.
            bound.warning(
                "rendering.fingerprint_changed",
                epoch_fingerprint=prefix.escaping_fingerprint,
                worker_fingerprint=ESCAPING_FINGERPRINT,
            )
        # One write: the request's body (whole or a delta of this worker's last one, logged items by reference),
        # its record and the turn's message (looked for as logged since this call's read: the memo holds the rest).
        hashes, seqs, record = await store.store_request(
            inp.session_id,
            inp.turn,
            inp.call_index,
            epoch=inp.epoch,
            prefix_sha256=plan.prefix_sha256,
            request_sha256=plan.request_sha256,
            estimated_tokens=plan.estimated_tokens,
            raw_tokens=plan.raw_tokens,
            plan=plan.summary().model_dump(mode="json"),
            inputs=ri.model_dump(mode="json"),
            body=form.stored.entries,
            counter=counter_key(estimator),
            base=form.base,
            keep=form.keep,
            append=message,
            renders=renders,
            append_after_seq=cache.max_seq,
        )
        if message and not seqs:  # logged before the memo's position: only an earlier turn logs there
            await self._refuse_reused_id(inp, message[0]["id"], stored=True)
        if message and seqs != [ri.max_seq]:
            # Something was logged between this call's read and its write (a late reply of a timed-out attempt):
            # the request was built without it. The retry reads it and builds again (its record replaces this).
            raise ApplicationError(
                f"the log of session {inp.session_id!r} moved while turn {inp.turn} was built; building again",
                type="LogMoved",
            )
        state.joined(message, seqs, renders, cache)
        built = BuiltRequest(plan.segments, record, reads.calibration, reads.provider_calibration)
        cache.remember_request(plan.request_sha256, built, plan.prefix_sha256, body_segments, form)
        if len(hashes) > 1 and plan.prefix_sha256 != hashes[0].prefix_sha256:
            # A second prefix hash in one epoch: a defect. Name the segment and byte where it changed.
            epoch_prefix, _ = await state.prefix(inp.session_id, inp.epoch, cache)
            # What the plan actually holds as Region A, against what the epoch stored.
            sent = [seg for seg in plan.segments if seg.region is Region.A]
            diff = first_difference(epoch_prefix.segments, sent)
            await state.event(
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
            await state.event(
                inp.session_id,
                f"yield:{inp.turn}:{inp.call_index}",
                EventType.YIELD_APPLIED,
                inp.turn,
                inp.epoch,
                {"yields": [y.model_dump(mode="json") for y in plan.yields]},
            )
        bound.info("context.built", tokens=plan.estimated_tokens, status=plan.status.value, yields=len(plan.yields))
        return BuildResult(plan=plan.summary(), user_item_id=user_item_id, turn_start_seq=body_in.turn_start_seq)

    async def _prepare(
        self, inp: BuildInput, open_: SessionOpen, secret: bytes, cache: SessionCache, reads: TurnReads
    ) -> _Prepared:
        """From the build's read (`reads`, with `cache`, the memo, brought up to date from it): the turn's message
        (when this call is the first to log it) and its render, the estimator, the prefix, the plan and how its body
        is stored. Reads or writes nothing when the message is not logged yet, no tool call waits for its result
        and the read searched recall."""
        state = self.state
        user_item_id = inp.user_item_id
        # The turn's message, when this call is the first to log it: built in place (at the next position) and
        # logged with the request in one write, so a message that cannot fit is refused with nothing appended.
        message: list[dict[str, Any]] = []
        if inp.user_text is not None:
            await seal_orphans(state, inp.session_id, inp.turn - 1, "its turn failed first", cache=cache)
            user_item_id = self._message_id(inp)
            if user_item_id not in cache.by_id:
                message = [
                    {"id": user_item_id, "kind": "user_message", "trust": TrustLevel.USER.value, "text": inp.user_text}
                ]
            else:  # logged already: by this turn's earlier attempt, or by an earlier turn (a reused update id)
                await self._refuse_reused_id(inp, user_item_id, stored=False)
        prefix, profile = await state.prefix(inp.session_id, inp.epoch, cache)
        profile = calibrated(profile, reads.calibration, reads.provider_calibration)
        estimator = TokenEstimator(profile, state.counter(profile.encoding))
        plan, ri, body_in = await self._plan(
            inp, open_, secret, cache, prefix, estimator, user_item_id, reads=reads, message=message
        )
        body_segments = plan.segments[len(prefix.segments) :]
        form = cache.body_form(plan.prefix_sha256, body_segments, cache.render_for(estimator))
        renders = state.render_for_log(message, cache)
        return _Prepared(user_item_id, message, renders, estimator, prefix, plan, ri, body_in, body_segments, form)

    @staticmethod
    def _message_id(inp: BuildInput) -> str:
        """The log id of the turn's message."""
        return f"u:{inp.update_id or inp.turn}"

    async def _refuse_reused_id(self, inp: BuildInput, user_item_id: str, *, stored: bool) -> None:
        """Fail the turn for good when its message's id was logged by an earlier turn: the update id is a retry of a
        turn whose answer the session no longer carries (older than its last 32 turns), and building again would
        find it again. `stored`: the request was just stored with it; never sent, its record goes."""
        store = self.state.store
        logged_by = await store.item_turn(inp.session_id, user_item_id)
        if logged_by is None or logged_by == inp.turn:
            return  # this turn's own message, logged by an earlier attempt of this build
        if stored:
            await store.drop_unsent_record(inp.session_id, inp.turn, inp.call_index)
        raise ApplicationError(
            f"update id {inp.update_id!r} was turn {logged_by}'s, whose answer this session no longer carries (it "
            f"carries at most its last {RECENT_UPDATES} answers across continue-as-new, fewer when they are large): "
            "nothing was appended; send a new turn with a new update id",
            {"update_id": inp.update_id, "turn": logged_by},
            type=UPDATE_ID_REUSED,
            non_retryable=True,
        )

    async def _plan(
        self,
        inp: BuildInput,
        open_: SessionOpen,
        secret: bytes,
        cache: SessionCache,
        prefix: FrozenPrefix,
        estimator: TokenEstimator,
        user_item_id: str | None,
        *,
        reads: TurnReads,
        message: list[dict[str, Any]],
    ) -> tuple[ContextPlan, RequestInputs, BodyInputs]:
        """The request's inputs, read from the store by reference (`reads`: this call's one read, with the memo
        brought up to date from it; `message`: the turn's message, not logged yet, at the next position), and the
        plan the pure builder makes of them."""
        store = self.state.store
        turn_message = parse_history_item({**message[0], "seq": cache.max_seq + 1}) if message else None
        renders = cache.render_for(estimator)
        logged = cache.logged(renders, estimator, turn_message)
        checkpoint = Checkpoint.model_validate(reads.checkpoint) if reads.checkpoint else None
        ws = working_state(reads.working_state_writes, estimator.counter.count, inp.turn + 1)
        recall_rows = reads.recall
        if recall_rows is None:  # the message was not in this worker's memo before the read: search now
            ids = logged.ids
            at = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] == user_item_id), -1) if user_item_id else -1
            query = logged.item(at).body_text() if at >= 0 else ""
            recall_rows = await store.search_memories(
                open_.memory_scope, query, limit=RECALL_LIMIT, exclude=snapshot_ids(prefix)
            )
        correction_rows = reads.corrections
        ri = RequestInputs(
            turn=inp.turn,
            call_index=inp.call_index,
            max_seq=logged.seqs[-1] if logged.seqs else -1,
            user_item_id=user_item_id,
            checkpoint_id=checkpoint.checkpoint_id if checkpoint else None,
            recall=[StoredMemory(memory_id=r.memory_id, text=r.text, trust=r.trust) for r in recall_rows],
            corrections=[
                StoredMemory(memory_id=r.memory_id, text=r.text, trust=r.trust, corrects=r.corrects)
                for r in correction_rows
            ],
            working_state=render(ws) if (ws.constraints or ws.tasks or ws.facts or ws.open_questions) else "",
            working_state_tainted=holds_tainted(ws),
            now_iso=inp.now_iso,
            profile=estimator.profile,
            budget=open_.context_budget(estimator.profile),
            estimate_rules=estimator.rules,
        )
        body = body_inputs(logged, checkpoint, ri)
        # A new message in a session with history may end up beside an escalation checkpoint (it compacts, then
        # escalates): it must fit there too, and a refusal names its room there (activities/minimum_body.py).
        escalating = turn_message if isinstance(turn_message, UserMessage) else None
        if checkpoint is None and len(logged.seqs) <= 1:  # no history: the turn cannot escalate
            escalating = None
        try:
            plan = build(prefix, body, budget=ri.budget, estimator=estimator, secret=secret, cache=renders)
        except TurnTooLargeError as exc:
            sized = beside_stand_in(exc, prefix, estimator, ri.budget, secret) if escalating else exc
            raise turn_too_large(sized, logged=not message) from exc
        except ContextError as exc:
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc
        if escalating is not None and plan.status is PlanStatus.NEEDS_COMPACTION:
            try:
                check_fits_escalated(prefix, escalating, ri, estimator, secret)
            except TurnTooLargeError as exc:
                raise turn_too_large(exc, logged=False) from exc
        return plan, ri, body

    def _recall_query(self, inp: BuildInput) -> str | None:
        """The text recall searches for: the turn's message (given on its first call, else in the memo)."""
        if inp.user_text is not None:
            return inp.user_text
        cache = self.state.cached(inp.session_id)
        if cache is None or inp.user_item_id is None:
            return None
        user = next((i for i in reversed(cache.items) if i.id == inp.user_item_id), None)
        return user.body_text() if user is not None else None

    def all(self) -> list[Any]:
        return [self.build_context]
