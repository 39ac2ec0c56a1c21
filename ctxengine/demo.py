"""`ctxengine demo`: everything up, one scripted session, each turn printed, then a clean stop."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from rich.console import Console
from rich.table import Table

from activities.providers import build_providers
from activities.tools import DEMO_TOOLS
from contract import names
from contract.payloads import RevokeTool, SessionOpen, SessionState, TurnInput, TurnResult, WriteMemory
from services.stack import services
from worker import configure_logging, connect, running_worker

DEMO_MODELS = {"scripted": "scripted-1", "openai": "gpt-4o-mini", "anthropic": "claude-sonnet-4-6"}

SCRIPT: list[tuple[str, Any]] = [
    ("turn", "Hi! I'm planning a weekend in Oslo and want help."),
    ("turn", 'What will the weather be?\n/call web.fetch {"url": "fixture://weather"}'),
    (
        "turn",
        '/call context.update_working_state {"operations": [{"op": "add_constraint", "text": "budget under 500 EUR"}, '
        '{"op": "add_task", "text": "find boots"}]}',
    ),
    ("turn", 'Remember to pack a raincoat.\n/call notes.save {"text": "pack a raincoat"}'),
    ("revoke", "notes.save"),
    ("turn", 'Also note the boots.\n/call notes.save {"text": "buy boots"}'),
    ("turn", 'Which boots are good? Here is a review page.\n/call web.fetch {"url": "fixture://injection"}'),
    ("memory", "The user is vegetarian."),
    ("turn", "Suggest a vegetarian dinner place in Oslo."),
]


async def run_demo(
    *, keep_running: bool = False, provider: str = "scripted", model: str | None = None, console: Console | None = None
) -> dict[str, Any]:
    console = console or Console(width=150)
    if provider not in DEMO_MODELS:
        raise SystemExit(f"unknown provider {provider!r}; choose one of {', '.join(DEMO_MODELS)}")

    port = build_providers().get(provider)
    if port is not None and not getattr(port, "configured", True):
        raise SystemExit(str(getattr(port, "message", f"provider {provider!r} is not configured")))
    configure_logging(level=30)  # warnings only: the demo prints its own table
    async with services() as svc:
        client = await connect(svc.temporal_address)
        async with running_worker(client, svc.store):
            session_id = f"demo-{uuid.uuid4().hex[:8]}"
            handle = await client.start_workflow(
                names.WORKFLOW_SESSION,
                SessionOpen.model_validate(
                    {
                        "agent_instructions": "You are a travel assistant. Be concise; cite tool results.",
                        "tools": DEMO_TOOLS,
                        "model_route": {"provider": provider, "model": model or DEMO_MODELS[provider]},
                    }
                ),
                id=session_id,
                task_queue=names.TASK_QUEUE,
            )
            console.print(f"[bold]session[/bold] {session_id}  temporal {svc.temporal_address}")
            table = Table(title=f"ctxengine demo — {session_id}")
            for col in ("turn", "epoch", "prefix", "tokens", "history", "yields", "tool calls", "reply"):
                table.add_column(
                    col, overflow="fold" if col == "tool calls" else "ellipsis", no_wrap=col != "tool calls"
                )
            results: list[TurnResult] = []
            for kind, arg in SCRIPT:
                if kind == "revoke":
                    await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name=arg, reason="demo: revoked"))
                    table.add_row("-", "", "", "", "", "", f"revoked {arg}", "")
                    continue
                if kind == "memory":
                    await handle.execute_update(names.UPDATE_WRITE_MEMORY, WriteMemory(text=arg))
                    table.add_row("-", "", "", "", "", "", "memory written", arg)
                    continue
                r: TurnResult = await handle.execute_update(
                    names.UPDATE_SUBMIT_TURN, TurnInput(text=arg), result_type=TurnResult
                )
                results.append(r)
                calls = ", ".join(
                    f"{c.name}:{'ok' if c.allowed and not c.is_error else 'denied' if not c.allowed else 'error'}"
                    f"({c.trust})"
                    for c in r.tool_calls
                )
                table.add_row(
                    str(r.turn),
                    str(r.epoch),
                    r.prefix_sha256[:12],
                    f"{r.plan.estimated_tokens:,}",
                    f"{r.plan.tokens_by_class.get('history', 0):,}",
                    str(len(r.plan.yields)),
                    calls,
                    r.text[:60],
                )
            state: SessionState = await handle.query(names.QUERY_STATE, result_type=SessionState)
            await handle.execute_update(names.UPDATE_CLOSE_SESSION, {"reason": "demo finished"})
            await handle.result()
            console.print(table)
            hashes = {r.prefix_sha256 for r in results}
            console.print(
                f"distinct prefix hashes: [bold]{len(hashes)}[/bold]; prefix violations: "
                f"{state.metrics.prefix_hash_violations}; tool denials: {state.metrics.tool_denials}"
            )
            console.print(f"inspect it: ctxengine inspect {session_id}")
            if svc.ui_url:
                console.print(f"Temporal UI: [link]{svc.ui_url}/namespaces/default/workflows/{session_id}[/link]")
            if keep_running:
                console.print("services stay up; Ctrl-C to stop")
                await asyncio.Event().wait()
            return {
                "session_id": session_id,
                "turns": len(results),
                "distinct_prefix_hashes": len(hashes),
                "ui_url": svc.ui_url,
            }
