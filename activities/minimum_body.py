"""Whether the smallest request a turn can make fits beside a prefix: a message, the working state, the
corrections and the clock. Checked when a session opens, with a one-word message (else no turn could ever be
answered: it fails at open, RouteDoesNotFit), and before an epoch rotation applies, with a message of
ROUTE_CHECK_MESSAGE_TOKENS (else the rotation is refused, RotationRefused, and the session keeps its working
route). A turn's own message is checked by its first build, before the message is logged (the build raises
TurnTooLargeError; `turn_too_large` makes it the turn's typed failure).
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from activities.assembly import RequestInputs, StoredMemory, body_inputs
from activities.session_state import SessionState, snapshot_ids, working_state
from contract.payloads import OpenInput
from core.budget import ContextBudget
from core.build import FrozenPrefix, build
from core.compaction import MAX_ESCALATION_REFS, Checkpoint, escalation_checkpoint
from core.errors import RouteDoesNotFitError, TurnTooLargeError
from core.estimator import ModelProfile, TokenEstimator
from core.items import BudgetClass, UserMessage
from core.plan import ContextPlan, PlanStatus
from core.working_state import render

# A rotation must leave room for a message of this many tokens beside the minimum body; an open, for one word.
ROUTE_CHECK_MESSAGE_TOKENS = 256
OPEN_CHECK_MESSAGE_TOKENS = 1
# What a request's real clock line (its digits tokenize differently from the check's), its message's id (an update
# id tokenizes differently from the check's) and the rounding of each class to whole tokens may add to the check's
# figure.
ROOM_SLACK_TOKENS = 16
# Shaped as a turn's message id: "u:" and its update's id, a UUID unless the caller chose one. The check's message
# carries one, so that its envelope is as long as a real message's (an id of a few tokens left a session that passed
# the open check 14 tokens short of answering "hi").
CHECK_MESSAGE_ID = "u:3f2504e0-4f89-41d3-9a0c-0305e82c3301"
# The check message's log position: past any checkpoint the check puts before it, the escalation stand-in's too.
CHECK_SEQ = 10**6


async def check_route_fits(
    state: SessionState,
    inp: OpenInput,
    prefix: FrozenPrefix,
    estimator: TokenEstimator,
    budget: ContextBudget,
    secret: bytes,
    *,
    last_resort: bool,
) -> None:
    """The minimum body (a message, the working state, corrections, the clock, beside the largest escalation
    checkpoint a long session's turn may carry: `escalation_stand_in`) must fit beside `prefix` under this route's
    estimate and budget, or RouteDoesNotFitError is raised. At open (epoch 1) the message is one word: a session
    that fails this could not go on answering turns once it compacts, and fails (RouteDoesNotFit). (Before, the
    check left the checkpoint out: a session at `ctxengine validate`'s floor answered its first turn and every later
    one failed.) At a rotation it is ROUTE_CHECK_MESSAGE_TOKENS, and a rotation that fails it is refused, the old
    epoch kept (RotationRefused).
    `last_resort`: the snapshot can give no more memories. Then a rotation whose route, encoding and window are
    the old epoch's and whose prefix is no larger (a forced revocation, say) applies anyway: it can only make
    room, and refusing it would keep a tool the operator removed."""
    words = OPEN_CHECK_MESSAGE_TOKENS if inp.epoch == 1 else ROUTE_CHECK_MESSAGE_TOKENS
    stand_in = escalation_stand_in(estimator)
    try:
        plan = await _build_minimum(
            state,
            inp.session_id,
            inp.open.memory_scope,
            prefix,
            estimator,
            budget,
            secret,
            checkpoint=stand_in,
            message_tokens=words,
        )
        # A real turn's clock line and message id may add ROOM_SLACK_TOKENS to the check's minimum.
        prefix_tokens, minimum = plan.prefix_tokens + plan.prefix_margin_tokens, plan.body_tokens + ROOM_SLACK_TOKENS
    except TurnTooLargeError as exc:
        beside = beside_stand_in(exc, prefix, estimator, budget, secret)
        prefix_tokens, minimum = beside.prefix_tokens, beside.minimum_body_tokens
    if prefix_tokens + minimum <= budget.input_limit:
        return
    if last_resort and inp.epoch > 1 and await _no_larger(state, inp, prefix, estimator):
        return
    raise RouteDoesNotFitError(
        estimator.profile.route, prefix_tokens, minimum, budget.input_limit, at_open=inp.epoch == 1
    )


async def _no_larger(state: SessionState, inp: OpenInput, prefix: FrozenPrefix, estimator: TokenEstimator) -> bool:
    """Whether `prefix` is on the old epoch's route, encoding and window and no larger than its prefix."""
    previous = await state.store.get_prefix(inp.session_id, inp.epoch - 1)
    if previous is None:
        return False
    old, new = ModelProfile.model_validate(previous.profile), estimator.profile
    same = (old.route, old.encoding, old.context_window) == (new.route, new.encoding, new.context_window)
    return same and FrozenPrefix.model_validate(previous.prefix).raw_tokens >= prefix.raw_tokens


async def working_state_cap(
    state: SessionState,
    session_id: str,
    memory_scope: str,
    prefix: FrozenPrefix,
    estimator: TokenEstimator,
    budget: ContextBudget,
    secret: bytes,
) -> int:
    """The tokens a working-state write may leave the block at: the budget's cap, and no more than leaves room
    for a message of ROUTE_CHECK_MESSAGE_TOKENS beside the prefix, the corrections and the clock (as a rotation
    must): a block that filled its fixed cap on a small window would leave no turn room to fit."""
    checkpoint = escalation_stand_in(estimator)
    try:
        plan = await _build_minimum(
            state,
            session_id,
            memory_scope,
            prefix,
            estimator,
            budget,
            secret,
            with_working_state=False,
            checkpoint=checkpoint,
        )
    except TurnTooLargeError:
        return 0
    room = budget.input_limit - plan.estimated_tokens - ROOM_SLACK_TOKENS
    return max(0, min(budget.working_state_tokens, room))


def escalation_stand_in(estimator: TokenEstimator) -> Checkpoint:
    """The largest checkpoint a turn's body can carry once nothing is left to compact: an escalation's references
    (its pointers drop under pressure), with ids, positions and counts as long as a long session's. Measured, not
    proved: a review compared it with real escalation checkpoints of 1-2,000 ancestors and checkpoint numbers up to
    5,678 (none larger); at 12,345 compaction runs one was 1-2 tokens larger (inside the open check's
    ROOM_SLACK_TOKENS; a turn's own check, `check_fits_escalated`, keeps no slack)."""
    stand_in = Checkpoint(
        checkpoint_id=f"cp-{CHECK_SEQ}-e{CHECK_SEQ}",
        depth=2,
        covers_from_seq=0,
        covers_to_seq=CHECK_SEQ - 3,
        summary="",
    )
    span = [UserMessage(id=f"u:{n}", seq=CHECK_SEQ - n, text="-") for n in (2, 1)]  # named as "items a..b"
    return escalation_checkpoint(
        span,
        current=stand_in,
        keep_from_seq=CHECK_SEQ,
        checkpoint_id=stand_in.checkpoint_id,
        ancestors=[f"cp-{CHECK_SEQ + n}-e{CHECK_SEQ}" for n in range(MAX_ESCALATION_REFS + 999)],
        count=estimator.counter.count,
    )


def check_fits_escalated(
    prefix: FrozenPrefix, message: UserMessage, ri: RequestInputs, estimator: TokenEstimator, secret: bytes
) -> None:
    """A new turn's message must fit as the minimum body beside the escalation checkpoint it would end up with
    (`escalation_stand_in`), or TurnTooLargeError is raised before the message is logged. Asked when its first
    build needs compaction: before, a message that fit beside the prefix alone was logged, compacted, escalated,
    and then failed in the child run, ContextNeedsCompaction, some tokens short beside the escalation's references
    (how many depended on the session's secret: the same turn was answered or failed)."""
    minimum = ri.model_copy(update={"call_index": 0, "max_seq": CHECK_SEQ, "user_item_id": message.id, "recall": []})
    at_end = message.model_copy(update={"seq": CHECK_SEQ})  # past the stand-in's positions, as the id is the turn's
    body = body_inputs([at_end], escalation_stand_in(estimator), minimum)
    try:
        plan = build(prefix, body, budget=ri.budget, estimator=estimator, secret=secret)
    except TurnTooLargeError as exc:  # the message overflows alone: its sizes, as beside the stand-in
        raise beside_stand_in(exc, prefix, estimator, ri.budget, secret) from None
    if plan.status is PlanStatus.FITS:
        return
    reserve = plan.prefix_tokens + plan.prefix_margin_tokens
    classes = {name: n for name, n in plan.tokens_by_class.items() if name not in prefix.class_tokens}
    raise TurnTooLargeError(
        classes, ri.budget.input_limit - reserve, prefix_tokens=reserve, input_limit=ri.budget.input_limit
    )


def beside_stand_in(
    exc: TurnTooLargeError, prefix: FrozenPrefix, estimator: TokenEstimator, budget: ContextBudget, secret: bytes
) -> TurnTooLargeError:
    """`exc` (a minimum body over the limit on its own, which `build` sizes without the checkpoint) with the
    stand-in's summary counted in its history class: the sizes a caller sizes a retry from name the room a turn
    has once its session compacts, not room it would lose to the checkpoint at the next refusal."""
    roomy = ContextBudget.model_validate({**budget.model_dump(), "context_window": budget.context_window + 10**6})
    ri = RequestInputs(
        turn=0,
        call_index=0,
        max_seq=CHECK_SEQ,
        user_item_id=CHECK_MESSAGE_ID,
        checkpoint_id=None,
        now_iso="2000-01-01T00:00:00+00:00",
        profile=estimator.profile,
        budget=roomy,
        estimate_rules=estimator.rules,
    )
    message = UserMessage(id=CHECK_MESSAGE_ID, seq=CHECK_SEQ, text="word")
    plan = build(
        prefix,
        body_inputs([message], escalation_stand_in(estimator), ri),
        budget=roomy,
        estimator=estimator,
        secret=secret,
    )
    history = BudgetClass.HISTORY.value
    classes = {**exc.classes, history: exc.classes.get(history, 0) + plan.tokens_by_class.get(history, 0)}
    return TurnTooLargeError(classes, exc.available, prefix_tokens=exc.prefix_tokens, input_limit=exc.input_limit)


def turn_too_large(exc: TurnTooLargeError, *, logged: bool) -> ApplicationError:
    """The typed, non-retryable failure of one turn: type TurnTooLarge, the sizes in its details. `logged`:
    whether the turn's message was already in the log (its tool calls' results did not fit as pointers)."""
    return ApplicationError(str(exc), {**exc.details(), "logged": logged}, type="TurnTooLarge", non_retryable=True)


async def _build_minimum(
    state: SessionState,
    session_id: str,
    memory_scope: str,
    prefix: FrozenPrefix,
    estimator: TokenEstimator,
    budget: ContextBudget,
    secret: bytes,
    *,
    with_working_state: bool = True,
    checkpoint: Checkpoint | None = None,
    message_tokens: int = ROUTE_CHECK_MESSAGE_TOKENS,
) -> ContextPlan:
    """Build the request of a `message_tokens` message alone beside the prefix, with the corrections, the clock,
    the session's working state (unless `with_working_state` is False) and `checkpoint`'s summary (no history, no
    recall); raises TurnTooLargeError when it does not fit."""
    message = UserMessage(id=CHECK_MESSAGE_ID, seq=CHECK_SEQ, text="word " * message_tokens)
    writes = await state.store.working_state_writes(session_id) if with_working_state else []
    correction_rows = await state.store.corrections(memory_scope, snapshot_ids(prefix))
    ws = working_state(writes, estimator.counter.count, 10**9)
    ri = RequestInputs(
        turn=0,
        call_index=0,
        max_seq=message.seq,
        user_item_id=message.id,
        checkpoint_id=None,
        corrections=[
            StoredMemory(memory_id=r.memory_id, text=r.text, trust=r.trust, corrects=r.corrects)
            for r in correction_rows
        ],
        working_state=render(ws) if (ws.constraints or ws.tasks or ws.facts or ws.open_questions) else "",
        now_iso="2000-01-01T00:00:00+00:00",
        profile=estimator.profile,
        budget=budget,
        estimate_rules=estimator.rules,
    )
    return build(prefix, body_inputs([message], checkpoint, ri), budget=budget, estimator=estimator, secret=secret)
