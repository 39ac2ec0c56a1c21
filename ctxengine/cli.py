"""The `ctxengine` console script: rich output for people, one JSON object on stdout for machines."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ctxengine: the context engine for agent sessions.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures measured side by side.")
app.add_typer(bench_app, name="bench")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


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
    from bench.build_bench import run

    emit(run(rounds=rounds, progress=not as_json), as_json, "bench build")


@bench_app.command("turns")
def bench_turns(
    as_json: JsonFlag = False,
    turns: Annotated[int, typer.Option(help="Plain turns in the single-session latency run.")] = 50,
    long_turns: Annotated[int, typer.Option("--long-turns", help="Turns in the long-session run.")] = 2_000,
) -> None:
    """Per-turn latency and throughput of the engine against a bare two-activity Temporal floor."""
    import asyncio

    from bench.turns_bench import run

    emit(asyncio.run(run(turns=turns, long_turns=long_turns, progress=not as_json)), as_json, "bench turns")


@app.command()
def demo(
    keep_running: Annotated[bool, typer.Option("--keep-running", help="Leave services and the UI up.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Bring everything up, run one scripted session, print each turn and the Temporal UI address."""
    import asyncio

    from ctxengine.demo import run_demo

    result = asyncio.run(run_demo(keep_running=keep_running, console=Console(stderr=as_json, width=150)))
    if as_json:
        emit(result, True, "demo")


@app.command()
def worker() -> None:
    """Run a worker (embedded services when TEMPORAL_ADDRESS / CTXENGINE_DATABASE_URL are unset)."""
    import asyncio

    from worker import main

    asyncio.run(main())


@app.command()
def inspect(
    session_id: str,
    turn: Annotated[int | None, typer.Option(help="The request of this turn (default: the last).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a request's context window: regions, classes against caps, yields, pointers, usage."""
    import asyncio

    from ctxengine.inspection import inspect_session, print_inspection
    from ctxengine.services import services

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


if __name__ == "__main__":
    app()
