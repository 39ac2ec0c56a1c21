"""Retry bounds and the failure classes no retry can fix (docs/reliability.md, "Bounded retries").

Pure names and numbers, shared by the workflows (which put them in each activity's Temporal RetryPolicy) and
by the activity interceptor (activities/failures.py, which classifies what an activity raised).
"""

from __future__ import annotations

# Database and CPU work: 0.2 s, doubling, at most 2 s apart (a PostgreSQL crash-restart is back within
# seconds, and a longer wait between attempts is latency added to the turn); 40 attempts wait out ~75 s of
# outage, then the turn fails with the cause and the session stays open.
ACTIVITY_MAX_ATTEMPTS = 40
# A model call may cost a provider call per attempt and up to `timeouts.model_seconds` each.
MODEL_MAX_ATTEMPTS = 4
# Sealing a failed turn (error results for its unanswered calls): the turn has failed already, and the next
# turn's build seals what this cannot, so a database outage adds ~0.6 s to the failure, not another ~75 s.
SEAL_MAX_ATTEMPTS = 3
# So a model call spends no attempt on a database outage, and neither a model call nor a tool throws away what it
# got: within one attempt it waits for PostgreSQL (before the provider call and after the reply, which is then
# stored; after a tool's run, whose result is then logged), as long as the other activities' 40 attempts do (~75 s)
# and its attempt has time left, counted from the outage's first failure on the worker, in this attempt or an earlier
# one; once spent, the activity's next failure is final (activities/failures.py: store_waiting, outage_since).
STORE_OUTAGE_WAIT_S = 75.0
INITIAL_INTERVAL_S = 0.2
MAXIMUM_INTERVAL_S = 2.0

# Raised for data no retry can store or parse (NUL in text, a value PostgreSQL refuses, a payload that does not
# validate) and for programming errors (a bug retried is the same bug): the turn fails, typed, at once.
INVALID_DATA = "InvalidData"
PROGRAMMING_ERROR = "ProgrammingError"
NON_RETRYABLE_ERROR_TYPES = [
    INVALID_DATA,
    PROGRAMMING_ERROR,
    "InvalidSessionOpen",
    "PrefixOverflowError",
    "SessionIdTaken",
    "MemoryIdTaken",
    "UnknownMemory",
    "UnknownSession",
    "UnknownEpoch",
    "UnknownRequest",
    "UnknownPlan",
    "NoCheckpoint",
    "ProviderNotConfigured",
    "OrphanedToolItemError",
    "NonYieldableOverflowError",
]
# A provider refused a request as too long for its model (the adapters raise it; the model call learns from it and
# the turn builds the request again once, workflows/turn.py); and a refusal whose figures say the route's window,
# not its estimate, is wrong (the model call raises it instead, learning nothing).
CONTEXT_LENGTH_EXCEEDED = "ContextLengthExceeded"
CONTEXT_WINDOW_MISMATCH = "ContextWindowMismatch"
# The typed error a failed turn's update carries when its cause had no type of its own.
TURN_FAILED = "TurnFailed"
# A submit_turn whose update id was an earlier turn's, whose answer the session no longer carries
# (bounds.RECENT_UPDATES): the turn fails for good, nothing appended (activities/build.py).
UPDATE_ID_REUSED = "UpdateIdReused"
