"""What every session activity family shares on one worker: the store, the providers, the tokenizers and a
memo per session of the immutable things already read (the log so far, each epoch's prefix, rendered items).

`SessionState` is built once in worker.py (through `activities.session.SessionActivities`) and handed to each
family; the families hold no state of their own. Its readers fail a call naming an unknown session or epoch
with a typed, non-retryable error.
"""

from __future__ import annotations

import bisect
import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import compress, repeat
from typing import Any, NamedTuple, cast

import structlog
from pydantic import TypeAdapter
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.failures import activities_running
from activities.memo_log import MemoLog
from activities.metrics import record_event
from activities.provider import ModelProvider, ProviderSegment
from activities.rows import CallReads, ItemRender, LiveLog, RequestRecord, StoredSession, TurnReads
from activities.store import MAX_DELTA_CHAIN, Store
from activities.tokens import TiktokenCounter
from contract.events import EventType
from contract.payloads import STORED, SessionOpen
from core.build import FrozenPrefix, RenderCache, counter_key, pointer_for, segment_of, segments_of_logged
from core.estimator import ModelProfile, TokenEstimator
from core.history import LoggedHistory, missing
from core.item_rendering import render_item
from core.items import HistoryItem, Region, ToolCall, ToolResult, parse_history_item
from core.plan import SEGMENT, Segment
from core.working_state import WorkingState, WorkingStateWrite, fold

log = structlog.get_logger("ctxengine.activities")
_seq = operator.attrgetter("seq")
RECALL_LIMIT = 10  # memories recalled for a turn's message, best first
_TEXT_AND_COUNT = {"text", "raw_tokens"}  # what a stored render holds beside its segment's other fields


_item_id = operator.attrgetter("item_id")  # a segment's
_second = operator.itemgetter(1)
_PAIRED = frozenset({"tool_call", "tool_result"})  # the kinds the open-call pass visits
_TOOL_RESULT, _USER_MESSAGE = "tool_result", "user_message"
_SEGMENTS: TypeAdapter[list[Segment]] = TypeAdapter(list[Segment])  # segments to or from their JSON form, at once


class BuiltRequest(NamedTuple):
    """A request this worker built: its segments, and what its model call would read (its record as the build
    stored it and the calibrations the build read), so that call, when it runs here, reads nothing."""

    segments: list[Segment]
    record: RequestRecord | None  # None: not written (an earlier call was answered): the call reads it
    calibration: float | None
    provider_calibration: float | None


WHOLE_SLACK = 4  # a body is stored whole unless that takes more than this many entries more than a delta


def _reference(first_id: str, first: int, last: int) -> dict[str, Any]:
    """A stored body's reference to the logged items at positions `first`..`last` (the first one's id given)."""
    return {"ref": first_id} if first == last else {"seqs": [first, last]}


class StoredForm(NamedTuple):
    """A body as the store keeps it (`SessionCache.stored_form`): its entries; what each refers to (the first
    item's id and the first and last log positions of a reference or a run, None for a segment stored as its
    JSON); and how many body segments the entries up to each one stand for."""

    entries: list[dict[str, Any]]
    spans: list[tuple[str, int, int] | None]
    ends: list[int]

    def head(self, keep: int) -> StoredForm:
        """The form of the body's first `keep` segments: a run that goes past them is cut."""
        n = bisect.bisect_right(self.ends, keep)
        entries, spans, ends = self.entries[:n], self.spans[:n], self.ends[:n]
        done = ends[-1] if ends else 0
        if done < keep:  # the next entry stands for more than one segment: a run
            span = self.spans[n]
            assert span is not None
            cut = (span[0], span[1], span[1] + keep - done - 1)
            entries.append(_reference(*cut))
            spans.append(cut)
            ends.append(keep)
        return StoredForm(entries, spans, ends)

    def then(self, tail: StoredForm) -> StoredForm:
        """This form followed by `tail`'s, a run across the junction made one."""
        if not self.entries:
            return tail
        n, done = len(self.entries), self.ends[-1]
        entries, spans = self.entries + tail.entries, self.spans + tail.spans
        ends = self.ends + [end + done for end in tail.ends]
        last, first = self.spans[-1], tail.spans[0] if tail.spans else None
        if last is not None and first is not None and last[2] + 1 == first[1]:
            # The run that ends this form goes on in the tail's first entry: one entry for both.
            span = (last[0], last[1], first[2])
            entries[n - 1 : n + 1] = [_reference(*span)]
            spans[n - 1 : n + 1] = [span]
            del ends[n - 1]
        return StoredForm(entries, spans, ends)


class BodyForm(NamedTuple):
    """How a request's body is stored (`SessionCache.body_form`): the request it extends (None: whole), how many
    of that one's body segments it keeps, the entries stored, and the body's whole form."""

    base: str | None
    keep: int
    stored: StoredForm
    whole: StoredForm


class LastBody(NamedTuple):
    """The last request stored from this worker, which the next one may extend: its hash, its prefix's, its body
    segments, how many deltas it is from a whole body and its body's whole form."""

    sha: str
    prefix_sha: str
    segments: list[Segment]
    depth: int
    whole: StoredForm


class SessionCache:
    """Per-session, per-worker memo of immutable things: the log so far, prefixes, rendered items."""

    def __init__(self, secret: bytes) -> None:
        # The log a request can still show, in log order: items made when a caller looks into them.
        self.items = MemoLog()
        self.max_seq = -1
        self.prefixes: dict[int, tuple[FrozenPrefix, ModelProfile]] = {}
        self.secret = secret
        self.renders: dict[str, RenderCache] = {}  # one memo per tokenizer: counts differ between them
        self.open: SessionOpen | None = None
        # Per segment object (segments are immutable and kept alive by the render caches): its stored JSON and
        # its provider form, made once. And the last requests built here, handed to the model call by hash.
        self.seg_json: dict[int, tuple[Segment, dict[str, Any]]] = {}
        self.seg_provider: dict[int, tuple[Segment, ProviderSegment]] = {}
        self.built: OrderedDict[str, BuiltRequest] = OrderedDict()
        self.last_body: LastBody | None = None
        # Per counter key, each logged item's segment made from its stored render (None: none was stored for the
        # counter; the build renders it), in the log's order.
        self.segments: dict[str, list[Segment | None]] = {}
        # Per counter key, by item id: the segment made from the item's stored render, when the store kept that
        # segment's other fields too. A request body refers to exactly these (`stored_form`).
        self.referable: dict[str, dict[str, Segment]] = {}
        # Kept as items are logged, so a turn's lookups cost what the turn added, not the session's length.
        self.by_id: dict[str, int] = {}  # each logged item's position, by id
        self.open_calls: dict[str, int] = {}  # the position of each tool call with no result yet, by call id
        self.covered_calls: dict[str, ToolCall] = {}  # those of them a checkpoint covers (pruned from `items`)
        # Items up to this position are covered by the latest checkpoint: no request shows them again, so the
        # memo drops them (`prune`) and a cold read starts after them. -1: no checkpoint.
        self.floor = -1
        # The last request's segments in the provider port's form, so the next one converts only what is new.
        self.last_provider: tuple[list[Segment], list[ProviderSegment]] = ([], [])
        # What the last build's read brought besides the log (its items and prefix left out): what the next build
        # guesses its read will bring (`SessionState.guess_reads`). And the last build or model call this worker
        # ran of the session (its workflow run's id, its activity id): a guess is made only by the activity the run
        # scheduled next after it; and the last request it built (turn, call index): a build of the same request
        # again (after a compaction, or the provider's refusal) does not guess.
        self.last_reads: TurnReads | None = None
        self.last_activity: tuple[str, str] | None = None
        self.last_built: tuple[int, int] | None = None

    def _lasting(self, seg: Segment) -> bool:
        """Whether `seg` lives as long as the session (Region A, or a logged item's): only those are memoised,
        so the memo does not grow with the per-request segments (clock, working state, recall)."""
        return seg.region is Region.A or seg.item_id in self.by_id

    def json_of(self, seg: Segment) -> dict[str, Any]:
        hit = self.seg_json.get(id(seg))
        if hit is None or hit[0] is not seg:
            hit = (seg, SEGMENT.dump_python(seg, mode="json"))
            if self._lasting(seg):
                self.seg_json[id(seg)] = hit
        return hit[1]

    def jsons_of(self, segs: list[Segment]) -> list[dict[str, Any]]:
        """`json_of` each of `segs`, the ones not memoised dumped in one call (a cold build under pressure stores
        hundreds of pointers whole)."""
        hits: list[tuple[Segment, dict[str, Any]] | None] = list(map(self.seg_json.get, map(id, segs)))
        misses = [k for k, (hit, seg) in enumerate(zip(hits, segs, strict=True)) if hit is None or hit[0] is not seg]
        if misses:
            for k, data in zip(misses, _SEGMENTS.dump_python([segs[k] for k in misses], mode="json"), strict=True):
                hits[k] = (segs[k], data)
                if self._lasting(segs[k]):
                    self.seg_json[id(segs[k])] = (segs[k], data)
        return [cast(tuple[Segment, dict[str, Any]], hit)[1] for hit in hits]

    def provider_of(self, seg: Segment) -> ProviderSegment:
        hit = self.seg_provider.get(id(seg))
        if hit is None or hit[0] is not seg:
            hit = (seg, provider_segment(self.json_of(seg)))
            if self._lasting(seg):
                self.seg_provider[id(seg)] = hit
        return hit[1]

    def providers_of(self, segs: list[Segment]) -> list[ProviderSegment]:
        """`provider_of` each of `segs`, in C-level passes over the memoised ones (an entry keeps its segment alive,
        so no other object has its `id`): only the others are converted one by one."""
        hits: list[tuple[Segment, ProviderSegment] | None] = list(map(self.seg_provider.get, map(id, segs)))
        for at in compress(range(len(hits)), map(operator.not_, hits)):
            hits[at] = (segs[at], self.provider_of(segs[at]))
        return list(map(_second, cast(list[tuple[Segment, ProviderSegment]], hits)))

    def provider_segments(self, segments: list[Segment]) -> list[ProviderSegment]:
        """`segments` in the provider port's form; the head they share with the last request's is reused."""
        last, converted = self.last_provider
        keep = shared_head(segments, last)
        out = converted[:keep] + self.providers_of(segments[keep:])
        self.last_provider = (segments, out)
        return out

    def catch_up(self, rows: LiveLog, covers_to_seq: int) -> None:
        """The log rows read after what the memo holds join it; then what the latest checkpoint covers (up to
        `covers_to_seq`, -1: no checkpoint) leaves it."""
        self.join(rows)
        self.prune(covers_to_seq)

    def prune(self, covers_to_seq: int) -> None:
        """Forget the logged items a checkpoint covers (up to `covers_to_seq`): no request shows them again (it
        shows the checkpoint), so the memo holds what the window holds, not the session's whole log."""
        if covers_to_seq <= self.floor:
            return
        self.floor = covers_to_seq
        self.max_seq = max(self.max_seq, covers_to_seq)
        log = self.items
        k = bisect.bisect_right(log.seqs, covers_to_seq)
        if not k:
            return
        covered = set(log.seqs[:k])
        for call_id, seq in list(self.open_calls.items()):
            if seq in covered:
                self.covered_calls[call_id] = cast(ToolCall, log.item(log.at(seq)))
                del self.open_calls[call_id]
        gone = set(log.ids[:k])
        log.drop_head(k)
        for column in self.segments.values():
            del column[:k]
        for item_id in gone:
            self.by_id.pop(item_id, None)
        for refs in self.referable.values():
            for item_id in gone:
                refs.pop(item_id, None)
        for cache in self.renders.values():
            cache.forget(gone)
        self.seg_json.clear()  # refilled by the next request, for the segments it still shows
        self.seg_provider.clear()
        self.last_provider = ([], [])

    def this_turn(self) -> list[HistoryItem]:
        """The items logged since the last user message, that message included (the current turn's, in order)."""
        kinds = self.items.kinds
        at = len(kinds) - 1
        while at > 0 and kinds[at] != _USER_MESSAGE:
            at -= 1
        return self.items[max(at, 0) :]

    def item(self, item_id: str) -> HistoryItem | None:
        """The logged item `item_id`, if the memo holds it."""
        seq = self.by_id.get(item_id)
        if seq is None:
            return None
        log = self.items
        return log.item(log.at(seq))

    def taken(self, item_id: str, key: str) -> Segment | None:
        """The segment made of the logged item `item_id`'s render stored for the counter `key` (None: none)."""
        seq = self.by_id.get(item_id)
        column = self.segments.get(key)
        if seq is None or column is None:
            return None
        return column[self.items.at(seq)]

    def unanswered_calls(self) -> list[ToolCall]:
        """The logged tool calls with no result yet, in log order."""
        log = self.items
        calls = [cast(ToolCall, log.item(log.at(seq))) for seq in self.open_calls.values()]
        return sorted([*calls, *self.covered_calls.values()], key=_seq)

    def answered_unseen(self, call_ids: Iterable[str]) -> None:
        """Calls whose results were logged where the memo does not look (`seal_orphans` read them): answered. A
        call a checkpoint covers is forgotten now (no read of this memo will bring its result); the next read
        brings the others' results."""
        for call_id in call_ids:
            self.covered_calls.pop(call_id, None)

    def logged(self, renders: RenderCache, estimator: TokenEstimator, message: HistoryItem | None) -> LoggedHistory:
        """The log as the builder reads it, with `renders`' counter's segments (one made now of an item logged
        without a render for the counter), and `message` (not logged yet) after it."""
        log = self.items
        column = self.segments[renders.counter_key]
        if missing(column):
            for k in [k for k, seg in enumerate(column) if seg is None]:
                column[k] = renders.segment(log.item(k), estimator)
        seqs, segs, ids = list(log.seqs), list[Segment | None](column), list(log.ids)
        if message is None:
            return LoggedHistory(seqs, segs, ids, log.item)
        n = len(seqs)
        seqs.append(message.seq)
        segs.append(None)
        ids.append(message.id)
        return LoggedHistory(seqs, segs, ids, lambda k: message if k == n else log.item(k))

    def remember_request(
        self, sha: str, built: BuiltRequest, prefix_sha: str, body: list[Segment], form: BodyForm
    ) -> None:
        """A request this worker built and stored (as `form`): its model call, when it runs here, reads nothing, and
        the next request built here may be stored as a delta of it."""
        self.built[sha] = built
        while len(self.built) > 2:
            self.built.popitem(last=False)
        depth = self.last_body.depth + 1 if form.base and self.last_body is not None else 0
        self.last_body = LastBody(sha, prefix_sha, body, depth, form.whole)

    def refused(self, sha: str) -> None:
        """The provider refused request `sha` as too long: the turn builds it again, so a later call of it on this
        worker reads the record as that build stored it (its estimate and calibrations), not this memo's."""
        self.built.pop(sha, None)

    def answered(self, sha: str) -> None:
        """The call of request `sha` has stored its outcome: its memoised record says unanswered no more, so a later
        call of the request on this worker reads the stored one (and returns the logged reply, never asking twice)."""
        built = self.built.get(sha)
        if built is not None and built.record is not None:
            self.built[sha] = built._replace(record=None)

    def calibrated(self, calibration: float, provider_calibration: float) -> None:
        """The route's calibrations as this worker's write left them (a model call's): what the next build's read
        will bring, unless another session moves them first."""
        if self.last_reads is not None:
            self.last_reads = replace(
                self.last_reads, calibration=calibration, provider_calibration=provider_calibration
            )

    def body_form(self, prefix_sha: str, body: list[Segment], renders: RenderCache) -> BodyForm:
        """How `body` is stored (`stored_form`): whole, or as a delta of the previous request stored from this
        worker (the leading body segments they share, by identity, and the rest) when the whole form would hold
        more than `WHOLE_SLACK` entries more than the rest alone (segments stored as JSON: pointers under
        pressure, items logged without their segment). A body that shows the log as a few runs of positions is
        stored whole: as small, and a worker that did not build it reads one row, not a chain of deltas.

        The whole form is the previous one's cut where they part, then the rest: the work is what the body
        added, not its length."""
        last = self.last_body
        keep = shared_head(body, last.segments) if last is not None and last.prefix_sha == prefix_sha else 0
        tail = self.stored_form(body[keep:], renders)
        if not keep or last is None:
            return BodyForm(None, 0, tail, tail)
        whole = last.whole.head(keep).then(tail)
        if last.depth < MAX_DELTA_CHAIN and len(whole.entries) > len(tail.entries) + WHOLE_SLACK:
            return BodyForm(last.sha, keep, tail, whole)
        return BodyForm(None, 0, whole, whole)

    def render_for(self, estimator: TokenEstimator) -> RenderCache:
        """The session's render memo for `estimator`'s counter."""
        return self.render_memo(counter_key(estimator))

    def render_memo(self, key: str) -> RenderCache:
        """The session's render memo for the counter `key`; a new one takes every stored render it can."""
        if key not in self.renders:
            cache = self.renders[key] = RenderCache(self.secret, key)
            self.segments[key] = []
            self._take(0, cache)
        return self.renders[key]

    def _take(self, start: int, cache: RenderCache) -> None:
        """The segments of the logged items from index `start` on that `cache`'s counter counted, made from their
        stored renders (and their pointers' renders taken by `cache`); the referable ones are noted in `referable`.

        In whole-column steps (a cold worker takes thousands): only the pointers are visited one by one."""
        key, log = cache.counter_key, self.items
        stop = len(log)
        column = log.counts.get(key)
        counts: list[int | None] = column[start:stop] if column is not None else [None] * (stop - start)
        texts = log.renders[start:stop]
        segs: list[Segment | None] | None = None
        if None not in counts and None not in texts:
            made = segments_of_logged(
                log.ids[start:stop],
                log.kinds[start:stop],
                log.trusts[start:stop],
                log.call_ids[start:stop],
                log.taints[start:stop],
                cast(list[str], texts),
                cast(list[int], counts),
            )
            segs = cast(list[Segment | None] | None, made)
        if segs is None:  # some were logged before renders (or segments) were stored: made of their items
            segs = [
                None if count is None or text is None else segment_of(log.item(start + k), text, count)
                for k, (text, count) in enumerate(zip(texts, counts, strict=True))
            ]
        self.segments[key] += segs
        referable = list(map(operator.and_, log.referable[start:stop], map(operator.is_not, segs, repeat(None))))
        self.referable.setdefault(key, {}).update(
            zip(compress(log.ids[start:stop], referable), cast(list[Segment], compress(segs, referable)), strict=True)
        )
        # The tool results' pointers this counter counted (only a tool result is stored with one).
        stored = log.pointers[start:stop]
        pointed = [
            k
            for k in compress(range(start, stop), stored)
            if log.kinds[k] == _TOOL_RESULT and key in log.pointers[k]["tokens"] and segs[k - start] is not None  # type: ignore[index]
        ]
        if pointed:
            cache.adopt_pointers(
                [log.ids[k] for k in pointed],
                [cast(Segment, segs[k - start]).raw_tokens for k in pointed],
                [cast(dict[str, Any], log.pointers[k])["text"] for k in pointed],
                [cast(dict[str, Any], log.pointers[k])["tokens"][key] for k in pointed],
            )

    def join(self, rows: LiveLog) -> None:
        """Logged items (`rows`, in log order, after what the memo holds) join the memo of the log, their stored
        renders taken by every render memo of their counters."""
        log = self.items
        start = len(log)
        log.extend(rows)
        if not rows.seqs:
            return
        self.max_seq = log.seqs[-1]
        self.by_id.update(zip(rows.ids, rows.seqs, strict=True))
        open_calls = self.open_calls
        # Only the calls and results, picked in a C-level pass.
        for k in compress(range(len(rows.seqs)), map(_PAIRED.__contains__, rows.kinds)):
            call_id = cast(str, rows.call_ids[k])
            if rows.kinds[k] == "tool_call":
                open_calls[call_id] = rows.seqs[k]
            else:
                open_calls.pop(call_id, None)
                self.covered_calls.pop(call_id, None)
        for cache in self.renders.values():
            self._take(start, cache)

    def stored_form(self, segments: list[Segment], renders: RenderCache) -> StoredForm:
        """`segments` as a request body stores them. A segment that is a logged item's stored render (the very
        segment `renders` took from it, with the stored text and count), whose fields the store keeps with the
        item, is stored as a reference to the item: a run of them at consecutive log positions as one entry,
        `{"seqs": [first, last]}`, a lone one as `{"ref": item id}`. The others (per-request segments, pointers,
        the turn's message, items logged before segments were stored) are stored as the segment's JSON.

        So a cold worker's first body, which shows thousands of logged items in log order, stores a few entries
        (docs/operations.md, "Schema and migrations")."""
        refs = self.referable.get(renders.counter_key, {})
        # In C-level passes (a cold worker's first body refers to thousands): which segments are referable, their
        # log positions, and which go on the run of the one before (referable both, at consecutive positions).
        ids = list(map(_item_id, segments))
        referred = list(map(operator.is_, map(refs.get, ids), segments))
        seqs = list(map(self.by_id.get, ids, repeat(-2)))  # -2: not logged (never referred to)
        follows = [
            False,
            *map(
                operator.and_,
                map(operator.and_, referred[1:], referred[:-1]),
                map(operator.eq, seqs[1:], map(operator.add, seqs[:-1], repeat(1))),
            ),
        ]
        form = StoredForm([], [], [])
        entries, spans, ends = form
        whole = iter(self.jsons_of(list(compress(segments, map(operator.not_, referred)))))
        at, n = 0, len(segments)
        while at < n:
            if not referred[at]:
                entries.append(next(whole))
                spans.append(None)
                at += 1
            else:  # a run: up to the next segment that does not go on it (found in C)
                try:
                    end = follows.index(False, at + 1)
                except ValueError:
                    end = n
                span = (ids[at], seqs[at], seqs[end - 1])
                entries.append(_reference(*span))
                spans.append(span)
                at = end
            ends.append(at)
        return form

    def resolved(self, session_id: str, body: list[dict[str, Any]]) -> list[ProviderSegment] | None:
        """A stored request body of this session (`StoredRequest`, references left in) in the provider port's
        form, each reference the segment this memo took from the item's stored render: the one the body was
        stored with, which the store would expand it to (`EXPANDED_BODY`). A reference names its item by id
        (`{"ref", "session", "counter"}`) or a run of items by their first and last log positions (`{"seqs",
        "session", "counter"}`: the memo's items at those positions, taken in C-level passes). None when a
        reference names an item the memo does not hold (another session's, or one a checkpoint pruned)."""
        out: list[ProviderSegment] = []
        for entry in body:
            if "ref" not in entry and "seqs" not in entry:
                out.append(provider_segment(entry))
                continue
            if entry["session"] != session_id:
                return None
            key = entry["counter"]
            self.render_memo(key)  # made (taking the stored renders) when this worker has not counted with it
            refs = self.referable[key]
            if "ref" in entry:
                seg = refs.get(entry["ref"])
                if seg is None:
                    return None
                out.append(self.provider_of(seg))
                continue
            first, last = entry["seqs"]
            log = self.items
            at = log.at(first)
            seqs = log.seqs[at : at + last - first + 1]
            # The memo's items are in log order, one per position: the run's count, first and last make them all.
            if len(seqs) != last - first + 1 or seqs[0] != first or seqs[-1] != last:
                return None
            segs = list(map(refs.get, log.ids[at : at + last - first + 1]))
            if not all(segs):  # a missing one (a segment is always true: no `==` per segment, as `in` makes)
                return None
            out += self.providers_of(cast(list[Segment], segs))
        return out

    def write_counter_encoding(self) -> str:
        """The encoding items are counted in when written: the latest epoch's route's, else the open's route's."""
        if self.prefixes:
            return self.prefixes[max(self.prefixes)][1].encoding
        assert self.open is not None
        return self.open.route.profile().encoding


def shared_head(a: list[Segment], b: list[Segment]) -> int:
    """How many leading segments `a` and `b` share, by identity (segments are immutable and memoised)."""
    same = list(map(operator.is_, a, b))
    return same.index(False) if False in same else len(same)


class SessionState:
    """The store, the providers and the tokenizers, and the per-session memos, shared by the families."""

    def __init__(
        self,
        store: Store,
        providers: dict[str, ModelProvider],
        *,
        search_attributes: bool = False,
        max_sessions_cached: int = 512,
        scripted_by_default: bool = False,
    ) -> None:
        self.store = store
        self.providers = providers
        self.search_attributes = search_attributes
        # Whether a session that names no model_route gets the scripted model (the embedded dev services
        # only); otherwise it is refused at open.
        self.scripted_by_default = scripted_by_default
        self._counters: dict[str, TiktokenCounter] = {}
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()
        self._max_sessions = max_sessions_cached

    def counter(self, encoding: str) -> TiktokenCounter:
        if encoding not in self._counters:
            self._counters[encoding] = TiktokenCounter(encoding)
        return self._counters[encoding]

    def forget(self, session_id: str) -> None:
        """Drop the session's memo (closed, or replaced by a new session under the same id)."""
        self._sessions.pop(session_id, None)

    async def session(self, session_id: str) -> tuple[SessionOpen, bytes, SessionCache]:
        row = await self.store.get_session(session_id)
        if row is None:
            raise ApplicationError(f"unknown session {session_id!r}", type="UnknownSession", non_retryable=True)
        return self.remember(session_id, row)

    def cached(self, session_id: str) -> SessionCache | None:
        """The session's memo on this worker, if it has one (not refreshed: the caller reads the session too)."""
        return self._sessions.get(session_id)

    def remember(self, session_id: str, row: StoredSession) -> tuple[SessionOpen, bytes, SessionCache]:
        """The session's memo for its stored row: kept while the secret is the same, else a new one."""
        cache = self._sessions.get(session_id)
        if cache is None or cache.secret != row.secret:
            cache = SessionCache(row.secret)
            self._sessions[session_id] = cache
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        if cache.open is None:
            cache.open = SessionOpen.model_validate(row.open, context=STORED)  # validated in full at open
        return cache.open, cache.secret, cache

    async def turn_reads(
        self, session_id: str, epoch: int, recall_query: str | None
    ) -> tuple[SessionOpen, bytes, SessionCache, TurnReads]:
        """What a build reads, in one round trip, with the session's memo brought up to date from it."""
        before = self.cached(session_id)
        reads = await self.read_turn(session_id, epoch, recall_query, before)
        open_, secret, cache = await self.adopt(session_id, epoch, before, reads)
        return open_, secret, cache, reads

    async def read_turn(
        self, session_id: str, epoch: int, recall_query: str | None, before: SessionCache | None
    ) -> TurnReads:
        """What a build reads, in one round trip, after what `before` (the session's memo, None: none) holds; the
        memo is not touched (`adopt` brings it up to date)."""
        reads = await self.store.turn_reads(
            session_id,
            after_seq=before.max_seq if before is not None else -1,
            epoch=epoch,
            with_prefix=before is None or epoch not in before.prefixes,
            recall_query=recall_query,
            limit=RECALL_LIMIT,
        )
        if reads is None:
            raise ApplicationError(f"unknown session {session_id!r}", type="UnknownSession", non_retryable=True)
        return reads

    async def adopt(
        self, session_id: str, epoch: int, before: SessionCache | None, reads: TurnReads
    ) -> tuple[SessionOpen, bytes, SessionCache]:
        """The session's memo brought up to date from `reads` (read after what `before` held), which it keeps as
        the last read (`guess_reads`)."""
        open_, secret, cache = self.remember(session_id, reads.session)
        if cache is not before and before is not None:  # another session under the id: read it whole
            await self.items(session_id, cache)
            await self.prefix(session_id, epoch, cache)
        else:
            covers = int(reads.checkpoint["covers_to_seq"]) if reads.checkpoint is not None else -1
            cache.catch_up(reads.items, covers)
            if reads.prefix is not None:
                cache.prefixes[epoch] = (
                    FrozenPrefix.model_validate(reads.prefix.prefix),
                    ModelProfile.model_validate(reads.prefix.profile),
                )
            elif epoch not in cache.prefixes:
                raise ApplicationError(
                    f"session {session_id!r} has no prefix for epoch {epoch}", type="UnknownEpoch", non_retryable=True
                )
        cache.last_reads = replace(reads, items=LiveLog(), prefix=None)
        return open_, secret, cache

    @staticmethod
    def ran(cache: SessionCache, *, built: tuple[int, int] | None = None) -> None:
        """Note the running activity (a build or a model call, with its memo of the session in hand) as the last
        this worker ran of the session; a build, the request it builds (`built`: turn, call index)."""
        cache.last_activity = _running()
        if built is not None:
            cache.last_built = built

    @staticmethod
    def guess_reads(
        cache: SessionCache | None, epoch: int, recall_query: str | None, message_id: str | None, call: tuple[int, int]
    ) -> TurnReads | None:
        """What a build's read will bring, guessed from the memo: nothing logged since it, and the rest as the
        last read found it (the calibrations, the working-state writes, the checkpoint, the corrections, no
        recall). None when the worker runs other activities too (they take its loop while the read is on its way,
        and other sessions' model calls move the route's calibration under a guess), when the memo cannot guess
        (another activity of the session's run ran since this worker's last, `_next_after`: on another worker,
        say, whose writes the memo has not seen), when the build is of the request this worker built last (`call`:
        turn, call index; built again because what it read changed: a compaction's checkpoint, the calibration a
        provider's refusal raised), or when a build from the guess would read or write (an epoch or a session not
        memoised, recall not searched by the read, a recall found last time, tool calls to seal, the turn's
        message, `message_id`, logged already).

        A guess is only ever used after the read confirms it (`guessed_right`): the build runs on it while the
        read is on its way, so the read's round trip, which the worker would spend waiting, is spent building."""
        last = cache.last_reads if cache is not None else None
        if (
            cache is None
            or last is None
            or activities_running() > 1
            or not _next_after(cache.last_activity, _running())
            or cache.last_built == call
            or cache.open is None
            or epoch not in cache.prefixes
            or recall_query is None
            or last.recall != []
            or cache.open_calls
            or cache.covered_calls
            or message_id in cache.by_id
        ):
            return None
        return replace(last, recall=[])

    @staticmethod
    def guessed_right(guess: TurnReads, reads: TurnReads) -> bool:
        """Whether `reads` brought exactly what `guess` said: a build from the guess is the build from them."""
        return (
            not reads.items.seqs
            and reads.prefix is None
            and reads.calibration == guess.calibration
            and reads.provider_calibration == guess.provider_calibration
            and reads.recall == guess.recall
            and reads.corrections == guess.corrections
            and reads.checkpoint == guess.checkpoint
            and reads.working_state_writes == guess.working_state_writes
        )

    async def call_reads(
        self, session_id: str, turn: int, call_index: int, epoch: int, request_sha256: str, *, first_attempt: bool
    ) -> tuple[SessionOpen, SessionCache, CallReads]:
        """What a model call reads, in one round trip, with the session's memo brought up to date from it; the
        request's body too when this worker did not build it.

        The first attempt of a call on the worker that built its request reads nothing: the build has just
        brought the memo up to date, stored the record (not answered yet, or it would not have been written) and
        read the calibrations. A retry reads, for the reply an earlier attempt may have logged."""
        before = self.cached(session_id)
        built = before.built.get(request_sha256) if before is not None else None
        if first_attempt and built is not None and built.record is not None and before is not None:
            assert before.open is not None  # the build remembered the session
            return (
                before.open,
                before,
                CallReads(
                    session=None,
                    record=built.record,
                    items=LiveLog(),
                    covers_to_seq=before.floor,
                    calibration=built.calibration,
                    provider_calibration=built.provider_calibration,
                ),
            )
        built_here = built is not None
        reads = await self.store.call_reads(
            session_id,
            turn,
            call_index,
            after_seq=before.max_seq if before is not None else -1,
            epoch=epoch,
            request=None if built_here else request_sha256,
        )
        if reads is None:
            raise ApplicationError(f"unknown session {session_id!r}", type="UnknownSession", non_retryable=True)
        assert reads.session is not None
        open_, _, cache = self.remember(session_id, reads.session)
        if cache is not before and before is not None:  # another session under the id: read it whole
            await self.items(session_id, cache)
        else:
            cache.catch_up(reads.items, reads.covers_to_seq)
        return open_, cache, reads

    async def items(self, session_id: str, cache: SessionCache) -> Sequence[HistoryItem]:
        """The log the latest checkpoint does not cover, in log order: what any request can show."""
        covers_to_seq, rows = await self.store.load_live_items(session_id, cache.max_seq)
        cache.catch_up(rows, covers_to_seq)
        return cache.items

    async def append(
        self,
        session_id: str,
        turn: int,
        items: list[dict[str, Any]],
        cache: SessionCache,
    ) -> list[int]:
        """Log `items` with their renders (`renders`), in one round trip; they join the memo (`joined`).

        `cache` is up to date (the caller read the log), and the callers log results the log does not hold (a
        tool's, looked for in the memo first; a sealed call's, in the log from the call on): an item already logged
        is looked for only after the memo's last position. In the whole log, a table never analysed (a new
        database) planned that lookup as a read of the session's rows. An item logged before it all the same (a
        late attempt's) is still logged once: the unique index keeps the first, and the item does not join the
        memo."""
        renders = self.render_for_log(items, cache)
        seqs = await self.store.append_items(session_id, turn, items, group_after_seq=cache.max_seq, renders=renders)
        self.joined(items, seqs, renders, cache)
        return seqs

    def render_for_log(self, items: list[dict[str, Any]], cache: SessionCache) -> list[ItemRender]:
        """Each item's render, stored with it (render once, at write time): rendered with the session's secret and
        counted by the counter of the session's current route, so a worker that has not seen the session reads
        them instead of rendering and counting again, and with its segment's other fields, so a request body
        refers to it instead of copying it."""
        counter = self.counter(cache.write_counter_encoding())
        out: list[ItemRender] = []
        for data in items:
            item = parse_history_item({**data, "seq": 0})
            text = render_item(item, cache.secret)
            tokens = counter.count(text)
            fields = SEGMENT.dump_python(segment_of(item, text, tokens), mode="json", exclude=_TEXT_AND_COUNT)
            pointer = None
            if isinstance(item, ToolResult):  # the pointer a build under pressure may show instead
                pointer_text = render_item(pointer_for(item, tokens), cache.secret)
                pointer = {"text": pointer_text, "tokens": {counter.name: counter.count(pointer_text)}}
            out.append(ItemRender(text=text, tokens={counter.name: tokens}, segment=fields, pointer=pointer))
        return out

    def joined(
        self,
        items: list[dict[str, Any]],
        seqs: list[int],
        renders: list[ItemRender],
        cache: SessionCache,
    ) -> None:
        """Items just logged at `seqs` join the memo when they follow what it holds (no read back); otherwise the
        next read brings them."""
        if items and seqs == list(range(cache.max_seq + 1, cache.max_seq + 1 + len(items))):
            cache.join(
                LiveLog.of_payloads(
                    [{**data, "seq": seq} for data, seq in zip(items, seqs, strict=True)],
                    segments=[r.segment for r in renders],
                    renders=[r.text for r in renders],
                    counts=[r.tokens for r in renders],
                    pointers=[r.pointer for r in renders],
                )
            )

    async def prefix(self, session_id: str, epoch: int, cache: SessionCache) -> tuple[FrozenPrefix, ModelProfile]:
        if epoch not in cache.prefixes:
            row = await self.store.get_prefix(session_id, epoch)
            if row is None:
                raise ApplicationError(
                    f"session {session_id!r} has no prefix for epoch {epoch}",
                    type="UnknownEpoch",
                    non_retryable=True,
                )
            cache.prefixes[epoch] = (
                FrozenPrefix.model_validate(row.prefix),
                ModelProfile.model_validate(row.profile),
            )
        return cache.prefixes[epoch]

    async def profile(self, base: ModelProfile) -> ModelProfile:
        learned = await self.store.get_calibration(base.route)
        return calibrated(base, learned, None if learned else await self.store.provider_calibration(base.provider))

    async def event(
        self, session_id: str, key: str, type_: EventType, turn: int, epoch: int, payload: dict[str, Any]
    ) -> None:
        """Store an event once (by key); the first store logs it and counts it in the metrics."""
        if await self.store.add_event(session_id, key, type_.value, turn=turn, epoch=epoch, payload=payload):
            self.logged_event(session_id, type_, turn, epoch, payload)

    def logged_event(self, session_id: str, type_: EventType, turn: int, epoch: int, payload: dict[str, Any]) -> None:
        """An event just stored (the first time): logged and counted in the metrics."""
        log.info(type_.value, session_id=session_id, turn=turn, epoch=epoch, **payload)
        record_event(type_, payload)


def _running() -> tuple[str, str]:
    """The running activity: its workflow run's id and its activity id."""
    info = activity.info()
    return info.workflow_run_id or "", info.activity_id


def _next_after(last: tuple[str, str] | None, now: tuple[str, str]) -> bool:
    """Whether activity `now` is the one its workflow run scheduled next after `last` (each: its run's id, its
    activity id), so that no other activity of the run ran between them. A run's activity ids are its activities'
    sequence numbers (the SDK's default, which the workflows keep); ids that are not numbers (a test environment's)
    tell nothing, and are taken as next."""
    if last is None or last[0] != now[0]:
        return False
    if not (last[1].isdigit() and now[1].isdigit()):
        return True
    return int(now[1]) == int(last[1]) + 1


def calibrated(base: ModelProfile, learned: float | None, highest: float | None) -> ModelProfile:
    """The route's profile with its learned calibration. A route not seen yet starts conservatively: its published
    ratio or the highest any route of its provider holds, whichever is higher; never optimistically (it learns
    downwards from usage)."""
    if learned:
        return base.model_copy(update={"calibration": learned})
    return base.model_copy(update={"calibration": highest}) if highest and highest > base.calibration else base


def working_state(writes: list[dict[str, Any]], count: Any, upto_turn: int) -> WorkingState:
    """The working state the stored writes fold to, as of `upto_turn`."""
    return fold([WorkingStateWrite.model_validate(w) for w in writes], count=count, upto_turn=upto_turn)


def snapshot_ids(prefix: FrozenPrefix) -> list[str]:
    """The memory ids of the prefix's frozen snapshot."""
    return [s.item_id.removeprefix("memory.") for s in prefix.segments if s.kind == "memory_snapshot"]


def provider_segment(data: dict[str, Any]) -> ProviderSegment:
    """A stored segment (its JSON) in the provider port's form (the fields the port has; pydantic-core drops the
    others)."""
    return ProviderSegment.model_validate(data)
