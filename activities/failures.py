"""Activity failures, classified and kept short (docs/reliability.md, "Bounded retries, classified failures").

A worker interceptor wraps every activity:

- transient failures (the database unreachable or restarting, a dropped connection, a timeout) become a
  retryable `ApplicationError` whose message is the cause, first and short;
- everything else an activity did not raise on purpose is data (a value PostgreSQL refuses, text it cannot
  encode, a payload that does not validate) or a bug: non-retryable (`InvalidData`, `ProgrammingError`), so
  the turn fails at once instead of retrying forever with the session's turn lock held.

The full traceback goes to the worker log; the failure Temporal stores stays far below the server's ~2 KB
failure limit (a stack over it reaches the UI as `Failure exceeds size limit.` and hides the cause).
It also heartbeats long activities, so a dead worker's work is retried after the heartbeat timeout, not after
the start-to-close timeout, and counts the activities the worker runs (`activities_running`: a build guesses its
read only while it runs alone, `SessionState.guess_reads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg
import pydantic
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from contract.retries import (
    INITIAL_INTERVAL_S,
    INVALID_DATA,
    MAXIMUM_INTERVAL_S,
    PROGRAMMING_ERROR,
    STORE_OUTAGE_WAIT_S,
)

T = TypeVar("T")
log = structlog.get_logger("ctxengine.activities")
MAX_MESSAGE_CHARS = 600
# SQLSTATE classes that a retry can outlive: connection, transaction rollback (serialization, deadlock),
# insufficient resources, operator intervention (shutdown, crash recovery), system error, internal error.
_TRANSIENT_SQLSTATE = {"08", "40", "53", "57", "58", "XX"}


# When each running activity (by its workflow run and activity id) first found PostgreSQL unreachable, on this
# worker (`time.monotonic()`): its later attempts here wait out what is left of `STORE_OUTAGE_WAIT_S`, and fail for
# good once it is spent, instead of each taking a fresh budget (a tool's first attempt waits up to its timeout for
# the store, and its 40 retries waited as long again; a model call's four attempts waited four times as long).
# Forgotten when the store answers or the activity fails for good, and at every activity's first attempt.
_OUTAGES: OrderedDict[tuple[str, str, str], float] = OrderedDict()
_OUTAGES_KEPT = 4_096
# The activities this worker process is running now (the interceptor counts them).
_RUNNING = 0


def activities_running() -> int:
    """How many activities this worker process is running now, the caller's own included (0 outside a worker:
    an activity run without the interceptor, as a test environment runs one)."""
    return _RUNNING


def _outage_key() -> tuple[str, str, str]:
    info = activity.info()
    return (info.workflow_id or "", info.workflow_run_id or "", info.activity_id)


def outage_since() -> float:
    """When this activity's outage began (as this worker saw it): the first transient failure of this attempt or of
    an earlier attempt here; now, if none."""
    key = _outage_key()
    since = _OUTAGES.get(key)
    if since is None:
        since = _OUTAGES[key] = time.monotonic()
        while len(_OUTAGES) > _OUTAGES_KEPT:
            _OUTAGES.popitem(last=False)
    return since


def outage_over() -> None:
    """The store answered (or the activity ends): the next transient failure starts a new outage."""
    _OUTAGES.pop(_outage_key(), None)


def short(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def transient(exc: BaseException) -> bool:
    """Whether a retry can outlive `exc`: the database unreachable or restarting, a dropped connection, a
    timeout, or a PostgreSQL error of a class a retry outlives (`_TRANSIENT_SQLSTATE`)."""
    if isinstance(exc, asyncpg.PostgresError):
        return str(getattr(exc, "sqlstate", "") or "")[:2] in _TRANSIENT_SQLSTATE
    return isinstance(exc, OSError | asyncpg.InterfaceError | asyncio.TimeoutError | TimeoutError | ConnectionError)


async def store_waiting(op: Callable[[], Awaitable[T]]) -> T:
    """`op()`, a read or write of the store, tried again while PostgreSQL is unreachable or restarting
    (`transient`): 0.2 s, doubling, at most 2 s apart, for as long as the other activities' retries wait out an
    outage (`STORE_OUTAGE_WAIT_S`, counted from the outage's first failure in this or an earlier attempt on this
    worker: `outage_since`) and this attempt has time left. For what an attempt must not throw away or do
    twice for a database blink: a model call's provider call and its reply, a tool's run and its result (the
    writes are idempotent: a retry of one that did commit finds it done). The interceptor heartbeats meanwhile."""
    info = activity.info()
    attempt_left = float("inf")
    if info.start_to_close_timeout is not None:
        ends = info.started_time + info.start_to_close_timeout
        attempt_left = (ends - datetime.now(UTC)).total_seconds() - 1.0
    attempt_ends = time.monotonic() + attempt_left
    delay = INITIAL_INTERVAL_S
    while True:
        try:
            result = await op()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > min(attempt_ends, outage_since() + STORE_OUTAGE_WAIT_S):
                raise
            log.warning(
                "store.waiting",
                activity=info.activity_type,
                workflow_id=info.workflow_id,
                attempt=info.attempt,
                error=f"{type(exc).__name__}: {exc}",
                retry_in_s=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAXIMUM_INTERVAL_S)
        else:
            outage_over()
            return result


def classify(exc: BaseException) -> ApplicationError:
    """The failure Temporal should record for `exc`: typed, short, retryable only if a retry can help."""
    cause = short(f"{type(exc).__name__}: {exc}")
    if transient(exc):
        return ApplicationError(cause, type=type(exc).__name__)
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        if state[:2] == "22":  # data exception: NUL in text, a value out of range, bad encoding
            return ApplicationError(cause, type=INVALID_DATA, non_retryable=True)
        return ApplicationError(cause, type=PROGRAMMING_ERROR, non_retryable=True)
    if isinstance(exc, UnicodeError | pydantic.ValidationError | ValueError):
        return ApplicationError(cause, type=INVALID_DATA, non_retryable=True)
    return ApplicationError(cause, type=PROGRAMMING_ERROR, non_retryable=True)


class _Inbound(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        global _RUNNING
        if activity.info().attempt == 1:
            outage_over()  # a new activity: an outage an earlier one (of another run with its ids) saw is not its
        beat = asyncio.create_task(_heartbeat_forever()) if activity.info().heartbeat_timeout else None
        _RUNNING += 1
        try:
            result = await super().execute_activity(input)
            outage_over()
            return result
        except (ApplicationError, CancelledError, asyncio.CancelledError) as exc:
            outage_over()
            if isinstance(exc, ApplicationError) and len(exc.message) > MAX_MESSAGE_CHARS:
                raise ApplicationError(
                    short(exc.message), *exc.details, type=exc.type, non_retryable=exc.non_retryable
                ) from None
            raise
        except Exception as exc:
            info = activity.info()
            failure = classify(exc)
            if failure.non_retryable:
                outage_over()
            elif time.monotonic() - outage_since() > STORE_OUTAGE_WAIT_S:
                # Unreachable for longer than the retries wait out, counted from the outage's first failure here
                # (an earlier attempt may have waited for the store within itself): fail for good, as the 40th
                # attempt of a fast-failing activity does.
                outage_over()
                failure = ApplicationError(failure.message, type=failure.type, non_retryable=True)
            log.error(
                "activity.failed",
                activity=info.activity_type,
                workflow_id=info.workflow_id,
                attempt=info.attempt,
                failure_type=failure.type,
                retryable=not failure.non_retryable,
                traceback=traceback.format_exc(),
            )
            raise failure from None
        finally:
            _RUNNING -= 1
            if beat is not None:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await beat


async def _heartbeat_forever() -> None:
    interval = (activity.info().heartbeat_timeout or timedelta(seconds=30)).total_seconds() / 3
    while True:
        await asyncio.sleep(interval)
        activity.heartbeat()


class FailureInterceptor(Interceptor):
    """Registered on every ctxengine worker (worker.py)."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Inbound(next)
