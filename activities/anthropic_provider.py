"""Anthropic Messages API adapter behind the provider port.

Region A becomes `tools` (the pinned tool definitions, prefix order, keys sorted) and one `system` text
block (the exact concatenated text of the platform, instruction and snapshot segments) that carries
`cache_control: {"type": "ephemeral"}`. Anthropic's cache order is tools, then system, then messages, so
that one breakpoint caches the whole of Region A. A second breakpoint sits on the last block of the
append-only history (the end of the stable body), so a turn reads the previous turn's history from the
cache too; the volatile tail (recall, working state, the clock, the current message) is after it. A third
sits just before the first full tool result, the point up to which a tool-result yield cannot change the
body (see `cache_breakpoints`). The fourth sits where the previous request of the session ended its history
(`previous_history_end`): a cache read happens at a breakpoint whose prefix an earlier request marked, so
with it each request reads the previous request's whole history at an offset that request wrote, whatever
the number of blocks added since (the documented 20-block lookback is not needed).

Region B becomes alternating messages: consecutive same-role segments are merged into one message with one
block each (tool calls as `tool_use`, results as `tool_result` with the same id, everything else as
`text`, each carrying its segment's text so the trust envelope stays).

The SDK runs with `max_retries=0`: Temporal owns retries. See docs/providers.md.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

from temporalio.exceptions import ApplicationError

from activities.openai_provider import (
    HISTORY_KINDS,
    ToolNames,
    UnconfiguredProvider,
    connection_error,
    context_length_error,
    history_breakpoint,
    region_a,
    region_b,
    sorted_json,
    status_error,
    tool_call_of,
)
from activities.provider import (
    SUMMARY_PROMPT,
    ProviderReply,
    ProviderRequest,
    ProviderSegment,
    ProviderToolCall,
    ProviderUsage,
    SummaryRequest,
    takes_no_options,
)
from activities.wire import wire_prefix
from contract.settings import settings
from core.estimator import ModelProfile

ENV_API_KEY = "ANTHROPIC_API_KEY"
ENV_BASE_URL = "ANTHROPIC_BASE_URL"
NOT_CONFIGURED = (
    "provider 'anthropic' is not configured: set ANTHROPIC_API_KEY (and ANTHROPIC_BASE_URL for a proxy or gateway)"
)
EPHEMERAL = {"type": "ephemeral"}
MAX_BREAKPOINTS = 4  # Anthropic's limit per request
# Anthropic's refusals of a request too long for the model: the prompt alone ("prompt is too long: 208310 tokens >
# 200000 maximum"), or the prompt and max_tokens together ("input length and `max_tokens` exceed context limit:
# 199759 + 8192 > 200000").
_TOO_LONG = re.compile(
    r"prompt is too long|input is too long|too many (?:input )?tokens|context window|exceed context limit", re.I
)


def render_messages_request(
    request: ProviderRequest, *, history_cache: bool = True
) -> tuple[dict[str, Any], ToolNames]:
    """The `messages.create` arguments for `request`, and the tool-name map to read the reply with.

    Pure. `tools` and `system` depend on Region A alone, so they are the same bytes for every request of
    an epoch; `history_cache=False` leaves only the Region A breakpoint (the cache bench uses it to model
    assemblers that mark their system prompt only).
    """
    system, specs = region_a(request.segments)
    names = ToolNames(spec["name"] for spec in specs)
    tools = [
        sorted_json(
            {
                "name": names.wire(spec["name"]),
                "description": spec.get("description", ""),
                "input_schema": spec.get("input_schema") or {"type": "object", "properties": {}},
            }
        )
        for spec in specs
    ]
    body = region_b(request.segments)
    marks = cache_breakpoints(body) if history_cache else set()
    messages: list[dict[str, Any]] = []
    for index, seg in enumerate(body):
        role = "assistant" if seg.role == "assistant" else "user"
        block: dict[str, Any]
        if seg.kind == "tool_call":
            call_id, tool, arguments = tool_call_of(seg)
            block = {"id": call_id, "input": arguments, "name": names.wire(tool), "type": "tool_use"}
        elif seg.role == "tool" and seg.call_id:
            block = {"content": seg.text, "tool_use_id": seg.call_id, "type": "tool_result"}
        else:
            block = {"text": seg.text, "type": "text"}
        if index in marks:
            block["cache_control"] = dict(EPHEMERAL)
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].append(sorted_json(block))
        else:
            messages.append({"content": [sorted_json(block)], "role": role})
    kwargs: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_output_tokens,
        "messages": messages,
    }
    if system:
        kwargs["system"] = [{"cache_control": dict(EPHEMERAL), "text": system, "type": "text"}]
    if tools:
        kwargs["tools"] = tools
    return kwargs, names


def cache_breakpoints(body: Sequence[ProviderSegment]) -> set[int]:
    """Indexes (in the Region B segments) of the blocks that get a breakpoint besides the system block.

    - The last segment of the append-only history: the next request extends it, so it reads all of it.
    - The segment just before the first full `tool_result`: yield 2 turns tool results into pointers
      oldest first (core/build.py), so everything before the first full result stays byte-identical until
      the next compaction, while a conversion rewrites what follows. A request that converts finds the
      previous request's mark there through Anthropic's lookback (an entry up to about 20 blocks before a
      breakpoint); under the strict rule it reads Region A (docs/providers.md, breakpoint 3).
    """
    marks: set[int] = set()
    end = history_breakpoint(body)
    if end is None:
        return marks
    marks.add(end)
    first_result = next((i for i, s in enumerate(body) if s.kind == "tool_result"), None)
    if first_result is not None and 0 < first_result <= end:
        marks.add(first_result - 1)
    previous = previous_history_end(body, end)
    if previous is not None:
        marks.add(previous)
    return marks


def previous_history_end(body: Sequence[ProviderSegment], end: int) -> int | None:
    """Index of the block where the previous request of the session put its history breakpoint, so that this
    request reads the previous one's history at an offset the previous one marked (the fourth breakpoint).

    Since the previous request the history grew by the model's reply to it (its assistant blocks) and the
    results of the tools it called; and, when the previous request was the first of its turn, by that turn's
    user message, which it carried as the current message (after its history) and which is history now: the
    user message right before the reply. Walking back from the end of the history over those gives the
    previous request's last history block.
    """
    i = end
    while i >= 0 and body[i].role == "tool":
        i -= 1
    if i < 0 or body[i].role != "assistant":
        return None
    while i >= 0 and body[i].role == "assistant":
        i -= 1
    if i >= 0 and body[i].kind == "user_message":
        i -= 1  # the previous request carried it as the current message, after its history
    return i if 0 <= i < end and body[i].kind in HISTORY_KINDS else None


def count_breakpoints(kwargs: Mapping[str, Any]) -> int:
    """How many `cache_control` markers a rendered request carries (Anthropic allows four)."""
    blocks = [*kwargs.get("tools", []), *kwargs.get("system", [])]
    blocks += [b for m in kwargs.get("messages", []) for b in m["content"]]
    return sum(1 for b in blocks if "cache_control" in b)


def read_message(message: Any, names: ToolNames) -> ProviderReply:
    """A Message as a ProviderReply. Input is everything the request carried: uncached + written + read."""
    texts: list[str] = []
    calls: list[ProviderToolCall] = []
    for block in message.content or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            texts.append(block.text)
        elif kind == "tool_use":
            arguments = block.input if isinstance(block.input, dict) else {"_unparsed": block.input}
            calls.append(ProviderToolCall(call_id=block.id, name=names.original(block.name), arguments=arguments))
    usage = message.usage
    written = getattr(usage, "cache_creation_input_tokens", None) or 0
    read = getattr(usage, "cache_read_input_tokens", None) or 0
    return ProviderReply(
        text="".join(texts),
        tool_calls=calls,
        usage=ProviderUsage(
            input_tokens=(usage.input_tokens or 0) + written + read,
            cached_tokens=read,
            output_tokens=usage.output_tokens or 0,
        ),
    )


class AnthropicProvider:
    """The port over `anthropic.AsyncAnthropic` (Messages), SDK retries off."""

    configured = True
    name = "anthropic"

    def __init__(self, *, api_key: str, base_url: str | None = None, timeout: float | None = None) -> None:
        import anthropic  # the SDK takes a while to import: only workers that route to it pay for that

        self._anthropic = anthropic
        options: dict[str, Any] = {"api_key": api_key, "base_url": base_url, "max_retries": 0}
        if timeout is not None:
            options["timeout"] = timeout
        self.client = anthropic.AsyncAnthropic(**options)
        # Given with every call: without it the SDK refuses, before sending, a call without streaming whose
        # `max_tokens` it expects to take over 10 minutes (an output reserve of about 21,334 or more). No read timeout
        # of the SDK's own (600 s): the model call cuts the call at its `timeouts.model_seconds` (`within_attempt`).
        self.call_timeout = anthropic.Timeout(timeout, connect=5.0 if timeout is None else min(5.0, timeout))

    async def aclose(self) -> None:
        """Close the SDK client's connections (the worker does, when it stops)."""
        await self.client.close()

    def route_profile(self, profile: ModelProfile, options: Mapping[str, Any]) -> ModelProfile:
        return takes_no_options(self.name, profile, options)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AnthropicProvider | UnconfiguredProvider:
        config = settings(env)
        secret = config.anthropic_api_key
        key = secret.get_secret_value() if secret is not None else ""
        if not key:
            return UnconfiguredProvider("anthropic", NOT_CONFIGURED)
        return cls(api_key=key, base_url=config.anthropic_base_url or None)

    async def _create(self, kwargs: dict[str, Any], request: ProviderRequest | None, model: str) -> Any:
        anthropic = self._anthropic
        try:
            return await self.client.messages.create(**kwargs, timeout=self.call_timeout)
        except anthropic.APIStatusError as exc:
            raise self._status_error(exc, request, model) from exc
        except anthropic.APITimeoutError as exc:
            raise connection_error(self.name, exc, timeout=True) from exc
        except anthropic.APIConnectionError as exc:
            raise connection_error(self.name, exc, timeout=False) from exc

    def _status_error(self, exc: Any, request: ProviderRequest | None, model: str) -> ApplicationError:
        body = exc.body if isinstance(exc.body, Mapping) else {}
        raw_error = body.get("error")
        error: Mapping[str, Any] = raw_error if isinstance(raw_error, Mapping) else {}
        message = str(error.get("message") or exc.message)
        error_type = error.get("type") or getattr(exc, "type", None)
        if exc.status_code == 400 and error_type in (None, "invalid_request_error") and _TOO_LONG.search(message):
            return context_length_error(
                provider=self.name,
                request=request,
                model=model,
                status=exc.status_code,
                message=message,
                request_id=exc.request_id,
            )
        return status_error(
            provider=self.name,
            request=request,
            model=model,
            status=exc.status_code,
            message=message,
            error_type=error_type,
            code=getattr(exc, "error_code", None),
            headers=exc.response.headers,
            request_id=exc.request_id,
        )

    async def _create_raw(self, kwargs: dict[str, Any], request: ProviderRequest) -> tuple[Any, bytes]:
        """Like `_create`, and the request body's bytes exactly as sent (for the wire hash)."""
        anthropic = self._anthropic
        try:
            raw = await self.client.messages.with_raw_response.create(**kwargs, timeout=self.call_timeout)
        except anthropic.APIStatusError as exc:
            raise self._status_error(exc, request, request.model) from exc
        except anthropic.APITimeoutError as exc:
            raise connection_error(self.name, exc, timeout=True) from exc
        except anthropic.APIConnectionError as exc:
            raise connection_error(self.name, exc, timeout=False) from exc
        parsed = raw.parse()
        return (await parsed if inspect.isawaitable(parsed) else parsed), bytes(raw.http_request.content)

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        kwargs, names = render_messages_request(request)
        message, sent = await self._create_raw(kwargs, request)
        return read_message(message, names).model_copy(update={"wire_prefix": wire_prefix(sent, "anthropic")})

    async def summarize(self, request: SummaryRequest) -> ProviderReply:
        kwargs = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "system": SUMMARY_PROMPT.format(max_tokens=request.max_tokens),
            "messages": [{"content": request.text, "role": "user"}],
        }
        message = await self._create(kwargs, None, request.model)
        return read_message(message, ToolNames())
