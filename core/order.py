"""The one fixed, total assembly order (ADR-0020 decision 2): platform policy first, current message last.

Region A sections come first, then Region B sections ordered from most to least stable, so the history
(append-only) extends the cached prefix and whatever changes every request sits just before the message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from core.errors import OrderError
from core.items import (
    AgentInstructions,
    AssistantMessage,
    CheckpointSummary,
    CorrectionLine,
    CurrentUserMessage,
    ElidedSpan,
    Item,
    MemorySnapshotEntry,
    PlatformPolicy,
    RecallItem,
    ToolCall,
    ToolDefinition,
    ToolResult,
    TurnContext,
    UserMessage,
    WorkingStateBlock,
)

# Section of each item type; history types share one section and are ordered by their log sequence.
SECTIONS: tuple[tuple[str, tuple[type[Item], ...]], ...] = (
    ("platform_policy", (PlatformPolicy,)),
    ("agent_instructions", (AgentInstructions,)),
    ("tools", (ToolDefinition,)),
    ("memory_snapshot", (MemorySnapshotEntry,)),
    ("history", (CheckpointSummary, UserMessage, AssistantMessage, ToolCall, ToolResult, ElidedSpan)),
    ("corrections", (CorrectionLine,)),
    ("recall", (RecallItem,)),
    ("working_state", (WorkingStateBlock,)),
    ("turn_context", (TurnContext,)),
    ("current_message", (CurrentUserMessage,)),
)

SECTION_RANK: dict[type[Item], int] = {t: rank for rank, (_, types) in enumerate(SECTIONS) for t in types}
# Within one log position a summary precedes messages, and a call precedes its result.
_TIE_RANK: dict[type[Item], int] = {t: i for _, types in SECTIONS for i, t in enumerate(types)}


def order_key(item: Item) -> tuple[int, int, str, int, str]:
    """Total order: section, then position inside it (log seq, tool name, recall rank), then type, then id."""
    kind = type(item)
    position = 0
    label = ""
    if isinstance(item, ToolDefinition):
        label = item.name
    elif isinstance(item, MemorySnapshotEntry):
        label = item.memory_id
    elif isinstance(item, RecallItem):
        position = item.rank
    elif isinstance(item, CheckpointSummary | UserMessage | AssistantMessage | ToolCall | ToolResult | ElidedSpan):
        position = item.seq
    return (SECTION_RANK[kind], position, label, _TIE_RANK[kind], item.id)


def assembly_order(items: Iterable[Item]) -> list[Item]:
    """Sort items into the fixed assembly order."""
    return sorted(items, key=order_key)


def check_order(items: Sequence[Item]) -> None:
    """Raise OrderError unless `items` is already in assembly order."""
    keys = [order_key(i) for i in items]
    for index in range(1, len(keys)):
        if keys[index - 1] >= keys[index]:
            raise OrderError(
                f"item {items[index].id!r} ({type(items[index]).__name__}) is out of assembly order "
                f"after {items[index - 1].id!r} ({type(items[index - 1]).__name__})"
            )
