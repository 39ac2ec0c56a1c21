"""Decisions 3 and 10: build() is pure, and no Region B input can change the prefix bytes."""

from __future__ import annotations

import hashlib

from hypothesis import example, given, settings
from hypothesis import strategies as st

from core.budget import ContextBudget
from core.build import BodyInputs, RenderCache, build, segment_of
from core.compaction import Checkpoint, apply_checkpoint
from core.items import (
    CorrectionLine,
    CurrentUserMessage,
    ElidedSpan,
    RecallItem,
    TrustLevel,
    TurnContext,
    UserMessage,
    WorkingStateBlock,
)
from core.plan import PlanStatus, Segment
from tests.unit import factories as f

BUDGET = ContextBudget()
PREFIX = f.prefix()


def _build(body: BodyInputs, cache: RenderCache | None = None):  # type: ignore[no-untyped-def]
    return build(PREFIX, body, budget=BUDGET, estimator=f.estimator(), secret=f.SECRET, cache=cache)


body_text = st.text(min_size=0, max_size=200)


class TestPurity:
    def test_same_inputs_same_bytes(self) -> None:
        """Two builds of the same inputs give identical bytes and hashes."""
        a, b = _build(f.body(8)), _build(f.body(8))
        assert a.text == b.text and a.request_sha256 == b.request_sha256 and a.prefix_sha256 == b.prefix_sha256

    def test_cache_never_changes_the_result(self) -> None:
        """A warm cache, a cold cache and no cache give the same plan."""
        cache = RenderCache(f.SECRET)
        _build(f.body(3), cache)
        warm = _build(f.body(8), cache)
        cold = _build(f.body(8))
        assert warm.model_dump() == cold.model_dump()

    def test_cache_detects_a_changed_item_with_the_same_id(self) -> None:
        """An item with a reused id but new content is rendered anew, not served stale."""
        cache = RenderCache(f.SECRET)
        body = f.body(1)
        _build(body, cache)
        changed = body.model_copy(
            update={"current": CurrentUserMessage(id="current", seq=body.current.seq, text="other")}
        )
        assert "other" in _build(changed, cache).text

    def test_each_item_is_rendered_once(self) -> None:
        """Across builds, each distinct item is rendered and counted once."""
        cache = RenderCache(f.SECRET)
        _build(f.body(5), cache)
        size = len(cache)
        _build(f.body(5), cache)
        assert len(cache) == size

    def test_request_hash_is_sha256_of_the_bytes(self) -> None:
        """request_sha256 is the SHA-256 of the whole request text; prefix_sha256 of the prefix."""
        plan = _build(f.body(2))
        assert plan.request_sha256 == hashlib.sha256(plan.text.encode()).hexdigest()
        assert plan.prefix_sha256 == hashlib.sha256(plan.prefix_text.encode()).hexdigest()

    @given(
        lengths=st.lists(st.one_of(st.sampled_from([0, 1, 63, 64, 65, 128, 129]), st.integers(0, 300)), max_size=6),
        changes=st.lists(st.integers(0, 299), max_size=5),
    )
    @settings(max_examples=100, deadline=None)
    def test_a_resumed_request_hash_is_the_hash_of_the_bytes(self, lengths: list[int], changes: list[int]) -> None:
        """Over successive requests through one memo (longer, shorter, changed anywhere), each request hash is the
        SHA-256 of the prefix and body bytes, wherever it resumed from (checkpoints every 64 segments)."""
        lengths = [1, 64, 65, 129, 128, *lengths]  # a segment alone, and a resume with one, or one more, to hash
        cache = RenderCache(f.SECRET)
        pool = [
            segment_of(UserMessage(id=f"u{i}", seq=i, text=f"m{i}"), f"text {i}\n", 3)
            for i in range(len(lengths) * 301)
        ]
        body: list[Segment] = []
        for step, length in enumerate(lengths):
            body = body[:length] + pool[len(body) : length] if length > len(body) else body[:length]
            for at in changes:
                if at < len(body) and step % 2:  # a different segment object in place: the hash resumes before it
                    body = [*body[:at], pool[-1 - at], *body[at + 1 :]]
            whole = PREFIX.text + "".join(seg.text for seg in body)
            assert cache.request_hash(PREFIX, body) == hashlib.sha256(whole.encode()).hexdigest()


class TestPrefixStability:
    @given(
        current=body_text,
        clock=body_text,
        ws=body_text,
        recall=st.lists(body_text, max_size=4),
        corrections=st.lists(body_text, max_size=3),
        turns=st.integers(min_value=0, max_value=6),
    )
    @settings(max_examples=60, deadline=None)
    def test_region_b_never_changes_prefix(
        self, current: str, clock: str, ws: str, recall: list[str], corrections: list[str], turns: int
    ) -> None:
        """Whatever the Region B inputs, the prefix bytes and hash are those of the frozen prefix."""
        hist = f.history(turns)
        seq = hist[-1].seq + 1 if hist else 0
        body = BodyInputs(
            history=hist,
            turn_start_seq=seq,
            current=CurrentUserMessage(id="cur", seq=seq, text=current),
            turn_context=TurnContext(id="clock", text=clock),
            working_state=WorkingStateBlock(id="ws", text=ws),
            recall=[RecallItem(id=f"r{i}", memory_id=f"m{i}", rank=i, text=t) for i, t in enumerate(recall)],
            corrections=[CorrectionLine(id=f"c{i}", memory_id=f"m{i}", text=t) for i, t in enumerate(corrections)],
        )
        plan = _build(body)
        assert plan.prefix_text == PREFIX.text
        assert plan.prefix_sha256 == PREFIX.sha256
        assert plan.text.startswith(PREFIX.text)

    def test_clock_crossing_midnight_keeps_prefix(self) -> None:
        """The clock lives in the body: 23:59 and 00:01 builds share one prefix hash."""
        body = f.body(2)
        before = _build(body.model_copy(update={"turn_context": TurnContext(id="clock", text="2026-11-30 23:59")}))
        after = _build(body.model_copy(update={"turn_context": TurnContext(id="clock", text="2026-12-01 00:01")}))
        assert before.prefix_sha256 == after.prefix_sha256
        assert before.request_sha256 != after.request_sha256

    def test_session_secret_changes_nonces_not_content(self) -> None:
        """Another session's secret renders other envelope nonces around the same content."""
        plan = build(PREFIX, f.body(1), budget=BUDGET, estimator=f.estimator(), secret=b"other")
        mine = _build(f.body(1))
        assert plan.body_text != mine.body_text
        assert "what next?" in plan.body_text and "what next?" in mine.body_text


class TestPlan:
    def test_plan_reports_classes_regions_and_status(self) -> None:
        """A plan reports tokens per class, the prefix and body split, and its status."""
        plan = _build(f.body(4))
        assert plan.status is PlanStatus.FITS and plan.deficit_tokens == 0
        assert {
            "platform_policy",
            "agent_instructions",
            "tools",
            "memory_snapshot",
            "history",
            "current_message",
        } <= set(plan.tokens_by_class)
        assert plan.estimated_tokens == plan.prefix_tokens + plan.prefix_margin_tokens + plan.body_tokens
        summary = plan.summary()
        assert summary.segments == len(plan.segments) and summary.prefix_sha256 == plan.prefix_sha256

    def test_history_only_user_messages_in_order(self) -> None:
        """History items appear in log order."""
        hist = [UserMessage(id=f"u{i}", seq=i, text=f"m{i}") for i in (3, 1, 2)]
        plan = _build(BodyInputs(history=hist, turn_start_seq=10))
        assert [s.item_id for s in plan.segments if s.kind == "user_message"] == ["u1", "u2", "u3"]


class TestWarmCache:
    def test_a_history_list_extended_in_place_is_read_again(self) -> None:
        """A caller that appends to the list it passed before still gets the new items (the memo keeps a copy)."""
        hist = list(f.history(4))
        cache = RenderCache(f.SECRET)
        seq = hist[-1].seq + 1
        # model_construct, as the activities build it: the builder gets the caller's list itself, not a copy.
        _build(BodyInputs.model_construct(history=hist, turn_start_seq=seq), cache)
        hist.append(UserMessage(id="late", seq=seq, text="appended in place"))
        warm = _build(BodyInputs.model_construct(history=hist, turn_start_seq=seq + 1), cache)
        assert warm.model_dump() == _build(BodyInputs(history=hist, turn_start_seq=seq + 1)).model_dump()
        assert "appended in place" in warm.text

    @given(
        steps=st.lists(
            st.tuples(
                st.sampled_from(
                    ["append", "replace", "drop_last", "shuffle", "window", "checkpoint", "same_checkpoint"]
                ),
                st.integers(0, 50),
            ),
            min_size=1,
            max_size=8,
        )
    )
    @settings(max_examples=40, deadline=None)
    @example(steps=[("shuffle", 23), ("append", 0), ("checkpoint", 19)])  # an append after a shuffle
    def test_any_sequence_of_builds_matches_cold_builds(self, steps: list[tuple[str, int]]) -> None:
        """Whatever changes between builds, a build through a warm cache equals a cold build of the same inputs."""
        import random

        hist = f.history(12)
        cache = RenderCache(f.SECRET)
        window = 100_000
        checkpoint: Checkpoint | None = None
        for op, n in steps:
            if op == "append":
                # At the log's next position (after a shuffle the list's last item is not the log's last; two items
                # at one position is a log the store cannot hold).
                seq = max((h.seq for h in hist), default=-1) + 1
                hist = [*hist, UserMessage(id=f"x{seq}", seq=seq, text=f"more {n}")]
            elif op == "replace" and hist:
                i = n % len(hist)
                if isinstance(hist[i], UserMessage):
                    hist = [*hist[:i], hist[i].model_copy(update={"text": f"changed {n}"}), *hist[i + 1 :]]
            elif op == "drop_last" and hist and hist[-1].kind == "user_message":
                hist = hist[:-1]
            elif op == "shuffle":
                hist = list(hist)
                random.Random(n).shuffle(hist)
            elif op == "window":
                window = 3_000 + n * 100
            elif op == "checkpoint" and hist:
                # A checkpoint over the log's first items, with a pointer to an untrusted one: what the build
                # shows from here is the summary, the pointers and the rest.
                ordered = sorted(hist, key=lambda h: h.seq)
                k = 1 + n % len(ordered)
                while k < len(ordered) and ordered[k].kind == "tool_result":  # a pair is never split
                    k += 1
                covered = ordered[:k]
                checkpoint = Checkpoint(
                    checkpoint_id=f"cp{n}",
                    depth=1,
                    covers_from_seq=covered[0].seq,
                    covers_to_seq=covered[-1].seq,
                    summary=f"summary {n}",
                    pointers=[
                        ElidedSpan(
                            id=f"cp{n}.p0",
                            trust=TrustLevel.TOOL,
                            seq=covered[0].seq,
                            original_id=covered[0].id,
                            original_tokens=40,
                            reference=f"item:{covered[0].id}",
                            reason="compaction_elided",
                        )
                    ],
                )
            elif op == "same_checkpoint" and checkpoint is not None:
                checkpoint = checkpoint.model_copy()  # equal, not identical: as each build reads it again
            seq = max((h.seq for h in hist), default=-1) + 1
            body = BodyInputs(
                history=hist,
                checkpoint=checkpoint,
                turn_start_seq=seq,
                current=CurrentUserMessage(id="c", seq=seq, text="q"),
            )
            budget = ContextBudget(context_window=window, output_reserve=500)
            warm = build(PREFIX, body, budget=budget, estimator=f.estimator(), secret=f.SECRET, cache=cache)
            cold = build(PREFIX, body, budget=budget, estimator=f.estimator(), secret=f.SECRET)
            assert warm.model_dump() == cold.model_dump()
            assert warm.request_sha256 == hashlib.sha256(warm.text.encode()).hexdigest()
            # The counts the builder keeps as it goes are the counts of what it sent.
            body_segments = warm.segments[len(PREFIX.segments) :]
            assert warm.pointers == sum(s.kind == "elided_span" for s in warm.segments)
            assert warm.untrusted_in_view == any(s.taints for s in body_segments)
            shown = {h.id for h in apply_checkpoint(hist, checkpoint)}
            assert {s.item_id for s in body_segments} >= {i for i in shown if not warm.yields}
