"""Decision 1: region membership is a property of the item type, declared in code."""

from __future__ import annotations

import pytest

from core.errors import UndeclaredRegionError
from core.items import ITEM_TYPES, BudgetClass, Item, Region, TrustLevel, TurnContext

# Every type and the region the ADR's rule gives it. A new type must be added here, on purpose.
EXPECTED = {
    "PlatformPolicy": Region.A,
    "AgentInstructions": Region.A,
    "ToolDefinition": Region.A,
    "MemorySnapshotEntry": Region.A,
    "CheckpointSummary": Region.B,
    "UserMessage": Region.B,
    "AssistantMessage": Region.B,
    "ToolCall": Region.B,
    "ToolResult": Region.B,
    "ElidedSpan": Region.B,
    "RecallItem": Region.B,
    "CorrectionLine": Region.B,
    "WorkingStateBlock": Region.B,
    "TurnContext": Region.B,
    "CurrentUserMessage": Region.B,
}


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _all_subclasses(sub)
    return out


class TestRegions:
    def test_every_type_declares_the_expected_region(self) -> None:
        """Each item type sits in the region the membership rule gives it."""
        assert {t.__name__: t.region for t in ITEM_TYPES} == EXPECTED

    def test_registry_lists_every_subclass(self) -> None:
        """No item type exists outside the enumerated registry."""
        found = {t for t in _all_subclasses(Item) if t.__module__ == "core.items"}
        assert found == set(ITEM_TYPES)

    def test_every_type_declares_budget_class_and_role(self) -> None:
        """Budget class and role are declared for every type."""
        for t in ITEM_TYPES:
            assert isinstance(t.budget_class, BudgetClass)
            assert "role" in vars(t)

    def test_type_without_region_fails_at_creation(self) -> None:
        """Declaring an item type without a region is an error at class creation (import time)."""
        with pytest.raises(UndeclaredRegionError, match="region"):

            class Undeclared(Item):
                kind: str = "undeclared"

    def test_clock_is_region_b(self) -> None:
        """The current date and time can differ between two requests, so it is Region B."""
        assert TurnContext.region is Region.B

    def test_region_a_holds_only_prefix_classes(self) -> None:
        """Region A holds policy, instructions, tools and the snapshot, and nothing else."""
        a_classes = {t.budget_class for t in ITEM_TYPES if t.region is Region.A}
        assert a_classes == {
            BudgetClass.PLATFORM_POLICY,
            BudgetClass.AGENT_INSTRUCTIONS,
            BudgetClass.TOOLS,
            BudgetClass.MEMORY_SNAPSHOT,
        }

    def test_trust_levels(self) -> None:
        """The trust levels the envelopes act on exist."""
        assert {"PLATFORM", "OPERATOR", "USER", "TOOL", "EXTERNAL_UNTRUSTED"} <= {t.value for t in TrustLevel}
