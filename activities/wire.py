"""The cacheable prefix of a request as it went on the wire: its exact bytes, read from the serialized body.

`prefix_sha256` hashes Region A as ctxengine rendered it; a provider caches what the adapter serialized. The
two can drift apart (an SDK that reorders keys, an adapter that adds a field to the system message), and
only the second is what a provider's cache sees. So the adapters hash the bytes they actually sent
(docs/providers.md, "Wire hashes"):

- OpenAI Chat Completions: the `tools` member and the first message when it is the system message, each
  exactly as it appears in the body;
- Anthropic Messages: the `tools` member and the `system` blocks up to and including the first block that
  carries `cache_control` (the Region A breakpoint).

Pure and SDK-free, so the protocol servers and the gates read recorded bodies with the same code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

from pydantic import BaseModel


class WirePrefix(BaseModel):
    """The cacheable prefix of one request body: its parts' exact bytes (decoded) and their hash."""

    sha256: str
    text: str  # the parts joined by one newline, exactly as they were in the body


def top_level_members(raw: bytes) -> dict[str, bytes]:
    """The exact bytes of each top-level member's value in a JSON object body, as they were sent."""
    return {key: value.encode() for key, value in _members(raw.decode(), "{", "}")}


def array_items(raw: bytes) -> list[bytes]:
    """The exact bytes of each element of a JSON array, as they were sent."""
    return [value.encode() for _, value in _members(raw.decode(), "[", "]")]


def openai_prefix_parts(raw: bytes) -> list[bytes]:
    """The cacheable prefix of a Chat Completions body: `tools`, then the system message (if first)."""
    members = top_level_members(raw)
    parts = [members["tools"]] if "tools" in members else []
    if "messages" in members:
        messages = array_items(members["messages"])
        if messages and json.loads(messages[0]).get("role") == "system":
            parts.append(messages[0])
    return parts


def anthropic_prefix_parts(raw: bytes) -> list[bytes]:
    """The cacheable prefix of a Messages body: `tools`, then `system` blocks up to the first breakpoint."""
    members = top_level_members(raw)
    parts = [members["tools"]] if "tools" in members else []
    system = members.get("system")
    if system is not None:
        if system.startswith(b"["):
            for block in array_items(system):
                parts.append(block)
                if "cache_control" in json.loads(block):
                    break
        else:  # a plain-string system prompt: no breakpoint, the string is the whole system part
            parts.append(system)
    return parts


def wire_prefix(raw: bytes, protocol: str) -> WirePrefix:
    """The cacheable prefix of a request body sent with `protocol` (`openai` or `anthropic`)."""
    parts = openai_prefix_parts(raw) if protocol == "openai" else anthropic_prefix_parts(raw)
    joined = b"\n".join(parts)
    return WirePrefix(sha256=hashlib.sha256(joined).hexdigest(), text=joined.decode())


def _members(text: str, open_: str, close: str) -> Iterator[tuple[str, str]]:
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    if text[i] != open_:
        raise ValueError(f"expected {open_!r} at offset {i}")
    i = _skip(text, i + 1)
    index = 0
    while text[i] != close:
        key = str(index)
        if open_ == "{":
            key, i = decoder.raw_decode(text, i)
            i = _skip(text, i)
            i = _skip(text, i + 1)  # the colon
        _, end = decoder.raw_decode(text, i)
        yield key, text[i:end]
        index += 1
        i = _skip(text, end)
        if text[i] == ",":
            i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i
