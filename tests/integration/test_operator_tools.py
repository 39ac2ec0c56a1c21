"""`ctxengine validate` and `ctxengine replay` (operator tooling), through the CLI as an operator runs them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.client import Client
from typer.testing import CliRunner

from activities.tokens import TiktokenCounter
from contract.payloads import SessionOpen
from ctxengine.cli import app
from ctxengine.operator_tools import validate_config
from tests.integration.session_helpers import session_open, stack, start, turn

EXAMPLE = Path(__file__).parents[2] / "examples" / "session_open.json"
runner = CliRunner()
# Large agent instructions (under their cap) on a 4,096-token window: no turn fits, though every class does.
_BIG_ON_SMALL_WINDOW = {
    "agent_instructions": "rule" + " rule" * 3_500,
    "model_route": {"provider": "openai", "model": "gpt-4o", "context_window": 4_096},
    "budget": {"output_reserve": 256},
}


def _instructions_measuring(tokens: int) -> str:
    """Agent instructions whose class measures exactly `tokens` (envelope included): ' rule' is one token."""
    counter = TiktokenCounter()
    words = tokens
    for _ in range(6):
        text = "rule" + " rule" * (words - 1)
        open_ = SessionOpen(agent_instructions=text)
        got = validate_config(open_, open_.route, lambda _: counter)["classes"]["agent_instructions"]["tokens"]
        if got == tokens:
            return text
        words += tokens - got
    raise AssertionError(f"could not hit {tokens} tokens (last {got})")


class TestValidate:
    def test_example_fits_with_figures(self) -> None:
        """The example configuration fits and each class reports tokens, cap and headroom."""
        res = runner.invoke(app, ["validate", str(EXAMPLE), "--model", "anthropic/claude-sonnet-4-6", "--json"])
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout)
        classes = report["configs"][0]["routes"][0]["classes"]
        assert classes["tools"]["count"] == 3 and classes["tools"]["count_cap"] == 30  # the control tool is not counted
        assert classes["agent_instructions"]["cap"] == 4_000 and classes["agent_instructions"]["headroom"] > 0

    def test_thirty_operator_tools_fit_and_thirty_one_do_not(self, tmp_path: Path) -> None:
        """30 operator tools fit (the platform's control tool takes none of the 30 places, as at session open);
        31 exit 1 naming the count."""
        tools = [{"name": f"tool_{i:02d}", "description": f"Tool number {i}."} for i in range(31)]
        fits, over = tmp_path / "thirty.json", tmp_path / "thirty-one.json"
        fits.write_text(json.dumps({"agent_instructions": "Be brief.", "tools": tools[:30]}))
        over.write_text(json.dumps({"agent_instructions": "Be brief.", "tools": tools}))
        res = runner.invoke(app, ["validate", str(fits), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["configs"][0]["routes"][0]["classes"]["tools"]["count"] == 30
        res = runner.invoke(app, ["validate", str(over)])
        assert res.exit_code == 1 and "31 tools, cap 30" in res.stderr

    def test_oversized_instructions_exit_1_naming_class(self, tmp_path: Path) -> None:
        """4,500 tokens of agent instructions exit 1 naming agent_instructions, 4,500 and 4,000."""
        cfg = tmp_path / "big.json"
        cfg.write_text(json.dumps({"agent_instructions": _instructions_measuring(4_500)}))
        res = runner.invoke(app, ["validate", str(cfg)])
        assert res.exit_code == 1
        assert "agent_instructions: 4,500 tokens, cap 4,000" in res.stderr

    def test_malformed_file_exits_2_naming_field(self, tmp_path: Path) -> None:
        """A file that is not a SessionOpen exits 2 naming the field and the reason."""
        cfg = tmp_path / "bad.yaml"
        cfg.write_text("agent_instructions: hi\ntools:\n  - name: 'has space'\n    description: x\n")
        res = runner.invoke(app, ["validate", str(cfg)])
        assert res.exit_code == 2
        assert "tools.0.name" in res.stderr

    def test_misspelt_field_is_named_beside_the_missing_one(self, tmp_path: Path) -> None:
        """A misspelt `agent_instructions` exits 2 naming both the missing field and the unknown one."""
        cfg = tmp_path / "typo.json"
        cfg.write_text(json.dumps({"agent_instrucions": "Be brief."}))
        res = runner.invoke(app, ["validate", str(cfg)])
        assert res.exit_code == 2
        assert "field agent_instructions: Field required" in res.stderr
        assert "field agent_instrucions: Extra inputs are not permitted" in res.stderr

    def test_short_prefix_warns_uncacheable(self, tmp_path: Path) -> None:
        """A prefix below the route's minimum cacheable length is warned about."""
        cfg = tmp_path / "tiny.json"
        cfg.write_text(json.dumps({"agent_instructions": "hi", "platform_policy": "be good"}))
        res = runner.invoke(app, ["validate", str(cfg), "--model", "anthropic/claude-haiku-4-5", "--json"])
        assert "minimum cacheable" in json.loads(res.stdout)["configs"][0]["routes"][0]["warnings"][0]

    def test_own_small_window_below_floor_exits_1(self, tmp_path: Path) -> None:
        """Without --model a configuration is checked on its own route: a 4,096-token window that cannot take a
        turn exits 1 naming the route, its window, the floor and the turn it was computed for."""
        cfg = tmp_path / "small.json"
        cfg.write_text(json.dumps(_BIG_ON_SMALL_WINDOW))
        res = runner.invoke(app, ["validate", str(cfg)])
        assert res.exit_code == 1, res.output
        assert "WINDOW BELOW FLOOR" in " ".join(res.stdout.split())
        assert f"window below floor: {cfg} [openai/gpt-4o]: context window 4,096 < floor " in res.stderr
        assert "(a 500-token message with 4 tool results)" in res.stderr
        report = json.loads(runner.invoke(app, ["validate", str(cfg), "--json"]).stdout)
        (route,) = report["configs"][0]["routes"]
        assert route["route"] == "openai/gpt-4o" and route["offending"] == []
        assert route["context_window"] == 4_096 < route["min_context_window"] and not route["fits"]

    def test_named_route_window_is_the_one_compared(self, tmp_path: Path) -> None:
        """With --model the configuration is checked on that route's window (128,000 for openai/gpt-4o: exit 0),
        lowered by a `budget.context_window` override (4,096: exit 1)."""
        cfg, lowered = tmp_path / "small.json", tmp_path / "lowered.json"
        cfg.write_text(json.dumps(_BIG_ON_SMALL_WINDOW))
        lowered_budget = {"output_reserve": 256, "context_window": 4_096}
        lowered.write_text(json.dumps(_BIG_ON_SMALL_WINDOW | {"model_route": None, "budget": lowered_budget}))
        res = runner.invoke(app, ["validate", str(cfg), "--model", "openai/gpt-4o", "--json"])
        assert res.exit_code == 0, res.output
        (route,) = json.loads(res.stdout)["configs"][0]["routes"]
        assert route["context_window"] == 128_000 and route["fits"] and route["min_context_window"] > 4_096
        res = runner.invoke(app, ["validate", str(lowered), "--model", "openai/gpt-4o"])
        assert res.exit_code == 1 and f"{lowered} [openai/gpt-4o]: context window 4,096 < floor" in res.stderr

    def test_own_anthropic_route_is_the_one_checked(self, tmp_path: Path) -> None:
        """A configuration whose own route is Anthropic is measured on Anthropic, with its window, without --model."""
        cfg = tmp_path / "anthropic.json"
        cfg.write_text(
            json.dumps(
                {
                    "agent_instructions": "Be brief.",
                    "model_route": {"provider": "anthropic", "model": "claude-sonnet-4-6"},
                }
            )
        )
        res = runner.invoke(app, ["validate", str(cfg), "--json"])
        assert res.exit_code == 0, res.output
        (route,) = json.loads(res.stdout)["configs"][0]["routes"]
        assert route["route"] == "anthropic/claude-sonnet-4-6" and route["context_window"] == 200_000

    def test_reserve_over_the_named_routes_window_is_below_floor(self, tmp_path: Path) -> None:
        """An output reserve that takes a named route's whole window is reported as a window below the floor,
        exit 1, not a traceback."""
        cfg = tmp_path / "wide.json"
        route = {"provider": "openai", "model": "gpt-4.1", "context_window": 1_000_000}
        cfg.write_text(
            json.dumps({"agent_instructions": "Be brief.", "model_route": route, "budget": {"output_reserve": 150_000}})
        )
        res = runner.invoke(app, ["validate", str(cfg), "--model", "openai/gpt-4o"])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert f"{cfg} [openai/gpt-4o]: context window 128,000 < floor " in res.stderr


@pytest.mark.integration
async def test_replay_reproduces_and_halving_needs_compaction(
    temporal_client: Client, pg_dsn: str, task_queue: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no changed setting replay reproduces every recorded request; with the window halved it says where
    compaction would first be needed; settings it cannot use are refused, named, exit 2."""
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        handle = await start(
            temporal_client, task_queue, session_open(budget={"context_window": 9_000, "output_reserve": 1_000})
        )
        for i in range(12):
            await turn(handle, f"turn {i}: " + "words " * 150 + '\n/call web.fetch {"url": "fixture://weather"}')
        records = await store.records(handle.id)
    monkeypatch.setenv("CTXENGINE_DATABASE_URL", pg_dsn)
    # The CLI runs its own event loop: invoke it from a thread, as a separate process would.
    same = await asyncio.to_thread(runner.invoke, app, ["replay", handle.id, "--json"])
    assert same.exit_code == 0, same.output
    report = json.loads(same.stdout)
    assert report["requests"] == len(records) and report["reproduced"] == len(records)
    assert report["prefix_hashes_differ"] == 0
    halved_run = await asyncio.to_thread(runner.invoke, app, ["replay", handle.id, "--window", "4500", "--json"])
    halved = json.loads(halved_run.stdout)
    assert halved["first_compaction_needed"] is not None
    assert halved["first_compaction_needed"]["turn"] > 1
    assert halved["prefix_hashes_differ"] == 0
    # Settings that cannot be used are refused in one line, exit 2, before or after reading the session.
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("bogus: 1\n")
    for args, says in (
        (["--window", "900"], "output_reserve"),  # under the recorded 1,000-token reserve
        (["--budget", str(bad_yaml)], "unknown budget field(s): bogus"),
        (["--budget", str(tmp_path / "missing.yaml")], "missing.yaml"),
        (["--model", "bogus/x"], "bogus"),
    ):
        refused = await asyncio.to_thread(runner.invoke, app, ["replay", handle.id, *args, "--json"])
        assert refused.exit_code == 2, (args, refused.output)
        assert refused.stderr.startswith("error: ") and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.output


class TestValidateFloor:
    def test_floor_is_the_smallest_window_that_takes_the_turn(self) -> None:
        """validate's floor takes a turn of that message and those results; one token less does not."""
        from core.build import PrefixInputs
        from core.estimator import TokenEstimator
        from ctxengine.operator_tools import _takes_turn, costliest_prefix

        counter = TiktokenCounter()
        open_ = session_open(budget={"output_reserve": 600})
        report = validate_config(open_, open_.route, lambda _: counter, message_tokens=300, tool_results=4)
        floor = report["min_context_window"]
        assert 600 + report["prefix_tokens"] + 300 < floor < 16_384
        estimator = TokenEstimator(open_.route.profile(), counter)
        loose = report  # the prefix is measured the same way validate measures it
        assert loose["floor_for"] == {"message_tokens": 300, "tool_results": 4}
        tools = [t for t in validate_prefix_tools(open_)]
        prefix, secret, tail = costliest_prefix(  # the prefix validate measures the floor on, and its tail
            PrefixInputs(
                platform_policy=open_.platform_policy, agent_instructions=open_.agent_instructions, tools=tools
            ),
            open_.context_budget().model_copy(update={"tools_max_count": 10**9}),
            estimator,
        )
        message = " ".join(["word"] * 300)
        budget = open_.context_budget(estimator.profile)
        assert tail > 0  # a costlier secret's prefix has room too
        assert _takes_turn(budget, prefix, estimator, floor, message, 4, secret, tail)
        assert not _takes_turn(budget, prefix, estimator, floor - 1, message, 4, secret, tail)

    def test_more_tool_results_need_a_larger_window(self) -> None:
        """The floor grows with the number of tool results, and the CLI prints it per route."""
        counter = TiktokenCounter()
        open_ = session_open(budget={"output_reserve": 600})
        floors = [
            validate_config(open_, open_.route, lambda _: counter, tool_results=n)["min_context_window"]
            for n in (0, 4, 8)
        ]
        assert floors == sorted(floors) and floors[0] < floors[2]
        res = runner.invoke(app, ["validate", str(EXAMPLE), "--tool-results", "8", "--message-tokens", "200"])
        assert "floor: a 200-token message with 8 tool results" in " ".join(res.output.split())


def validate_prefix_tools(open_: SessionOpen) -> list:  # type: ignore[type-arg]
    from core.items import ToolDefinition
    from core.working_state import CONTROL_TOOL_DESCRIPTION, CONTROL_TOOL_NAME, control_tool_schema

    tools = [
        ToolDefinition(id=f"tool.{t.name}", name=t.name, description=t.description, input_schema=t.input_schema)
        for t in open_.tools
    ]
    tools.append(
        ToolDefinition(
            id=f"tool.{CONTROL_TOOL_NAME}",
            name=CONTROL_TOOL_NAME,
            description=CONTROL_TOOL_DESCRIPTION,
            input_schema=control_tool_schema(),
        )
    )
    return tools
