"""The model call: send the stored request through the provider port, log the reply (all or none of it), record
usage and the wire prefix, and reconcile the estimator. A retry after the reply was stored never asks the
model twice.

`ModelCallActivities.reply_tainted` decides a reply's taint; the harness's taint fault overrides it
(harness/faults.py).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import Any, TypeVar

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.failures import store_waiting
from activities.provider import ProviderRequest
from activities.rows import RequestRecord
from activities.session_state import SessionState, calibrated, provider_segment
from activities.wire import WirePrefix
from contract import names
from contract.activity_interfaces import ModelCalls
from contract.events import EventType
from contract.payloads import ModelInput, ModelResult, ToolCallRequest
from contract.retries import CONTEXT_LENGTH_EXCEEDED, CONTEXT_WINDOW_MISMATCH
from core.estimator import ModelProfile, calibration_target, reconcile
from core.explain import first_wire_difference
from core.items import AssistantMessage, HistoryItem, ToolCall, ToolResult, TrustLevel
from core.plan import SEGMENT

T = TypeVar("T")
log = structlog.get_logger("ctxengine.activities")


class ModelCallActivities(ModelCalls):
    def __init__(self, state: SessionState) -> None:
        self.state = state

    def reply_tainted(self, plan: dict[str, Any]) -> bool:
        """Whether a reply to the request planned as `plan` is tainted: untrusted content was in its view."""
        return bool(plan.get("untrusted_in_view", False))

    @activity.defn(name=names.ACTIVITY_MODEL)
    async def call_model(self, inp: ModelInput) -> ModelResult:
        """Send the stored request through the provider port, append the reply, record usage, reconcile.

        Every read and write of the store waits out a database outage within the attempt (`store_waiting`)."""
        state, store = self.state, self.state.store
        # One read: the session, the request's record, the log since this worker's memo, the calibrations.
        open_, cache, reads = await store_waiting(
            lambda: state.call_reads(
                inp.session_id,
                inp.turn,
                inp.call_index,
                inp.epoch,
                inp.request_sha256,
                first_attempt=activity.info().attempt == 1,
            )
        )
        state.ran(cache)
        record = reads.record
        if record is None or record.request_sha256 != inp.request_sha256:
            raise ApplicationError(
                f"no stored request {inp.request_sha256} for turn {inp.turn}",
                type="UnknownRequest",
                non_retryable=True,
            )
        prefix, epoch_profile = await store_waiting(lambda: state.prefix(inp.session_id, inp.epoch, cache))
        base = f"t{inp.turn}.m{inp.call_index}."
        logged = [i for i in cache.this_turn() if i.id.startswith(base)]
        if logged and record.actual_input_tokens is not None:
            # A retry after the reply was stored: never ask the model twice for one request.
            return _model_result(
                logged,
                record.actual_input_tokens,
                record.cached_tokens or 0,
                record.output_tokens or 0,
                record.estimated_tokens,
                overrun=None,
            )
        built = cache.built.get(inp.request_sha256)
        if built is not None:  # built on this worker: no need to read the request back
            segments = cache.provider_segments(built.segments)
        else:  # built on another worker: its body came with the read, the items it refers to are in the memo
            body = cache.resolved(inp.session_id, reads.request.body) if reads.request is not None else None
            if body is None:  # not read, or naming items the memo does not hold: read it whole
                stored = await store_waiting(lambda: store.get_request(inp.request_sha256))
                if stored is None:
                    raise ApplicationError(
                        f"no stored body for request {inp.request_sha256}", type="UnknownRequest", non_retryable=True
                    )
                body = [provider_segment(s) for s in stored.body]
            segments = [cache.provider_of(s) for s in prefix.segments] + body
        provider = state.providers.get(epoch_profile.provider)
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
            tools=[SEGMENT.dump_python(s, mode="json") for s in prefix.segments if s.kind == "tool_definition"],
            options=open_.route.provider_options,
            estimated_tokens=record.estimated_tokens,
            max_output_tokens=open_.context_budget(epoch_profile).output_reserve,
        )
        if activity.info().attempt > 1:  # an earlier attempt's refusal, stored before its worker died: not again
            refused = await store_waiting(lambda: store.event_payload(inp.session_id, refusal_key(inp)))
            if refused is not None:
                cache.refused(inp.request_sha256)
                raise ApplicationError(
                    "the provider refused this request as too long (an earlier attempt; its count is learned)",
                    refused,
                    type=CONTEXT_LENGTH_EXCEEDED,
                    non_retryable=True,
                )
        try:
            reply = await within_attempt(provider.complete(request))  # the interceptor heartbeats meanwhile
        except ApplicationError as exc:
            if exc.type == CONTEXT_LENGTH_EXCEEDED:
                window = open_.context_budget(epoch_profile).context_window
                mismatch = window_mismatch(exc, record.estimated_tokens, window, epoch_profile.route)
                if mismatch is not None:
                    raise mismatch from exc  # not an estimate too low: learning from it would inflate the route
                refusal, profile = exc, calibrated(epoch_profile, reads.calibration, reads.provider_calibration)
                await store_waiting(lambda: self._learn_refusal(inp, record, profile, refusal))
                cache.refused(inp.request_sha256)
            raise
        if (wire := reply.wire_prefix) is not None:
            await store_waiting(lambda: self._record_wire_prefix(inp, wire))
        # The outcome: usage (the first attempt's figures win), the estimator's reconciliation and its event.
        usage = reply.usage
        profile = calibrated(epoch_profile, reads.calibration, reads.provider_calibration)
        learned, rec = reconcile(
            profile,
            raw_tokens=record.raw_tokens,
            estimated_tokens=record.estimated_tokens,
            actual_tokens=usage.input_tokens,
        )
        event_key = f"reconciled:{inp.turn}:{inp.call_index}"
        payload = {
            **rec.model_dump(mode="json"),
            "cached_tokens": usage.cached_tokens,
            # the prefix's tokens the provider read from its cache (workflows.turn counts the same)
            "prefix_tokens_reused": min(record.plan["prefix_tokens"], usage.cached_tokens),
        }
        # Everything the model wrote in reply to a request with untrusted content in view may repeat or obey it.
        tainted = self.reply_tainted(record.plan)
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
        # One write: usage, reconciliation and its event, and the reply's items as one group (logged after the
        # request was built: its inputs name that position), all or none of them.
        renders = state.render_for_log(new_items, cache)
        outcome = await store_waiting(
            lambda: store.record_outcome(
                inp.session_id,
                inp.turn,
                inp.call_index,
                actual=usage.input_tokens,
                cached=usage.cached_tokens,
                output=usage.output_tokens,
                route=profile.route,
                target=calibration_target(rec.observed_ratio),
                first=learned.calibration,
                event_key=event_key,
                event_type=EventType.ESTIMATOR_RECONCILED.value,
                epoch=inp.epoch,
                payload=payload,
                append=new_items,
                group_prefix=base,
                group_after_seq=int(record.inputs.get("max_seq", -1)),
                renders=renders,
            )
        )
        cache.answered(inp.request_sha256)
        cache.calibrated(outcome.calibration, outcome.provider_calibration)
        if outcome.event_added:
            state.logged_event(inp.session_id, EventType.ESTIMATOR_RECONCILED, inp.turn, inp.epoch, payload)
        state.joined(new_items, outcome.seqs, renders, cache)
        logged = [i for i in cache.this_turn() if i.id.startswith(base)]
        if not logged:  # logged out of the memo's order (another attempt's reply): read the log
            log = await store_waiting(lambda: state.items(inp.session_id, cache))
            logged = [log[k] for k, item_id in enumerate(cache.items.ids) if item_id.startswith(base)]
        if not outcome.usage_recorded:  # an earlier attempt recorded its usage first: its figures are the truth
            first = await store_waiting(lambda: store.get_record(inp.session_id, inp.turn, inp.call_index))
            assert first is not None and first.actual_input_tokens is not None
            return _model_result(
                logged,
                first.actual_input_tokens,
                first.cached_tokens or 0,
                first.output_tokens or 0,
                first.estimated_tokens,
                overrun=None,
            )
        return _model_result(
            logged,
            usage.input_tokens,
            usage.cached_tokens,
            usage.output_tokens,
            record.estimated_tokens,
            overrun=rec.overrun,
        )

    async def _learn_refusal(
        self, inp: ModelInput, record: RequestRecord, profile: ModelProfile, exc: ApplicationError
    ) -> None:
        """The provider refused the request as too long: learn its count like a response's usage, upwards only, so
        that the turn's next build of the request (workflows/turn.py) and every later request on the route estimate
        at least that much. A refusal that gives no count teaches the estimate plus the safety margin, and one
        token: at least what the provider must have counted, for the request to be over its limit."""
        details = _refusal_details(exc)
        counted = details.get("provider_tokens")
        if not isinstance(counted, int):  # a count at or under the estimate is a window mismatch (window_mismatch)
            counted = math.ceil(record.estimated_tokens * (1.0 + profile.safety_margin)) + 1
        _, rec = reconcile(
            profile, raw_tokens=record.raw_tokens, estimated_tokens=record.estimated_tokens, actual_tokens=counted
        )
        lifted = max(profile.calibration, calibration_target(rec.observed_ratio))
        payload = {
            **rec.model_dump(mode="json"),
            "calibration_after": lifted,
            "provider_tokens": details.get("provider_tokens"),
            "provider_limit": details.get("provider_limit"),
            "request_sha256": inp.request_sha256,
        }
        added = await self.state.store.record_refusal(
            inp.session_id,
            route=profile.route,
            calibration=lifted,
            event_key=refusal_key(inp),
            event_type=EventType.ESTIMATOR_REFUSED.value,
            turn=inp.turn,
            epoch=inp.epoch,
            payload=payload,
        )
        if added:
            self.state.logged_event(inp.session_id, EventType.ESTIMATOR_REFUSED, inp.turn, inp.epoch, payload)

    async def _record_wire_prefix(self, inp: ModelInput, wire: WirePrefix) -> None:
        """Store the request's wire prefix hash; a second distinct one in the epoch is the prefix defect
        (`context.prefix.violation`), explained at the first differing byte of what was sent."""
        distinct = await self.state.store.record_wire_prefix(
            inp.session_id, inp.turn, inp.call_index, epoch=inp.epoch, sha256=wire.sha256, text=wire.text
        )
        if len(distinct) > 1 and wire.sha256 != distinct[0].sha256:
            diff = first_wire_difference(distinct[0].text, wire.text)
            await self.state.event(
                inp.session_id,
                f"violation:{inp.epoch}:wire:{wire.sha256}",
                EventType.PREFIX_VIOLATION,
                inp.turn,
                inp.epoch,
                {
                    "observer": "wire",
                    "expected": distinct[0].sha256,
                    "got": wire.sha256,
                    "distinct_in_epoch": len(distinct),
                    "first_difference": diff.model_dump() if diff else None,
                },
            )

    def all(self) -> list[Any]:
        return [self.call_model]


def refusal_key(inp: ModelInput) -> str:
    """The event key of this model call's refusal: one per call (a run's activity), so a rebuild that is the same
    request (the same hash), refused again by the next call, is its own event; an attempt of the same call finds it."""
    info = activity.info()
    return f"refused:{inp.turn}:{inp.call_index}:{info.workflow_run_id}:{info.activity_id}"


def _refusal_details(exc: ApplicationError) -> dict[str, Any]:
    return exc.details[0] if exc.details and isinstance(exc.details[0], dict) else {}


def window_mismatch(exc: ApplicationError, estimated: int, window: int, route: str) -> ApplicationError | None:
    """A refusal that says the route's window is wrong, not its estimate: the provider states a window smaller than
    the route's (`model_route.context_window` or `budget.context_window`), or counted no more than the estimate,
    which was within the route's input limit. Learning from it would lift the calibration for every session on the
    route, and a rebuild would be refused again: the turn fails `ContextWindowMismatch`, naming the fix."""
    details = _refusal_details(exc)
    limit, counted = details.get("provider_limit"), details.get("provider_tokens")
    if isinstance(limit, int) and limit < window:
        said = f"says {route}'s window is {limit:,} tokens"
    elif isinstance(counted, int) and counted <= estimated:
        said = f"counted {counted:,} tokens, no more than the {estimated:,} estimated within this route's input limit"
    else:
        return None
    return ApplicationError(
        f"the provider refused the request as too long and {said}: this route's context window ({window:,} "
        "tokens) is larger than the model's; set model_route.context_window (or budget.context_window) to the "
        "model's window",
        {**details, "context_window": window},
        type=CONTEXT_WINDOW_MISMATCH,
        non_retryable=True,
    )


async def within_attempt(work: Awaitable[T], *, spent_s: float = 0.0) -> T:
    """`work`, cut off just before this attempt's start-to-close timeout: a late reply must not be stored after
    Temporal has given up on the attempt (and the turn may have failed). A typed, retryable timeout. `spent_s`: how
    long the attempt ran before `work` began (its reads), which the timeout counts too."""
    limit = activity.info().start_to_close_timeout
    if limit is None:
        return await work
    try:
        return await asyncio.wait_for(work, timeout=max(0.1, limit.total_seconds() - spent_s - 0.25))
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
