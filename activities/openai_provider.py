"""OpenAI-compatible Chat Completions adapter behind the provider port (OpenAI, vLLM, Ollama, LiteLLM proxies).

The request is rendered from the plan's segments, never re-assembled: Region A becomes one system message
(the exact concatenated text of the platform, instruction and snapshot segments) and the tools list (the
pinned tool definitions, in prefix order, keys sorted), so both are the same bytes on every request of an
epoch; Region B becomes messages in plan order, each carrying its segment's text (the trust envelope stays).
`prompt_cache_key` is `session:epoch`, so every request of an epoch is routed to the same prompt cache.

The SDK runs with `max_retries=0`: Temporal owns retries. HTTP failures become `ApplicationError`s whose
`non_retryable` and `next_retry_delay` (from `retry-after-ms` / `retry-after`) say what Temporal should do.

The first part of this module holds the SDK-free wire helpers the Anthropic adapter shares (tool names,
tool specs, error mapping, the unconfigured stand-in). See docs/providers.md.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from temporalio.exceptions import ApplicationError

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
from activities.tokens import TiktokenCounter
from activities.wire import wire_prefix
from contract.retries import CONTEXT_LENGTH_EXCEEDED
from contract.settings import settings
from core.estimator import ModelProfile
from core.rendering import escape_content, parse_envelopes

# ----------------------------------------------------------------------------------------------------------
# Wire helpers shared by both adapters (no SDK in here).
# ----------------------------------------------------------------------------------------------------------

# Region B kinds that belong to the append-only conversation (the stable part of the body). Everything else
# in Region B (corrections, recall, working state, the clock, the current message) is per-request.
HISTORY_KINDS = frozenset(
    {"user_message", "assistant_message", "tool_call", "tool_result", "elided_span", "checkpoint_summary"}
)
TOOL_NAME_MAX = 64
_TOOL_NAME_OK = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def sorted_json(value: Any) -> Any:
    """`value` with every mapping's keys in sorted order, so its JSON serialisation is byte-stable."""
    if isinstance(value, Mapping):
        return {key: sorted_json(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [sorted_json(v) for v in value]
    return value


def envelope_content(text: str) -> str:
    """The original content of an enveloped segment (platform text, which has no envelope, as is)."""
    envelopes = parse_envelopes(text)
    return envelopes[0].content if envelopes else text.rstrip("\n")


class ToolNames:
    """Reversible map between ctxengine tool names (`web.fetch`) and provider names (`web__fetch`).

    Providers allow `[a-zA-Z0-9_-]{1,64}`; ctxengine also allows dots. A dot becomes `__`; a name that would
    then collide with another tool's, or grow past 64 characters, gets a short hash suffix instead. The map
    is a pure function of the name list, so it is the same for every request of an epoch; names the map
    does not know (a tool from an earlier epoch in the history) are converted the same way.
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._to_wire: dict[str, str] = {}
        self._to_original: dict[str, str] = {}
        originals = list(dict.fromkeys(names))
        taken = {n for n in originals if _TOOL_NAME_OK.match(n)}
        for name in originals:
            wire = name if _TOOL_NAME_OK.match(name) else _plain_wire(name)
            if wire != name and (wire in taken or wire in self._to_original):
                wire = _hashed_wire(name)
            self._to_wire[name] = wire
            self._to_original[wire] = name

    def wire(self, name: str) -> str:
        known = self._to_wire.get(name)
        if known is not None:
            return known
        return name if _TOOL_NAME_OK.match(name) else _plain_wire(name)

    def original(self, wire: str) -> str:
        known = self._to_original.get(wire)
        if known is not None:
            return known
        return wire.replace("__", ".")  # a name the model made up: undo the plain mapping


def _plain_wire(name: str) -> str:
    wire = re.sub(r"[^A-Za-z0-9_-]", "_", name.replace(".", "__"))
    return wire if len(wire) <= TOOL_NAME_MAX else _hashed_wire(name)


def _hashed_wire(name: str) -> str:
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    base = re.sub(r"[^A-Za-z0-9_-]", "_", name.replace(".", "__"))
    return f"{base[: TOOL_NAME_MAX - 10]}_h{digest}"


def region_a(segments: Sequence[ProviderSegment]) -> tuple[str, list[dict[str, Any]]]:
    """Region A as (system text, tool specs): the exact concatenated text of the non-tool segments, and
    each tool definition's canonical JSON parsed back ({"name", "description", "input_schema"}), in order."""
    system: list[str] = []
    tools: list[dict[str, Any]] = []
    for seg in segments:
        if seg.region != "A":
            continue
        if seg.kind == "tool_definition":
            tools.append(json.loads(envelope_content(seg.text)))
        else:
            system.append(seg.text)
    return "".join(system), tools


def region_b(segments: Sequence[ProviderSegment]) -> list[ProviderSegment]:
    return [s for s in segments if s.region != "A"]


def tool_call_of(seg: ProviderSegment) -> tuple[str, str, dict[str, Any]]:
    """(call_id, tool name, arguments) of a tool_call segment (its canonical JSON inside the envelope). The
    arguments leave their envelope for the provider's structured field, so each of their strings, keys included,
    is escaped as the envelope escaped it (`escaped_arguments`)."""
    data = json.loads(envelope_content(seg.text))
    arguments = data.get("arguments")
    call_id = seg.call_id or str(data["call_id"])
    return call_id, str(data["tool"]), escaped_arguments(arguments) if isinstance(arguments, dict) else {}


def escaped_arguments(value: Any) -> Any:
    """A tool call's arguments with every string (keys too) through the rendering contract's `escape_content`: a
    model that copied a page's `<|im_start|>`, a forged envelope or a role marker into a call sends it back inert,
    as every other segment's content goes (a chat-template server would read it as its own tokens). Ordinary text
    is left as it is (`escape_content(x) == x` when x holds nothing to escape), so the bytes of such calls do not
    change."""
    if isinstance(value, str):
        return escape_content(value)
    if isinstance(value, Mapping):
        return {escape_content(str(key)): escaped_arguments(item) for key, item in value.items()}
    if isinstance(value, list):
        return [escaped_arguments(item) for item in value]
    return value


def history_breakpoint(body: Sequence[ProviderSegment]) -> int | None:
    """Index (in `body`) of the last segment of the append-only history, if any: the end of the stable body."""
    last = None
    for index, seg in enumerate(body):
        if seg.kind in HISTORY_KINDS:
            last = index
    return last


def parse_arguments(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {"_unparsed": raw}
    return value if isinstance(value, dict) else {"_unparsed": raw}


def retry_after(headers: Mapping[str, str] | None) -> timedelta | None:
    """The provider's `retry-after-ms` or `retry-after` (seconds or an HTTP date), if it sent one."""
    if not headers:
        return None
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            seconds = float(value) / 1_000
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and seconds > 0:
            return timedelta(seconds=seconds)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return timedelta(seconds=seconds) if math.isfinite(seconds) and seconds > 0 else None


# Status -> (ApplicationError type, retryable). The SDKs themselves retry 408, 409, 429 and 5xx: so does this.
_STATUS_TYPES: dict[int, tuple[str, bool]] = {
    400: ("ProviderBadRequest", False),
    401: ("ProviderAuthError", False),
    402: ("ProviderPaymentRequired", False),
    403: ("ProviderPermissionDenied", False),
    404: ("ProviderNotFound", False),
    408: ("ProviderTimeout", True),
    409: ("ProviderConflict", True),
    413: ("ProviderRequestTooLarge", False),
    422: ("ProviderUnprocessable", False),
    429: ("ProviderRateLimited", True),
    529: ("ProviderOverloaded", True),
}


def status_error(
    *,
    provider: str,
    request: ProviderRequest | None,
    model: str,
    status: int,
    message: str,
    error_type: str | None,
    code: str | None,
    headers: Mapping[str, str] | None,
    request_id: str | None,
) -> ApplicationError:
    """Map an HTTP error to the ApplicationError Temporal acts on: retryable with the provider's delay for
    408/409/429/5xx, non-retryable for every other 4xx; a provider's `x-should-retry` header wins."""
    error, retryable = _STATUS_TYPES.get(
        status, ("ProviderServerError", True) if status >= 500 else ("ProviderClientError", False)
    )
    if status == 429 and code == "insufficient_quota":  # a billing state, not a transient limit
        error, retryable = "ProviderQuotaExceeded", False
    should_retry = (headers or {}).get("x-should-retry")
    if should_retry in ("true", "false"):
        retryable = should_retry == "true"
    delay = retry_after(headers) if retryable else None
    details = {
        "provider": provider,
        "model": model,
        "status": status,
        "error_type": error_type,
        "code": code,
        "request_id": request_id,
        "request_sha256": request.request_sha256 if request is not None else None,
        "retry_after_seconds": delay.total_seconds() if delay else None,
    }
    what = f" ({error_type or code})" if (error_type or code) else ""
    return ApplicationError(
        f"{provider} returned HTTP {status}{what}: {message}",
        details,
        type=error,
        non_retryable=not retryable,
        next_retry_delay=delay,
    )


_LIMIT_PATTERNS = (
    re.compile(r"maximum context length is (?P<limit>\d+)"),
    re.compile(r"resulted in (?P<actual>\d+) tokens"),
    re.compile(r"(?P<actual>\d+) tokens > (?P<limit>\d+) maximum"),
    re.compile(r"requested (?P<actual>\d+) tokens"),
    # "you requested 130563 tokens (129563 in the messages, 1000 in the completion)": the input is the messages'
    # share (a later pattern's figure wins), so a refusal is not learned as input it never counted.
    re.compile(r"(?P<actual>\d+) in the messages"),
    # Anthropic's "input length and `max_tokens` exceed context limit: 199759 + 8192 > 200000": the input and the limit.
    re.compile(r"(?P<actual>\d+) \+ \d+ > (?P<limit>\d+)"),
)


def context_length_error(
    *, provider: str, request: ProviderRequest | None, model: str, status: int, message: str, request_id: str | None
) -> ApplicationError:
    """Non-retryable `ContextLengthExceeded`: the provider counted more than the model takes, although the
    estimator let the request through. The message and details carry that estimate, to fix the profile."""
    estimated = request.estimated_tokens if request is not None else None
    numbers: dict[str, int] = {}
    for pattern in _LIMIT_PATTERNS:
        match = pattern.search(message)
        if match:
            numbers.update({k: int(v) for k, v in match.groupdict().items() if v is not None})
    said = []
    if "actual" in numbers:
        said.append(f"{numbers['actual']:,} tokens")
    if "limit" in numbers:
        said.append(f"limit {numbers['limit']:,}")
    counted = f" ({', '.join(said)})" if said else ""
    estimate = (
        f"ctxengine estimated {estimated:,} tokens and let the request through"
        if estimated is not None
        else "ctxengine's estimate for it was not passed to the adapter"
    )
    return ApplicationError(
        f"{provider} rejected the request as too long for {model}{counted}: {message}. {estimate}; the "
        "estimator's profile for this route undercounts (see docs/providers.md)",
        {
            "provider": provider,
            "model": model,
            "status": status,
            "request_id": request_id,
            "request_sha256": request.request_sha256 if request is not None else None,
            "estimated_tokens": estimated,
            "provider_tokens": numbers.get("actual"),
            "provider_limit": numbers.get("limit"),
            "provider_message": message,
        },
        type=CONTEXT_LENGTH_EXCEEDED,
        non_retryable=True,
    )


def connection_error(provider: str, exc: Exception, *, timeout: bool) -> ApplicationError:
    kind = "ProviderTimeout" if timeout else "ProviderConnectionError"
    return ApplicationError(f"{provider}: {exc}", {"provider": provider}, type=kind, non_retryable=False)


class UnconfiguredProvider:
    """Stands in for a provider whose key is not set: every call fails at once, non-retryably, saying how
    to configure it (a retry cannot fix a missing key)."""

    configured = False

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        self.message = message

    def _error(self) -> ApplicationError:
        return ApplicationError(self.message, {"provider": self.name}, type="ProviderNotConfigured", non_retryable=True)

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        raise self._error()

    async def summarize(self, request: SummaryRequest) -> ProviderReply:
        raise self._error()

    def route_profile(self, profile: ModelProfile, options: Mapping[str, Any]) -> ModelProfile:
        return takes_no_options(self.name, profile, options)


# ----------------------------------------------------------------------------------------------------------
# The OpenAI adapter.
# ----------------------------------------------------------------------------------------------------------

ENV_API_KEY = "OPENAI_API_KEY"
ENV_BASE_URL = "OPENAI_BASE_URL"
NOT_CONFIGURED = "provider 'openai' is not configured: set OPENAI_API_KEY (and OPENAI_BASE_URL for a compatible server)"


def prompt_cache_key(request: ProviderRequest) -> str:
    return f"{request.session_id}:{request.epoch}"


def render_chat_request(request: ProviderRequest) -> tuple[dict[str, Any], ToolNames]:
    """The `chat.completions.create` arguments for `request`, and the tool-name map to read the reply with.

    Pure: the same request gives the same arguments, and the system message and tools list depend on
    Region A alone, so they are identical for every request of an epoch.
    """
    system, specs = region_a(request.segments)
    names = ToolNames(spec["name"] for spec in specs)
    tools = [
        sorted_json(
            {
                "type": "function",
                "function": {
                    "name": names.wire(spec["name"]),
                    "description": spec.get("description", ""),
                    "parameters": spec.get("input_schema") or {"type": "object", "properties": {}},
                },
            }
        )
        for spec in specs
    ]
    messages: list[dict[str, Any]] = [{"content": system, "role": "system"}] if system else []
    for seg in region_b(request.segments):
        if seg.role == "assistant":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"content": None, "role": "assistant"}
                messages.append(last)
            if seg.kind == "tool_call":
                call_id, tool, arguments = tool_call_of(seg)
                last.setdefault("tool_calls", []).append(
                    sorted_json(
                        {
                            "function": {
                                "arguments": json.dumps(arguments, sort_keys=True, ensure_ascii=False),
                                "name": names.wire(tool),
                            },
                            "id": call_id,
                            "type": "function",
                        }
                    )
                )
            else:
                last["content"] = seg.text if last["content"] is None else last["content"] + seg.text
        elif seg.role == "tool" and seg.call_id:
            messages.append({"content": seg.text, "role": "tool", "tool_call_id": seg.call_id})
        else:
            messages.append({"content": seg.text, "role": "user"})
    messages = [sorted_json(m) for m in messages]
    kwargs: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "prompt_cache_key": prompt_cache_key(request),
    }
    if tools:
        kwargs["tools"] = tools
    return kwargs, names


def read_completion(completion: Any, names: ToolNames, fallback_input_tokens: int) -> ProviderReply:
    """A ChatCompletion as a ProviderReply: text, tool calls under their ctxengine names, usage."""
    choice = completion.choices[0] if completion.choices else None
    message = choice.message if choice is not None else None
    text = (message.content or "") if message is not None else ""
    calls: list[ProviderToolCall] = []
    for tc in (message.tool_calls or []) if message is not None else []:
        function = getattr(tc, "function", None)
        if function is None:  # a custom (non-function) tool: ctxengine never declares one
            continue
        calls.append(
            ProviderToolCall(
                call_id=tc.id, name=names.original(function.name), arguments=parse_arguments(function.arguments)
            )
        )
    usage = completion.usage
    if usage is None:  # some compatible servers omit usage: count, so reconciliation has a figure
        return ProviderReply(text=text, tool_calls=calls, usage=ProviderUsage(input_tokens=fallback_input_tokens))
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0
    return ProviderReply(
        text=text,
        tool_calls=calls,
        usage=ProviderUsage(
            input_tokens=usage.prompt_tokens or 0, cached_tokens=cached, output_tokens=usage.completion_tokens or 0
        ),
    )


class OpenAIProvider:
    """The port over `openai.AsyncOpenAI` (Chat Completions), SDK retries off."""

    configured = True
    name = "openai"

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str | None = None,
        counter: TiktokenCounter | None = None,
        timeout: float | None = None,
    ) -> None:
        import openai  # the SDK takes a while to import: only workers that route to it pay for that

        self._openai = openai
        options: dict[str, Any] = {"api_key": api_key, "base_url": base_url, "max_retries": 0}
        if timeout is not None:
            options["timeout"] = timeout
        self.client = openai.AsyncOpenAI(**options)
        self._counter = counter
        # No read timeout of the SDK's own (600 s): the model call cuts the call at its `timeouts.model_seconds`.
        self.call_timeout = openai.Timeout(timeout, connect=5.0 if timeout is None else min(5.0, timeout))

    async def aclose(self) -> None:
        """Close the SDK client's connections (the worker does, when it stops)."""
        await self.client.close()

    def route_profile(self, profile: ModelProfile, options: Mapping[str, Any]) -> ModelProfile:
        return takes_no_options(self.name, profile, options)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, counter: TiktokenCounter | None = None
    ) -> OpenAIProvider | UnconfiguredProvider:
        config = settings(env)
        secret = config.openai_api_key
        key = secret.get_secret_value() if secret is not None else ""
        if not key:
            return UnconfiguredProvider("openai", NOT_CONFIGURED)
        return cls(api_key=key, base_url=config.openai_base_url or None, counter=counter)

    def _count(self, kwargs: Mapping[str, Any]) -> int:
        counter = self._counter or TiktokenCounter()
        return counter.count(json.dumps(kwargs.get("messages", []), ensure_ascii=False))

    async def _create(self, kwargs: dict[str, Any], request: ProviderRequest | None, model: str) -> Any:
        openai = self._openai
        try:
            return await self.client.chat.completions.create(**kwargs, timeout=self.call_timeout)
        except openai.APIStatusError as exc:
            raise self._status_error(exc, request, model) from exc
        except openai.APITimeoutError as exc:
            raise connection_error(self.name, exc, timeout=True) from exc
        except openai.APIConnectionError as exc:
            raise connection_error(self.name, exc, timeout=False) from exc

    def _status_error(self, exc: Any, request: ProviderRequest | None, model: str) -> ApplicationError:
        body = exc.body if isinstance(exc.body, Mapping) else {}
        message = str(body.get("message") or exc.message)
        code = exc.code or (str(body["code"]) if body.get("code") is not None else None)
        if exc.status_code in (400, 413) and (
            code == "context_length_exceeded" or "maximum context length" in message.lower()
        ):
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
            error_type=getattr(exc, "type", None),
            code=code,
            headers=exc.response.headers,
            request_id=exc.request_id,
        )

    async def _create_raw(self, kwargs: dict[str, Any], request: ProviderRequest) -> tuple[Any, bytes]:
        """Like `_create`, and the request body's bytes exactly as sent (for the wire hash)."""
        openai = self._openai
        try:
            raw = await self.client.chat.completions.with_raw_response.create(**kwargs, timeout=self.call_timeout)
        except openai.APIStatusError as exc:
            raise self._status_error(exc, request, request.model) from exc
        except openai.APITimeoutError as exc:
            raise connection_error(self.name, exc, timeout=True) from exc
        except openai.APIConnectionError as exc:
            raise connection_error(self.name, exc, timeout=False) from exc
        parsed = raw.parse()
        return (await parsed if inspect.isawaitable(parsed) else parsed), bytes(raw.http_request.content)

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        kwargs, names = render_chat_request(request)
        completion, sent = await self._create_raw(kwargs, request)
        reply = read_completion(completion, names, fallback_input_tokens=self._count(kwargs))
        return reply.model_copy(update={"wire_prefix": wire_prefix(sent, "openai")})

    async def summarize(self, request: SummaryRequest) -> ProviderReply:
        kwargs = {
            "model": request.model,
            "messages": [
                {"content": SUMMARY_PROMPT.format(max_tokens=request.max_tokens), "role": "system"},
                {"content": request.text, "role": "user"},
            ],
            "max_completion_tokens": request.max_tokens,
            "prompt_cache_key": f"{request.session_id}:summary",
        }
        completion = await self._create(kwargs, None, request.model)
        return read_completion(completion, ToolNames(), fallback_input_tokens=self._count(kwargs))
