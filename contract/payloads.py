"""The external contract: every workflow/update/query/activity payload, as pydantic models.

Pure (pydantic + core only), so workflow modules can pass it through the sandbox. Inputs forbid unknown
fields, so a typo in a CLI `--input` fails with the field's name instead of being ignored.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from contract import bounds
from core.budget import ContextBudget
from core.estimator import DEFAULT_PROFILES, ModelProfile
from core.plan import PlanSummary
from core.working_state import WorkingStateUpdate

SCHEMAS_REMEMBERED = 1_024  # distinct tool schemas whose check a process remembers (`ToolSpec._valid_schema`)
MAX_TURN_TEXT = 100_000  # characters; larger input belongs in an artifact, not a turn
DEFAULT_PLATFORM_POLICY = (
    "You are running on the ctxengine platform. Follow the operator's agent instructions within this "
    "policy. Never reveal secrets or credentials. Tools are authorised when they are called: a tool listed "
    "below may still be denied, and a denial is final for that call."
)


# Tool-call caps (SessionOpen): defaults a real agent never reaches, and upper bounds that keep the worst turn
# far inside Temporal's history limit (contract/bounds.py proves it; docs/reliability.md states it).
DEFAULT_TOOL_CALLS_PER_REPLY = 64
DEFAULT_TOOL_CALLS_PER_TURN = 256
MAX_TOOL_CALLS_PER_REPLY = 128
MAX_TOOL_CALLS_PER_TURN = 512


def storable_text_error(value: Any, path: str = "") -> str | None:
    """Where `value` (a string, or a JSON-like dict/list of them) holds text PostgreSQL cannot store: NUL
    (`\\u0000` is refused in text and jsonb) or a lone surrogate (not encodable as UTF-8). None when it can."""
    if isinstance(value, str):
        if "\x00" in value:
            where = value.index("\x00")
            return f"{path or 'value'}: contains a NUL character (\\u0000 at index {where}), which cannot be stored"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{path or 'value'}: contains a lone surrogate at index {exc.start}, which is not valid UTF-8"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = storable_text_error(key, f"{path}.{key!s}" if path else str(key)) or storable_text_error(
                item, f"{path}.{key}" if path else str(key)
            )
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = storable_text_error(item, f"{path}.{index}" if path else str(index))
            if found:
                return found
    return None


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # NUL, and a lone surrogate (a Python str holds no pair)


def storable_text(value: Any) -> Any:
    """`value` (a string, or a JSON-like dict/list of them) with what PostgreSQL cannot store (`storable_text_error`)
    replaced by U+FFFD, keys included: for text the engine did not choose, such as a model's reply."""
    if isinstance(value, str):
        return _UNSTORABLE.sub("\ufffd", value) if not value.isascii() or "\x00" in value else value
    if isinstance(value, dict):
        return {storable_text(k): storable_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_text(v) for v in value]
    return value


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Every text field of every start and update input: refused at decode time, before any handler runs, any
    # lock is taken or anything is stored (a NUL reaching PostgreSQL is an error no retry can fix).
    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str | dict | list):
            found = storable_text_error(value)
            if found:
                raise ValueError(found.removeprefix("value: "))
        return value


# Validation context of an input read back from the store: it was validated in full when it was written.
STORED: dict[str, bool] = {"stored": True}


class ToolSpec(_Input):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str = Field(max_length=4_000)
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # The highest trust this tool's results may carry (docs/trust.md): a tool that reads the outside world
    # declares EXTERNAL_UNTRUSTED. An executor may lower it, never raise it.
    max_trust: Literal["USER", "TOOL", "EXTERNAL_UNTRUSTED"] = "TOOL"

    @field_validator("input_schema", mode="after")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """A broken schema is refused at open, not at the first call (when the model already relies on it). An
        open read back from the store (`STORED`) was checked when it was opened: not again on every worker."""
        if info.context is STORED:
            return schema
        try:
            canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):  # not JSON (a Python caller's value): checked as it is, not remembered
            error = _schema_error_of(schema)
        else:
            error = _schema_error(canonical)
        if error is not None:
            raise ValueError(error)
        return schema


def _schema_error_of(schema: Any) -> str | None:
    """Why `schema` is not a valid JSON Schema, or None."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"not a valid JSON Schema at {where}: {exc.message}"
    return None


@functools.lru_cache(maxsize=SCHEMAS_REMEMBERED)
def _schema_error(canonical: str) -> str | None:
    """`_schema_error_of` the schema written as `canonical` (sorted keys), remembered: a session's start input is
    validated again by every run of it (each continue-as-new, each child run, each replay after an eviction), and
    checking a dozen tools' schemas took 4.9 ms of the 5 ms its validation took."""
    return _schema_error_of(json.loads(canonical))


class ModelRoute(_Input):
    """Which provider and model serve the session; a change of route rotates the epoch."""

    provider: Literal["scripted", "openai", "anthropic"] = "scripted"
    model: str = "scripted-1"
    encoding: str | None = None
    context_window: int | None = Field(default=None, gt=0)
    min_cacheable_tokens: int | None = Field(default=None, ge=0)
    # Options only the route's provider reads, checked by that provider when a session opens on the route (an
    # option it does not take refuses the open): the scripted provider's are `activities.provider.ScriptedOptions`.
    provider_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _recorded_usage_ratio(cls, data: Any) -> Any:
        """Histories recorded before `provider_options` carry the scripted provider's ratio as a route field
        (`scripted_usage_ratio`, 1.0 in every one of tests/histories): read it as that provider's option."""
        if isinstance(data, dict) and "scripted_usage_ratio" in data:
            data = dict(data)
            ratio = data.pop("scripted_usage_ratio")
            if ratio != 1.0 and "provider_options" not in data:
                data["provider_options"] = {"usage_ratio": ratio}
        return data

    def profile(self) -> ModelProfile:
        base = DEFAULT_PROFILES.get(self.provider, DEFAULT_PROFILES["scripted"])
        update: dict[str, Any] = {"provider": self.provider, "model": self.model}
        if self.encoding:
            update["encoding"] = self.encoding
        if self.context_window:
            update["context_window"] = self.context_window
        if self.min_cacheable_tokens is not None:
            update["min_cacheable_tokens"] = self.min_cacheable_tokens
        elif self.provider == "anthropic":
            update["min_cacheable_tokens"] = anthropic_min_cacheable(self.model)
        return base.model_copy(update=update)


def anthropic_min_cacheable(model: str) -> int:
    """Anthropic's published minimum cacheable prompt length for `model` (prompt-caching docs): 4,096 tokens
    for Haiku 4.5 and Opus 4.5/4.6, 2,048 for Haiku 3 and 3.5, 1,024 for the other current models."""
    name = model.lower()
    if any(m in name for m in ("haiku-4-5", "haiku-4.5", "opus-4-5", "opus-4.5", "opus-4-6", "opus-4.6")):
        return 4_096
    if "haiku" in name:
        return 2_048
    return 1_024


class ActivityTimeouts(_Input):
    """Seconds. Short start-to-close timeouts let Temporal move work off a dead worker quickly."""

    build_seconds: float = Field(default=30, gt=0)
    model_seconds: float = Field(default=300, gt=0)
    model_heartbeat_seconds: float = Field(default=5, gt=0)
    tool_seconds: float = Field(default=60, gt=0)
    # Every other activity heartbeats too (activities/failures.py): a dead worker's build or tool is retried
    # after this, not after its start-to-close timeout.
    heartbeat_seconds: float = Field(default=5, gt=0)


class SessionOpen(_Input):
    """Start input of SessionWorkflow (workflow id = session id)."""

    agent_instructions: str
    platform_policy: str = DEFAULT_PLATFORM_POLICY
    tools: list[ToolSpec] = Field(default_factory=list)
    grants: list[str] | None = None  # None: every pinned tool is granted
    # None: the caller named no route. Only a worker on the embedded dev services serves such a session (with
    # the scripted model, `route`); any other worker refuses it at open (ModelRouteRequired).
    model_route: ModelRoute | None = None
    # overrides of ContextBudget fields; validated with the route even when empty (a route window may be too small)
    budget: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    memory_scope: str = "default"
    timeouts: ActivityTimeouts = Field(default_factory=ActivityTimeouts)
    continue_as_new_after_turns: int | None = Field(default=None, ge=1)  # tests and demos; None: when suggested
    # Past these, further tool calls are refused with an error result the model sees (docs/reliability.md).
    max_tool_calls_per_reply: int = Field(default=DEFAULT_TOOL_CALLS_PER_REPLY, ge=1, le=MAX_TOOL_CALLS_PER_REPLY)
    max_tool_calls_per_turn: int = Field(default=DEFAULT_TOOL_CALLS_PER_TURN, ge=1, le=MAX_TOOL_CALLS_PER_TURN)
    # Set by the workflow when it continues as new; callers leave it out. (One input argument, because
    # Temporal decodes typed arguments only when the payload count matches the signature.)
    carried: SessionState | None = None
    carried_results: dict[str, TurnResult] = Field(default_factory=dict)  # recent update id -> its result
    carried_failures: dict[str, TurnFailure] = Field(default_factory=dict)  # recent update id -> how its turn failed
    carried_update_ids: list[str] = Field(default_factory=list)  # recent rotate/revoke/grant update ids, applied

    @property
    def route(self) -> ModelRoute:
        """The route the session runs on: `model_route`, or the scripted model when the caller named none."""
        return self.model_route or ModelRoute()

    def context_budget(self, profile: ModelProfile | None = None) -> ContextBudget:
        """The budget for a route: its window, with this session's overrides on top (validated together, so a
        small route window with a smaller reserve override is a valid budget). `budget.context_window` may lower
        the route's window, never raise it: a model takes no more than its window, whatever route the session
        rotates to."""
        window = (profile or self.route.profile()).context_window
        return ContextBudget.model_validate(_on_route(window, self.budget))

    @field_validator("budget", mode="after")
    @classmethod
    def _budget_fits_route(cls, budget: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Route and budget are checked together at the door; the error names the budget field.

        This runs wherever a SessionOpen is decoded, a workflow replaying or continuing a running session too, so it
        accepts every open it accepted before (a run must decode its own start input): what only the open itself
        refuses now is refused by the open activity (`activities/lifecycle.py`, `InvalidSessionOpen`)."""
        if "model_route" not in info.data:  # the route itself did not validate
            return budget
        window = (info.data["model_route"] or ModelRoute()).profile().context_window
        try:
            ContextBudget.model_validate(_on_route(window, budget))
        except ValidationError as exc:
            if _as_written_before(window, budget):
                return budget
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            field = f"budget.{loc}" if loc else "budget (with the route's context_window)"
            if not loc and "output_reserve" in first["msg"]:
                field = "budget.output_reserve"
            msg = str(first["msg"]).removeprefix("Value error, ")
            raise ValueError(f"{field}: {msg} (model_route.context_window {window:,})") from None
        return budget


_WINDOW = TypeAdapter(int)  # as `ContextBudget.context_window`, an `int`, reads a value


def _on_route(window: int, budget: dict[str, Any]) -> dict[str, Any]:
    """A route's `window` with the session's budget overrides on top; an override of `context_window` takes the
    smaller of the two (a larger one would send requests over the model's window). The override is read as
    `ContextBudget` reads it (`100000.0` and `"100000"` are 100,000); one it cannot read is left for its
    validation to name."""
    merged = {"context_window": window, **budget}
    if "context_window" in budget:
        try:
            merged["context_window"] = min(window, _WINDOW.validate_python(budget["context_window"]))
        except ValidationError:
            pass
    return merged


def _as_written_before(window: int, budget: dict[str, Any]) -> bool:
    """Whether the budget validated before `_on_route` read a `context_window` override that is not an `int`
    (`100000.0`, `"100000"`): it was then left as written, not lowered to the route's window."""
    override = budget.get("context_window")
    if "context_window" not in budget or (isinstance(override, int) and not isinstance(override, bool)):
        return False
    try:
        ContextBudget.model_validate({"context_window": window, **budget})
    except ValidationError:
        return False
    return True


class TurnInput(_Input):
    """Update `submit_turn`."""

    text: str = Field(min_length=1, max_length=MAX_TURN_TEXT)


class RevokeTool(_Input):
    """Update `revoke_tool`: the tool stays in the pinned prefix and its calls are denied."""

    name: str = Field(max_length=64)
    reason: str = Field(default="revoked by operator", max_length=bounds.REASON_CHARS)


class RotateEpoch(_Input):
    """Update `rotate_epoch`: the only way the prefix changes mid-session."""

    reason: Literal["model_route_changed", "provider_routing_changed", "forced_revocation"]
    model_route: ModelRoute | None = None
    revoke_tools: list[str] = Field(default_factory=list)


class WriteMemory(_Input):
    """Update `write_memory`: reaches the store and in-turn recall, never the frozen snapshot."""

    text: str = Field(min_length=1, max_length=4_000)
    memory_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:\-]{1,100}$")
    corrects: str | None = None  # memory id this one corrects


class CloseSession(_Input):
    reason: str = Field(default="closed by caller", max_length=bounds.REASON_CHARS)


class GrantTool(_Input):
    """Update `grant_tool`: re-grant a revoked tool, or grant a pinned tool `SessionOpen.grants` left out.

    The prefix is untouched (same prefix hash, no epoch). A tool that is not pinned needs an epoch rotation.
    """

    name: str = Field(max_length=64)
    reason: str = Field(default="granted by operator", max_length=bounds.REASON_CHARS)


class DeleteMemory(_Input):
    """Update `delete_memory`: the memory leaves the store and later recall. A session whose frozen snapshot
    holds it keeps it until its next epoch, with a correction line saying it was withdrawn."""

    memory_id: str = Field(pattern=r"^[A-Za-z0-9_.:\-]{1,100}$")
    reason: str = Field(default="withdrawn by the user", max_length=bounds.REASON_CHARS)


class MemoryDeleted(BaseModel):
    memory_id: str
    deleted: bool  # False: no such memory in the session's scope (already deleted, or never written)
    in_snapshot: bool  # the session's frozen snapshot holds it: a correction line withdraws it until next epoch


class WorkingStateResult(BaseModel):
    """Result of update `update_working_state`: the working state the next request will show."""

    turn: int  # the first turn whose requests see this write
    working_state: str


class ToolCallOutcome(BaseModel):
    name: str
    call_id: str
    allowed: bool
    is_error: bool
    trust: str  # the result's trust level
    summary: str
    # The result inherits its call's taint: the call was written with untrusted content in view (docs/trust.md).
    tainted: bool = False


class TurnFailure(BaseModel):
    """How a turn failed, as its update answered: carried across continue-as-new, so a retry of its update id
    gets the same answer there too (Temporal de-duplicates update ids within a run only)."""

    type: str
    message: str
    details: list[Any] = Field(default_factory=list)


class TurnResult(BaseModel):
    turn: int
    epoch: int
    text: str
    prefix_sha256: str
    plan: PlanSummary
    tool_calls: list[ToolCallOutcome] = Field(default_factory=list)
    model_calls: int = 1


class SessionMetrics(BaseModel):
    epochs: int = 1
    prefix_hash_violations: int = 0
    requests: int = 0
    estimator_error_tokens: int = 0  # sum of signed (estimate - actual)
    estimator_overruns: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    prefix_tokens_reused: int = 0  # per request, the provider's cached tokens up to the prefix's size
    compactions: int = 0
    max_summary_depth: int = 0
    escalations: int = 0
    tool_denials: int = 0

    @property
    def cache_efficiency(self) -> float:
        """The share of input tokens the provider reported read from its cache (`ctxengine inspect`'s figure)."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


class SessionState(BaseModel):
    """Query `state`, and what continue-as-new carries."""

    session_id: str
    status: Literal["opening", "open", "closed", "failed"] = "opening"
    epoch: int = 1
    turns: int = 0
    prefix_hashes: dict[str, list[str]] = Field(default_factory=dict)  # epoch -> distinct hashes seen
    pinned_tools: list[str] = Field(default_factory=list)
    revoked_tools: dict[str, str] = Field(default_factory=dict)
    granted_tools: list[str] = Field(default_factory=list)  # pinned tools granted beyond SessionOpen.grants
    removed_tools: list[str] = Field(default_factory=list)  # taken out of the prefix by a forced revocation
    compaction_runs: int = 0  # every CompactionWorkflow started, whatever it decided: names the next one
    working_state: str = ""
    last_plan: PlanSummary | None = None
    metrics: SessionMetrics = Field(default_factory=SessionMetrics)
    model_route: ModelRoute = Field(default_factory=ModelRoute)
    search_attributes: bool = False


# ---------------------------------------------------------------- activity payloads


class OpenInput(BaseModel):
    session_id: str
    open: SessionOpen
    epoch: int = 1
    reason: str = "session_open"
    revoked: list[str] = Field(default_factory=list)
    owner: str | None = None  # the session's first run id: one owner per session id (docs/reliability.md)


class OpenResult(BaseModel):
    epoch: int
    prefix_sha256: str
    prefix_tokens: int
    tokens_by_class: dict[str, int]
    pinned_tools: list[str]
    search_attributes: bool


class BuildInput(BaseModel):
    session_id: str
    turn: int
    call_index: int
    epoch: int
    now_iso: str  # workflow.now(): the clock is a Region B input chosen by the workflow, so replay is stable
    user_text: str | None = None  # first request of a turn: the message to append
    update_id: str | None = None
    user_item_id: str | None = None  # later requests of the turn: the message already appended


class BuildResult(BaseModel):
    plan: PlanSummary
    user_item_id: str | None = None
    turn_start_seq: int = 0


class ModelInput(BaseModel):
    session_id: str
    turn: int
    call_index: int
    epoch: int
    request_sha256: str
    # Tool calls this reply may make; past it the next call is logged with a refusal the model sees.
    max_tool_calls: int | None = None
    tool_call_cap: str = ""  # what the cap is, in the refusal's words


class ToolCallRequest(BaseModel):
    item_id: str
    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ModelResult(BaseModel):
    text: str
    tool_calls: list[ToolCallRequest] = Field(default_factory=list)
    input_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    estimated_tokens: int
    overrun: bool = False
    refused_tool_calls: int = 0  # calls past the cap, answered with a refusal in the log already


class ToolInput(BaseModel):
    session_id: str
    turn: int
    epoch: int
    call: ToolCallRequest
    allowed: bool
    denial: str | None = None


class ToolResultSummary(BaseModel):
    item_id: str
    is_error: bool
    trust: str
    tokens: int
    summary: str
    working_state: str | None = None
    tainted: bool = False  # the stored result's taint (docs/trust.md); absent from results recorded before it


class MemoryInput(BaseModel):
    session_id: str
    scope: str
    write: WriteMemory
    update_id: str
    turn: int
    epoch: int


class MemoryResult(BaseModel):
    memory_id: str
    correction_of_snapshot: bool


class EventInput(BaseModel):
    session_id: str
    event_key: str
    type: str
    turn: int
    epoch: int
    payload: dict[str, Any] = Field(default_factory=dict)


class WorkingStateInput(BaseModel):
    session_id: str
    update_id: str
    turn: int  # the first turn that sees the write: the one after the last finished turn
    epoch: int
    update: WorkingStateUpdate


class DeleteMemoryInput(BaseModel):
    session_id: str
    scope: str
    delete: DeleteMemory
    update_id: str
    turn: int
    epoch: int


class CloseInput(BaseModel):
    session_id: str
    reason: str
    turn: int
    epoch: int


SessionOpen.model_rebuild()


# ---------------------------------------------------------------- compaction and escalation


class CompactionInput(BaseModel):
    session_id: str
    epoch: int
    turn: int
    checkpoint_id: str
    keep_from_seq: int
    timeouts: ActivityTimeouts = Field(default_factory=ActivityTimeouts)


class CompactionStep(BaseModel):
    """What the compaction policy decided (the plan itself stays in Postgres)."""

    decision: str  # core.compaction.CompactionDecision value
    checkpoint_id: str
    depth: int
    chunks: int = 0
    covers_from_seq: int = 0
    covers_to_seq: int = 0
    pointers: int = 0
    summarized_items: int = 0
    reason: str = ""


class SummarizeInput(BaseModel):
    session_id: str
    epoch: int
    checkpoint_id: str
    chunk_index: int


class CompactionOutcome(BaseModel):
    decision: str
    checkpoint_id: str
    depth: int
    summarized_items: int = 0
    elided_items: int = 0
    summarizer_calls: int = 0
    reason: str = ""


class ChildRunInput(BaseModel):
    """A fresh body for the rest of a turn: same pinned prefix, working state, pointers to the parent's checkpoints."""

    open: SessionOpen
    state: SessionState
    turn: int
    user_item_id: str | None  # None: a whole turn run in a child (a long run's history), starting from `text`
    call_index: int
    text: str | None = None
    update_id: str | None = None


class ChildRunResult(BaseModel):
    result: TurnResult
    state: SessionState


class SealTurnInput(BaseModel):
    session_id: str
    turn: int
    epoch: int
    reason: str


class FormationInput(BaseModel):
    session_id: str
    scope: str
    turn: int
    epoch: int


class FormationResult(BaseModel):
    candidates: int
    written: int
    rejected: dict[str, int] = Field(default_factory=dict)  # gate -> count
