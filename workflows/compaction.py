"""CompactionWorkflow: a child of the session that writes one checkpoint (ADR-0020 decisions 10 and 12).

Plan (pure policy, stored), summarize each trusted chunk, commit the checkpoint. Past depth 2 it writes an
escalation checkpoint instead, and the session continues the turn in a ChildRunWorkflow.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contract import names
    from contract.activity_interfaces import CompactionActivityCalls
    from contract.payloads import CompactionInput, CompactionOutcome, CompactionStep, SummarizeInput
    from core.compaction import CompactionDecision

from workflows.retry_policies import MODEL_RETRY, RETRY

SUMMARIZE_CONCURRENCY = 4


@workflow.defn(name=names.WORKFLOW_COMPACTION)
class CompactionWorkflow:
    @workflow.run
    async def run(self, inp: CompactionInput) -> CompactionOutcome:
        t = inp.timeouts
        step: CompactionStep = await workflow.execute_activity_method(
            CompactionActivityCalls.plan,
            inp,
            start_to_close_timeout=timedelta(seconds=t.build_seconds),
            heartbeat_timeout=timedelta(seconds=t.heartbeat_seconds),
            retry_policy=RETRY,
            summary=f"plan {inp.checkpoint_id}",
        )
        if step.decision == CompactionDecision.NOTHING_TO_COMPACT.value:
            return CompactionOutcome(
                decision=step.decision, checkpoint_id=inp.checkpoint_id, depth=step.depth, reason=step.reason
            )
        if step.decision == CompactionDecision.ESCALATE.value:
            outcome: CompactionOutcome = await workflow.execute_activity_method(
                CompactionActivityCalls.escalate,
                inp,
                start_to_close_timeout=timedelta(seconds=t.build_seconds),
                heartbeat_timeout=timedelta(seconds=t.heartbeat_seconds),
                retry_policy=RETRY,
                summary=f"escalate: {step.reason}",
            )
            return outcome
        # Bounded fan-out: each chunk is at most the summarizer's window, whatever the size of the history.
        semaphore = asyncio.Semaphore(SUMMARIZE_CONCURRENCY)

        async def summarize(index: int) -> None:
            async with semaphore:
                await workflow.execute_activity_method(
                    CompactionActivityCalls.summarize,
                    SummarizeInput(
                        session_id=inp.session_id, epoch=inp.epoch, checkpoint_id=inp.checkpoint_id, chunk_index=index
                    ),
                    start_to_close_timeout=timedelta(seconds=t.model_seconds),
                    heartbeat_timeout=timedelta(seconds=t.model_heartbeat_seconds),
                    # A summarizer call is a model call: its attempts are a model call's (each may cost a provider
                    # request, and one that hangs holds the session for each of them), not the database's 40.
                    retry_policy=MODEL_RETRY if workflow.patched("summarize-model-retry") else RETRY,
                    summary=f"summarize chunk {index + 1}/{step.chunks}",
                )

        await asyncio.gather(*(summarize(i) for i in range(step.chunks)))
        done: CompactionOutcome = await workflow.execute_activity_method(
            CompactionActivityCalls.commit,
            inp,
            start_to_close_timeout=timedelta(seconds=t.build_seconds),
            heartbeat_timeout=timedelta(seconds=t.heartbeat_seconds),
            retry_policy=RETRY,
            summary=f"commit {inp.checkpoint_id} (depth {step.depth})",
        )
        return done
