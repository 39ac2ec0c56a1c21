"""Local HTTP servers on 127.0.0.1 that speak just enough of the OpenAI Chat Completions and Anthropic
Messages protocols for the adapters' tests. Each records every request it receives (path, headers, the raw
body bytes and the parsed JSON) and answers from a FIFO of scripted replies, else with a default reply.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    raw: bytes
    body: dict[str, Any]


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


# ------------------------------------------------------------------------------------------ wire bytes


def top_level_members(raw: bytes) -> dict[str, bytes]:
    """The exact bytes of each top-level member's value in a JSON object body, as they were sent."""
    return dict(_members(raw.decode(), "{", "}"))


def array_items(raw: bytes) -> list[bytes]:
    """The exact bytes of each element of a JSON array (as sent)."""
    return [value for _, value in _members(raw.decode(), "[", "]")]


def _members(text: str, open_: str, close: str) -> Iterator[tuple[str, bytes]]:
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    assert text[i] == open_, f"expected {open_!r} at {i}"
    i = _skip(text, i + 1)
    index = 0
    while text[i] != close:
        key = str(index)
        if open_ == "{":
            key, i = decoder.raw_decode(text, i)
            i = _skip(text, i)
            assert text[i] == ":"
            i = _skip(text, i + 1)
        _, end = decoder.raw_decode(text, i)
        yield key, text[i:end].encode()
        index += 1
        i = _skip(text, end)
        if text[i] == ",":
            i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i
