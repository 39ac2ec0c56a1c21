"""Conversation item types. Region membership is a property of the type, declared here (ADR-0020 decision 1).

The rule: anything that can differ between two requests of one session is Region B. A subclass of `Item`
that does not declare `region` and `budget_class` fails at class creation, which is import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from core.canonical import canonical_json
from core.errors import UndeclaredRegionError


class TrustLevel(StrEnum):
    """Who vouches for a piece of text. Only PLATFORM text renders outside an envelope.

    MEMORY is what memories render at (snapshot, recall, corrections): remembered data, never a request,
    whatever trust the memory was written at (docs/trust.md).
    """

    PLATFORM = "PLATFORM"
    OPERATOR = "OPERATOR"
    USER = "USER"
    MODEL = "MODEL"
    TOOL = "TOOL"
    MEMORY = "MEMORY"
    EXTERNAL_UNTRUSTED = "EXTERNAL_UNTRUSTED"


TRUST_ORDER: tuple[TrustLevel, ...] = tuple(TrustLevel)
"""The trust levels, highest first: who vouches more for a text comes earlier (PLATFORM ... EXTERNAL_UNTRUSTED)."""


def lowest_trust(levels: Iterable[TrustLevel]) -> TrustLevel:
    """The lowest of `levels` by `TRUST_ORDER` (a pointer to a run of items carries it)."""
    return max(levels, key=TRUST_ORDER.index)


class Region(StrEnum):
    A = "A"  # frozen prefix: pinned at session open, byte-stable for the epoch
    B = "B"  # turn body: everything that can differ between two requests


class BudgetClass(StrEnum):
    PLATFORM_POLICY = "platform_policy"
    AGENT_INSTRUCTIONS = "agent_instructions"
    TOOLS = "tools"
    MEMORY_SNAPSHOT = "memory_snapshot"
    HISTORY = "history"
    TOOL_RESULTS = "tool_results"
    RECALL = "recall"
    CORRECTIONS = "corrections"
    WORKING_STATE = "working_state"
    TURN_CONTEXT = "turn_context"
    CURRENT_MESSAGE = "current_message"


class Role(StrEnum):
    """The chat role an adapter gives a segment."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class Item(BaseModel):
    """Base of every item. `id` is stable for the item's life in the session log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    region: ClassVar[Region]
    budget_class: ClassVar[BudgetClass]
    role: ClassVar[Role]
    kind: str
    id: str = Field(min_length=1, max_length=200)
    trust: TrustLevel
    # Written while untrusted content was in view, so it may repeat or obey it (docs/trust.md). Rendered as
    # the envelope's provenance; compaction elides it instead of summarizing it.
    tainted: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith("_"):
            return
        missing = [name for name in ("region", "budget_class", "role") if name not in _declared(cls)]
        if missing:
            raise UndeclaredRegionError(
                f"item type {cls.__name__} must declare {', '.join(missing)} (ADR-0020 decision 1)"
            )

    def body_text(self) -> str:
        """The text that is rendered (escaped, enveloped) for this item."""
        raise NotImplementedError

    def taints_view(self) -> bool:
        """Whether a model that reads this item may derive untrusted content from it (docs/trust.md).

        `core.build.segments_of` applies this rule column by column to the types that do not override it: change
        both together (`tests/unit/test_session_memo.py` compares them)."""
        return self.tainted or self.trust is TrustLevel.EXTERNAL_UNTRUSTED


def _declared(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is Item:
            break
        names.update(vars(klass).keys())
    return names


# ---------------------------------------------------------------- Region A


class PlatformPolicy(Item):
    region = Region.A
    budget_class = BudgetClass.PLATFORM_POLICY
    role = Role.SYSTEM
    kind: Literal["platform_policy"] = "platform_policy"
    trust: TrustLevel = TrustLevel.PLATFORM
    text: str

    def body_text(self) -> str:
        return self.text


class AgentInstructions(Item):
    region = Region.A
    budget_class = BudgetClass.AGENT_INSTRUCTIONS
    role = Role.SYSTEM
    kind: Literal["agent_instructions"] = "agent_instructions"
    trust: TrustLevel = TrustLevel.OPERATOR
    text: str

    def body_text(self) -> str:
        return self.text


class ToolDefinition(Item):
    """A tool pinned at session open. Revocation never removes it (decision 4)."""

    region = Region.A
    budget_class = BudgetClass.TOOLS
    role = Role.SYSTEM
    kind: Literal["tool_definition"] = "tool_definition"
    trust: TrustLevel = TrustLevel.OPERATOR
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    def body_text(self) -> str:
        return canonical_json({"name": self.name, "description": self.description, "input_schema": self.input_schema})


class MemorySnapshotEntry(Item):
    """A memory frozen into the prefix at session open; mid-session writes never touch it."""

    region = Region.A
    budget_class = BudgetClass.MEMORY_SNAPSHOT
    role = Role.SYSTEM
    kind: Literal["memory_snapshot"] = "memory_snapshot"
    trust: TrustLevel = TrustLevel.MEMORY
    memory_id: str
    text: str

    def body_text(self) -> str:
        return self.text


# ---------------------------------------------------------------- Region B


class UserMessage(Item):
    """A user message of an earlier turn (history)."""

    region = Region.B
    budget_class = BudgetClass.HISTORY
    role = Role.USER
    kind: Literal["user_message"] = "user_message"
    trust: TrustLevel = TrustLevel.USER
    seq: int = Field(ge=0)
    text: str

    def body_text(self) -> str:
        return self.text


class AssistantMessage(Item):
    region = Region.B
    budget_class = BudgetClass.HISTORY
    role = Role.ASSISTANT
    kind: Literal["assistant_message"] = "assistant_message"
    trust: TrustLevel = TrustLevel.MODEL
    seq: int = Field(ge=0)
    text: str

    def body_text(self) -> str:
        return self.text


class ToolCall(Item):
    """Half of an atomic budget unit: never sent without its ToolResult (decision 9)."""

    region = Region.B
    budget_class = BudgetClass.HISTORY
    role = Role.ASSISTANT
    kind: Literal["tool_call"] = "tool_call"
    trust: TrustLevel = TrustLevel.MODEL
    seq: int = Field(ge=0)
    call_id: str
    tool_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    def body_text(self) -> str:
        return canonical_json({"call_id": self.call_id, "tool": self.tool_name, "arguments": self.arguments})


class ToolResult(Item):
    """The other half. External content is EXTERNAL_UNTRUSTED; large content lives in an artifact."""

    region = Region.B
    budget_class = BudgetClass.TOOL_RESULTS
    role = Role.TOOL
    kind: Literal["tool_result"] = "tool_result"
    trust: TrustLevel = TrustLevel.TOOL
    seq: int = Field(ge=0)
    call_id: str
    tool_name: str
    content: str
    is_error: bool = False
    artifact_ref: str | None = None

    def body_text(self) -> str:
        return self.content


class ElidedSpan(Item):
    """A typed pointer that stands for content not shown: trust level, size and where the original is.

    Used for tool results truncated under pressure (yield 2) and for untrusted spans that compaction
    elides instead of paraphrasing (decision 12). For a tool result it keeps `call_id`, so the pair stays whole.
    """

    region = Region.B
    budget_class = BudgetClass.TOOL_RESULTS
    role = Role.TOOL
    kind: Literal["elided_span"] = "elided_span"
    trust: TrustLevel
    seq: int = Field(ge=0)
    original_id: str
    original_tokens: int = Field(ge=0)
    reference: str
    call_id: str | None = None
    tool_name: str | None = None
    reason: Literal["tool_result_truncated", "compaction_elided"] = "tool_result_truncated"

    def body_text(self) -> str:
        derived = " derived from untrusted content" if self.tainted else ""
        return (
            f"[elided {self.reason}: {self.original_tokens} tokens of {self.trust.value} content{derived} "
            f"from item {self.original_id}; original at {self.reference}]"
        )

    def taints_view(self) -> bool:
        return False  # a pointer shows trust, size and a reference: none of the content


class CheckpointSummary(Item):
    """The summary a compaction wrote, standing for the history it covers (trusted content only)."""

    region = Region.B
    budget_class = BudgetClass.HISTORY
    role = Role.USER
    kind: Literal["checkpoint_summary"] = "checkpoint_summary"
    trust: TrustLevel = TrustLevel.MODEL
    seq: int = Field(ge=0)
    checkpoint_id: str
    depth: int = Field(ge=0)
    covers_to_seq: int = Field(ge=0)
    text: str

    def body_text(self) -> str:
        return self.text


class RecallItem(Item):
    """A memory retrieved for this turn (in-turn recall); the first thing to yield."""

    region = Region.B
    budget_class = BudgetClass.RECALL
    role = Role.USER
    kind: Literal["recall"] = "recall"
    trust: TrustLevel = TrustLevel.MEMORY
    memory_id: str
    rank: int = Field(ge=0)
    text: str

    def body_text(self) -> str:
        return self.text


class CorrectionLine(Item):
    """A correction of a snapshot memory, shown in the body so the prefix stays frozen. Never yields."""

    region = Region.B
    budget_class = BudgetClass.CORRECTIONS
    role = Role.USER
    kind: Literal["correction"] = "correction"
    trust: TrustLevel = TrustLevel.MEMORY
    memory_id: str
    text: str

    def body_text(self) -> str:
        return f"correction to memory {self.memory_id}: {self.text}"


class WorkingStateBlock(Item):
    """The rendered working state (decision 14). Never yields."""

    region = Region.B
    budget_class = BudgetClass.WORKING_STATE
    role = Role.USER
    kind: Literal["working_state"] = "working_state"
    trust: TrustLevel = TrustLevel.MODEL
    text: str
    # Some entry was written while untrusted content was in view: the entries say which, the block is not
    # rendered as tainted as a whole (the user's own constraints sit beside them), but it taints the view.
    holds_tainted: bool = False

    def body_text(self) -> str:
        return self.text

    def taints_view(self) -> bool:
        return self.holds_tainted or super().taints_view()


class TurnContext(Item):
    """Per-request runtime facts such as the current date and time: they differ between requests, so B."""

    region = Region.B
    budget_class = BudgetClass.TURN_CONTEXT
    role = Role.USER
    kind: Literal["turn_context"] = "turn_context"
    trust: TrustLevel = TrustLevel.PLATFORM
    text: str

    def body_text(self) -> str:
        return self.text


class CurrentUserMessage(Item):
    """The message this request answers: always last, never yields."""

    region = Region.B
    budget_class = BudgetClass.CURRENT_MESSAGE
    role = Role.USER
    kind: Literal["current_message"] = "current_message"
    trust: TrustLevel = TrustLevel.USER
    seq: int = Field(ge=0)
    text: str

    def body_text(self) -> str:
        return self.text


ITEM_TYPES: tuple[type[Item], ...] = (
    PlatformPolicy,
    AgentInstructions,
    ToolDefinition,
    MemorySnapshotEntry,
    CheckpointSummary,
    UserMessage,
    AssistantMessage,
    ToolCall,
    ToolResult,
    ElidedSpan,
    RecallItem,
    CorrectionLine,
    WorkingStateBlock,
    TurnContext,
    CurrentUserMessage,
)

REGION_A_TYPES = tuple(t for t in ITEM_TYPES if t.region is Region.A)
REGION_B_TYPES = tuple(t for t in ITEM_TYPES if t.region is Region.B)

HistoryItem = UserMessage | AssistantMessage | ToolCall | ToolResult | ElidedSpan | CheckpointSummary


def parse_history_item(data: dict[str, Any]) -> HistoryItem:
    """Rebuild a logged history item from its stored JSON (the `kind` field picks the type)."""
    return _HISTORY_ADAPTER.validate_python(data)


def parse_history_json(texts: Sequence[str]) -> list[HistoryItem]:
    """Logged history items from their stored JSON texts, in one pass (no dict made of each on the way)."""
    return _HISTORY_LIST_ADAPTER.validate_json("[" + ",".join(texts) + "]")


_HISTORY_TYPE = Annotated[
    UserMessage | AssistantMessage | ToolCall | ToolResult | ElidedSpan | CheckpointSummary,
    Field(discriminator="kind"),
]
_HISTORY_ADAPTER: TypeAdapter[HistoryItem] = TypeAdapter(_HISTORY_TYPE)
_HISTORY_LIST_ADAPTER: TypeAdapter[list[HistoryItem]] = TypeAdapter(list[_HISTORY_TYPE])
