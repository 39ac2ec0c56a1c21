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


class TurnTooLargeError(NonYieldableOverflowError):
    """Even the minimum body (current message, working state, corrections, turn context, active pairs as
    pointers) does not fit beside the prefix: this turn fails alone, nothing of it is logged, and the session
    takes the next turn (docs/assembly-and-budget.md, "A turn that cannot fit")."""

    def __init__(self, classes: dict[str, int], available: int, *, prefix_tokens: int, input_limit: int) -> None:
        super().__init__(classes, available)
        self.message_tokens = classes.get("current_message", 0)
        self.prefix_tokens = prefix_tokens
        self.input_limit = input_limit
        self.minimum_body_tokens = sum(classes.values())
        self.budget_class = max(sorted(classes), key=lambda name: classes[name]) if classes else "current_message"
        Exception.__init__(
            self,
            f"turn too large: its minimum body needs {self.minimum_body_tokens:,} tokens (largest class "
            f"{self.budget_class!r}; message {self.message_tokens:,}) beside a {prefix_tokens:,}-token prefix, over "
            f"the {input_limit:,}-token input limit; the session takes the next turn",
        )

    def details(self) -> dict[str, object]:
        """The sizes, for a caller to check: message + rest of the minimum body + prefix > input limit."""
        return {
            "class": self.budget_class,
            "message_tokens": self.message_tokens,
            "minimum_body_tokens": self.minimum_body_tokens,
            "prefix_tokens": self.prefix_tokens,
            "input_limit": self.input_limit,
            "classes": dict(self.classes),
        }


class RouteDoesNotFitError(ContextError):
    """A route under which the minimum body does not fit beside the prefix: at open the session fails (no turn
    could ever be answered), at a rotation the rotation is refused and the old epoch stays."""

    def __init__(
        self, route: str, prefix_tokens: int, minimum_body_tokens: int, input_limit: int, *, at_open: bool = False
    ) -> None:
        self.route = route
        self.prefix_tokens = prefix_tokens
        self.minimum_body_tokens = minimum_body_tokens
        self.input_limit = input_limit
        self.error_type = "RouteDoesNotFit" if at_open else "RotationRefused"
        sizes = (
            f"its prefix estimate ({prefix_tokens:,} tokens) and the minimum body ({minimum_body_tokens:,}) exceed "
            f"its {input_limit:,}-token input limit"
        )
        super().__init__(
            f"session cannot open on {route}: {sizes}, so no turn could be answered; open it on a route with a "
            "larger window, or with a smaller prefix"
            if at_open
            else f"rotation to {route} refused: {sizes}; the old epoch stays"
        )

    def details(self) -> dict[str, object]:
        return {
            "route": self.route,
            "prefix_tokens": self.prefix_tokens,
            "minimum_body_tokens": self.minimum_body_tokens,
            "input_limit": self.input_limit,
        }
