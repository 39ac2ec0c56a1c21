"""How one item reads in any rendered context: a request, a summarizer's input, a replay.

Platform text renders as is; every other trust level renders inside a nonced, attributed envelope
(docs/rendering-contract.md), with ``provenance="untrusted"`` when it was written while untrusted content was in
view (docs/trust.md). One function, used by the builder and by compaction, so the two never drift apart.
"""

from __future__ import annotations

from core.items import (
    CorrectionLine,
    ElidedSpan,
    Item,
    MemorySnapshotEntry,
    RecallItem,
    ToolCall,
    ToolDefinition,
    ToolResult,
    TrustLevel,
)
from core.rendering import UNTRUSTED_PROVENANCE, derive_nonce, render_envelope

__all__ = ["UNTRUSTED_PROVENANCE", "render_item", "render_text_as", "source_of"]


def source_of(item: Item) -> str:
    """The attribution an envelope carries."""
    if isinstance(item, ToolResult | ToolCall):
        return f"{item.kind}:{item.tool_name}"
    if isinstance(item, ElidedSpan) and item.tool_name:
        return f"{item.kind}:{item.tool_name}"
    if isinstance(item, ToolDefinition):
        return f"tool_definition:{item.name}"
    if isinstance(item, MemorySnapshotEntry | RecallItem | CorrectionLine):
        return f"{item.kind}:{item.memory_id}"
    return item.kind


def render_item(item: Item, secret: bytes) -> str:
    """Platform text renders as is; every other trust level inside a nonced, attributed envelope."""
    return render_text_as(item, item.body_text(), item.id, secret)


def render_text_as(item: Item, text: str, item_id: str, secret: bytes) -> str:
    """Render `text` with `item`'s attribution, trust and provenance under `item_id` (a part of a cut item)."""
    if item.trust is TrustLevel.PLATFORM:
        return text + "\n"
    return render_envelope(
        text,
        nonce=derive_nonce(secret, item_id),
        source=source_of(item),
        trust=item.trust.value,
        item_id=item_id,
        provenance=UNTRUSTED_PROVENANCE if item.tainted else None,
    )
