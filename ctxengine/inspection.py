"""`ctxengine inspect SESSION_ID`: one request's context window as a person wants to read it."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from activities.store import Store
from contract.events import EventType
from core.budget import ContextBudget
from core.plan import PlanSummary
from core.rendering import UNTRUSTED_PROVENANCE, parse_envelopes


async def inspect_session(store: Store, session_id: str, turn: int | None = None) -> dict[str, Any]:
    """The last request of the session (or of `turn`), with segments, classes against caps and usage."""
    session = await store.get_session(session_id)
    if session is None:
        raise LookupError(f"no session {session_id!r} in this database")
    records = await store.records(session_id)
    if turn is not None:
        records = [r for r in records if r.turn == turn]
    if not records:
        raise LookupError(f"session {session_id!r} has no recorded request" + (f" for turn {turn}" if turn else ""))
    rec = records[-1]
    plan = PlanSummary.model_validate(rec.plan)
    prefix_row = await store.get_prefix(session_id, rec.epoch)
    request = await store.get_request(rec.request_sha256)
    assert prefix_row is not None and request is not None
    segments = [*prefix_row.prefix["segments"], *request.body]
    budget = ContextBudget.model_validate(rec.inputs["budget"])
    caps = {k.value: v for k, v in budget.prefix_caps().items()}
    caps.update(
        {
            "working_state": budget.working_state_tokens,
            "recall": budget.retrieved_context_tokens,
            "tool_results": budget.tool_results_cap(plan.input_limit - plan.prefix_tokens - plan.prefix_margin_tokens),
        }
    )
    refused = [
        e.payload
        for e in await store.events(session_id)
        if e.type == EventType.ESTIMATOR_REFUSED.value
        and e.event_key.startswith(f"refused:{rec.turn}:{rec.call_index}:")
    ]
    all_records = await store.records(session_id)
    input_total = sum(r.actual_input_tokens or 0 for r in all_records)
    cached_total = sum(r.cached_tokens or 0 for r in all_records)
    return {
        "session_id": session_id,
        "turn": rec.turn,
        "call_index": rec.call_index,
        "epoch": rec.epoch,
        "prefix_sha256": rec.prefix_sha256,
        "request_sha256": rec.request_sha256,
        "status": plan.status.value,
        # As stored with the request's plan: what the model wrote in reply to it is tainted (docs/trust.md).
        "untrusted_in_view": plan.untrusted_in_view,
        "estimated_tokens": rec.estimated_tokens,
        "actual_input_tokens": rec.actual_input_tokens,  # None: not answered
        "cached_tokens": rec.cached_tokens,
        # The provider's refusals of this turn's request as too long (context.estimator.refused), each learned from.
        "refusals": refused,
        "input_limit": plan.input_limit,
        "tokens_by_class": plan.tokens_by_class,
        "caps": caps,
        "yields": [y.model_dump(mode="json") for y in plan.yields],
        "pointers": [
            {"item_id": s["item_id"], "trust": s["trust"], "tainted": _tainted(s), "text": s["text"][:200]}
            for s in segments
            if s["kind"] == "elided_span"
        ],
        "segments": [
            {
                "region": s["region"],
                "class": s["budget_class"],
                "kind": s["kind"],
                "trust": s["trust"],
                "tainted": _tainted(s),
                "taints_view": bool(s.get("taints", False)),
                "item_id": s["item_id"],
                "raw_tokens": s["raw_tokens"],
            }
            for s in segments
        ],
        "session_cache_efficiency": round(cached_total / input_total, 4) if input_total else 0.0,
        "requests": len(all_records),
        "distinct_prefix_hashes_in_epoch": len({r.prefix_sha256 for r in all_records if r.epoch == rec.epoch}),
    }


def _tainted(segment: dict[str, Any]) -> bool:
    """Whether a stored segment was written while untrusted content was in view: its envelope, as stored, carries
    `provenance="untrusted"` (docs/trust.md)."""
    return any(e.provenance == UNTRUSTED_PROVENANCE for e in parse_envelopes(segment["text"]))


def print_inspection(view: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(
        f"[bold]{view['session_id']}[/bold] turn {view['turn']} model call {view['call_index']} epoch {view['epoch']} "
        f"prefix {view['prefix_sha256'][:16]} status {view['status']}"
    )
    actual = view["actual_input_tokens"]
    usage = f"actual {actual:,} (cached {view['cached_tokens'] or 0:,})" if actual is not None else "not answered"
    if view["refusals"]:
        usage += f"; refused as too long {len(view['refusals'])} time(s)"
    console.print(
        f"estimate {view['estimated_tokens']:,} / limit {view['input_limit']:,}; {usage}; session cache efficiency "
        f"{view['session_cache_efficiency']:.1%}; "
        f"prefix hashes in this epoch: {view['distinct_prefix_hashes_in_epoch']} (1 means byte-stable)"
    )
    if view["untrusted_in_view"]:
        console.print("untrusted content in view: what the model wrote in reply to this request is tainted")
    classes = Table(title="tokens by class")
    classes.add_column("class")
    classes.add_column("tokens", justify="right")
    classes.add_column("cap", justify="right")
    for name, tokens in view["tokens_by_class"].items():
        cap = view["caps"].get(name)
        classes.add_row(name, f"{tokens:,}", f"{cap:,}" if cap is not None else "-")
    console.print(classes)
    segs = Table(title="context window, in order")
    for col in ("region", "class", "kind", "trust", "taint", "item", "tokens"):
        segs.add_column(col)
    for s in view["segments"]:
        segs.add_row(s["region"], s["class"], s["kind"], s["trust"], _taint_cell(s), s["item_id"], str(s["raw_tokens"]))
    console.print(segs)
    for y in view["yields"]:
        console.print(
            f"yield: {y['step']} ({y['reason']}) freed {y['tokens_freed']:,} tokens: {', '.join(y['item_ids'])}"
        )
    for p in view["pointers"]:
        console.print(f"pointer {p['item_id']} [{p['trust']}{', tainted' if p['tainted'] else ''}]")


def _taint_cell(segment: dict[str, Any]) -> str:
    """`tainted` (provenance untrusted); `taints view` for untrusted content without that mark (an EXTERNAL_UNTRUSTED
    result, a working-state block holding a tainted entry); else nothing."""
    if segment["tainted"]:
        return "tainted"
    return "taints view" if segment["taints_view"] else ""
