"""The `ctxengine` console script: rich output for people, one JSON object on stdout for machines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ctxengine: the context engine for agent sessions.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures measured side by side.")
app.add_typer(bench_app, name="bench")

# Each command imports what it runs inside its body: `ctxengine --help` and a quick `inspect` should not pay
# for importing Temporal workers, benchmarks and their peers. (Start-up speed, not cycles: the layers have none.)
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


@app.callback()
def _setup(ctx: typer.Context) -> None:
    """Logs go to stderr as JSON lines (stdout is for results); the worker logs at info, the rest at warning."""
    import logging

    from worker import configure_logging, install_runtime

    configure_logging(logging.INFO if ctx.invoked_subcommand == "worker" else logging.WARNING)
    if ctx.invoked_subcommand != "worker":  # the worker installs its own, with the metrics endpoint
        install_runtime()


def emit(result: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
        return
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


@bench_app.command("build")
def bench_build(
    as_json: JsonFlag = False,
    rounds: Annotated[int, typer.Option(help="Timed repetitions per case.")] = 30,
) -> None:
    """Build latency against LangChain trim_messages and the join+hash floor (issue: pure builder)."""
    from harness.bench.build_bench import run

    emit(run(rounds=rounds, progress=not as_json), as_json, "bench build")


@bench_app.command("rendering")
def bench_rendering(as_json: JsonFlag = False) -> None:
    """Escaping overhead (cl100k tokens) on benign HTML, Markdown, code and JSON; the written attacks."""
    from harness.bench.rendering_bench import run

    result = run(progress=not as_json)
    emit(result, as_json, "bench rendering")
    if not result["passed"]:
        raise typer.Exit(1)


@bench_app.command("turns")
def bench_turns(
    as_json: JsonFlag = False,
    turns: Annotated[int, typer.Option(help="Plain turns in the single-session latency run.")] = 50,
    long_turns: Annotated[int, typer.Option("--long-turns", help="Turns in the long-session run.")] = 2_000,
) -> None:
    """Per-turn latency and throughput of the engine against a bare two-activity Temporal floor."""
    import asyncio

    from harness.bench.turns_bench import run

    emit(asyncio.run(run(turns=turns, long_turns=long_turns, progress=not as_json)), as_json, "bench turns")


@bench_app.command("cache")
def bench_cache(as_json: JsonFlag = False) -> None:
    """Cache economics, priced: ctxengine against a stable-prompt assembler that trims when full, one that summarizes
    when full, and a naive one with the clock in its system prompt."""
    from harness.bench.cache_bench import run

    emit(run(progress=not as_json), as_json, "bench cache")


@app.command()
def demo(
    keep_running: Annotated[bool, typer.Option("--keep-running", help="Leave services and the UI up.")] = False,
    provider: Annotated[
        str, typer.Option(help="scripted (offline), openai or anthropic (see docs/providers.md for keys).")
    ] = "scripted",
    model: Annotated[str | None, typer.Option(help="Model name for a real provider.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Bring everything up, run one scripted session, print each turn and the Temporal UI address."""
    import asyncio

    from ctxengine.demo import run_demo

    result = asyncio.run(
        run_demo(keep_running=keep_running, provider=provider, model=model, console=Console(stderr=as_json, width=150))
    )
    if as_json:
        emit(result, True, "demo")


@app.command()
def worker() -> None:
    """Run a worker (embedded services when TEMPORAL_ADDRESS / CTXENGINE_DATABASE_URL are unset)."""
    from worker import run

    run()


@app.command()
def inspect(
    session_id: str,
    turn: Annotated[int | None, typer.Option(help="The request of this turn (default: the last).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a request's context window: regions, classes against caps, yields, pointers, usage."""
    import asyncio

    from ctxengine.inspection import inspect_session, print_inspection
    from services.stack import services

    async def go() -> dict[str, Any]:
        async with services(temporal=False) as svc:
            return await inspect_session(svc.store, session_id, turn)

    try:
        view = asyncio.run(go())
    except LookupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        sys.stdout.write(json.dumps(view) + "\n")
    else:
        print_inspection(view)


@app.command()
def gate(
    name: Annotated[
        str, typer.Argument(help="stability, trust, budget, pairs, determinism, compaction, chaos, inputs, or all.")
    ],
    as_json: JsonFlag = False,
    inject_prefix_timestamp: Annotated[
        bool, typer.Option("--inject-prefix-timestamp", hidden=True, help="Test-only fault: a clock in the prefix.")
    ] = False,
    seed: Annotated[
        int | None,
        typer.Option("--seed", help="chaos and inputs: draw kills and cases from this seed (each reports its seed)."),
    ] = None,
) -> None:
    """Run a hard gate on the live stack (embedded services unless TEMPORAL_ADDRESS / CTXENGINE_DATABASE_URL)."""
    import asyncio

    from activities.session import SessionActivities
    from harness.faults import PrefixTimestampFault
    from harness.gates import ALL, GATES, SEEDED, run_gate, run_gates

    fault = PrefixTimestampFault if inject_prefix_timestamp else SessionActivities

    if name != "all" and name not in GATES:
        typer.echo(f"error: unknown gate {name!r}; choose from {', '.join([*GATES, 'all'])}", err=True)
        raise typer.Exit(2)
    if seed is not None and name not in (*SEEDED, "all"):
        typer.echo(f"error: --seed applies to {', '.join(SEEDED)} (and all), not {name!r}", err=True)
        raise typer.Exit(2)
    if name == "all":
        result = asyncio.run(run_gates(list(ALL), activities_class=fault, seed=seed))
    else:
        seeded: dict[str, Any] = {"seed": seed} if seed is not None else {}
        result = asyncio.run(run_gate(name, activities_class=fault, **seeded))
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        rows = result["gates"] if name == "all" else {name: result}
        for gate_name, figures in rows.items():
            emit(
                {k: v for k, v in figures.items() if not isinstance(v, dict | list)},
                False,
                f"gate {gate_name}: {'PASS' if figures['passed'] else 'FAIL'}",
            )
    raise typer.Exit(0 if result["passed"] else 1)


@app.command()
def validate(
    configs: Annotated[list[Path], typer.Argument(help="SessionOpen files (JSON or YAML).")],
    model: Annotated[
        list[str],
        typer.Option("--model", help="Route provider/model; repeat for several. Default: each config's own route."),
    ] = [],  # noqa: B006 - typer reads the default
    message_tokens: Annotated[
        int, typer.Option("--message-tokens", min=1, help="Message size the floor is computed for.")
    ] = 500,
    tool_results: Annotated[
        int, typer.Option("--tool-results", min=0, help="Tool results in one model call, for the floor.")
    ] = 4,
    as_json: JsonFlag = False,
) -> None:
    """Check agent configurations against every route before deployment: exit 0 fits, 1 a class over its cap or
    a window below the floor, 2 invalid.

    The floor is the smallest context window that takes a turn of that message size and that many tool results;
    each route's window (its own, lowered by the config's `budget.context_window`) must reach it."""
    from ctxengine.operator_tools import floor_lines, offending_lines, validate_files

    code, report = validate_files(configs, model, message_tokens=message_tokens, tool_results=tool_results)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    elif code == 2:
        typer.echo(f"error: {report['error']}", err=True)
    else:
        console = Console()
        for cfg in report["configs"]:
            for r in cfg["routes"]:
                # A class over its cap leaves no floor to compare, so at most one of the two fails.
                failed = "OVER A CAP" if r["offending"] else "WINDOW BELOW FLOOR" if r["window_below_floor"] else ""
                table = Table(title=f"{cfg['config']} on {r['route']}: {failed or 'fits'}")
                for col in ("class", "tokens", "cap", "headroom", "count"):
                    table.add_column(col, justify="left" if col == "class" else "right")
                for name, row in r["classes"].items():
                    count = f"{row['count']}/{row['count_cap']}" if "count" in row else ""
                    table.add_row(name, f"{row['tokens']:,}", f"{row['cap']:,}", f"{row['headroom']:,}", count)
                console.print(table)
                for w in r["warnings"]:
                    console.print(f"[yellow]warning:[/yellow] {w}")
                if (floor := r["min_context_window"]) is not None and floor > 0:
                    f = r["floor_for"]
                    console.print(
                        f"floor: a {f['message_tokens']:,}-token message with {f['tool_results']} tool results "
                        f"needs a context window of at least {floor:,} tokens (this route's: {r['context_window']:,})"
                    )
        for line in offending_lines(report):
            typer.echo(f"over cap: {line}", err=True)
        for line in floor_lines(report):
            typer.echo(f"window below floor: {line}", err=True)
    raise typer.Exit(code)


@app.command()
def replay(
    session_id: str,
    window: Annotated[int | None, typer.Option(help="Context window to rebuild under.")] = None,
    output_reserve: Annotated[int | None, typer.Option("--output-reserve", help="Output reserve.")] = None,
    budget: Annotated[Path | None, typer.Option(help="JSON/YAML file of ContextBudget overrides.")] = None,
    model: Annotated[str | None, typer.Option(help="Route provider/model to estimate with.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Rebuild every recorded request of a session under other settings (never writes to the session)."""
    import asyncio

    import pydantic
    import yaml

    from activities.rebuild import Overrides, rebuild_session
    from activities.tokens import TiktokenCounter
    from core.budget import ContextBudget
    from ctxengine.operator_tools import ConfigError, parse_route
    from services.stack import services

    def refuse(message: str) -> NoReturn:
        """A setting that cannot be used: named, exit 2 (1 means a replay that did not reproduce)."""
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)

    changes: dict[str, Any] = {}
    if budget is not None:
        try:
            loaded = yaml.safe_load(budget.read_text())
        except (OSError, UnicodeError, yaml.YAMLError) as exc:
            refuse(f"--budget {budget}: {exc}")
        if not isinstance(loaded, dict | None):
            refuse(f"--budget {budget}: expected a mapping of ContextBudget fields, got {type(loaded).__name__}")
        changes.update(loaded or {})
    if window is not None:
        changes["context_window"] = window
    if output_reserve is not None:
        changes["output_reserve"] = output_reserve
    if unknown := sorted(set(changes) - set(ContextBudget.model_fields)):
        known = ", ".join(ContextBudget.model_fields)
        refuse(f"unknown budget field(s): {', '.join(map(str, unknown))} (ContextBudget has {known})")
    try:
        profile = parse_route(model).profile() if model else None
    except ConfigError as exc:
        refuse(str(exc))
    overrides = Overrides(budget=changes, profile=profile)
    counters: dict[str, TiktokenCounter] = {}

    async def go() -> list[Any]:
        async with services(temporal=False) as svc:
            return await rebuild_session(
                svc.store, session_id, lambda e: counters.setdefault(e, TiktokenCounter(e)), overrides
            )

    try:
        rows = asyncio.run(go())
    except LookupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except pydantic.ValidationError as exc:  # the overrides and a recorded budget make no valid budget
        refuse(f"the overrides do not make a valid budget: {'; '.join(e['msg'] for e in exc.errors())}")
    first_compaction = next((r for r in rows if r.status == "needs_compaction"), None)
    report = {
        "session_id": session_id,
        "settings_changed": not overrides.empty,
        "requests": len(rows),
        "reproduced": sum(r.reproduced for r in rows),
        "prefix_hashes_differ": sum(r.prefix_sha256 != r.recorded_prefix_sha256 for r in rows),
        "needs_compaction": sum(r.status == "needs_compaction" for r in rows),
        "errors": sum(r.status == "error" for r in rows),
        "first_compaction_needed": (
            {
                "turn": first_compaction.turn,
                "call_index": first_compaction.call_index,
                "deficit_tokens": first_compaction.deficit_tokens,
            }
            if first_compaction
            else None
        ),
        "turns": [r.model_dump() | {"reproduced": r.reproduced} for r in rows],
    }
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        table = Table(title=f"replay {session_id}" + (" (changed settings)" if changes or model else ""))
        for col in ("turn", "epoch", "status", "estimate", "recorded", "actual", "prefix", "yields"):
            table.add_column(col)
        for r in rows:
            same = "same" if r.prefix_sha256 == r.recorded_prefix_sha256 else "DIFFERS"
            table.add_row(
                f"{r.turn}.{r.call_index}",
                str(r.epoch),
                r.status + (f" (-{r.deficit_tokens:,})" if r.deficit_tokens else ""),
                f"{r.estimated_tokens or 0:,}",
                f"{r.recorded_estimated_tokens:,}",
                f"{r.actual_input_tokens:,}" if r.actual_input_tokens is not None else "-",
                same,
                ", ".join(r.yields) or r.error or "",
            )
        Console().print(table)
        fc = report["first_compaction_needed"]
        typer.echo(
            f"reproduced {report['reproduced']}/{len(rows)}; first compaction needed: "
            + (f"turn {fc['turn']} ({fc['deficit_tokens']:,} tokens over)" if fc else "never")
        )
    if not changes and not model and report["reproduced"] != len(rows):
        raise typer.Exit(1)


@app.command()
def schema(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the JSON Schemas into.")],
    as_json: JsonFlag = False,
) -> None:
    """Write JSON Schema for the start input, every update's input and result, and the query (docs/contract.md)."""
    from ctxengine.schema import write_schemas

    written = write_schemas(out)
    if as_json:
        sys.stdout.write(json.dumps({"out": str(out), "files": [p.name for p in written]}) + "\n")
    else:
        typer.echo(f"wrote {len(written)} files to {out}")


@app.command()
def purge(
    session: Annotated[str, typer.Option("--session", help="The closed session to erase.")],
    as_json: JsonFlag = False,
) -> None:
    """Erase a closed session from PostgreSQL: log, artifacts, requests, checkpoints, events, formed memories.

    Temporal keeps its workflow histories until the namespace's retention period expires."""
    import asyncio

    from activities.store import SessionNotClosedError
    from ctxengine.client import HISTORY_NOTE
    from services.stack import services

    async def go() -> dict[str, int]:
        async with services(temporal=False) as svc:
            return await svc.store.purge_session(session)

    try:
        rows = asyncio.run(go())
    except (LookupError, SessionNotClosedError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    report = {"session_id": session, "rows_deleted": rows, "temporal_history": HISTORY_NOTE}
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        emit(rows, False, f"purged {session}")
        typer.echo(HISTORY_NOTE)


def main() -> None:
    """The console script. A malformed environment variable exits 2 naming the variable, whichever command read
    it (docs/operations.md, "Configuration"), not 1 with a traceback; PostgreSQL down or refusing the connection
    exits 3 for a command that needs it (1 stays "not found"), also with one line."""
    from contract.settings import SettingsError
    from services.stack import PostgresUnreachable

    try:
        app()
    except SettingsError as exc:
        sys.stderr.write(f"ctxengine: {exc}\n")
        raise SystemExit(2) from None
    except PostgresUnreachable as exc:
        sys.stderr.write(f"ctxengine: {exc}\n")
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
