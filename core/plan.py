"""What build() returns: the ordered segments, the figures, the yields and the status (ADR-0020 decision 10)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar, dataclass_transform

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from core.items import BudgetClass, Region, Role, TrustLevel

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def _value(cls: type[T]) -> type[T]:
    """A slotted dataclass the type checker holds frozen (`make lint` refuses an assignment to a field), built at
    a plain dataclass's cost (a frozen one sets each field through `object.__setattr__`: several times it)."""
    return dataclass(slots=True, unsafe_hash=True)(cls)


@_value
class Segment:
    """One rendered item in its assembly position. Never changed once made (`_value`): memos, plans and request
    bodies share each one by identity.

    A plain value, not a pydantic model: a worker that has not seen a session makes one for each of its logged
    items, and a model costs several times the construction and three objects for the garbage collector instead
    of one. Pydantic validates and serialises it as a field of the models that hold it (`ContextPlan`,
    `FrozenPrefix`); `SEGMENT` does it for one alone."""

    item_id: str
    kind: str
    region: Region
    budget_class: BudgetClass
    role: Role
    trust: TrustLevel
    text: str
    raw_tokens: int
    call_id: str | None = None
    taints: bool = False  # a model that reads it may derive untrusted content from it (docs/trust.md)


SEGMENT: TypeAdapter[Segment] = TypeAdapter(Segment)  # one segment from or to its JSON form


class YieldStep(StrEnum):
    RECALL_DROPPED = "recall_dropped"
    TOOL_RESULTS_TO_POINTERS = "tool_results_to_pointers"
    # Only once older history has nothing left to give (docs/assembly-and-budget.md, "Inside the active turn").
    ACTIVE_TOOL_RESULTS_TO_POINTERS = "active_tool_results_to_pointers"
    CHECKPOINT_POINTERS_DROPPED = "checkpoint_pointers_dropped"


class YieldApplied(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: YieldStep
    reason: str  # "cap" (the class was over its own cap) or "pressure" (the request was over the window)
    item_ids: list[str]
    tokens_freed: int


class PlanStatus(StrEnum):
    FITS = "fits"
    NEEDS_COMPACTION = "needs_compaction"


class PlanSummary(BaseModel):
    """The small, history-safe view of a plan: what workflows, the UI and `inspect` carry."""

    model_config = ConfigDict(frozen=True)

    epoch: int
    prefix_sha256: str
    request_sha256: str
    status: PlanStatus
    deficit_tokens: int
    estimated_tokens: int
    raw_tokens: int
    input_limit: int
    prefix_tokens: int
    body_tokens: int
    # The safety margin set aside beside the prefix (core/estimator.py, rules 2): estimated = prefix + margin + body.
    prefix_margin_tokens: int = 0
    tokens_by_class: dict[str, int]
    yields: list[YieldApplied] = Field(default_factory=list)
    segments: int
    pointers: int
    # Untrusted content (or text derived from it) was in view: what the model writes in reply is tainted.
    untrusted_in_view: bool = False


class ContextPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    epoch: int
    prefix_sha256: str
    request_sha256: str
    segments: list[Segment]
    prefix_text: str
    status: PlanStatus
    deficit_tokens: int
    estimated_tokens: int
    raw_tokens: int
    input_limit: int
    prefix_tokens: int
    body_tokens: int
    prefix_margin_tokens: int
    tokens_by_class: dict[str, int]
    yields: list[YieldApplied]
    untrusted_in_view: bool = False
    pointers: int = 0  # segments that are typed pointers (elided spans), counted by the builder as it goes

    @property
    def body_text(self) -> str:
        """Joined on demand: the activity stores segments, so a build need not join the body."""
        return "".join(s.text for s in self.segments if s.region is Region.B)

    @property
    def text(self) -> str:
        return self.prefix_text + self.body_text

    def summary(self) -> PlanSummary:
        return PlanSummary(
            epoch=self.epoch,
            prefix_sha256=self.prefix_sha256,
            request_sha256=self.request_sha256,
            status=self.status,
            deficit_tokens=self.deficit_tokens,
            estimated_tokens=self.estimated_tokens,
            raw_tokens=self.raw_tokens,
            input_limit=self.input_limit,
            prefix_tokens=self.prefix_tokens,
            body_tokens=self.body_tokens,
            prefix_margin_tokens=self.prefix_margin_tokens,
            tokens_by_class=self.tokens_by_class,
            yields=self.yields,
            segments=len(self.segments),
            pointers=self.pointers,
            untrusted_in_view=self.untrusted_in_view,
        )
