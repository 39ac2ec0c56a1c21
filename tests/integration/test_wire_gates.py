"""The gates' independent observers (harness/wire_gates.py) against sessions driven through the real adapters
and the scripted protocol servers (harness/protocol_servers.py), without Temporal; each with the fault it
must catch, injected here in the harness (an adapter subclass, an estimator, a renderer), never by a switch
production code reads."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from activities.anthropic_provider import AnthropicProvider
from activities.openai_provider import OpenAIProvider, read_completion, render_chat_request
from activities.provider import ProviderReply, ProviderRequest
from activities.providers import close_providers
from activities.wire import wire_prefix
from core.build import FrozenPrefix, PrefixInputs, open_prefix, pointer_for
from core.estimator import ModelProfile, TokenEstimator
from core.item_rendering import render_item
from core.items import HistoryItem, Item, ToolResult, parse_history_item
from harness.protocol_servers import FakeServer, scripted_anthropic_server, scripted_openai_server
from harness.wire_gates import (
    check_wire_budget,
    check_wire_pairs,
    check_wire_stability,
    compare_item_render,
    compare_rerender,
)
from tests.integration import test_providers as tp

pytestmark = pytest.mark.integration


@pytest.fixture
def openai_wire() -> Iterator[FakeServer]:
    server = scripted_openai_server()
    yield server
    server.stop()


@pytest.fixture
def anthropic_wire() -> Iterator[FakeServer]:
    server = scripted_anthropic_server(ratio=1.0)
    yield server
    server.stop()


TURNS = [
    "Hi! I am planning a weekend in Oslo.",
    'What will the weather be?\n/call web.fetch {"url": "https://example.com/weather"}',
    "Any dinner ideas?",
    'Note this.\n/call notes.save {"text": "pack a raincoat"}\n/call web.fetch {"url": "https://example.com/b"}',
    "Thanks!",
]


async def drive(session: tp.Session) -> tp.Session:
    """Five turns; the tool calls come from the protocol server reading the `/call` lines off the wire."""
    for text in TURNS:
        await session.turn_(text)
    return session


def records_of(session: tp.Session) -> list[dict[str, Any]]:
    """What the request records would say of each request: epoch, checkpoint, yields, limit, estimate."""
    return [
        {
            "epoch": sent.request.epoch,
            "turn": index,
            "call_index": 0,
            "inputs": {"checkpoint_id": None, "profile": ESTIMATOR_PROFILE},
            "plan": {
                "pointers": session.yields[index],
                "yields": [],
                "input_limit": tp.BUDGET.input_limit,
                "status": "fits",
            },
            "estimated_tokens": sent.request.estimated_tokens,
            "actual_input_tokens": sent.reply.usage.input_tokens,
            "wire_prefix_sha256": sent.reply.wire_prefix.sha256 if sent.reply.wire_prefix else None,
        }
        for index, sent in enumerate(session.sent)
    ]


ESTIMATOR_PROFILE = tp.ESTIMATOR.profile.model_dump(mode="json")


def openai_session(server: FakeServer, cls: type[OpenAIProvider] = OpenAIProvider) -> tp.Session:
    return tp.Session(tp.made(cls(api_key="k", base_url=server.url + "/v1", counter=tp.COUNTER)), "openai")


def anthropic_session(server: FakeServer) -> tp.Session:
    return tp.Session(tp.made(AnthropicProvider(api_key="k", base_url=server.url)), "anthropic")


@pytest.fixture(autouse=True)
async def _close_adapters() -> AsyncIterator[None]:
    """The adapters a test makes (`tp.made`), their SDK clients closed after it."""
    yield
    await close_providers(tp.MADE)
    tp.MADE.clear()


class TestStabilityObserver:
    async def test_both_adapters_one_wire_prefix_and_no_unexplained_break(
        self, openai_wire: FakeServer, anthropic_wire: FakeServer
    ) -> None:
        """Through either adapter, the recorded bodies carry one wire prefix, matching the adapter's claim, and
        each request's history is a byte prefix of the next's; the server answered the `/call` lines."""
        for server, session in (
            (openai_wire, openai_session(openai_wire)),
            (anthropic_wire, anthropic_session(anthropic_wire)),
        ):
            await drive(session)
            result = check_wire_stability(server.requests, records_of(session))
            assert result["faults"] == [] and result["wire_requests_checked"] == len(session.sent) == 7
            assert result["wire_prefix_hashes_per_epoch"] == 1 and result["history_breaks"] == 0

    async def test_negative_request_id_in_system_prompt(self, openai_wire: FakeServer) -> None:
        """An adapter that appends a request id to the system message: the observer names the changed prefix."""
        session = await drive(openai_session(openai_wire, RequestIdAdapter))
        result = check_wire_stability(openai_wire.requests, records_of(session))
        assert result["wire_prefix_hashes_per_epoch"] == 7
        assert any(f.startswith("wire_prefix_changed_within_epoch") for f in result["faults"])


class RequestIdAdapter(OpenAIProvider):
    async def complete(self, request: ProviderRequest) -> ProviderReply:
        kwargs, names = render_chat_request(request)
        kwargs["messages"][0]["content"] += f"\nRequest id: {request.request_sha256[:12]}"
        completion, sent = await self._create_raw(kwargs, request)
        return read_completion(completion, names, 0).model_copy(update={"wire_prefix": wire_prefix(sent, "openai")})


class DroppedToolCallId(OpenAIProvider):
    """The fault the pairs observer guards against: the second request on the wire loses a tool_call_id."""

    async def complete(self, request: ProviderRequest) -> ProviderReply:
        kwargs, names = render_chat_request(request)
        for message in kwargs["messages"]:
            if message["role"] == "tool":
                message.pop("tool_call_id")
                break
        completion, sent = await self._create_raw(kwargs, request)
        return read_completion(completion, names, 0).model_copy(update={"wire_prefix": wire_prefix(sent, "openai")})


class TestPairsObserver:
    async def test_no_orphans_on_either_wire(self, openai_wire: FakeServer, anthropic_wire: FakeServer) -> None:
        """Tool calls and results stay paired in the bodies both adapters send."""
        await drive(openai_session(openai_wire))
        await drive(anthropic_session(anthropic_wire))
        for server in (openai_wire, anthropic_wire):
            result = check_wire_pairs(server.requests)
            assert result["wire_requests_with_orphans"] == 0 and result["wire_requests_checked"] == 7

    async def test_negative_dropped_tool_call_id(self, openai_wire: FakeServer) -> None:
        """A tool message without its tool_call_id on the wire fails the observer, which names the orphan."""
        await drive(openai_session(openai_wire, DroppedToolCallId))
        result = check_wire_pairs(openai_wire.requests)
        assert result["wire_requests_with_orphans"] > 0
        assert result["faults"][0].startswith("orphan_on_wire") and "tool_call_id" in result["faults"][0]


class TestBudgetObserver:
    def test_a_model_name_sets_the_servers_ratio(self) -> None:
        """`-r1.45` at the end of the model name makes the server count 1.45 times more; else its own ratio."""
        from harness.protocol_servers import Received, ScriptedWire

        wire = ScriptedWire("openai", ratio=1.0)
        assert wire.ratio_for(Received("/v1/chat/completions", {}, b"{}", {"model": "budget-r1.45"})) == 1.45
        assert wire.ratio_for(Received("/v1/chat/completions", {}, b"{}", {"model": "gpt-4o"})) == 1.0

    async def test_estimates_cover_the_servers_count(self, openai_wire: FakeServer, anthropic_wire: FakeServer) -> None:
        """The estimator's figures cover what each server counted with its own tokenizer (ratio 1.0)."""
        openai_s = await drive(openai_session(openai_wire))
        anthropic_s = await drive(anthropic_session(anthropic_wire))
        for server, session in ((openai_wire, openai_s), (anthropic_wire, anthropic_s)):
            result = check_wire_budget(server.requests, records_of(session), assume_reconciled=True)
            assert result["faults"] == [], result

    async def test_negative_estimator_fifteen_percent_optimistic(
        self, openai_wire: FakeServer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An estimator 15% optimistic (calibration 0.85, set in the harness) underestimates the server's count
        and the observer says so. (10% no longer does: with the margin on the whole request, and per-message
        overheads this server does not count, a calibration of 0.9 still left 47 tokens of headroom on 1,672.)"""
        optimistic = TokenEstimator(ModelProfile(calibration=0.85), tp.COUNTER)
        monkeypatch.setattr(tp, "ESTIMATOR", optimistic)
        session = await drive(openai_session(openai_wire))
        result = check_wire_budget(openai_wire.requests, records_of(session), assume_reconciled=True)
        assert result["underestimates_by_server_count"] > 0
        assert any(f.startswith("underestimate_after_reconciliation") for f in result["faults"])


class TestDeterminismObserver:
    @staticmethod
    def row() -> dict[str, Any]:
        inputs = PrefixInputs(
            platform_policy="Platform policy: be careful.",
            agent_instructions="You are a travel assistant.",
            tools=list(tp.TOOLS),
        )
        prefix = open_prefix(inputs, budget=tp.BUDGET, estimator=tp.ESTIMATOR, secret=tp.SECRET)
        return {
            "inputs": inputs.model_dump(mode="json"),
            "prefix": prefix.model_dump(mode="json"),
            "profile": tp.ESTIMATOR.profile.model_dump(mode="json"),
        }

    def test_rerender_reproduces_the_stored_bytes(self) -> None:
        """Region A re-rendered from the stored inputs is byte-identical to the stored prefix."""
        diff = compare_rerender(self.row(), secret=tp.SECRET, budget=tp.BUDGET, counter_for=lambda _: tp.COUNTER)
        assert diff is None

    def test_negative_rerender_that_changes_one_byte(self) -> None:
        """A renderer that changes one byte of the policy is caught, at that segment and byte."""

        def one_byte_off(inputs: PrefixInputs, **kw: Any) -> FrozenPrefix:
            policy = inputs.platform_policy.replace("careful", "carefuL")
            return open_prefix(inputs.model_copy(update={"platform_policy": policy}), **kw)

        diff = compare_rerender(
            self.row(), secret=tp.SECRET, budget=tp.BUDGET, counter_for=lambda _: tp.COUNTER, render=one_byte_off
        )
        assert diff is not None and diff.item_id == "platform.1.policy" and diff.offset_in_segment == 26

    def test_stored_item_render_reproduces_and_one_byte_off_is_caught(self) -> None:
        """Render once, at write time: an item's stored render equals a fresh one; a renderer that changes one
        byte (or a stored count that is off by one) is caught, naming the item."""
        item = parse_history_item({"id": "u:1", "seq": 3, "kind": "user_message", "trust": "USER", "text": "careful"})
        stored = render_item(item, tp.SECRET)
        tokens = {"cl100k_base": tp.COUNTER.count(stored)}
        same = compare_item_render(item, stored, tokens, secret=tp.SECRET, counter_for=lambda _: tp.COUNTER)
        assert same is None

        def one_byte_off(it: HistoryItem, secret: bytes) -> str:
            return render_item(it, secret).replace("careful", "carefuL")

        diff = compare_item_render(
            item, stored, tokens, secret=tp.SECRET, counter_for=lambda _: tp.COUNTER, render=one_byte_off
        )
        assert diff is not None and diff.startswith("item_render_differs: u:1 at byte ")
        miscounted = compare_item_render(
            item, stored, {"cl100k_base": tokens["cl100k_base"] + 1}, secret=tp.SECRET, counter_for=lambda _: tp.COUNTER
        )
        assert miscounted is not None and miscounted.startswith("item_count_differs: u:1")

    def test_stored_pointer_render_reproduces_and_one_byte_off_is_caught(self) -> None:
        """A tool result's pointer, rendered when the result was logged, equals a fresh render of the pointer for
        the result's count; a renderer that changes one byte of it is caught, naming the pointer."""
        result = parse_history_item(
            {
                "id": "t1.m0.call0.result",
                "seq": 4,
                "kind": "tool_result",
                "trust": "EXTERNAL_UNTRUSTED",
                "call_id": "call_t1_m0_0",
                "tool_name": "web.fetch",
                "content": "a long page " * 50,
                "is_error": False,
                "artifact_ref": None,
            }
        )
        assert isinstance(result, ToolResult)
        pointer = pointer_for(result, tp.COUNTER.count(render_item(result, tp.SECRET)))
        stored = render_item(pointer, tp.SECRET)
        tokens = {"cl100k_base": tp.COUNTER.count(stored)}
        assert compare_item_render(pointer, stored, tokens, secret=tp.SECRET, counter_for=lambda _: tp.COUNTER) is None

        def one_byte_off(it: Item, secret: bytes) -> str:
            return render_item(it, secret).replace("tokens of", "tokens Of")

        diff = compare_item_render(
            pointer, stored, tokens, secret=tp.SECRET, counter_for=lambda _: tp.COUNTER, render=one_byte_off
        )
        assert diff is not None and diff.startswith("item_render_differs: t1.m0.call0.result#pointer at byte ")
