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


@app.command()
def demo() -> None:
    """Bring everything up and run one scripted session."""
    typer.echo("runtime arrives with the session workflow: `make test` exercises the pure builder today.")


if __name__ == "__main__":
    app()
