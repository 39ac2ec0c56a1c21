"""Observers the engine does not control: the gates' checks of what went on the wire and of what was stored.

Development harness (docs/events-and-metrics.md, "Hard gates"). Every check here reads an artefact the
engine did not compute for the check: request bodies recorded by the protocol servers
(harness/protocol_servers.py), usage counted by those servers with their own tokenizer, or a prefix
re-rendered from its stored inputs. Each returns figures and the faults it found, named, so a negative test
can assert that the gate failed for the reason it injected.
"""

from __future__ import annotations

import dataclasses
import random
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from temporalio.client import WorkflowUpdateFailedError

from activities.openai_provider import HISTORY_KINDS
from activities.rows import RequestRecord
from activities.store import Store
from activities.wire import wire_prefix
from contract import names
from contract.payloads import RevokeTool, RotateEpoch, SessionOpen
from core.budget import ContextBudget
from core.build import FrozenPrefix, PrefixInputs, open_prefix, pointer_for
from core.estimator import ModelProfile, TokenCounter, TokenEstimator
from core.explain import PrefixDifference, first_difference
from core.item_rendering import render_item
from core.items import HistoryItem, Item, ToolResult, parse_history_item
from core.plan import SEGMENT, ContextPlan
from harness.protocol_servers import Element, Received, prompt_elements
from harness.sessions import gate_open as _open

_HISTORY_SOURCES = frozenset(HISTORY_KINDS)


# ------------------------------------------------------------------------------------------- stability
def is_history(element: Element) -> bool:
    """Whether an element belongs to the append-only part of a request: Region A or conversation history."""
    if element.role in ("tool", "system") or element.tool_use_id or element.tool_result_id:
        return True
    if element.role == "assistant":
        return True
    head = element.text[:400]
    marker = 'source="'
    at = head.find(marker)
    if at < 0:
        return False
    source = head[at + len(marker) :].split('"', 1)[0].split(":", 1)[0]
    return source in _HISTORY_SOURCES


def history_length(elements: Sequence[Element]) -> int:
    """How many leading elements of a request are its prefix and history (up to the last history element)."""
    return max((i + 1 for i, e in enumerate(elements) if is_history(e)), default=0)


def common_prefix(a: Sequence[Element], b: Sequence[Element]) -> int:
    """Leading elements of `a` and `b` whose cache keys are byte-identical."""
    n = 0
    while n < min(len(a), len(b)) and a[n].key == b[n].key:
        n += 1
    return n


def break_cause(previous: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """What explains a history break between two consecutive requests' records, if anything does."""
    if previous["inputs"].get("checkpoint_id") != current["inputs"].get("checkpoint_id"):
        return "compaction"
    if current["plan"].get("pointers", 0) != previous["plan"].get("pointers", 0) or any(
        y.get("step") == "tool_results_to_pointers" for y in current["plan"].get("yields", [])
    ):
        return "yield:tool_results_to_pointers"
    return None


def check_wire_stability(received: Sequence[Received], records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Check one session's recorded request bodies against themselves.

    `received` are the bodies a protocol server recorded for the session, in arrival order (summarizer calls
    are skipped); `records` the session's request records in (turn, call) order, which say only the epoch,
    the checkpoint and the yields of each request (to attribute breaks) and the adapter's claimed wire hash.
    Per epoch: the wire prefix of every request is byte-identical to the first; and the longest common
    prefix of consecutive requests covers the previous request's history unless a compaction or a yield
    explains the break.
    """
    turns = [r for r in received if not r.is_summary]
    faults: list[str] = []
    if len(turns) != len(records):
        faults.append(f"wire_requests_unmatched: {len(turns)} bodies on the wire, {len(records)} request records")
    hashes: dict[int, set[str]] = {}
    breaks: list[dict[str, Any]] = []
    claimed_mismatch = claimed_recorded = 0
    previous: tuple[list[Element], Mapping[str, Any]] | None = None
    for body, record in zip(turns, records, strict=False):
        epoch = int(record["epoch"])
        wire = wire_prefix(body.raw, body.protocol)
        hashes.setdefault(epoch, set()).add(wire.sha256)
        claimed = record.get("wire_prefix_sha256")
        claimed_recorded += int(claimed is not None)
        claimed_mismatch += int(claimed is not None and claimed != wire.sha256)
        elements = prompt_elements(body)
        if previous is not None and previous[1]["epoch"] == epoch:
            before, before_record = previous
            covered = history_length(before)
            common = common_prefix(before, elements)
            if common < covered:
                cause = break_cause(before_record, record)
                breaks.append(
                    {
                        "turn": record["turn"],
                        "call_index": record["call_index"],
                        "common_elements": common,
                        "history_elements": covered,
                        "cause": cause,
                    }
                )
        previous = (elements, record)
    per_epoch = max((len(h) for h in hashes.values()), default=0)
    unexplained = [b for b in breaks if b["cause"] is None]
    if per_epoch > 1:
        faults.append(f"wire_prefix_changed_within_epoch: {per_epoch} distinct wire prefix hashes in one epoch")
    if unexplained:
        first = unexplained[0]
        faults.append(
            f"history_break_unexplained: turn {first['turn']} call {first['call_index']} shares "
            f"{first['common_elements']} of the previous request's {first['history_elements']} history elements"
        )
    if claimed_mismatch:
        faults.append(f"wire_hash_claim_mismatch: {claimed_mismatch} recorded hashes differ from the bytes sent")
    if claimed_recorded < min(len(turns), len(records)):
        faults.append(f"wire_hash_not_recorded: {claimed_recorded} of {len(records)} request records carry one")
    return {
        "wire_requests_checked": len(turns),
        "wire_prefix_hashes_per_epoch": per_epoch,
        "history_breaks": len(breaks),
        "history_breaks_explained": {
            cause: sum(1 for b in breaks if b["cause"] == cause) for cause in sorted({str(b["cause"]) for b in breaks})
        },
        "history_breaks_unexplained": len(unexplained),
        "wire_hash_claims_recorded": claimed_recorded,
        "wire_hash_claims_mismatched": claimed_mismatch,
        "faults": faults,
    }


# ------------------------------------------------------------------------------------------------ pairs
def check_wire_pairs(received: Sequence[Received]) -> dict[str, Any]:
    """Every tool call on the wire has its result right after it, and every result answers a call.

    OpenAI: an assistant message's `tool_calls` ids, each answered by a `tool` message with that
    `tool_call_id` before the next non-tool message. Anthropic: each `tool_use` block's id answered by a
    `tool_result` with that `tool_use_id` in the next (user) message.
    """
    checked = orphans = 0
    faults: list[str] = []
    for body in received:
        if body.is_summary:
            continue
        checked += 1
        found = _openai_orphans(body.body) if body.protocol == "openai" else _anthropic_orphans(body.body)
        if found:
            orphans += 1
            if len(faults) < 3:
                faults.append(f"orphan_on_wire: {body.protocol} request {checked}: {found[0]}")
    return {"wire_requests_checked": checked, "wire_requests_with_orphans": orphans, "faults": faults}


def _openai_orphans(body: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    open_calls: set[str] = set()
    for message in body.get("messages", []):
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not call_id or call_id not in open_calls:
                problems.append(f"tool message without a matching tool_call_id ({call_id!r})")
            open_calls.discard(call_id)
            continue
        if open_calls:
            problems.append(f"tool_calls {sorted(open_calls)} not answered before the next message")
            open_calls.clear()
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                if not call.get("id"):
                    problems.append("assistant tool_call without an id")
                open_calls.add(call.get("id") or "")
    if open_calls:
        problems.append(f"tool_calls {sorted(open_calls)} never answered")
    return problems


def _anthropic_orphans(body: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    pending: set[str] = set()
    for message in body.get("messages", []):
        content = message.get("content")
        blocks = content if isinstance(content, list) else []
        results = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        if pending - results:
            problems.append(f"tool_use {sorted(pending - results)} without a tool_result in the next message")
        stray = results - pending
        if stray:
            problems.append(f"tool_result for {sorted(str(s) for s in stray)} with no tool_use just before")
        pending = {str(b.get("id")) for b in blocks if b.get("type") == "tool_use"}
    if pending:
        problems.append(f"tool_use {sorted(pending)} never answered")
    return problems


# ------------------------------------------------------------------------------------------------ budget
# A turn that cannot fit fails alone with one of these, and nothing is sent (docs/assembly-and-budget.md).
BUDGET_FAILURES = frozenset({"TurnTooLarge", "ContextNeedsCompaction"})


def check_wire_budget(
    received: Sequence[Received], records: Sequence[Mapping[str, Any]], *, assume_reconciled: bool = False
) -> dict[str, Any]:
    """Estimates against the protocol server's own count of what it received (not the engine's figures).

    The server's count is the input usage it answered each turn request with, read from its recording. The
    answered requests are paired in order with the answered records (a build that needed compaction was never
    sent; a refused request's record is replaced by the turn's next build of it). A request is over its window
    when the server refused it as too long, or counted more than the plan's input limit. Once a route has
    reconciled (any request after its first; or `assume_reconciled`, when the server's tokenizer and ratio are the
    estimator's own), an estimate below the server's count is an underestimate. `least_headroom_tokens` is the
    smallest estimate minus the server's count among reconciled requests (negative: an underestimate).
    """
    turns = [r for r in received if not r.is_summary]
    answered = [r for r in turns if r.reply is not None and r.reply.status == 200]
    refused = len(turns) - len(answered)  # a provider refuses a request over its window: over by its count
    server_usage = [server_input_tokens(r) for r in answered]
    sent = [r for r in records if r["plan"]["status"] == "fits" and r["actual_input_tokens"] is not None]
    over, under = refused, 0
    headroom: list[int] = []
    faults: list[str] = []
    if len(sent) != len(answered):
        faults.append(f"unpaired: {len(answered)} answered turn requests on the wire, {len(sent)} answered records")
    for index, (record, counted) in enumerate(zip(sent, server_usage, strict=False)):
        limit = record["plan"]["input_limit"]
        if counted > limit:
            over += 1
        # Reconciled once an earlier request of the route reported usage (a new route starts from a published
        # ratio, which is not yet a reconciliation, so the calibration being off 1.0 says nothing).
        if assume_reconciled or index > 0:
            headroom.append(record["estimated_tokens"] - counted)
            if record["estimated_tokens"] < counted:
                under += 1
    if over:
        faults.append(f"request_over_window: {over} requests counted by the server above their input limit")
    if under:
        faults.append(f"underestimate_after_reconciliation: {under} estimates below the server's count")
    return {
        "wire_requests_checked": len(turns),
        "requests_over_window_by_server_count": over,
        "underestimates_by_server_count": under,
        "least_headroom_tokens": min(headroom, default=None),
        "faults": faults,
    }


def server_input_tokens(received: Received) -> int:
    """Input tokens the protocol server answered `received` with (OpenAI prompt, Anthropic all three parts)."""
    usage = received.reply.body.get("usage", {}) if received.reply is not None else {}
    if received.protocol == "openai":
        return int(usage.get("prompt_tokens", 0))
    return int(
        usage.get("input_tokens", 0)
        + usage.get("cache_read_input_tokens", 0)
        + usage.get("cache_creation_input_tokens", 0)
    )


# ------------------------------------------------------------------------------------------- determinism
Render = Callable[..., FrozenPrefix]


def compare_rerender(
    row: Mapping[str, Any],
    *,
    secret: bytes,
    budget: ContextBudget,
    counter_for: Callable[[str], TokenCounter],
    render: Render = open_prefix,
) -> PrefixDifference | None:
    """Re-render an epoch's Region A from its stored `PrefixInputs` and profile (a stored prefix row), and
    compare the bytes with the stored prefix: None when identical, else where they first differ."""
    profile = ModelProfile.model_validate(row["profile"])
    estimator = TokenEstimator(profile, counter_for(profile.encoding))
    fresh = render(PrefixInputs.model_validate(row["inputs"]), budget=budget, estimator=estimator, secret=secret)
    stored = FrozenPrefix.model_validate(row["prefix"])
    if fresh.text.encode("utf-8", "surrogatepass") == stored.text.encode("utf-8", "surrogatepass") and (
        fresh.sha256 == stored.sha256
    ):
        return None
    return first_difference(stored.segments, fresh.segments) or PrefixDifference(
        segment_index=-1, item_id="", budget_class="", byte_offset=0, offset_in_segment=0, expected="", actual=""
    )


async def rerender_prefixes(
    store: Store, session_id: str, counter_for: Callable[[str], TokenCounter], render: Render = open_prefix
) -> dict[str, Any]:
    """Every epoch of a session with requests: its prefix re-rendered from the stored inputs, bytes compared."""

    session = await store.get_session(session_id)
    assert session is not None
    budget = SessionOpen.model_validate(session.open).context_budget()
    epochs = sorted({r.epoch for r in await store.records(session_id)})
    faults: list[str] = []
    identical = 0
    for epoch in epochs:
        row = await store.get_prefix(session_id, epoch)
        assert row is not None
        diff = compare_rerender(
            dataclasses.asdict(row), secret=session.secret, budget=budget, counter_for=counter_for, render=render
        )
        if diff is None:
            identical += 1
        else:
            faults.append(
                f"prefix_rerender_differs: epoch {epoch}, {diff.item_id or 'prefix'} at byte {diff.byte_offset}: "
                f"stored {diff.expected!r}, re-rendered {diff.actual!r}"
            )
    return {"prefixes_rerendered": len(epochs), "prefix_bytes_identical": identical, "faults": faults}


Renderer = Callable[[Item, bytes], str]  # how an item is rendered (a negative test passes a faulty one)


def compare_item_render(
    item: Item,
    rendered: str,
    tokens: Mapping[str, int],
    *,
    secret: bytes,
    counter_for: Callable[[str], TokenCounter],
    render: Renderer = render_item,
) -> str | None:
    """An item's render stored at write time against a fresh render and count: None, or the first difference."""
    fresh = render(item, secret)
    if fresh != rendered:
        at = next(
            (i for i, (a, b) in enumerate(zip(rendered, fresh, strict=False)) if a != b), min(len(rendered), len(fresh))
        )
        return (
            f"item_render_differs: {item.id} at byte {at}: "
            f"stored {rendered[at : at + 20]!r}, re-rendered {fresh[at : at + 20]!r}"
        )
    for key, count in tokens.items():
        recount = counter_for(key).count(fresh)
        if recount != count:
            return f"item_count_differs: {item.id} ({key}): stored {count}, counted {recount}"
    return None


async def rerender_items(
    store: Store, session_id: str, counter_for: Callable[[str], TokenCounter], render: Renderer = render_item
) -> dict[str, Any]:
    """Every logged item with a render stored at write time (and a tool result's pointer): rendered and counted
    again, compared."""
    session = await store.get_session(session_id)
    assert session is not None
    checked = identical = 0
    faults: list[str] = []
    for row in await store.load_items(session_id):
        if row.rendered is None or not row.tokens:
            continue
        item = parse_history_item(row.payload)
        renders: list[tuple[HistoryItem, str, Mapping[str, int]]] = [(item, row.rendered, row.tokens)]
        if row.pointer is not None and isinstance(item, ToolResult):
            # The pointer that may stand for a tool result, rendered when the result was logged, with the
            # result's count by the same counter in it.
            for key, count in row.pointer["tokens"].items():
                renders.append((pointer_for(item, row.tokens[key]), row.pointer["text"], {key: count}))
        for what, text, tokens in renders:
            checked += 1
            diff = compare_item_render(
                what, text, tokens, secret=session.secret, counter_for=counter_for, render=render
            )
            if diff is None:
                identical += 1
            else:
                faults.append(diff)
    return {"items_rerendered": checked, "item_renders_identical": identical, "faults": faults}


Rebuilt = tuple[RequestRecord, FrozenPrefix, ContextPlan]  # a record, with the prefix and plan rebuilt for it


async def compare_stored_bodies(store: Store, rebuilt: Sequence[Rebuilt]) -> dict[str, Any]:
    """Every reproduced request's stored body, read back (the logged items it refers to expanded from what was
    stored with them), against the body rebuilt from the request's stored inputs, segment by segment and field
    by field: what a worker that did not build the request sends, and what `inspect` shows."""
    checked = identical = 0
    faults: list[str] = []
    for rec, prefix, plan in rebuilt:
        if plan.request_sha256 != rec.request_sha256:
            continue  # not reproduced: the rebuild's own check reports it
        checked += 1
        want = [SEGMENT.dump_python(seg, mode="json") for seg in plan.segments[len(prefix.segments) :]]
        try:
            stored = await store.get_request(rec.request_sha256)
        except LookupError as exc:
            faults.append(f"stored_body_unreadable: turn {rec.turn}.{rec.call_index}: {exc}")
            continue
        got = stored.body if stored is not None else []
        if got == want:
            identical += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        if at >= min(len(got), len(want)):
            faults.append(
                f"stored_body_differs: turn {rec.turn}.{rec.call_index}: {len(got)} segments, rebuilt {len(want)}"
            )
            continue
        field = next(k for k in sorted({*got[at], *want[at]}) if got[at].get(k) != want[at].get(k))
        faults.append(
            f"stored_body_differs: turn {rec.turn}.{rec.call_index} segment {at} ({want[at]['item_id']}) {field}: "
            f"stored {str(got[at].get(field))[:40]!r}, rebuilt {str(want[at].get(field))[:40]!r}"
        )
    return {"stored_bodies_checked": checked, "stored_bodies_identical": identical, "faults": faults}


# ------------------------------------------------------------------------ sessions on the wire, for gates
# What gate_budget and gate_pairs call to add the wire observers to their figures. Each needs a stack whose
# `openai` and `anthropic` routes reach the protocol servers (`live_stack(wire=True)`, GATES option
# `"wire": True`); a negative test swaps an adapter with `run_gate(..., wire_adapters={...})`.
PAIRS_CALLS = (
    '/call web.fetch {"url": "fixture://long"}',
    '/call notes.save {"text": "n"}',
    "/call nope.tool {}",
    '/call web.fetch {"bad": 1}',
)


async def wire_pairs(s: Any, *, turns: int = 16, window: int = 8_000) -> dict[str, Any]:
    """The pairs scenario (several calls per turn, an unknown tool, a schema error, a revocation, compaction)
    once through each adapter; every recorded body checked for orphans (`check_wire_pairs`)."""

    assert s.wire is not None, "wire_pairs needs live_stack(wire=True)"
    figures: dict[str, Any] = {"wire_requests_checked": 0, "wire_requests_with_orphans": 0, "faults": []}
    for provider, server in (("openai", s.wire.openai), ("anthropic", s.wire.anthropic)):
        server.reset()
        open_: SessionOpen = _open(
            model_route={"provider": provider, "model": f"pairs-{provider}", "encoding": "cl100k_base"},
            budget={"context_window": window, "output_reserve": 600},
        )
        handle = await s.start(open_, f"pairs-wire-{provider}")
        for t in range(turns):
            await s.turn(handle, f"turn {t}\n" + "\n".join(PAIRS_CALLS[: 1 + t % 4]))
            if t == turns // 2:
                await handle.execute_update(names.UPDATE_REVOKE_TOOL, RevokeTool(name="notes.save"))
        result = check_wire_pairs(list(server.requests))
        figures["wire_requests_checked"] += result["wire_requests_checked"]
        figures["wire_requests_with_orphans"] += result["wire_requests_with_orphans"]
        figures["faults"] += result["faults"]
    return figures


async def wire_budget(
    s: Any,
    *,
    ratios: Sequence[float] = (1.0, 1.2, 1.45),
    windows: Sequence[int] = (6_000, 12_000),
    turns: int = 14,
    output_reserve: int = 800,
) -> dict[str, Any]:
    """The budget scenario through the OpenAI adapter, the protocol server counting with its own tokenizer
    times each ratio (asked for by the model name): no request over its window by the server's count, and
    once the route has reconciled, no estimate below it (`check_wire_budget`). On a small window a turn may
    fail typed instead (`TurnTooLarge`, `ContextNeedsCompaction`: nothing sent); the session goes on."""

    assert s.wire is not None, "wire_budget needs live_stack(wire=True)"
    run = uuid.uuid4().hex[:6]
    figures: dict[str, Any] = {
        "wire_requests_checked": 0,
        "requests_over_window_by_server_count": 0,
        "underestimates_by_server_count": 0,
        "least_headroom_tokens": None,
        "turns_failed_typed": 0,
        "faults": [],
    }
    server = s.wire.openai
    for ratio in ratios:
        for window in windows:
            server.reset()
            route = {"provider": "openai", "model": f"budget-{run}-w{window}-r{ratio}", "encoding": "cl100k_base"}
            budget = {"context_window": window, "output_reserve": output_reserve}
            handle = await s.start(_open(model_route=route, budget=budget), "budget-wire")
            rng = random.Random(f"{ratio}-{window}")
            for t in range(turns):
                text = f"turn {t}: " + " ".join(
                    rng.choices(["alpha", "beta", "gamma", "delta"], k=rng.randint(20, 400))
                )
                if t % 3 == 1:
                    text += '\n/call web.fetch {"url": "fixture://long"}'
                try:
                    await s.turn(handle, text)
                except WorkflowUpdateFailedError as exc:
                    if getattr(exc.cause, "type", None) not in BUDGET_FAILURES:
                        raise
                    figures["turns_failed_typed"] += 1
            records = [dataclasses.asdict(r) for r in await s.store.records(handle.id)]
            result = check_wire_budget(list(server.requests), records, assume_reconciled=ratio == 1.0)
            for key in ("wire_requests_checked", "requests_over_window_by_server_count"):
                figures[key] += result[key]
            figures["underestimates_by_server_count"] += result["underestimates_by_server_count"]
            headrooms = [
                h for h in (figures["least_headroom_tokens"], result["least_headroom_tokens"]) if h is not None
            ]
            figures["least_headroom_tokens"] = min(headrooms, default=None)
            figures["faults"] += [f"ratio {ratio}, window {window}: {f}" for f in result["faults"]]
    return figures


async def wire_refusal(s: Any, *, window: int = 6_000, history_turns: int = 9) -> dict[str, Any]:
    """A request the provider refuses as too long is learned from and built again, and the turn is answered.

    The session fills its body on a route the server counts like the counter (no window in its model name), then
    rotates to a route the server counts 1.3 times and whose model has `window` tokens (`-w`): a route no response
    has calibrated yet, whose first request the estimator lets through and the server refuses. Run it on a database
    whose routes the provider's other routes have not calibrated higher (a fresh one). Figures: the requests the
    server refused, the turns that failed (with their error types), and the refusal events stored."""
    assert s.wire is not None, "wire_refusal needs live_stack(wire=True)"
    run = uuid.uuid4().hex[:6]
    server = s.wire.openai
    counted_like_the_counter = {"provider": "openai", "model": f"refusal-{run}-r1.0", "encoding": "cl100k_base"}
    refusing = {"provider": "openai", "model": f"refusal-{run}-w{window}-r1.3", "encoding": "cl100k_base"}
    budget = {"context_window": window, "output_reserve": 512}
    handle = await s.start(_open(model_route=counted_like_the_counter, budget=budget), "refusal")
    rng = random.Random(3)

    def text(t: int) -> str:
        return f"turn {t}: " + " ".join(rng.choices(["alpha", "beta", "gamma", "delta"], k=150))

    for t in range(history_turns):
        await s.turn(handle, text(t))
    await handle.execute_update(
        names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="model_route_changed", model_route=refusing)
    )
    server.reset()
    failed: list[str] = []
    for t in range(history_turns, history_turns + 3):
        try:
            await s.turn(handle, text(t))
        except WorkflowUpdateFailedError as exc:
            failed.append(str(getattr(exc.cause, "type", None)))
    turns = [r for r in server.requests if not r.is_summary]
    refused = [r for r in turns if r.reply is not None and r.reply.status != 200]
    events = [e.payload for e in await s.store.events(handle.id) if e.type == "context.estimator.refused"]
    records = [dataclasses.asdict(r) for r in await s.store.records(handle.id) if r.epoch == 2]
    budget_check = check_wire_budget(turns, records)
    return {
        "requests_refused": len(refused),
        "refused_counts": [int(m) for r in refused for m in re.findall(r"(\d+) in the messages", str(r.reply.body))],
        "turns_failed": failed,
        "refusal_events": events,
        "answered_after_refusal": budget_check["wire_requests_checked"] - len(refused),
        "underestimates_by_server_count": budget_check["underestimates_by_server_count"],
    }
