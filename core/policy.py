"""Call-time authorisation (ADR-0020 decision 4): a tool definition in the prompt grants nothing.

The tool set is pinned at session open and stays in the prefix; whether a call may run is decided here,
at call time, against the session's current grants.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pydantic import BaseModel, ConfigDict

from core.errors import ToolTrustCeilingError
from core.items import TrustLevel, lowest_trust

TOOL_RESULT_TRUST: tuple[TrustLevel, ...] = (TrustLevel.EXTERNAL_UNTRUSTED, TrustLevel.TOOL, TrustLevel.USER)
"""The trust levels a tool result may carry, lowest first. A tool's ceiling is one of them (default TOOL)."""


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    allowed: bool
    reason: str


def authorize(name: str, *, pinned: Collection[str], granted: Collection[str], revoked: Mapping[str, str]) -> Decision:
    if name not in pinned:
        return Decision(allowed=False, reason=f"tool {name!r} is not in this session's tool set")
    if name in revoked:
        return Decision(allowed=False, reason=f"tool {name!r} was revoked: {revoked[name]}")
    if name not in granted:
        return Decision(allowed=False, reason=f"tool {name!r} is not granted to this session")
    return Decision(allowed=True, reason="granted")


def result_trust(tool: str, *, claimed: TrustLevel, ceiling: TrustLevel) -> TrustLevel:
    """The trust a tool result is stored at: what the executor claimed, if at or below the tool's ceiling.

    An executor may lower trust, never raise it; a claim above the ceiling, or at a level that is never a
    tool result's (PLATFORM, OPERATOR, MODEL, MEMORY), raises ToolTrustCeilingError.
    """
    if claimed not in TOOL_RESULT_TRUST or TOOL_RESULT_TRUST.index(claimed) > TOOL_RESULT_TRUST.index(ceiling):
        raise ToolTrustCeilingError(tool, claimed.value, ceiling.value)
    return claimed


def failure_trust(ceiling: TrustLevel) -> TrustLevel:
    """The trust a failed tool's error text is stored at: the tool's ceiling, at most TOOL.

    An executor's exception message is the tool's output too (a fetcher's parse error may quote the page it
    read), so it never sits above what the tool's results may carry."""
    return lowest_trust([ceiling, TrustLevel.TOOL])
