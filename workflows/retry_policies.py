"""The activities' Temporal retry policies: bounded, and no retry for data or programming errors (the numbers and
the error types are in contract/retries.py; docs/reliability.md, "Bounded retries")."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contract import retries


def bounded_retry(attempts: int) -> RetryPolicy:
    """0.2 s, doubling, at most 2 s apart, at most `attempts` attempts; the non-retryable types never retried."""
    return RetryPolicy(
        initial_interval=timedelta(seconds=retries.INITIAL_INTERVAL_S),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=retries.MAXIMUM_INTERVAL_S),
        maximum_attempts=attempts,
        non_retryable_error_types=retries.NON_RETRYABLE_ERROR_TYPES,
    )


RETRY = bounded_retry(retries.ACTIVITY_MAX_ATTEMPTS)  # database and CPU work: ~75 s of outage waited out
MODEL_RETRY = bounded_retry(retries.MODEL_MAX_ATTEMPTS)  # each attempt may cost a provider call
# Sealing a failed turn's unanswered calls: a few quick attempts, not the 75 s of `RETRY` (the turn has already
# failed, often because PostgreSQL is down, and the next turn's build seals what this could not).
SEAL_RETRY = bounded_retry(retries.SEAL_MAX_ATTEMPTS)
