"""The tool activity: run one authorised call (or record its denial) and log its result as the pair's second
half. The control tool's working-state writes are applied here, measured as the build will count them.

Tool executors live in activities/tools.py. `ToolCallActivities.write_tainted` decides a control-tool write's
taint; the harness's taint fault overrides it (harness/faults.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jsonschema
import structlog
from temporalio import activity

from activities.failures import store_waiting
from activities.minimum_body import working_state_cap
from activities.session_state import SessionState, working_state
from activities.tools import EXECUTORS, Executor, ToolOutput
from contract import names
from contract.activity_interfaces import ToolCalls
from contract.events import EventType
from contract.payloads import SessionOpen, ToolInput, ToolResultSummary
from core.build import measure_working_state
from core.errors import ContextError, ToolTrustCeilingError
from core.estimator import TokenEstimator
from core.items import HistoryItem, ToolResult, TrustLevel
from core.policy import failure_trust, result_trust
from core.rendering import escape_content
from core.working_state import (
    CONTROL_TOOL_NAME,
    WorkingStateUpdate,
    WorkingStateWrite,
    apply,
    render,
    write_problem,
)

log = structlog.get_logger("ctxengine.activities")
# Untrusted results longer than this (characters) also go to an artifact, so a pointer can always resolve to
# the original bytes. 0: every untrusted result does.
ARTIFACT_THRESHOLD = 0
# What a tool run comes to: the result's content, its trust level, whether it is an error, its artifact.
_Outcome = tuple[str, TrustLevel, bool, str | None]


class UnloggedRuns:
    """What a worker's tool runs returned, kept until their results are logged: a retry of the activity on the same
    worker (its attempt ran out of time waiting for PostgreSQL to come back) logs that instead of running the tool
    again. Keyed by session and call item id (item ids are a session's own); at most `kept` runs, each for at most
    `ttl_s` (a run whose turn failed is never logged: its call is sealed)."""

    def __init__(self, kept: int = 1_024, ttl_s: float = 3_600.0) -> None:
        self.kept, self.ttl_s = kept, ttl_s
        self._runs: OrderedDict[tuple[str, str], tuple[float, ToolOutput | _Outcome]] = OrderedDict()

    def get(self, key: tuple[str, str]) -> ToolOutput | _Outcome | None:
        kept = self._runs.get(key)
        return None if kept is None or time.monotonic() - kept[0] > self.ttl_s else kept[1]

    def keep(self, key: tuple[str, str], ran: ToolOutput | _Outcome) -> None:
        now = time.monotonic()
        self._runs.pop(key, None)  # kept again: at the end, with the others in the order they were kept
        self._runs[key] = (now, ran)
        while self._runs and (len(self._runs) > self.kept or now - next(iter(self._runs.values()))[0] > self.ttl_s):
            self._runs.popitem(last=False)

    def drop(self, key: tuple[str, str]) -> None:
        self._runs.pop(key, None)

    def __len__(self) -> int:
        return len(self._runs)


class ToolCallActivities(ToolCalls):
    def __init__(self, state: SessionState, executors: Mapping[str, Executor] | None = None) -> None:
        self.state = state
        self.executors = EXECUTORS if executors is None else executors
        self.unlogged = UnloggedRuns()

    def write_tainted(self, call_tainted: bool, items: list[HistoryItem], turn: int) -> bool:
        """Whether a control-tool write is tainted: its call was, or untrusted content entered the turn's log
        before it (a write in the same reply as the fetch counts)."""
        in_turn = f"t{turn}."
        return call_tainted or any(i.taints_view() for i in items if i.id.startswith(in_turn))

    @activity.defn(name=names.ACTIVITY_TOOL)
    async def execute_tool(self, inp: ToolInput) -> ToolResultSummary:
        """Run one authorised call (or record its denial) and append the result as the pair's second half.

        Everything the run needs from the store is read before the tool runs; after it, every write waits out a
        database outage within the attempt (`store_waiting`), and a retry on this worker takes what a run whose
        result was not logged returned instead of running the tool again (`UnloggedRuns`): a database blink never
        runs a tool twice (docs/reliability.md)."""
        state = self.state
        open_, _, cache = await state.session(inp.session_id)
        result_id = f"{inp.call.item_id}.result"
        await state.items(inp.session_id, cache)
        done = cache.item(result_id)
        ws_text: str | None = None
        if isinstance(done, ToolResult):
            self.unlogged.drop((inp.session_id, inp.call.item_id))
            return _summary(done, state.counter("cl100k_base").count(done.content), None)
        call_item = cache.item(inp.call.item_id)
        # A result inherits its call's taint: a tool can store and return text the model chose (notes.save).
        tainted = call_item.tainted if call_item is not None else True
        # The turn's items so far (what a control-tool write's taint depends on), not the whole log.
        content, trust, is_error, artifact = await self._run_tool(inp, open_, cache.this_turn(), tainted=tainted)
        if inp.call.name == CONTROL_TOOL_NAME and not is_error:
            writes = await store_waiting(lambda: state.store.working_state_writes(inp.session_id))
            ws_text = render(working_state(writes, state.counter("cl100k_base").count, inp.turn + 1))
        entry = {
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
        await store_waiting(lambda: state.append(inp.session_id, inp.turn, [entry], cache))
        self.unlogged.drop((inp.session_id, inp.call.item_id))
        stored = cache.item(result_id) or next(
            i for i in await store_waiting(lambda: state.items(inp.session_id, cache)) if i.id == result_id
        )
        assert isinstance(stored, ToolResult)
        return _summary(stored, state.counter("cl100k_base").count(stored.content), ws_text)

    async def _run_tool(
        self, inp: ToolInput, open_: SessionOpen, items: list[HistoryItem], *, tainted: bool
    ) -> _Outcome:
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
        limit = await self._result_limit(inp, open_)  # read before the tool runs: after it, only writes
        run = (inp.session_id, inp.call.item_id)
        ran = self.unlogged.get(run)
        if ran is None:
            try:
                ran = await executor(inp.call.arguments)
            except Exception as exc:
                log.warning(
                    "tool.failed", session_id=inp.session_id, turn=inp.turn, tool=inp.call.name, error=repr(exc)
                )
                message = f"error: tool {inp.call.name!r} failed: {type(exc).__name__}: {exc}"
                ran = (message, failure_trust(TrustLevel(spec.max_trust)), True, None)
            self.unlogged.keep(run, ran)
        if isinstance(ran, tuple):
            return ran
        out = ran
        try:
            trust = result_trust(inp.call.name, claimed=out.trust, ceiling=TrustLevel(spec.max_trust))
        except ToolTrustCeilingError as exc:
            refused = {"tool": exc.tool, "claimed": exc.claimed, "ceiling": exc.ceiling, "call": inp.call.item_id}
            await store_waiting(
                lambda: self.state.event(
                    inp.session_id,
                    f"trust_refused:{inp.call.item_id}",
                    EventType.TOOL_TRUST_REFUSED,
                    inp.turn,
                    inp.epoch,
                    refused,
                )
            )
            return f"error: {exc}", TrustLevel.TOOL, True, None
        content, artifact = out.content, None
        count = self.state.counter("cl100k_base").count
        # Measured as rendered: escaping (markup above all) can double a page's token count.
        rendered_tokens = count(escape_content(content))
        if rendered_tokens > limit or (trust is TrustLevel.EXTERNAL_UNTRUSTED and len(content) > ARTIFACT_THRESHOLD):
            whole = content
            artifact = "artifact:" + await store_waiting(
                lambda: self.state.store.put_artifact(inp.session_id, whole, trust=trust.value)
            )
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
        _, _, cache = await self.state.session(inp.session_id)
        prefix, profile = await self.state.prefix(inp.session_id, inp.epoch, cache)
        budget = open_.context_budget(profile)
        # The route's calibration as the build reads it (learned since the epoch opened: a refusal lifts it).
        estimator = TokenEstimator(await self.state.profile(profile), self.state.counter(profile.encoding))
        body = budget.input_limit - estimator.prefix_reserve(prefix.raw_tokens, prefix.tool_count)
        return max(64, budget.tool_results_cap(body))

    async def _update_working_state(self, inp: ToolInput, *, tainted: bool) -> _Outcome:
        """The control tool's write: applied all or nothing, refused (as the tool's error result) over a cap."""
        state, store = self.state, self.state.store
        try:
            update = WorkingStateUpdate.model_validate(inp.call.arguments)
        except ValueError as exc:
            return f"error: invalid working state update: {exc}", TrustLevel.TOOL, True, None
        if await store.has_working_state_write(inp.session_id, inp.call.item_id):
            return "working state updated", TrustLevel.TOOL, False, None  # a retry after the write
        problem = write_problem(update)
        if problem is not None:
            return f"error: invalid working state update: {problem}", TrustLevel.TOOL, True, None
        open_, secret, cache = await state.session(inp.session_id)
        prefix, profile = await state.prefix(inp.session_id, inp.epoch, cache)
        estimator = TokenEstimator(await state.profile(profile), state.counter(profile.encoding))
        budget = open_.context_budget(profile)
        cap = await working_state_cap(state, inp.session_id, open_.memory_scope, prefix, estimator, budget, secret)
        writes = await store.working_state_writes(inp.session_id)
        ws = working_state(writes, estimator.counter.count, inp.turn + 1)
        untrusted = tainted  # the call was written with untrusted content in view: so is every entry it adds
        try:
            # Measured as build() will count the block, so an accepted write always fits its cap.
            apply(
                ws,
                update,
                writer="model",
                count=lambda text: measure_working_state(text, estimator=estimator, secret=secret),
                untrusted_in_context=untrusted,
                token_cap=cap,
            )
        except ContextError as exc:
            await state.event(
                inp.session_id,
                f"ws_rejected:{inp.call.item_id}",
                EventType.WORKING_STATE_REJECTED,
                inp.turn,
                inp.epoch,
                {"error": str(exc)},
            )
            return f"error: {exc}", TrustLevel.TOOL, True, None
        write = WorkingStateWrite(turn=inp.turn, writer="model", untrusted_in_context=untrusted, update=update)
        await store.add_working_state_write(inp.session_id, inp.call.item_id, inp.turn, write.model_dump(mode="json"))
        return "working state updated", TrustLevel.TOOL, False, None

    def all(self) -> list[Any]:
        return [self.execute_tool]


def _summary(item: ToolResult, tokens: int, ws_text: str | None) -> ToolResultSummary:
    flat = " ".join(item.content.split())
    return ToolResultSummary(
        item_id=item.id,
        is_error=item.is_error,
        trust=item.trust.value,
        tokens=tokens,
        summary=flat[:120],
        working_state=ws_text,
        tainted=item.tainted,
    )
