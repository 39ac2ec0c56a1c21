"""Decision 3: a second prefix hash comes with the segment and byte where the prefix changed."""

from __future__ import annotations

from core.budget import ContextBudget
from core.build import open_prefix
from core.explain import first_difference
from tests.unit import factories as f


class TestExplainer:
    def test_identical_prefixes_have_no_difference(self) -> None:
        """Two renders of the same inputs do not differ."""
        assert first_difference(f.prefix().segments, f.prefix().segments) is None

    def test_timestamp_in_policy_is_located(self) -> None:
        """A timestamp appended to the platform policy is named by segment, class and byte offset."""
        base = f.prefix()
        stamped = f.prefix(platform_policy="Platform policy: be safe and helpful. Rendered at 12:00.")
        diff = first_difference(base.segments, stamped.segments)
        assert diff is not None
        assert (diff.item_id, diff.budget_class, diff.segment_index) == ("platform.1.policy", "platform_policy", 0)
        assert diff.byte_offset == len("Platform policy: be safe and helpful.")
        assert "Rendered at" in diff.actual

    def test_changed_tool_is_located_after_earlier_segments(self) -> None:
        """A changed tool description is found in the tools class, past the bytes of earlier segments."""
        tools = f.tools()
        changed = [tools[0], tools[1].model_copy(update={"description": "changed"}), tools[2]]
        a = f.prefix()
        b = open_prefix(
            f.prefix_inputs(tools=changed), budget=ContextBudget(), estimator=f.estimator(), secret=f.SECRET
        )
        diff = first_difference(a.segments, b.segments)
        assert diff is not None and diff.budget_class == "tools" and diff.item_id == "tool.t01"
        assert diff.byte_offset > sum(len(s.text.encode()) for s in a.segments[: diff.segment_index])
