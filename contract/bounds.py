"""How many history events one run of a session can reach, from the caps SessionOpen accepts.

Temporal terminates a run at 51,200 events (and warns from 10,240). A session continues as new between turns
once its run holds HISTORY_CONTINUE_AS_NEW events, runs a whole turn in a child run once it holds
HISTORY_TURN_IN_CHILD, and its validators refuse new updates from HISTORY_ADMIT_LIMIT, so no run grows past
`run_events_bound(...)`. tests/unit/test_bounds.py checks that bound against 10,000 for every accepted cap;
tests/integration/test_nowedge.py checks the per-activity figures against a real history.
"""

from __future__ import annotations

RUN_EVENTS_TARGET = 10_000
HISTORY_CONTINUE_AS_NEW = 4_000  # between turns (or when Temporal suggests it first)
HISTORY_TURN_IN_CHILD = 5_000  # a turn starting later than this runs in a ChildRunWorkflow (a fresh history)
HISTORY_ADMIT_LIMIT = 8_000  # validators refuse updates from here until the run has continued as new
MAX_IN_FLIGHT_UPDATES = 10  # Temporal's per-workflow default (history.maxInFlightUpdates)
# Temporal refuses a run's 2,001st update (history.maxTotalUpdates): a session continues as new between turns once a
# run has taken UPDATES_CONTINUE_AS_NEW, and its validators refuse updates (retryably) from UPDATES_ADMIT_LIMIT.
UPDATES_CONTINUE_AS_NEW = 1_000
UPDATES_ADMIT_LIMIT = 1_900
# Temporal refuses a payload over 2 MB (a continue-as-new input included, which would fail its workflow task for
# good): the turn results and failures a session carries across continue-as-new are kept under this many bytes.
CARRIED_RESULTS_BYTES = 512 * 1024
# Turn results (and failures, and applied update ids) remembered by update id across continue-as-new.
RECENT_UPDATES = 32
REASON_CHARS = 500  # the longest `reason` an update takes

# Upper bounds per unit, each with its workflow task: scheduled + started + completed (3) + the workflow task
# that handles it (scheduled, started, completed: 3). Retries add no events; heartbeats add none.
EVENTS_PER_ACTIVITY = 6
EVENTS_PER_CHILD = 9  # initiated, started, completed + two workflow tasks
EVENTS_PER_UPDATE = 5  # accepted, completed + a workflow task
EVENTS_PER_TURN_FIXED = 20  # search attributes, markers, the failed-turn seal, the escalation child


def turn_events(*, per_reply: int, per_turn: int, model_calls: int = 8, compactions_per_request: int = 2) -> int:
    """Most events one turn adds to the run it runs in (the workflow's loop, workflows/turn.py)."""
    tool_calls = min(per_turn, per_reply * model_calls)
    per_model_call = (1 + compactions_per_request) * EVENTS_PER_ACTIVITY + compactions_per_request * (EVENTS_PER_CHILD)
    return (
        model_calls * (per_model_call + EVENTS_PER_ACTIVITY)
        + tool_calls * EVENTS_PER_ACTIVITY
        + EVENTS_PER_UPDATE
        + EVENTS_PER_TURN_FIXED
    )


def run_events_bound(*, per_reply: int, per_turn: int) -> int:
    """Most events any run of a session reaches.

    The session's own run: a turn that starts below HISTORY_TURN_IN_CHILD runs inline; from there a turn costs
    the parent a child and an update; from HISTORY_ADMIT_LIMIT nothing new is admitted and at most
    MAX_IN_FLIGHT_UPDATES accepted updates finish. A child run holds one turn.
    """
    one_turn = turn_events(per_reply=per_reply, per_turn=per_turn)
    inline = HISTORY_TURN_IN_CHILD + one_turn
    delegated = HISTORY_ADMIT_LIMIT + MAX_IN_FLIGHT_UPDATES * (
        EVENTS_PER_CHILD + EVENTS_PER_UPDATE + EVENTS_PER_ACTIVITY
    )
    child = one_turn + EVENTS_PER_TURN_FIXED
    return max(inline, delegated, child)
