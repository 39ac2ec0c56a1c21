"""Faults the gates must catch, registered by the harness as subclasses of the production activities.

Production workers never import this module, and no production code reads a switch for them: a negative
test (or `ctxengine gate ... --inject-...`) passes one of these classes to `running_worker(activities_class=)`.
Each is a `SessionActivities` whose slot for one activity family (or for the state the families share) holds
a faulty subclass of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.assembly import RequestInputs
from activities.build import BuildActivities
from activities.lifecycle import LifecycleActivities
from activities.model_call import ModelCallActivities
from activities.rows import ItemRender, RequestRecord, TurnReads
from activities.session import SessionActivities
from activities.session_state import SessionCache, SessionState
from activities.tool_calls import ToolCallActivities
from contract import names
from contract.payloads import BuildInput, CloseInput, ModelInput, SessionOpen
from core.build import BodyInputs, FrozenPrefix, PrefixInputs, open_prefix
from core.estimator import ModelProfile, TokenEstimator
from core.items import HistoryItem, TrustLevel
from core.plan import ContextPlan, PlanStatus


class TimestampedPrefixBuild(BuildActivities):
    """Builds every request over a prefix re-rendered with the clock in its platform policy."""

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
        row = await self.state.store.get_prefix(inp.session_id, inp.epoch)
        assert row is not None
        inputs = PrefixInputs.model_validate(row.inputs)
        stamped = inputs.model_copy(update={"platform_policy": f"{inputs.platform_policy}\nRendered at {inp.now_iso}."})
        budget = open_.context_budget(estimator.profile)
        prefix = open_prefix(stamped, budget=budget, estimator=estimator, secret=secret)
        return await super()._plan(
            inp, open_, secret, cache, prefix, estimator, user_item_id, reads=reads, message=message
        )


class PrefixTimestampFault(SessionActivities):
    """The bug ADR-0020 warns of: the clock appended to the platform policy when a request is built, so every
    request's prefix differs. The stability gate and the cache-break explainer must catch it (naming
    `platform.1.policy`)."""

    build_family: ClassVar[type[BuildActivities]] = TimestampedPrefixBuild


class UntaintedReplies(ModelCallActivities):
    def reply_tainted(self, plan: dict[str, Any]) -> bool:
        return False


class UntaintedWrites(ToolCallActivities):
    def write_tainted(self, call_tainted: bool, items: list[HistoryItem], turn: int) -> bool:
        return False


class TaintOff(SessionActivities):
    """Taint propagation switched off: replies and control-tool writes are never tainted. The trust gates must
    fail with it."""

    model_call_family: ClassVar[type[ModelCallActivities]] = UntaintedReplies
    tool_call_family: ClassVar[type[ToolCallActivities]] = UntaintedWrites


class OverBudgetChildBuild(BuildActivities):
    """In a child run, every plan says the body needs compaction (as a child body that cannot fit would)."""

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
        plan, ri, body = await super()._plan(
            inp, open_, secret, cache, prefix, estimator, user_item_id, reads=reads, message=message
        )
        if activity.info().workflow_type == names.WORKFLOW_CHILD_RUN and self._over_budget(inp):
            plan = plan.model_copy(update={"status": PlanStatus.NEEDS_COMPACTION, "deficit_tokens": 1})
        return plan, ri, body

    def _over_budget(self, inp: BuildInput) -> bool:
        """Whether this child-run build is made to need compaction: every one."""
        return True


class OverBudgetAfterAChildCall(OverBudgetChildBuild):
    """In a child run, every plan after the run's first says the body needs compaction: the child sends one request
    (its tool calls run), then fails the turn (a child body that stops fitting once results arrive)."""

    first_call: ClassVar[dict[str, int]] = {}  # child run id -> the call index of its first build (one worker)

    def _over_budget(self, inp: BuildInput) -> bool:
        first = self.first_call.setdefault(activity.info().workflow_id or "", inp.call_index)
        return inp.call_index > first


class ChildRunsFailAfterACall(SessionActivities):
    """A child run sends a request, then fails the turn: the session must still count what it sent."""

    build_family: ClassVar[type[BuildActivities]] = OverBudgetAfterAChildCall


class FailingChildRuns(SessionActivities):
    """A child run's body never fits: the child compacts over its fresh body, finds nothing to compact and fails
    the turn. What the session does next must not depend on what the failed child did (its compactions' ids)."""

    build_family: ClassVar[type[BuildActivities]] = OverBudgetChildBuild


class UserTrustRenders(SessionState):
    """Stores every logged item's segment fields with USER trust: a tool's output recorded as the user's words."""

    def render_for_log(self, items: list[dict[str, Any]], cache: SessionCache) -> list[ItemRender]:
        renders = super().render_for_log(items, cache)
        return [dataclasses.replace(r, segment={**r.segment, "trust": TrustLevel.USER.value}) for r in renders]


class LaunderedStoredSegments(SessionActivities):
    """The segment fields stored with each logged item claim USER trust. The worker that builds a request sends
    what it built, so nothing on its wire changes; but a request body that refers to the items reads back
    laundered (what a worker that did not build the request would send, and what `inspect` shows). The
    determinism gate's stored-bodies check must catch it."""

    state_class: ClassVar[type[SessionState]] = UserTrustRenders


class CloseFailsOnce(LifecycleActivities):
    """Each session's first close activity fails, as one past its retries does while PostgreSQL is down."""

    failed: ClassVar[set[str]] = set()

    @activity.defn(name=names.ACTIVITY_CLOSE)
    async def close_session(self, inp: CloseInput) -> None:
        if inp.session_id not in self.failed:
            self.failed.add(inp.session_id)
            raise ApplicationError("the store is down (an injected fault)", type="StoreDown", non_retryable=True)
        await super().close_session(inp)


class FirstCloseFails(SessionActivities):
    """A close that fails must leave the session open, and closable again."""

    lifecycle_family: ClassVar[type[LifecycleActivities]] = CloseFailsOnce


class RefusalsForgotten(ModelCallActivities):
    async def _learn_refusal(
        self, inp: ModelInput, record: RequestRecord, profile: ModelProfile, exc: ApplicationError
    ) -> None:
        return None


class RefusalNotLearned(SessionActivities):
    """A provider's refusal of a request as too long is not learned: the turn's next build of the request is the same
    request, refused again, and the turn fails `ContextLengthExceeded` (tests/gates/test_wire_observers.py)."""

    model_call_family: ClassVar[type[ModelCallActivities]] = RefusalsForgotten
