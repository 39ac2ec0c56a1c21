"""The local protocol servers the adapters' tests use: they live in harness/protocol_servers.py (the gates
drive the adapters against them too); this module keeps the tests' import path."""

from __future__ import annotations

from harness.protocol_servers import (
    FakeServer,
    Received,
    Reply,
    anthropic_error,
    anthropic_message,
    anthropic_server,
    array_items,
    openai_completion,
    openai_error,
    openai_server,
    top_level_members,
)

__all__ = [
    "FakeServer",
    "Received",
    "Reply",
    "anthropic_error",
    "anthropic_message",
    "anthropic_server",
    "array_items",
    "openai_completion",
    "openai_error",
    "openai_server",
    "top_level_members",
]
