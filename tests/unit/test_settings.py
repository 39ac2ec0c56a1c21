"""Configuration: a malformed environment variable is refused when read, naming the variable (docs/operations.md)."""

from __future__ import annotations

import pytest

from contract.settings import SettingsError, settings


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CTXENGINE_METRICS_ADDRESS", "garbage"),
        ("CTXENGINE_METRICS_ADDRESS", "127.0.0.1:99999"),
        ("TEMPORAL_ADDRESS", "localhost"),
        ("TEMPORAL_ADDRESS", ":7233"),
        ("CTXENGINE_DATABASE_URL", "notaurl"),
        ("CTXENGINE_DATABASE_URL", "mysql://u@h/db"),
        ("CTXENGINE_EAGER_ACTIVITIES", "sometimes"),
        ("TEMPORAL_NAMESPACE", ""),
    ],
)
def test_a_malformed_variable_is_refused_by_name(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"environment variable {variable}:"):
        settings({variable: value})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CTXENGINE_METRICS_ADDRESS", ""),
        ("CTXENGINE_METRICS_ADDRESS", "off"),
        ("CTXENGINE_METRICS_ADDRESS", "0.0.0.0:9464"),
        ("TEMPORAL_ADDRESS", "temporal.internal:7233"),
        ("TEMPORAL_ADDRESS", "[::1]:7233"),
        ("CTXENGINE_DATABASE_URL", "postgresql://ctx:secret@db:5432/ctxengine"),
        ("CTXENGINE_DATABASE_URL", "postgres://postgres@/ctxengine?host=/run/postgresql&port=5432"),
    ],
)
def test_a_well_formed_variable_is_taken(variable: str, value: str) -> None:
    settings({variable: value})
