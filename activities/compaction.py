"""Compaction and memory-formation activities. They run the pure policies of core/ on stored inputs and
write their results idempotently: a retried activity finds its own earlier write and returns it."""

from __future__ import annotations

import time
from typing import Any

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.model_call import within_attempt
from activities.provider import SummaryRequest
from activities.session_state import SessionState
from activities.tokens import TiktokenCounter
from contract import names
from contract.activity_interfaces import CompactionActivityCalls
from contract.events import EventType
from contract.payloads import (
    CompactionInput,
    CompactionOutcome,
    CompactionStep,
    FormationInput,
    FormationResult,
    SummarizeInput,
)
from core.compaction import (
    Checkpoint,
    CompactionDecision,
    CompactionPlan,
    SummaryChunk,
    escalation_checkpoint,
    plan_compaction,
)
from core.estimator import TokenEstimator
from core.items import TrustLevel
from core.working_state import WorkingStateWrite, fold

log = structlog.get_logger("ctxengine.compaction")
SUMMARY_MAX_TOKENS = 300
MIN_FACT_CHARS = 8
MAX_FACT_CHARS = 1_000


NO_SUMMARY = "(The summarizer returned nothing for this span; it began:)\n"


def fitted_summary(reply: str, chunk: str, limit: int, counter: TiktokenCounter) -> tuple[str, str | None]:
    """What a checkpoint keeps of a chunk: the summarizer's reply, cut to `limit` tokens (the chunk's share of the
    fifth of the body a summary may take; a summarizer may write past `max_tokens`, and a longer summary would
    take room every later request needs); a blank reply becomes the chunk's own opening, cut the same way, so a
    summarizer that answers nothing drops nothing unseen. With why it differs from the reply (None: it does not)."""
    if not reply.strip():
        return counter.truncate(NO_SUMMARY + chunk, limit), "blank"
    if counter.count(reply) > limit:
        return counter.truncate(reply, limit), "over_limit"
    return reply, None


class CompactionActivities(CompactionActivityCalls):
    def __init__(self, state: SessionState) -> None:
        self.state = state
        self.store = state.store

    async def _context(self, session_id: str) -> tuple[Any, Any]:
        open_, _, cache = await self.state.session(session_id)
        profile = open_.route.profile()
        return open_, (cache, self.state.counter(profile.encoding), profile)

    def _chunk_tokens(self, context_window: int) -> int:
        """A summarizer input never exceeds a quarter of the model's window (and 8k tokens)."""
        return max(512, min(8_000, context_window // 4))

    @activity.defn(name=names.ACTIVITY_COMPACTION_PLAN)
    async def plan(self, inp: CompactionInput) -> CompactionStep:
        """Run the pure policy on the stored log and store the plan (a retry gets the stored one)."""
        open_, (cache, counter, _) = await self._context(inp.session_id)
        prefix, profile = await self.state.prefix(inp.session_id, inp.epoch, cache)
        items = await self.state.items(inp.session_id, cache)
        secret = cache.secret
        current_json = await self.store.latest_checkpoint(inp.session_id)
        current = Checkpoint.model_validate(current_json) if current_json else None
        budget = open_.context_budget(profile)
        # The route's calibration as the build reads it (learned since the epoch opened: a refusal lifts it).
        estimator = TokenEstimator(await self.state.profile(profile), counter)
        body = budget.input_limit - estimator.prefix_reserve(prefix.raw_tokens, prefix.tool_count)
        plan = plan_compaction(
            items,
            current=current,
            keep_from_seq=inp.keep_from_seq,
            count=counter.count,
            chunk_tokens=self._chunk_tokens(profile.context_window),
            secret=secret,
            summary_budget=max(200, body // 5),  # the summary may take a fifth of the body, never more
        )
        stored = CompactionPlan.model_validate(
            await self.store.put_compaction_plan(inp.session_id, inp.checkpoint_id, plan.model_dump(mode="json"))
        )
        await self.state.event(
            inp.session_id,
            f"compaction_started:{inp.checkpoint_id}",
            EventType.COMPACTION_STARTED,
            inp.turn,
            inp.epoch,
            {
                "checkpoint_id": inp.checkpoint_id,
                "decision": stored.decision.value,
                "depth": stored.depth,
                "chunks": len(stored.chunks),
                "covers": [stored.covers_from_seq, stored.covers_to_seq],
            },
        )
        return CompactionStep(
            decision=stored.decision.value,
            checkpoint_id=inp.checkpoint_id,
            depth=stored.depth,
            chunks=len(stored.chunks),
            covers_from_seq=stored.covers_from_seq,
            covers_to_seq=stored.covers_to_seq,
            pointers=len(stored.pointers),
            summarized_items=len({i for c in stored.chunks for i in c.item_ids}),
            reason=stored.reason,
        )

    @activity.defn(name=names.ACTIVITY_COMPACTION_SUMMARIZE)
    async def summarize(self, inp: SummarizeInput) -> int:
        """Summarize one trusted chunk; the exact input is recorded beside its summary."""
        began = time.monotonic()
        existing = await self.store.get_summary(inp.session_id, inp.checkpoint_id, inp.chunk_index)
        if existing is not None:
            return len(existing)
        stored_chunk = await self.store.get_compaction_chunk(inp.session_id, inp.checkpoint_id, inp.chunk_index)
        if stored_chunk is None:
            raise ApplicationError(
                f"no chunk {inp.chunk_index} in compaction plan {inp.checkpoint_id}",
                type="UnknownPlan",
                non_retryable=True,
            )
        chunk, summary_tokens = SummaryChunk.model_validate(stored_chunk[0]), stored_chunk[1]
        _, (cache, _, _) = await self._context(inp.session_id)
        _, profile = await self.state.prefix(inp.session_id, inp.epoch, cache)  # this epoch's route
        provider = self.state.providers.get(profile.provider)
        if provider is None:
            raise ApplicationError(
                f"provider {profile.provider!r} is not configured",
                type="ProviderNotConfigured",
                non_retryable=True,
            )
        reply = await within_attempt(  # typed `ModelCallTimeout`, as a turn's model call is
            provider.summarize(
                SummaryRequest(
                    session_id=inp.session_id,
                    model=profile.model,
                    text=chunk.text,
                    max_tokens=min(SUMMARY_MAX_TOKENS, summary_tokens),
                )
            ),
            spent_s=time.monotonic() - began,
        )
        summary, why = fitted_summary(reply.text, chunk.text, summary_tokens, self.state.counter(profile.encoding))
        if why is not None:
            log.warning(
                "compaction.summary_fitted",
                session_id=inp.session_id,
                checkpoint_id=inp.checkpoint_id,
                chunk=inp.chunk_index,
                reason=why,
                reply_chars=len(reply.text),
                limit_tokens=summary_tokens,
            )
        stored = await self.store.put_summary(inp.session_id, inp.checkpoint_id, inp.chunk_index, chunk.text, summary)
        return len(stored)

    @activity.defn(name=names.ACTIVITY_COMPACTION_COMMIT)
    async def commit(self, inp: CompactionInput) -> CompactionOutcome:
        """Write the checkpoint: the parent's summary, then this span's chunk summaries, and the pointers."""
        plan_json = await self.store.get_compaction_plan(inp.session_id, inp.checkpoint_id)
        assert plan_json is not None
        plan = CompactionPlan.model_validate(plan_json)
        rows = await self.store.summaries(inp.session_id, inp.checkpoint_id)
        if len(rows) != len(plan.chunks):
            raise ApplicationError(f"{len(plan.chunks) - len(rows)} chunk summaries missing", type="Incomplete")
        parts = ([plan.previous_summary] if plan.previous_summary else []) + [r.summary for r in rows]
        checkpoint = Checkpoint(
            checkpoint_id=inp.checkpoint_id,
            parent_id=plan.parent_id,
            depth=plan.depth,
            covers_from_seq=plan.covers_from_seq,
            covers_to_seq=plan.covers_to_seq,
            summary="\n".join(parts),
            pointers=plan.pointers,
            tainted=plan.previous_tainted or any(c.tainted for c in plan.chunks),
        )
        await self.store.put_checkpoint(inp.session_id, checkpoint.model_dump(mode="json"))
        outcome = CompactionOutcome(
            decision=CompactionDecision.COMPACT.value,
            checkpoint_id=inp.checkpoint_id,
            depth=plan.depth,
            summarized_items=len({i for c in plan.chunks for i in c.item_ids}),
            elided_items=len(plan.pointers),
            summarizer_calls=len(rows),
        )
        return await self._completed(inp, outcome)

    @activity.defn(name=names.ACTIVITY_COMPACTION_ESCALATE)
    async def escalate(self, inp: CompactionInput) -> CompactionOutcome:
        """Past depth 2: write a checkpoint that is a fresh body of references, for a child run to start from."""
        _, (cache, counter, _) = await self._context(inp.session_id)
        items = await self.state.items(inp.session_id, cache)
        current_json = await self.store.latest_checkpoint(inp.session_id)
        if current_json is None:
            raise ApplicationError(
                "escalation needs a checkpoint to start from", type="NoCheckpoint", non_retryable=True
            )
        current = Checkpoint.model_validate(current_json)
        ancestors = [c["checkpoint_id"] for c in await self.store.checkpoints(inp.session_id)]
        checkpoint = escalation_checkpoint(
            items,
            current=current,
            keep_from_seq=inp.keep_from_seq,
            checkpoint_id=inp.checkpoint_id,
            ancestors=ancestors,
            count=counter.count,
        )
        await self.store.put_checkpoint(inp.session_id, checkpoint.model_dump(mode="json"))
        plan = await self.store.get_compaction_plan(inp.session_id, inp.checkpoint_id)  # why it escalated
        why = plan.get("reason") if plan else None
        outcome = CompactionOutcome(
            decision=CompactionDecision.ESCALATE.value,
            checkpoint_id=inp.checkpoint_id,
            depth=0,
            elided_items=len(checkpoint.pointers),
            reason=f"{why or 'escalated'}; child run from {inp.checkpoint_id}",
        )
        return await self._completed(inp, outcome)

    @activity.defn(name=names.ACTIVITY_MEMORY_FORM)
    async def form_memories(self, inp: FormationInput) -> FormationResult:
        """Offer the session's established facts to memory formation; every gate's rejection is recorded.

        Gates, in order: untrusted (a fact derived from untrusted content is never written), length,
        duplicate (already a memory in scope). Idempotent: a fact is decided once per session.
        """
        _, (_, counter, _) = await self._context(inp.session_id)
        writes = [WorkingStateWrite.model_validate(w) for w in await self.store.working_state_writes(inp.session_id)]
        # The state at close holds every logged write, as the state query shows it: a runtime write after the last
        # turn (`inp.turn`) is logged under the next turn's number (docs/working-state.md), so the fold runs to the
        # turn after that one.
        state = fold(writes, count=counter.count, upto_turn=inp.turn + 2)
        decided = {r.fact_id for r in await self.store.candidates(inp.session_id)}
        known = {text.lower() for text in await self.store.memory_texts(inp.scope)}
        written = 0
        rejected: dict[str, int] = {}
        for fact in state.facts:
            if fact.id in decided:
                continue
            text = fact.text.strip()
            gate, reason = None, "accepted"
            if fact.tainted:
                gate, reason = "untrusted", "derived from untrusted content: the write ban applies"
            elif not MIN_FACT_CHARS <= len(text) <= MAX_FACT_CHARS:
                gate, reason = "length", f"{len(text)} characters, outside {MIN_FACT_CHARS}..{MAX_FACT_CHARS}"
            elif text.lower() in known:
                gate, reason = "duplicate", "already a memory in this scope"
            memory_id = f"{inp.session_id}:{fact.id}"
            if gate == "duplicate" and await self._formed(inp, memory_id, text):
                gate, reason = None, "accepted"  # a retry: this very fact was written by the first attempt
            elif gate is None:
                await self.store.write_memory(
                    inp.scope, memory_id, text, trust=TrustLevel.MODEL.value, session_id=inp.session_id, corrects=None
                )
                if not await self._formed(inp, memory_id, text):  # a caller's write_memory took the id first
                    gate, reason = "id_taken", f"memory id {memory_id!r} holds another writer's memory"
            if gate is None:
                known.add(text.lower())
                written += 1
            else:
                rejected[gate] = rejected.get(gate, 0) + 1
            await self.store.put_candidate(
                inp.session_id,
                fact.id,
                text,
                accepted=gate is None,
                gate=gate,
                reason=reason,
                memory_id=memory_id if gate is None else None,
            )
        log.info(
            "memory.formation",
            session_id=inp.session_id,
            turn=inp.turn,
            epoch=inp.epoch,
            candidates=len(state.facts),
            written=written,
            rejected=rejected,
        )
        return FormationResult(candidates=len(state.facts), written=written, rejected=rejected)

    async def _formed(self, inp: FormationInput, memory_id: str, text: str) -> bool:
        """Whether the scope holds this session's fact under `memory_id` (a memory another writer put there is not)."""
        row = await self.store.get_memory(inp.scope, memory_id)
        return row is not None and (row.source_session, row.text) == (inp.session_id, text)

    async def _completed(self, inp: CompactionInput, outcome: CompactionOutcome) -> CompactionOutcome:
        await self.state.event(
            inp.session_id,
            f"compaction_completed:{inp.checkpoint_id}",
            EventType.COMPACTION_COMPLETED,
            inp.turn,
            inp.epoch,
            outcome.model_dump(mode="json"),
        )
        return outcome

    def all(self) -> list[Any]:
        return [self.plan, self.summarize, self.commit, self.escalate, self.form_memories]
