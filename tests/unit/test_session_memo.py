"""A worker's memo of a session (`activities.session_state.SessionCache`) without PostgreSQL: the log read as
columns joins it, its stored renders are taken instead of rendered again, a request body refers to exactly the
segments taken from referable stored renders, and what a checkpoint covers leaves every part of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from activities.rows import LiveLog, count_columns, joined_counts
from activities.session_state import SessionCache
from activities.store import _composed, _tagged
from core.budget import ContextBudget
from core.build import build, segment_of, segments_of, segments_of_logged
from core.item_rendering import render_item
from core.items import HistoryItem, TrustLevel, UserMessage, WorkingStateBlock
from core.plan import SEGMENT, Segment
from tests.unit.factories import COUNTER, SECRET, body, estimator, history, prefix


def _log(items: list[HistoryItem], *, referable: bool = True, rendered: bool = True) -> LiveLog:
    """`items` as a read of the log returns them: each with its render, count and segment's other fields stored at
    write time (or without them)."""
    texts = [render_item(item, SECRET) for item in items]
    segments = [SEGMENT.dump_python(segment_of(item, "", 0), mode="json") for item in items]
    return LiveLog.of_payloads(
        [item.model_dump(mode="json") for item in items],
        segments=segments if referable else [None] * len(items),
        renders=texts if rendered else [None] * len(items),
        counts=[{COUNTER.name: COUNTER.count(text)} for text in texts] if rendered else [None] * len(items),
        pointers=[None] * len(items),
    )


def _is_ref(entry: dict[str, Any]) -> bool:
    return "ref" in entry or "seqs" in entry


def _refers_to(stored: list[dict[str, Any]], cache: SessionCache) -> list[str | None]:
    """Each segment of a stored body: the id of the logged item it refers to (a run of log positions, position by
    position), or None for a segment stored whole."""
    at = {item.seq: item.id for item in cache.items}
    out: list[str | None] = []
    for entry in stored:
        if "seqs" in entry:
            first, last = entry["seqs"]
            out += [at[seq] for seq in range(first, last + 1)]
        else:
            out.append(entry.get("ref"))
    return out


def test_a_cold_memo_takes_the_stored_renders_and_refers_to_them() -> None:
    """A memo that read the log builds the request a fresh render memo builds, and stores each logged item of
    its body as a reference; the turn's message and the per-request segments are stored whole."""
    est = estimator()
    inputs = body(turns=6)
    cache = SessionCache(SECRET)
    cache.catch_up(_log(list(inputs.history)), -1)
    renders = cache.render_for(est)
    # Taken, not rendered: every logged item has its segment, and no item was made to make it.
    assert len(cache.segments[renders.counter_key]) == len(inputs.history) and len(renders) == 0
    assert None not in cache.segments[renders.counter_key] and cache.items.made() == 0
    logged = inputs.model_copy(update={"history": cache.logged(renders, est, None)})
    plan = build(prefix(), logged, budget=ContextBudget(), estimator=est, secret=SECRET, cache=renders)
    fresh = build(prefix(), inputs, budget=ContextBudget(), estimator=est, secret=SECRET)
    assert plan.segments == fresh.segments and plan.request_sha256 == fresh.request_sha256
    body_segments = plan.segments[len(prefix().segments) :]
    stored = cache.stored_form(body_segments, renders).entries
    ids = {item.id for item in inputs.history}
    assert _refers_to(stored, cache) == [seg.item_id if seg.item_id in ids else None for seg in body_segments]
    assert [entry for entry in stored if _is_ref(entry)] == [{"seqs": [0, len(inputs.history) - 1]}]  # one run
    assert [entry["item_id"] for entry in stored if not _is_ref(entry)] == [
        seg.item_id for seg in body_segments if seg.item_id not in ids
    ]


def test_only_the_segment_taken_from_a_referable_render_is_referred_to() -> None:
    """An item logged without its segment's fields (not referable), or a segment made anew for a logged item
    (equal, but not the one taken from its stored render), is stored whole."""
    est = estimator()
    items = history(2)
    cache = SessionCache(SECRET)
    cache.catch_up(_log(items[:2], referable=False), -1)
    cache.catch_up(_log(items[2:]), -1)
    renders = cache.render_for(est)
    taken = [cache.taken(item.id, renders.counter_key) for item in items]
    assert all(seg is not None for seg in taken)
    again = segment_of(items[-1], render_item(items[-1], SECRET), taken[-1].raw_tokens)  # type: ignore[union-attr]
    assert again == taken[-1]
    stored = cache.stored_form([*taken, again], renders).entries  # type: ignore[list-item]
    assert _refers_to(stored, cache) == [None, None] + [item.id for item in items[2:]] + [None]
    assert stored[-1] == SEGMENT.dump_python(again, mode="json")


def test_an_item_logged_without_a_render_is_rendered_by_the_build() -> None:
    """A log read without stored renders (items logged before renders were stored): the memo takes nothing and
    refers to nothing; the build renders them."""
    est = estimator()
    items = history(2)
    cache = SessionCache(SECRET)
    cache.catch_up(_log(items, rendered=False), -1)
    renders = cache.render_for(est)
    assert cache.segments[renders.counter_key] == [None] * len(items) and len(renders) == 0
    segs = [renders.segment(item, est) for item in items]
    assert not any(map(_is_ref, cache.stored_form(segs, renders).entries))


def test_what_a_checkpoint_covers_leaves_the_memo_and_its_references() -> None:
    """Pruned items leave the log, the stored renders, the render memo and the referable segments alike."""
    est = estimator()
    items = history(4)
    cache = SessionCache(SECRET)
    cache.catch_up(_log(items), -1)
    renders = cache.render_for(est)
    covered = items[: len(items) // 2]
    cache.prune(covered[-1].seq)
    gone = {item.id for item in covered}
    assert not gone & set(cache.by_id) and not gone & set(cache.referable[renders.counter_key])
    assert all(cache.taken(item.id, renders.counter_key) is None for item in covered)
    assert len(cache.segments[renders.counter_key]) == len(cache.items) == len(items) - len(covered)
    assert [item.id for item in cache.items] == [item.id for item in items[len(covered) :]]


def test_a_log_read_with_columns_of_different_lengths_is_refused() -> None:
    """The columns of one read are one row each: a short column is a defect, not a silently shorter log."""
    items = history(1)
    log = _log(items)
    short = dataclasses.replace(log, renders=log.renders[:-1])
    with pytest.raises(ValueError):
        SessionCache(SECRET).catch_up(short, -1)


def test_counts_by_counter_join_the_memo_item_by_item() -> None:
    """Counts are kept a column per counter key: reads counted by different counters (a route changed between
    them) join as columns in which an item another counter counted has none, and a checkpoint drops every column's
    head; the columns are the per-item counts, item by item."""
    items = history(4)
    first, second = items[: len(items) // 2], items[len(items) // 2 :]
    per_item = [{"a": 1, "b": 2}, None, {"b": 3}] + [{"a": k} for k in range(len(first) - 3)]
    assert count_columns(per_item) == {
        "a": [1, None, None, *range(len(first) - 3)],
        "b": [2, None, 3, *[None] * (len(first) - 3)],
    }
    old = dataclasses.replace(_log(first), counts=count_columns(per_item))
    new = dataclasses.replace(_log(second), counts={"c": list(range(len(second)))})
    cache = SessionCache(SECRET)
    cache.catch_up(old, -1)
    cache.catch_up(new, -1)
    held = cache.items.counts
    assert held == joined_counts([(len(first), old.counts), (len(second), new.counts)])
    assert held["c"] == [None] * len(first) + list(range(len(second)))
    assert held["a"][: len(first)] == old.counts["a"] and held["a"][len(first) :] == [None] * len(second)
    cache.prune(items[1].seq)  # covers the first two
    assert {key: len(column) for key, column in cache.items.counts.items()} == dict.fromkeys("abc", len(items) - 2)
    assert cache.items.counts["b"][0] == 3


def test_segments_made_together_are_the_ones_made_one_by_one() -> None:
    """`segments_of` (a cold memo's thousands in one call) makes each item's segment exactly as `segment_of` does:
    every kind of logged item, untrusted and tainted ones included."""
    items = history(12)
    tainted = [item.model_copy(update={"tainted": True}) for item in items[:6]]
    kinds = {item.kind for item in items}
    assert {"user_message", "assistant_message", "tool_call", "tool_result"} <= kinds
    assert any(item.taints_view() for item in items)
    texts = [render_item(item, SECRET) for item in items + tainted]
    counts = [COUNTER.count(text) for text in texts]
    together = segments_of(items + tainted, texts, counts)
    assert together == [segment_of(i, t, c) for i, t, c in zip(items + tainted, texts, counts, strict=True)]
    assert [s.taints for s in together[len(items) :]] == [True] * len(tainted)
    assert all(type(s.taints) is bool for s in together)
    # With an item whose type taints by a rule of its own (a working state holding a tainted entry), each one
    # is made one by one, the same way.
    block = WorkingStateBlock(id="ws", text="constraints: none", holds_tainted=True)
    mixed = [*items[:3], block, *items[3:6]]
    texts = [render_item(item, SECRET) for item in mixed]
    segs = segments_of(mixed, texts, [7] * len(mixed))
    assert segs == [segment_of(i, t, 7) for i, t in zip(mixed, texts, strict=True)] and segs[3].taints


def test_segments_made_of_stored_heads_are_the_items_segments() -> None:
    """`segments_of_logged` (a cold memo's thousands, no item made) makes each logged item's segment exactly as
    `segment_of` makes it of the item, from the head stored with it (id, kind, trust, call id, and the taint of the
    segment made when it was logged): every kind, untrusted and tainted ones included. An item logged without its
    segment (no taint stored), or of a kind that is not logged, is left to the caller (None)."""
    items = history(12)
    tainted = [item.model_copy(update={"tainted": True}) for item in items[:6]]
    untrusted = [item.model_copy(update={"trust": TrustLevel.EXTERNAL_UNTRUSTED}) for item in items[6:12]]
    every = items + tainted + untrusted
    texts = [render_item(item, SECRET) for item in every]
    counts = [COUNTER.count(text) for text in texts]
    expected = [segment_of(i, t, c) for i, t, c in zip(every, texts, counts, strict=True)]
    assert any(s.taints for s in expected) and any(s.call_id for s in expected)
    log = _log(every)
    heads = (log.ids, log.kinds, log.trusts, log.call_ids, log.taints)
    made = segments_of_logged(*heads, texts, counts)
    assert made == expected
    assert made is not None and [type(s.trust) for s in made] == [type(s.trust) for s in expected]
    bare = _log(every, referable=False)
    assert segments_of_logged(bare.ids, bare.kinds, bare.trusts, bare.call_ids, bare.taints, texts, counts) is None
    odd = [*log.kinds[:-1], "working_state"]
    assert segments_of_logged(log.ids, odd, log.trusts, log.call_ids, log.taints, texts, counts) is None


def test_a_cold_memo_makes_no_item_to_build() -> None:
    """A memo that read the log builds a request without making an item of what it read (each is made only when a
    caller looks into it), and an item made is the logged one."""
    est = estimator()
    inputs = body(turns=6)
    cache = SessionCache(SECRET)
    cache.catch_up(_log(list(inputs.history)), -1)
    renders = cache.render_for(est)
    logged = inputs.model_copy(update={"history": cache.logged(renders, est, None)})
    plan = build(prefix(), logged, budget=ContextBudget(), estimator=est, secret=SECRET, cache=renders)
    assert plan.segments == build(prefix(), inputs, budget=ContextBudget(), estimator=est, secret=SECRET).segments
    assert cache.items.made() == 0
    assert list(cache.items) == list(inputs.history)
    last_user = max(k for k, item in enumerate(inputs.history) if isinstance(item, UserMessage))
    assert cache.this_turn() == list(inputs.history[last_user:])
    assert cache.item(inputs.history[2].id) == inputs.history[2] and cache.item("nope") is None


def test_a_segment_is_a_value_and_its_json_form_gives_it_back() -> None:
    """A segment (a slotted dataclass, not a pydantic model) is equal to and hashed as any segment of the same
    fields, and the JSON form the store keeps of it (`SEGMENT`) gives back an equal one, its enums restored."""
    item = history(2)[1]
    seg = segment_of(item, render_item(item, SECRET), 7)
    again = SEGMENT.validate_python(SEGMENT.dump_python(seg, mode="json"))
    assert again == seg and hash(again) == hash(seg) and again is not seg
    assert type(again.region) is type(seg.region) and type(again.trust) is type(seg.trust)
    assert SEGMENT.dump_python(seg, mode="json")["region"] == seg.region.value
    assert segment_of(item, "other text", 7) != seg


def _shown(log: list[tuple[int, bool, bool, bool]]) -> tuple[SessionCache, Any, list[Segment]]:
    """A memo of a log drawn by hypothesis (each item at a position after a gap or not, logged with its segment's
    fields or not, shown or not, a per-request segment after it or not) and the body segments it shows."""
    est = estimator()
    items: list[HistoryItem] = []
    seq = 0
    for i, (gap, _, _, _) in enumerate(log):
        seq += gap
        items.append(UserMessage(id=f"u{i}", seq=seq, text=f"message {i}"))
        seq += 1
    cache = SessionCache(SECRET)
    for item, (_, referable, _, _) in zip(items, log, strict=True):
        cache.catch_up(_log([item], referable=referable), -1)
    renders = cache.render_for(est)
    shown: list[Segment] = []
    for i, (item, (_, _, show, extra)) in enumerate(zip(items, log, strict=True)):
        if show:
            shown.append(cache.taken(item.id, renders.counter_key) or renders.segment(item, est))
        if extra:  # a segment no logged item stands for (as the turn's context is)
            shown.append(renders.segment(UserMessage(id=f"x{i}", seq=10_000 + i, text=f"context {i}"), est))
    return cache, renders, shown


_LOG = st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=30)


# Logs with runs: items mostly at consecutive positions, mostly logged with their segment's fields and shown.
_LOG_WITH_RUNS = st.lists(
    st.tuples(
        st.sampled_from((0, 0, 0, 1)),
        st.sampled_from((True, True, True, False)),
        st.sampled_from((True, True, True, False)),
        st.booleans(),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(_LOG_WITH_RUNS, st.integers(0, 40), st.lists(st.integers(0, 40), max_size=4))
@example(log=[(0, True, True, False)] * 6, cut=3, after=[])
def test_a_body_stored_as_a_delta_reads_back_as_its_segments(
    log: list[tuple[int, bool, bool, bool]], cut: int, after: list[int]
) -> None:
    """Any body, cut anywhere (inside a run or not): the whole form of its head followed by the form of the rest
    is its whole form (`StoredForm.head`, `.then`), and stored as a delta of an earlier body it shares that head
    with (`after`: what followed the head there), the store's composition (`_composed`: the base's entries cut at
    `keep`, a run cut inside) resolved by the memo gives back the very segments, in order."""
    cache, renders, shown = _shown(log)
    keep = min(cut, len(shown))
    whole = cache.stored_form(shown, renders)
    tail = cache.stored_form(shown[keep:], renders)
    assert whole.head(keep).then(tail) == whole
    assert whole.ends[-1:] == ([len(shown)] if shown else [])
    earlier = cache.stored_form(shown[:keep] + [shown[i % len(shown)] for i in after if shown], renders)
    where = {"session": "s", "counter": renders.counter_key}
    chain = [  # nearest first, as the store reads a chain
        {"prefix_sha256": "p", "body": {"base": "b", "keep": keep, "tail": tail.entries, **where}},
        {"prefix_sha256": "p", "body": {"base": None, "keep": 0, "tail": earlier.entries, **where}},
    ]
    composed = _composed("r", chain)
    assert composed is not None
    assert cache.resolved("s", composed.body) == [cache.provider_of(s) for s in shown]


@settings(max_examples=150, deadline=None)
@given(_LOG)
def test_a_stored_body_reads_back_as_the_segments_it_was_stored_from(log: list[tuple[int, bool, bool, bool]]) -> None:
    """Any body over any log: each item at a position after a gap or not (positions a read can skip), logged with
    its segment's fields or not, shown or not, a per-request segment after it or not. Stored (runs of consecutive
    positions, lone references, whole segments), handed on as the store hands a body to a model call (`_tagged`:
    a run stays one entry) and resolved by the memo, it gives back the very segments, in order; and
    every run covers only positions of the items it shows."""
    cache, renders, shown = _shown(log)
    stored = cache.stored_form(shown, renders).entries
    refs = cache.referable[renders.counter_key]
    assert _refers_to(stored, cache) == [s.item_id if refs.get(s.item_id) is s else None for s in shown]
    assert all(refs.get(item_id) is not None for item_id in _refers_to(stored, cache) if item_id is not None)
    handed_on = _tagged({"base": None, "keep": 0, "tail": stored, "session": "s", "counter": renders.counter_key})
    assert cache.resolved("s", handed_on) == [cache.provider_of(s) for s in shown]
    assert cache.resolved("another", handed_on) is None or not any(map(_is_ref, stored))
