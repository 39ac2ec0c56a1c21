"""ContextBudget: absolute caps for every class but history (ADR-0020 decisions 6 and 7).

Only history scales with the window. The output reserve is subtracted first and never allocated.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.items import BudgetClass


class ContextBudget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    context_window: int = Field(default=200_000, gt=0)
    output_reserve: int = Field(default=8_192, ge=0)
    platform_policy_tokens: int = Field(default=2_000, gt=0)
    agent_instructions_tokens: int = Field(default=4_000, gt=0)
    tools_max_count: int = Field(default=30, ge=0)
    tools_tokens: int = Field(default=6_000, ge=0)
    memory_snapshot_max_items: int = Field(default=40, ge=0)
    memory_snapshot_tokens: int = Field(default=1_500, ge=0)
    working_state_tokens: int = Field(default=1_000, gt=0)
    retrieved_context_tokens: int = Field(default=2_000, ge=0)
    tool_results_share: float = Field(default=0.25, gt=0, le=1)

    @model_validator(mode="after")
    def _reserve_fits(self) -> ContextBudget:
        if self.output_reserve >= self.context_window:
            raise ValueError(
                f"output_reserve ({self.output_reserve:,}) must be smaller than context_window "
                f"({self.context_window:,})"
            )
        return self

    @property
    def input_limit(self) -> int:
        """Tokens a request may carry: the window less the output reserve, taken first."""
        return self.context_window - self.output_reserve

    def prefix_caps(self) -> dict[BudgetClass, int]:
        return {
            BudgetClass.PLATFORM_POLICY: self.platform_policy_tokens,
            BudgetClass.AGENT_INSTRUCTIONS: self.agent_instructions_tokens,
            BudgetClass.TOOLS: self.tools_tokens,
            BudgetClass.MEMORY_SNAPSHOT: self.memory_snapshot_tokens,
        }

    def prefix_ceiling(self) -> int:
        return sum(self.prefix_caps().values())

    def tool_results_cap(self, body_tokens: int) -> int:
        """Tool results may take at most this share of the body."""
        return int(body_tokens * self.tool_results_share)
