"""`ctxengine validate` (agent configuration against every model route, before deployment) and
`ctxengine replay` (a recorded session rebuilt under other settings)."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from activities.minimum_body import CHECK_MESSAGE_ID, CHECK_SEQ, ROOM_SLACK_TOKENS, escalation_stand_in
from activities.tokens import TiktokenCounter
from contract.payloads import ModelRoute, SessionOpen
from core.budget import ContextBudget
from core.build import (
    BodyInputs,
    FrozenPrefix,
    PrefixInputs,
    build,
    open_prefix,
    operator_tool,
    operator_tool_count,
    region_a_inputs,
)
from core.errors import TurnTooLargeError
from core.estimator import DEFAULT_PROFILES, ModelProfile, TokenEstimator
from core.items import (
    BudgetClass,
    CurrentUserMessage,
    HistoryItem,
    ToolCall,
    ToolResult,
    TrustLevel,
    TurnContext,
    UserMessage,
)
from core.plan import PlanStatus

_VALIDATE_SECRET = b"ctxengine-validate"
# Nonces have a fixed length but not a fixed token count: a session's secret moves its prefix by some tens of tokens.
# The floor is measured on the costliest prefix of this many secrets, with room for a costlier secret's: the
# prefix's raw count over them, mean plus FLOOR_TAIL_SIGMAS standard deviations. Measured, not proved (a nonce's
# count is bounded but skewed): for 2,500 words of instructions 1,000 of 1,000 random secrets opened at the floor.
FLOOR_SECRETS = 64
FLOOR_TAIL_SIGMAS = 6
FLOOR_SEARCH_LIMIT = 1 << 24  # the largest window the floor is looked for up to; beyond it the floor is -1


class ConfigError(ValueError):
    """A file that is not a valid SessionOpen: names the file, the field and the reason."""


def parse_route(text: str) -> ModelRoute:
    """`provider/model`, e.g. `anthropic/claude-sonnet-4-6`, or a bare provider name."""
    provider, _, model = text.partition("/")
    if provider not in DEFAULT_PROFILES:
        raise ConfigError(f"unknown provider {provider!r} in route {text!r}; known: {', '.join(DEFAULT_PROFILES)}")
    return ModelRoute.model_validate({"provider": provider, **({"model": model} if model else {})})


def load_config(path: Path) -> SessionOpen:
    try:
        raw = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(raw) if path.suffix in (".yaml", ".yml") else json.loads(raw)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}") from exc
    try:
        return SessionOpen.model_validate(data)
    except ValidationError as exc:
        # Every error, so a misspelt field is named beside the required one it stands for.
        problems = "; ".join(
            f"field {'.'.join(str(p) for p in error['loc']) or '(top level)'}: {error['msg']}" for error in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from exc


def validate_config(
    open_: SessionOpen, route: ModelRoute, counter_for: Any, *, message_tokens: int = 500, tool_results: int = 4
) -> dict[str, Any]:
    """Measure each Region A class with the route's estimator (tokens, cap, headroom; tools also by count), then
    the floor, against the window a session of this configuration would have on the route."""
    profile = route.profile()
    budget = route_budget(open_, profile)
    estimator = TokenEstimator(profile, counter_for(profile.encoding))
    inputs = region_a_inputs(  # the same Region A a session open assembles
        platform_policy=open_.platform_policy,
        agent_instructions=open_.agent_instructions,
        tools=[operator_tool(t.name, t.description, t.input_schema) for t in open_.tools],
    )
    tool_count = operator_tool_count(inputs)  # the platform's control tool takes none of the operator's places
    # Measure every class even when one overflows: open with unlimited caps, then compare with the real ones.
    loose = budget.model_copy(
        update={
            "platform_policy_tokens": 10**9,
            "agent_instructions_tokens": 10**9,
            "tools_tokens": 10**9,
            "tools_max_count": 10**9,
        }
    )
    prefix = open_prefix(inputs, budget=loose, estimator=estimator, secret=_VALIDATE_SECRET)
    classes: dict[str, Any] = {}
    offending: list[str] = []
    for cls, cap in budget.prefix_caps().items():
        tokens = prefix.class_tokens[cls.value]
        row: dict[str, Any] = {"tokens": tokens, "cap": cap, "headroom": cap - tokens}
        if cls is BudgetClass.TOOLS:
            row.update({"count": tool_count, "count_cap": budget.tools_max_count})
            if tool_count > budget.tools_max_count:
                offending.append(cls.value)
        if cls is BudgetClass.MEMORY_SNAPSHOT:
            row["note"] = "filled at session open from the memory scope, up to its cap"
        if tokens > cap:
            offending.append(cls.value)
        classes[cls.value] = row
    prefix_tokens = estimator.prefix_tokens(prefix.raw_tokens, prefix.tool_count)
    warnings = []
    if prefix_tokens < profile.min_cacheable_tokens:
        warnings.append(
            f"prefix is {prefix_tokens:,} tokens, below {profile.route}'s minimum cacheable length of "
            f"{profile.min_cacheable_tokens:,}: it will not be cached at all"
        )
    floor = None
    if not offending:
        worst, secret, tail = costliest_prefix(inputs, loose, estimator)
        floor = min_window(budget, worst, estimator, message_tokens, tool_results, secret=secret, tail=tail)
    below_floor = floor is not None and not 0 < floor <= budget.context_window
    return {
        "route": profile.route,
        "fits": not offending and not below_floor,
        "offending": sorted(set(offending)),
        "context_window": budget.context_window,
        "window_below_floor": below_floor,
        "prefix_tokens": prefix_tokens,
        "classes": classes,
        "warnings": warnings,
        "min_context_window": floor,
        "floor_for": {"message_tokens": message_tokens, "tool_results": tool_results},
    }


def route_budget(open_: SessionOpen, profile: ModelProfile) -> ContextBudget:
    """The budget a session of this configuration would have on the route: the route's window (lowered by a
    `budget.context_window` override), the other overrides on top, as `SessionOpen.context_budget` gives it."""
    try:
        return open_.context_budget(profile)
    except ValidationError:
        # The output reserve takes the route's whole window. Only the window differs from the configuration's own
        # (valid) budget, and here it is the route's own (an override below it would have been below the reserve
        # too): keep that budget unvalidated, so the floor, above the reserve, reports the window as too small.
        return open_.context_budget().model_copy(update={"context_window": profile.context_window})


def costliest_prefix(
    inputs: PrefixInputs, budget: ContextBudget, estimator: TokenEstimator
) -> tuple[FrozenPrefix, bytes, int]:
    """The prefix of `inputs` with the most tokens over FLOOR_SECRETS secrets (its nonces' tokens vary), its secret,
    and the tail: the estimated tokens a costlier secret's prefix may add to it (FLOOR_TAIL_SIGMAS over the mean),
    taken off the window beside the spare. What the floor is measured on, so that a session at the floor opens
    whatever its own secret."""
    drawn = [_VALIDATE_SECRET + str(k).encode() for k in range(FLOOR_SECRETS)]
    prefixes = [(open_prefix(inputs, budget=budget, estimator=estimator, secret=s), s) for s in drawn]
    worst, secret = max(prefixes, key=lambda pair: pair[0].raw_tokens)
    counts = [p.raw_tokens for p, _ in prefixes]
    bound = math.ceil(statistics.fmean(counts) + FLOOR_TAIL_SIGMAS * statistics.pstdev(counts))
    tools = worst.tool_count
    tail = estimator.prefix_reserve(max(bound, worst.raw_tokens), tools) - estimator.prefix_reserve(
        worst.raw_tokens, tools
    )
    return worst, secret, tail


def _takes_turn(
    budget: ContextBudget,
    prefix: Any,
    estimator: TokenEstimator,
    window: int,
    message: str,
    n: int,
    secret: bytes,
    tail: int = 0,
) -> bool:
    """Whether a turn fits at `window` under the route's `budget`, as the open check asks (a message id shaped as a
    real one, ROOM_SLACK_TOKENS to spare for a real turn's clock and id): the first request (the message) and the one
    after its n tool results. The spare, and the `tail` a costlier secret's prefix may add (`costliest_prefix`), are
    taken off the window, so the builder yields for them as it would for a real turn's extra tokens, and a larger
    window never takes less."""
    spare = ROOM_SLACK_TOKENS + tail
    if window - spare <= budget.output_reserve:
        return False
    budget = ContextBudget.model_validate({**budget.model_dump(), "context_window": window - spare})
    # Shaped as a long session's: ids and positions as long as its, a provider's call ids, untrusted results
    # kept as artifacts (their pointers name one), all beside the largest escalation checkpoint a turn may carry.
    at = CHECK_SEQ
    pairs: list[HistoryItem] = []
    for i in range(n):
        item, call_id = f"t99999.m7.call{i}", f"toolu_{hashlib.sha256(b'call%d' % i).hexdigest()[:24]}"
        pairs.append(
            ToolCall(id=item, seq=at + 1 + 2 * i, call_id=call_id, tool_name="web.fetch", arguments={"q": "x" * 40})
        )
        pairs.append(
            ToolResult(
                id=f"{item}.result",
                seq=at + 2 + 2 * i,
                call_id=call_id,
                tool_name="web.fetch",
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                content="data " * 400,
                artifact_ref="artifact:" + hashlib.sha256(b"result%d" % i).hexdigest(),
            )
        )
    clock = TurnContext(id="clock", text="Current date and time (UTC): 2000-01-01T00:00:00+00:00")
    stand_in = escalation_stand_in(estimator)
    bodies = [
        BodyInputs(
            checkpoint=stand_in,
            turn_start_seq=at,
            current=CurrentUserMessage(id=CHECK_MESSAGE_ID, seq=at, text=message),
            turn_context=clock,
        ),
        BodyInputs(
            checkpoint=stand_in,
            history=[UserMessage(id=CHECK_MESSAGE_ID, seq=at, text=message), *pairs],
            turn_start_seq=at,
            turn_context=clock,
        ),
    ]
    try:
        plans = [build(prefix, b, budget=budget, estimator=estimator, secret=secret) for b in bodies]
    except TurnTooLargeError:
        return False
    return all(p.status is PlanStatus.FITS for p in plans)


def min_window(
    budget: ContextBudget,
    prefix: Any,
    estimator: TokenEstimator,
    message_tokens: int,
    n: int,
    *,
    secret: bytes = _VALIDATE_SECRET,
    tail: int = 0,
) -> int:
    """The smallest context window at which a configuration with the route's `budget` takes a turn with a message
    of `message_tokens` tokens and `n` tool results (its output reserve included), by bisection: a larger window
    never fits less. -1 when no window up to FLOOR_SEARCH_LIMIT does."""
    message = " ".join(["word"] * message_tokens)
    low, high = budget.output_reserve + 1, max(budget.output_reserve + 2, 1 << 16)
    while not _takes_turn(budget, prefix, estimator, high, message, n, secret, tail):
        high *= 2
        if high > FLOOR_SEARCH_LIMIT:
            return -1
    while low < high:
        mid = (low + high) // 2
        if _takes_turn(budget, prefix, estimator, mid, message, n, secret, tail):
            high = mid
        else:
            low = mid + 1
    return low


def validate_files(
    paths: list[Path], routes: list[str], *, message_tokens: int = 500, tool_results: int = 4
) -> tuple[int, dict[str, Any]]:
    """Exit code (0 all fit; 1 a class over its cap or a window below the floor; 2 a file is not a valid
    configuration) and the report. Each configuration is checked on `routes`, or on its own route when none."""
    counters: dict[str, TiktokenCounter] = {}

    def counter_for(encoding: str) -> TiktokenCounter:
        return counters.setdefault(encoding, TiktokenCounter(encoding))

    try:
        parsed_routes = [parse_route(r) for r in routes]
        configs = [(p, load_config(p)) for p in paths]
    except ConfigError as exc:
        return 2, {"ok": False, "error": str(exc)}
    report: dict[str, Any] = {"ok": True, "configs": []}
    for path, open_ in configs:
        routes_out = [
            validate_config(open_, r, counter_for, message_tokens=message_tokens, tool_results=tool_results)
            for r in parsed_routes or [open_.route]
        ]
        report["configs"].append({"config": str(path), "routes": routes_out})
        if not all(r["fits"] for r in routes_out):
            report["ok"] = False
    return (0 if report["ok"] else 1), report


def offending_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for cfg in report.get("configs", []):
        for r in cfg["routes"]:
            for cls in r["offending"]:
                row = r["classes"][cls]
                if cls == "tools" and row.get("count", 0) > row.get("count_cap", 10**9):
                    lines.append(f"{cfg['config']} [{r['route']}]: tools: {row['count']} tools, cap {row['count_cap']}")
                if row["tokens"] > row["cap"]:
                    lines.append(f"{cfg['config']} [{r['route']}]: {cls}: {row['tokens']:,} tokens, cap {row['cap']:,}")
    return lines


def floor_lines(report: dict[str, Any]) -> list[str]:
    """One line per route whose window cannot take the turn the floor was computed for."""
    lines = []
    for cfg in report.get("configs", []):
        for r in cfg["routes"]:
            if not r["window_below_floor"]:
                continue
            f, floor = r["floor_for"], r["min_context_window"]
            turn = f"a {f['message_tokens']:,}-token message with {f['tool_results']} tool results"
            line = f"{cfg['config']} [{r['route']}]: context window {r['context_window']:,}"
            if floor > 0:
                lines.append(f"{line} < floor {floor:,} ({turn})")
            else:
                lines.append(f"{line}, and no window up to {FLOOR_SEARCH_LIMIT:,} tokens takes {turn}")
    return lines
