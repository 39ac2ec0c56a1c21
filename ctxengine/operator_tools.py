"""`ctxengine validate` (agent configuration against every model route, before deployment) and
`ctxengine replay` (a recorded session rebuilt under other settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from activities.tokens import TiktokenCounter
from core.build import open_prefix, operator_tool, operator_tool_count, region_a_inputs
from core.estimator import DEFAULT_PROFILES, TokenEstimator
from core.items import BudgetClass
from ctxengine.contract import ModelRoute, SessionOpen

_VALIDATE_SECRET = b"ctxengine-validate"  # nonces have a fixed length, so any secret measures the same


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
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ConfigError(f"{path}: field {field}: {first['msg']}") from exc


def validate_config(open_: SessionOpen, route: ModelRoute, counter_for: Any) -> dict[str, Any]:
    """Measure each Region A class with the route's estimator: tokens, cap, headroom; tools also by count."""
    profile = route.profile()
    budget = open_.context_budget()
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
    return {
        "route": profile.route,
        "fits": not offending,
        "offending": sorted(set(offending)),
        "prefix_tokens": prefix_tokens,
        "classes": classes,
        "warnings": warnings,
    }


def validate_files(paths: list[Path], routes: list[str]) -> tuple[int, dict[str, Any]]:
    """Exit code (0 all fit, 1 something over a cap, 2 a file is not a valid configuration) and the report."""
    counters: dict[str, TiktokenCounter] = {}

    def counter_for(encoding: str) -> TiktokenCounter:
        return counters.setdefault(encoding, TiktokenCounter(encoding))

    try:
        parsed_routes = [parse_route(r) for r in routes] or [ModelRoute()]
        configs = [(p, load_config(p)) for p in paths]
    except ConfigError as exc:
        return 2, {"ok": False, "error": str(exc)}
    report: dict[str, Any] = {"ok": True, "configs": []}
    for path, open_ in configs:
        routes_out = [validate_config(open_, r, counter_for) for r in parsed_routes]
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
