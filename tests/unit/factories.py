"""Small builders for core tests: a session's prefix and body from a few numbers."""

from __future__ import annotations

from activities.tokens import TiktokenCounter
from core.budget import ContextBudget
from core.build import BodyInputs, FrozenPrefix, PrefixInputs, open_prefix
from core.estimator import ModelProfile, TokenEstimator
from core.items import (
    AssistantMessage,
    CurrentUserMessage,
    HistoryItem,
    MemorySnapshotEntry,
    ToolCall,
    ToolDefinition,
    ToolResult,
    TrustLevel,
    UserMessage,
)

SECRET = b"test-session-secret"
COUNTER = TiktokenCounter()


def estimator(profile: ModelProfile | None = None) -> TokenEstimator:
    return TokenEstimator(profile or ModelProfile(), COUNTER)


def tools(n: int = 3) -> list[ToolDefinition]:
    return [
        ToolDefinition(
            id=f"tool.t{i:02d}",
            name=f"t{i:02d}",
            description=f"tool number {i} does a thing",
            input_schema={"type": "object", "properties": {"q": {"type": "string"}}},
        )
        for i in range(n)
    ]


def prefix_inputs(**overrides: object) -> PrefixInputs:
    values: dict[str, object] = {
        "platform_policy": "Platform policy: be safe and helpful.",
        "agent_instructions": "You are a research agent. Cite sources.",
        "tools": tools(),
        "memory_snapshot": [
            MemorySnapshotEntry(id=f"mem.m{i}", memory_id=f"m{i}", text=f"user prefers style {i}") for i in range(3)
        ],
    }
    values.update(overrides)
    return PrefixInputs.model_validate(values)


def prefix(budget: ContextBudget | None = None, **overrides: object) -> FrozenPrefix:
    return open_prefix(
        prefix_inputs(**overrides), budget=budget or ContextBudget(), estimator=estimator(), secret=SECRET
    )


def history(turns: int, *, words: int = 40, tool_every: int = 2, untrusted_every: int = 5) -> list[HistoryItem]:
    """A log of `turns` turns: user, optional tool pair, assistant."""
    items: list[HistoryItem] = []
    seq = 0
    filler = " ".join(["lorem"] * words)
    for t in range(turns):
        items.append(UserMessage(id=f"u{t}", seq=seq, text=f"question {t}: {filler}"))
        seq += 1
        if tool_every and t % tool_every == 0:
            call_id = f"call{t}"
            items.append(ToolCall(id=f"c{t}", seq=seq, call_id=call_id, tool_name="t00", arguments={"q": str(t)}))
            seq += 1
            untrusted = bool(untrusted_every) and t % untrusted_every == 0
            items.append(
                ToolResult(
                    id=f"r{t}",
                    seq=seq,
                    call_id=call_id,
                    tool_name="t00",
                    content=f"result {t}: {filler} {filler}",
                    trust=TrustLevel.EXTERNAL_UNTRUSTED if untrusted else TrustLevel.TOOL,
                    artifact_ref=f"artifact:r{t}",
                )
            )
            seq += 1
        items.append(AssistantMessage(id=f"a{t}", seq=seq, text=f"answer {t}: {filler}"))
        seq += 1
    return items


def body(turns: int = 5, **kw: object) -> BodyInputs:
    h = history(turns)
    next_seq = h[-1].seq + 1 if h else 0
    return BodyInputs(
        history=h,
        turn_start_seq=next_seq,
        current=CurrentUserMessage(id="current", seq=next_seq, text="what next?"),
        **kw,  # type: ignore[arg-type]
    )
