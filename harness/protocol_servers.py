"""Local HTTP servers on 127.0.0.1 that speak the OpenAI Chat Completions and Anthropic Messages protocols.

Development harness (docs/providers.md, "Protocol servers"): the gates drive the real adapters against them,
and the adapters' tests use them too. Each server records every request it receives (path, headers, the
raw body bytes and the parsed JSON) and answers from a FIFO of queued replies, else with its default reply.

`scripted_openai_server` and `scripted_anthropic_server` answer the way the `scripted` model does, read from
the wire rather than from the plan: each `/call TOOL {json}` line in the last user message becomes a tool
call; after tool results the answer is "Done."; else the message is acknowledged. Their usage is their own:
the server counts the content it received with its own tokenizer and ratio (never ctxengine's figures), and
reports cached tokens by the provider's cache rule applied to the bytes it received:

- OpenAI: the longest run of leading prompt elements (tools, then messages) identical to an earlier request
  with the same `prompt_cache_key`, counted when at least 1,024 tokens, in steps of 128;
- Anthropic, strict: a read happens only at a breakpoint of this request whose prefix (every block up to and
  including it) an earlier request marked with a breakpoint; what is marked and not read is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from activities.anthropic_provider import AnthropicProvider
from activities.openai_provider import OpenAIProvider
from activities.tokens import TiktokenCounter
from activities.wire import array_items, top_level_members
from core.rendering import EnvelopeParseError, parse_envelopes

__all__ = [
    "FakeServer",
    "ProtocolServers",
    "Received",
    "Reply",
    "anthropic_error",
    "anthropic_message",
    "anthropic_server",
    "array_items",
    "openai_completion",
    "openai_error",
    "openai_server",
    "prompt_elements",
    "scripted_anthropic_server",
    "scripted_openai_server",
    "top_level_members",
]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    raw: bytes
    body: dict[str, Any]
    reply: Reply | None = None  # what the server answered (its usage figures are the server's own count)

    @property
    def protocol(self) -> str:
        return "anthropic" if self.path.endswith("/messages") else "openai"

    @property
    def is_summary(self) -> bool:
        """A summarizer call (compaction), not a turn's request: no tools, and a plain system prompt."""
        if self.protocol == "openai":
            return str(self.body.get("prompt_cache_key", "")).endswith(":summary")
        return isinstance(self.body.get("system"), str)


@dataclass
class Reply:
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


class FakeServer:
    """A threaded HTTP server; `reply(...)` queues the next answer, `requests` lists what arrived."""

    def __init__(self, default: Callable[[Received], Reply]) -> None:
        self.default = default
        self.requests: list[Received] = []
        self._queue: list[Reply] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                received = Received(
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    raw=raw,
                    body=json.loads(raw) if raw else {},
                )
                with server._lock:
                    server.requests.append(received)
                    queued = server._queue.pop(0) if server._queue else None
                    reply = queued or server.default(received)
                    received.reply = reply
                data = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                return

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-llm", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def reply(
        self, status: int = 200, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> None:
        with self._lock:
            self._queue.append(Reply(status, body or {}, headers or {}))

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self._queue.clear()


# ------------------------------------------------------------------------------------------------ OpenAI


def openai_completion(
    *,
    content: str | None = "ok",
    tool_calls: list[dict[str, Any]] | None = None,
    prompt_tokens: int = 100,
    cached_tokens: int = 0,
    completion_tokens: int = 5,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "gpt-fake",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop", "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
    }


def openai_error(
    status_message: str, *, code: str | None = None, type_: str = "invalid_request_error"
) -> dict[str, Any]:
    return {"error": {"message": status_message, "type": type_, "param": None, "code": code}}


def openai_server() -> FakeServer:
    """Answers every chat completion with "ok" and a usage figure of the body size / 4."""
    return FakeServer(lambda r: Reply(body=openai_completion(prompt_tokens=max(1, len(r.raw) // 4)))).start()


# --------------------------------------------------------------------------------------------- Anthropic


def anthropic_message(
    *,
    text: str | None = "ok",
    tool_uses: list[dict[str, Any]] | None = None,
    input_tokens: int = 100,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
    output_tokens: int = 5,
) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", **t} for t in tool_uses or []]
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": content,
        "stop_reason": "tool_use" if tool_uses else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": cache_creation_input_tokens,
            "cache_read_input_tokens": cache_read_input_tokens,
        },
    }


def anthropic_error(message: str, *, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def anthropic_server() -> FakeServer:
    return FakeServer(lambda r: Reply(body=anthropic_message(input_tokens=max(1, len(r.raw) // 4)))).start()


# ------------------------------------------------------------------------------- the prompt, as received


@dataclass(frozen=True)
class Element:
    """One element of a prompt as the server received it, in cache order (tools, system, messages).

    `raw` is its exact bytes; `key` the bytes that decide a cache match (for Anthropic, the block without its
    `cache_control` marker, which is not prompt content); `text` what the server's tokenizer counts.
    """

    role: str
    raw: bytes
    key: bytes
    text: str
    breakpoint: bool = False
    tool_use_id: str | None = None  # a tool call (OpenAI: one per call id of an assistant message)
    tool_result_id: str | None = None


def prompt_elements(received: Received) -> list[Element]:
    """The request's prompt, element by element, in the order a provider caches it."""
    members = top_level_members(received.raw)
    tools = array_items(members["tools"]) if "tools" in members else []
    out = [Element("tool", t, t, t.decode()) for t in tools]
    if received.protocol == "openai":
        for raw in array_items(members.get("messages", b"[]")):
            msg = json.loads(raw)
            calls = msg.get("tool_calls") or []
            # A call is read as the model wrote it: its name and its arguments' text (a JSON string on the wire,
            # decoded once), not that text escaped again.
            text = (msg.get("content") or "") + "".join(_call_text(c.get("function", {})) for c in calls)
            out.append(
                Element(
                    msg.get("role", "user"),
                    raw,
                    raw,
                    text,
                    tool_use_id=",".join(c.get("id", "") for c in calls) or None,
                    tool_result_id=msg.get("tool_call_id"),
                )
            )
        return out
    system = members.get("system")
    if system is not None:
        blocks = array_items(system) if system.startswith(b"[") else [system]
        for raw in blocks:
            block = json.loads(raw)
            text = block.get("text", "") if isinstance(block, dict) else str(block)
            out.append(_anthropic_element("system", raw, block, text))
    for message in received.body.get("messages", []):
        content = message.get("content")
        parts: list[dict[str, Any]] = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for block in parts:
            raw = json.dumps(block, sort_keys=True).encode()
            kind = block.get("type")
            if kind == "tool_use":
                text = json.dumps(block.get("input", {}), ensure_ascii=False)
            elif kind == "tool_result":
                inner = block.get("content", "")
                text = inner if isinstance(inner, str) else json.dumps(inner, ensure_ascii=False)
            else:
                text = block.get("text", "")
            out.append(_anthropic_element(message.get("role", "user"), raw, block, text))
    return out


def _call_text(function: Any) -> str:
    """An OpenAI tool call's function as a model reads it: its name, then its arguments as written."""
    if not isinstance(function, dict):
        return json.dumps(function, ensure_ascii=False)
    arguments = function.get("arguments", "")
    written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return str(function.get("name", "")) + written


def _anthropic_element(role: str, raw: bytes, block: Any, text: str) -> Element:
    if not isinstance(block, dict):
        return Element(role, raw, raw, text)
    plain = {k: v for k, v in block.items() if k != "cache_control"}
    return Element(
        role,
        raw,
        json.dumps([role, plain], sort_keys=True).encode(),
        text,
        breakpoint="cache_control" in block,
        tool_use_id=block.get("id") if block.get("type") == "tool_use" else None,
        tool_result_id=block.get("tool_use_id") if block.get("type") == "tool_result" else None,
    )


# ---------------------------------------------------------------------------- scripted, read off the wire

_DIRECTIVE = re.compile(r"^/call\s+([A-Za-z0-9_.\-]+)\s*(\{.*\})?\s*$", re.MULTILINE)
_ENVELOPE_SOURCE = re.compile(r'source="([a-z_]+)')
_MODEL_RATIO = re.compile(r"-r([0-9]+(?:\.[0-9]+)?)$")
# A model name with `-w<tokens>` (`budget-w6000-r1.3`) has that context window: the server refuses, as the provider
# does, a request whose input by its own count and requested output do not fit in it.
_MODEL_WINDOW = re.compile(r"-w([0-9]+)(?:-|$)")
OPENAI_MIN_CACHED = 1_024
OPENAI_CACHE_STEP = 128


class ScriptedWire:
    """The scripted model's behaviour and a provider's usage, computed from the bytes received."""

    def __init__(self, protocol: str, *, encoding: str = "cl100k_base", ratio: float = 1.0) -> None:
        self.protocol = protocol
        self.counter = TiktokenCounter(encoding)
        self.ratio = ratio
        self._openai_seen: dict[str, list[list[bytes]]] = {}
        self._anthropic_marked: set[str] = set()
        self.replies = 0

    def tokens(self, elements: list[Element], ratio: float | None = None) -> int:
        """The server's own count: its tokenizer over the content received, 4 per element, times its ratio."""
        return math.ceil(sum(self.counter.count(e.text) + 4 for e in elements) * (ratio or self.ratio))

    def ratio_for(self, received: Received) -> float:
        """The server's ratio, or the one a model name asks for with a `-r<ratio>` suffix (`budget-r1.45`), so
        one server can stand in for providers whose tokenizers count differently."""
        match = _MODEL_RATIO.search(str(received.body.get("model", "")))
        return float(match.group(1)) if match else self.ratio

    def _too_long(self, received: Received, total: int) -> Reply | None:
        """The provider's refusal of a request over its model's window (`_MODEL_WINDOW`), in its own words."""
        match = _MODEL_WINDOW.search(str(received.body.get("model", "")))
        if match is None:
            return None
        window = int(match.group(1))
        output = int(received.body.get("max_completion_tokens") or received.body.get("max_tokens") or 0)
        if total + output <= window:
            return None
        # Each provider's usual words when the input and the requested output together are over the window.
        if self.protocol == "openai":
            message = (
                f"This model's maximum context length is {window} tokens. However, you requested {total + output} "
                f"tokens ({total} in the messages, {output} in the completion). Please reduce the length of the "
                "messages or completion."
            )
            return Reply(400, openai_error(message, code="context_length_exceeded"))
        message = f"input length and `max_tokens` exceed context limit: {total} + {output} > {window}, decrease input"
        return Reply(400, anthropic_error(message))

    def answer(self, received: Received) -> Reply:
        elements = prompt_elements(received)
        self.replies += 1
        if received.is_summary:
            text = "Summary: " + " ".join(elements[-1].text.split()[:40]) if elements else "Summary."
            calls: list[tuple[str, dict[str, Any]]] = []
        else:
            calls = _directives(elements)
            text = "" if calls else _acknowledge(elements)
        total = self.tokens(elements, self.ratio_for(received))
        refusal = None if received.is_summary else self._too_long(received, total)
        if refusal is not None:
            return refusal
        if self.protocol == "openai":
            cached = 0 if received.is_summary else self._openai_cached(received, elements)
            tool_calls = [
                {
                    "id": f"call_{self.replies}_{j}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                for j, (name, args) in enumerate(calls)
            ]
            return Reply(
                body=openai_completion(
                    content=text or None,
                    tool_calls=tool_calls or None,
                    prompt_tokens=total,
                    cached_tokens=cached,
                    completion_tokens=self.counter.count(text) + 8 * len(calls),
                )
            )
        read, written = self._anthropic_cache(elements)
        tool_uses = [
            {"id": f"toolu_{self.replies}_{j}", "name": name, "input": args} for j, (name, args) in enumerate(calls)
        ]
        return Reply(
            body=anthropic_message(
                text=text or None,
                tool_uses=tool_uses or None,
                input_tokens=max(0, total - read - written),
                cache_read_input_tokens=read,
                cache_creation_input_tokens=written,
                output_tokens=self.counter.count(text) + 8 * len(calls),
            )
        )

    def _openai_cached(self, received: Received, elements: list[Element]) -> int:
        keys = [e.key for e in elements]
        seen = self._openai_seen.setdefault(str(received.body.get("prompt_cache_key")), [])
        common = max((_common_prefix(keys, earlier) for earlier in seen), default=0)
        seen.append(keys)
        tokens = self.tokens(elements[:common])
        return 0 if tokens < OPENAI_MIN_CACHED else tokens - tokens % OPENAI_CACHE_STEP

    def _anthropic_cache(self, elements: list[Element]) -> tuple[int, int]:
        """(read, written) under the strict rule: a read only at a prefix an earlier request marked."""
        digest = hashlib.sha256()
        marks: list[tuple[int, str]] = []
        for index, e in enumerate(elements):
            digest.update(e.key + b"\x00")
            if e.breakpoint:
                marks.append((index + 1, digest.hexdigest()))
        read_upto = max((n for n, h in marks if h in self._anthropic_marked), default=0)
        last_mark = marks[-1][0] if marks else 0
        self._anthropic_marked.update(h for _, h in marks)
        read = self.tokens(elements[:read_upto])
        written = max(0, self.tokens(elements[:last_mark]) - read) if last_mark > read_upto else 0
        return read, written


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _directives(elements: list[Element]) -> list[tuple[str, dict[str, Any]]]:
    """`/call` lines of the last user message, unless tool results came after it (then the model answers)."""
    user_at = max((i for i, e in enumerate(elements) if _source(e.text) == "current_message"), default=-1)
    results_at = max((i for i, e in enumerate(elements) if e.tool_result_id), default=-1)
    if user_at < 0 or results_at > user_at:
        return []
    calls: list[tuple[str, dict[str, Any]]] = []
    for match in _DIRECTIVE.finditer(_envelope_content(elements[user_at].text)):
        try:
            args = json.loads(match.group(2)) if match.group(2) else {}
        except json.JSONDecodeError:
            args = {"_unparsed": match.group(2)}
        calls.append((match.group(1).replace(".", "__"), args))
    return calls


def _acknowledge(elements: list[Element]) -> str:
    if any(e.tool_result_id for e in elements[-6:]):
        return "Done."
    user = next((e for e in reversed(elements) if _source(e.text) == "current_message"), None)
    words = " ".join(_envelope_content(user.text).split()[:8]) if user else ""
    return f"Noted: {words}"


def _source(text: str) -> str | None:
    match = _ENVELOPE_SOURCE.search(text[:400])
    return match.group(1) if match else None


def _envelope_content(text: str) -> str:

    try:
        envelopes = parse_envelopes(text)
    except EnvelopeParseError:
        return text
    return envelopes[0].content if envelopes else text


def scripted_openai_server(*, encoding: str = "cl100k_base", ratio: float = 1.0) -> FakeServer:
    return FakeServer(ScriptedWire("openai", encoding=encoding, ratio=ratio).answer).start()


def scripted_anthropic_server(*, encoding: str = "cl100k_base", ratio: float = 1.1) -> FakeServer:
    return FakeServer(ScriptedWire("anthropic", encoding=encoding, ratio=ratio).answer).start()


@dataclass
class ProtocolServers:
    """One scripted server per protocol, and the adapters a worker registers to reach them."""

    openai: FakeServer
    anthropic: FakeServer

    def providers(self, openai_cls: type[Any] | None = None, anthropic_cls: type[Any] | None = None) -> dict[str, Any]:
        """`openai` and `anthropic` adapters (or the harness's subclasses of them) pointed at these servers."""

        return {
            "openai": (openai_cls or OpenAIProvider)(api_key="wire-harness", base_url=self.openai.url + "/v1"),
            "anthropic": (anthropic_cls or AnthropicProvider)(api_key="wire-harness", base_url=self.anthropic.url),
        }

    def reset(self) -> None:
        self.openai.reset()
        self.anthropic.reset()


@contextmanager
def protocol_servers() -> Iterator[ProtocolServers]:
    servers = ProtocolServers(scripted_openai_server(), scripted_anthropic_server())
    try:
        yield servers
    finally:
        servers.openai.stop()
        servers.anthropic.stop()
