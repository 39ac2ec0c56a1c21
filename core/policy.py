"""Call-time authorisation (ADR-0020 decision 4): a tool definition in the prompt grants nothing.

The tool set is pinned at session open and stays in the prefix; whether a call may run is decided here,
at call time, against the session's current grants.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pydantic import BaseModel, ConfigDict


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
