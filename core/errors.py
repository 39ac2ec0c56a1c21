"""Domain errors. Each names what was wrong, so a user can fix it without reading code."""

from __future__ import annotations


class ContextError(Exception):
    """Base of every error the context engine raises on purpose."""


class PrefixOverflowError(ContextError):
    """A Region A class exceeds its ceiling: the session must not open (ADR-0020 decision 7)."""

    def __init__(self, budget_class: str, tokens: int, cap: int, *, unit: str = "tokens") -> None:
        self.budget_class = budget_class
        self.tokens = tokens
        self.cap = cap
        self.unit = unit
        super().__init__(
            f"prefix class {budget_class!r} is {tokens:,} {unit}, over its cap of {cap:,} {unit}; "
            "the prefix never yields, so the session cannot open"
        )


class NonYieldableOverflowError(ContextError):
    """Items that never yield (current message, working state, corrections, active pairs) alone overflow."""

    def __init__(self, classes: dict[str, int], available: int) -> None:
        self.classes = classes
        self.available = available
        named = ", ".join(f"{name}={tokens:,}" for name, tokens in sorted(classes.items()))
        super().__init__(
            f"non-yieldable content needs {sum(classes.values()):,} tokens but only {available:,} "
            f"are left after the prefix and output reserve ({named})"
        )


class OrphanedToolItemError(ContextError):
    """A tool call without its result, or a result without its call: a malformed request (decision 9)."""

    def __init__(self, item_ids: list[str]) -> None:
        self.item_ids = item_ids
        super().__init__(f"orphaned tool call/result items would be sent: {', '.join(item_ids)}")


class WorkingStateCapError(ContextError):
    """A working-state write past a cap; nothing was changed (decision 14)."""

    def __init__(self, field: str, size: int, cap: int, *, unit: str = "entries") -> None:
        self.field = field
        self.size = size
        self.cap = cap
        self.unit = unit
        super().__init__(
            f"working state {field!r} would hold {size:,} {unit}, over its cap of {cap:,}; "
            "the write was rejected and nothing changed"
        )


class WorkingStateError(ContextError):
    """A working-state operation that does not apply (unknown id, empty text)."""


class ToolTrustCeilingError(ContextError):
    """A tool executor claimed a trust level above its tool's declared ceiling (docs/trust.md)."""

    def __init__(self, tool: str, claimed: str, ceiling: str) -> None:
        self.tool = tool
        self.claimed = claimed
        self.ceiling = ceiling
        super().__init__(
            f"tool {tool!r} returned a result at trust {claimed}, above its ceiling {ceiling}; an executor may "
            "lower trust, never raise it (PLATFORM, OPERATOR, MODEL and MEMORY are never tool-result levels), "
            "so the result was refused"
        )


class OrderError(ContextError):
    """Items reached assembly out of the fixed total order."""


class UndeclaredRegionError(TypeError):
    """An item type that does not declare its region and budget class (decision 1)."""
