"""The budget torture run (development harness, beside the gates; never imported by production code).

Hypothesis draws random sessions (docs/assembly-and-budget.md, "The torture run"): windows 4,096-32,768,
scripted usage ratios 1.0-1.45, and turns that mix long pastes, tool-heavy model calls (1-8 calls), untrusted
pages, memory writes, revocations and route rotations. Each session runs on the live stack; the invariants
are read back from PostgreSQL and from what each update returned:

- no request over its limit (the provider's reported usage against the plan's input limit);
- no session stuck: every failed turn is a typed TurnTooLarge whose sizes really exceed the limit, and a
  small turn right after it is answered; a refused rotation is typed and the next turn is answered;
- yields follow the ADR order within every plan.

Sessions are drawn first (hypothesis, `derandomize` unless a seed is given), then run; a failure names the
session's seed and script, so `CTXENGINE_TORTURE_SEED=... ` (read by the test only) replays it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.tokens import TiktokenCounter
from contract import names
from contract.payloads import ModelRoute, RevokeTool, RotateEpoch, WriteMemory
from harness.sessions import gate_open as _open

MIN_WINDOW = 4_096
MAX_WINDOW = 32_768
# Pressure-yield steps in the ADR's order (decision 8, then inside the active turn, then the minimum body).
YIELD_RANK = {
    "recall_dropped": 0,
    "tool_results_to_pointers": 1,
    "active_tool_results_to_pointers": 2,
    "checkpoint_pointers_dropped": 3,
}
PAGES = ["fixture://long", "fixture://injection", "fixture://weather", "fixture://long"]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "route", "budget", "window", "turn"]


@dataclass(frozen=True)
class Op:
    kind: str  # paste | tools | page | memory | revoke | rotate | small
    size: int = 0  # words of a paste, calls of a tool turn, window of a rotation
    seed: int = 0


@dataclass(frozen=True)
class Script:
    seed: int
    window: int
    output_reserve: int
    ratio: float
    ops: tuple[Op, ...]

    def describe(self) -> str:
        ops = ", ".join(f"{o.kind}({o.size})" if o.size else o.kind for o in self.ops)
        return f"seed={self.seed} window={self.window} reserve={self.output_reserve} ratio={self.ratio}: {ops}"


@dataclass
class Figures:
    sessions: int = 0
    turns: int = 0
    requests: int = 0
    requests_over_window: int = 0
    sessions_stuck: int = 0
    turns_too_large: int = 0
    turns_too_large_sizes_checked: int = 0
    rotations: int = 0
    rotations_refused: int = 0
    yields_out_of_order: int = 0
    active_yields: int = 0
    min_window_tested: int = MAX_WINDOW
    max_window_tested: int = 0
    max_actual_over_limit: float = 0.0
    failures: list[str] = field(default_factory=list)

    def passed(self) -> bool:
        return (
            self.sessions > 0
            and self.requests_over_window == 0
            and self.sessions_stuck == 0
            and self.yields_out_of_order == 0
            and self.turns_too_large_sizes_checked == self.turns_too_large
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "requests": self.requests,
            "requests_over_window": self.requests_over_window,
            "max_actual_over_limit": round(self.max_actual_over_limit, 4),
            "sessions_stuck": self.sessions_stuck,
            "turns_too_large": self.turns_too_large,
            "turns_too_large_sizes_checked": self.turns_too_large_sizes_checked,
            "rotations": self.rotations,
            "rotations_refused": self.rotations_refused,
            "active_turn_yields": self.active_yields,
            "yields_out_of_order": self.yields_out_of_order,
            "min_window_tested": self.min_window_tested,
            "max_window_tested": self.max_window_tested,
            "failures": self.failures[:5],
            "passed": self.passed(),
        }


# Every run also plays this one, so each invariant is exercised whatever hypothesis draws: the floor of the
# window range at the highest ratio, a paste no window of that size takes, 8 calls in one model call,
# untrusted pages, a rotation to a route too small to take a turn (refused), then to a larger one.
EDGE = Script(
    seed=2**31 + 1,
    window=MIN_WINDOW,
    output_reserve=600,
    ratio=1.45,
    ops=(
        Op("tools", 8, 3),
        Op("paste", 9_000, 5),
        Op("page", 3),
        Op("memory", 60, 2),
        Op("tools", 6, 1),
        Op("rotate", 2_048),
        Op("revoke", 0, 0),
        Op("tools", 8, 2),
        Op("rotate", 8_192),
        Op("paste", 2_500, 9),
        Op("tools", 5, 4),
    ),
)

# And this one, where tool-heavy turns fit only once their own results are pointers (yields inside the turn).
EDGE_TOOLS = Script(
    seed=2**31 + 2,
    window=6_000,
    output_reserve=600,
    ratio=1.2,
    ops=(Op("tools", 4, 0), Op("tools", 6, 0), Op("page", 3), Op("tools", 8, 0), Op("small", 0, 1)),
)


def draw_scripts(examples: int, *, ops: tuple[int, int], seed: int | None = None) -> list[Script]:
    """`examples` sessions drawn by hypothesis: derandomized (the same every run) unless `seed` is given.

    The first drawn session is pinned to the smallest window, so every run tests the floor of the range; the two
    fixed sessions (EDGE, EDGE_TOOLS) come first.
    """

    op = st.one_of(
        st.builds(Op, kind=st.just("paste"), size=st.integers(200, 9_000), seed=st.integers(0, 10**6)),
        st.builds(Op, kind=st.just("tools"), size=st.integers(1, 8), seed=st.integers(0, 10**6)),
        st.builds(Op, kind=st.just("page"), size=st.integers(1, 3), seed=st.integers(0, 10**6)),
        st.builds(Op, kind=st.just("memory"), size=st.integers(5, 120), seed=st.integers(0, 10**6)),
        st.builds(Op, kind=st.just("revoke"), seed=st.integers(0, 1)),
        st.builds(Op, kind=st.just("rotate"), size=st.sampled_from([2_048, 3_000, 4_096, 8_192, 16_384, 32_768])),
        st.builds(Op, kind=st.just("small"), seed=st.integers(0, 10**6)),
    )
    script = st.builds(
        Script,
        seed=st.integers(0, 2**31),
        window=st.integers(MIN_WINDOW, MAX_WINDOW),
        output_reserve=st.sampled_from([256, 512, 600, 800, 1_024]),
        ratio=st.integers(100, 145).map(lambda r: r / 100),
        ops=st.lists(op, min_size=ops[0], max_size=ops[1]).map(tuple),
    )
    drawn: list[Script] = []

    @settings(
        max_examples=examples,
        derandomize=seed is None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(script)
    def collect(s: Script) -> None:
        drawn.append(s)

    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    collect()
    scripts = drawn[:examples]
    if scripts:
        scripts[0] = Script(scripts[0].seed, MIN_WINDOW, scripts[0].output_reserve, scripts[0].ratio, scripts[0].ops)
    return [EDGE, EDGE_TOOLS, *scripts]


def _text(op: Op, n: int) -> str:
    words = [WORDS[(op.seed + i * 7) % len(WORDS)] + str((op.seed + i) % 97) for i in range(op.size)]
    if op.kind == "paste":
        return f"turn {n}: please read this paste.\n" + " ".join(words)
    if op.kind == "tools":
        lines = []
        for i in range(op.size):
            k = (op.seed + i) % 4
            if k == 3:
                lines.append(f'/call notes.save {{"text": "note {i}"}}')
            else:
                lines.append(f'/call web.fetch {{"url": "{PAGES[k]}"}}')
        return f"turn {n}: tools\n" + "\n".join(lines)
    if op.kind == "page":
        return f"turn {n}: read untrusted pages\n" + "\n".join(
            f'/call web.fetch {{"url": "fixture://{"injection" if i % 2 else "long"}"}}' for i in range(op.size)
        )
    return f"turn {n}: small talk {op.seed}"


class _Run:
    def __init__(self, stack: Any, script: Script, figures: Figures, counter: TiktokenCounter) -> None:
        self.s = stack
        self.script = script
        self.f = figures
        self.counter = counter
        self.turn_no = 0
        self.stuck = False
        self.epoch = 1  # the session's epoch and route, to check that a refused rotation changes neither
        self.route_model = f"torture-{script.seed}"
        self.scope_id = uuid.uuid4().hex[:8]  # a fresh memory scope per run: the snapshot never carries over

    def fail(self, why: str) -> None:
        self.f.failures.append(f"{why} [{self.script.describe()}]")

    async def turn(self, handle: Any, text: str, *, must_succeed: bool = False) -> bool:
        self.turn_no += 1
        self.f.turns += 1
        try:
            await self.s.turn(handle, text)
            return True
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if must_succeed or not isinstance(cause, ApplicationError) or cause.type != "TurnTooLarge":
                self.stuck = True
                self.fail(f"turn {self.turn_no} failed: {type(cause).__name__}: {cause}")
                return False
            self.f.turns_too_large += 1
            d = cause.details[0] if cause.details else {}
            raw = self.counter.count(text)
            over = d.get("minimum_body_tokens", 0) + d.get("prefix_tokens", 0) > d.get("input_limit", 10**9)
            # Refused before logging, the message itself is the current message: at least its raw count.
            if over and (d.get("logged") or d.get("message_tokens", 0) >= raw):
                self.f.turns_too_large_sizes_checked += 1
            else:
                self.fail(f"TurnTooLarge with sizes that fit: {d} (message raw {raw})")
            # The session is not stuck: a small turn right after is answered.
            await self.turn(handle, f"turn {self.turn_no + 1}: still there?", must_succeed=True)
            return False

    async def run(self) -> None:
        sc = self.script
        route: dict[str, Any] = {
            "provider": "scripted",
            "model": f"torture-{sc.seed}",
            "provider_options": {"usage_ratio": sc.ratio},
            "context_window": sc.window,
        }

        handle = await self.s.start(
            _open(
                model_route=route,
                budget={"output_reserve": sc.output_reserve},
                memory_scope=f"t-{sc.seed}-{self.scope_id}",
            ),
            "torture",
        )
        self.f.sessions += 1
        self.f.min_window_tested = min(self.f.min_window_tested, sc.window)
        self.f.max_window_tested = max(self.f.max_window_tested, sc.window)
        rotations = 0
        for op in sc.ops:
            if op.kind in ("memory", "revoke"):
                text = " ".join(WORDS[(op.seed + i) % len(WORDS)] for i in range(op.size))
                update = (
                    (names.UPDATE_WRITE_MEMORY, WriteMemory(text=f"remember: {text}"))
                    if op.kind == "memory"
                    else (names.UPDATE_REVOKE_TOOL, RevokeTool(name=("web.fetch", "notes.save")[op.seed % 2]))
                )
                try:
                    await handle.execute_update(*update)
                except WorkflowUpdateFailedError as exc:
                    self.stuck = True
                    self.fail(f"{op.kind} failed: {exc.cause}")
                    break
                continue
            if op.kind == "rotate":
                rotations += 1
                new_route = ModelRoute(
                    model=f"torture-{sc.seed}-r{rotations}",
                    provider_options={"usage_ratio": sc.ratio},
                    context_window=op.size,
                )
                try:
                    await handle.execute_update(
                        names.UPDATE_ROTATE_EPOCH, RotateEpoch(reason="model_route_changed", model_route=new_route)
                    )
                    self.f.rotations += 1
                    self.epoch += 1
                    self.route_model = new_route.model
                    self.f.min_window_tested = min(self.f.min_window_tested, op.size)
                except WorkflowUpdateFailedError as exc:
                    if not (isinstance(exc.cause, ApplicationError) and exc.cause.type == "RotationRefused"):
                        self.stuck = True
                        self.fail(f"rotation failed untyped: {exc.cause}")
                        break
                    self.f.rotations_refused += 1
                    state = await self.s.state(handle)
                    if state.epoch != self.epoch or state.model_route.model != self.route_model:
                        self.stuck = True
                        self.fail(f"a refused rotation changed the session: epoch {state.epoch}")
                        break
                if not await self.turn(handle, f"turn {self.turn_no + 1}: after rotation", must_succeed=True):
                    break
                continue
            await self.turn(handle, _text(op, self.turn_no + 1))
            if self.stuck:
                break
        if not self.stuck:  # the session still takes a turn at its end
            await self.turn(handle, "last turn: done?", must_succeed=True)
        self.f.sessions_stuck += int(self.stuck)
        await self.check_records(handle.id)

    async def check_records(self, session_id: str) -> None:
        for r in await self.s.store.records(session_id):
            actual = r.actual_input_tokens
            if actual is None:
                continue
            self.f.requests += 1
            limit = r.plan["input_limit"]
            self.f.max_actual_over_limit = max(self.f.max_actual_over_limit, actual / limit)
            if actual > limit:
                self.f.requests_over_window += 1
                self.fail(f"request {r.turn}.{r.call_index}: {actual} tokens over its {limit} limit")
            steps = [y["step"] for y in r.plan["yields"] if y["reason"] == "pressure"]
            ranks = [YIELD_RANK[s] for s in steps]
            out_of_order = ranks != sorted(ranks)
            if "active_tool_results_to_pointers" in steps:
                self.f.active_yields += 1
                request = await self.s.store.get_request(r.request_sha256)
                kinds = {seg["kind"] for seg in (request.body if request else [])}
                out_of_order |= "recall" in kinds  # the active turn yields only after recall has gone
            if out_of_order:
                self.f.yields_out_of_order += 1
                self.fail(f"request {r.turn}.{r.call_index}: yields out of order: {steps}")


async def torture(stack: Any, scripts: list[Script]) -> Figures:
    """Run every script on `stack` (a gates.Stack); the figures say whether every invariant held."""
    figures = Figures()
    counter = TiktokenCounter()
    for script in scripts:
        await _Run(stack, script, figures, counter).run()
    return figures


def scripts_json(scripts: list[Script]) -> str:
    return json.dumps([s.describe() for s in scripts], indent=1)


__all__ = ["Figures", "Op", "Script", "draw_scripts", "scripts_json", "torture"]
