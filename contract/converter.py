"""The data converter of every ctxengine client and worker (docs/contract.md, "Error types").

Temporal's pydantic converter, with one change to how failures are written: a pydantic `ValidationError` is a
non-retryable `ApplicationError`, as the validators' own refusals are. A session workflow fails an update or its
run with one when the update's arguments or the start input do not validate, or when a value the workflow builds
does not (`failure_exception_types`); on the same code, the same input gets the same answer, so a caller that
honours `non_retryable` does not send it again. Activities are unaffected: their failures are classified by
`activities/failures.py`.
"""

from __future__ import annotations

import dataclasses

import pydantic
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DefaultFailureConverter, PayloadConverter


class ValidationNotRetryable(DefaultFailureConverter):
    """Temporal's failure converter, writing a pydantic `ValidationError` as non-retryable."""

    def to_failure(self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure) -> None:
        super().to_failure(exception, payload_converter, failure)
        if isinstance(exception, pydantic.ValidationError) and failure.HasField("application_failure_info"):
            failure.application_failure_info.non_retryable = True


DATA_CONVERTER = dataclasses.replace(pydantic_data_converter, failure_converter_class=ValidationNotRetryable)
