"""Faults the gates must catch, registered by the harness as subclasses of the production activities.

Production workers never import this module, and no production code reads a switch for them: a negative
test (or `ctxengine gate ... --inject-...`) passes one of these classes to `running_worker(activities_class=)`.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from temporalio import activity

from activities.context import SessionActivities, _SessionCache
from contract import names
from contract.payloads import BuildInput, BuildResult
from core.build import FrozenPrefix, PrefixInputs, open_prefix
from core.estimator import ModelProfile, TokenEstimator

_clock: ContextVar[str | None] = ContextVar("fault_clock", default=None)


class PrefixTimestampFault(SessionActivities):
    """The bug ADR-0020 warns of: the clock appended to the platform policy, so every request's prefix
    differs. The stability gate and the cache-break explainer must catch it (naming `platform.1.policy`)."""

    @activity.defn(name=names.ACTIVITY_BUILD)
    async def build_context(self, inp: BuildInput) -> BuildResult:
        token = _clock.set(inp.now_iso)
        try:
            return await super().build_context(inp)
        finally:
            _clock.reset(token)

    async def _prefix(self, session_id: str, epoch: int, cache: _SessionCache) -> tuple[FrozenPrefix, ModelProfile]:
        prefix, profile = await super()._prefix(session_id, epoch, cache)
        clock = _clock.get()
        if clock is None:
            return prefix, profile
        row = await self.store.get_prefix(session_id, epoch)
        assert row is not None
        inputs = PrefixInputs.model_validate(row["inputs"])
        stamped = inputs.model_copy(update={"platform_policy": f"{inputs.platform_policy}\nRendered at {clock}."})
        open_, secret, _ = await self._session(session_id)
        estimator = TokenEstimator(profile, self.counter(profile.encoding))
        budget = open_.context_budget(profile)
        return open_prefix(stamped, budget=budget, estimator=estimator, secret=secret), profile


class TaintOff(SessionActivities):
    """Taint propagation switched off: replies are never tainted. The trust gates must fail with it."""

    def reply_tainted(self, plan: dict[str, Any]) -> bool:
        return False
