"""A tool's input schema is checked when a session opens (a broken one is refused, naming where), and a process
checks each distinct schema once: every run of a session validates its start input again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from contract import payloads
from contract.payloads import STORED, ToolSpec

BROKEN = {"type": "object", "properties": {"q": {"type": "strin"}}}


def _tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": "search", "description": "searches", "input_schema": schema}


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The schemas actually checked (the memo cleared first, so each test starts cold)."""
    payloads._schema_error.cache_clear()
    seen: list[Any] = []
    check = payloads._schema_error_of

    def counted(schema: Any) -> str | None:
        seen.append(schema)
        return check(schema)

    monkeypatch.setattr(payloads, "_schema_error_of", counted)
    yield seen
    payloads._schema_error.cache_clear()


def test_a_broken_schema_is_refused_naming_where_every_time(checks: list[Any]) -> None:
    """Refused at the path of the fault, on the first validation and on every later one (the memo keeps the
    refusal, not only the passes), whatever the order of the schema's keys."""
    reordered = {"properties": {"q": {"type": "strin"}}, "type": "object"}
    for schema in (BROKEN, BROKEN, reordered):
        with pytest.raises(ValidationError, match="not a valid JSON Schema at properties/q/type"):
            ToolSpec.model_validate(_tool(schema))
    assert len(checks) == 1


def test_each_distinct_schema_is_checked_once(checks: list[Any]) -> None:
    good = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    other = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for schema in (good, other, good, dict(reversed(list(good.items()))), other):
        assert ToolSpec.model_validate(_tool(schema)).input_schema == schema
    assert checks == [good, other]


def test_a_schema_that_is_not_json_is_checked_as_it_is(checks: list[Any]) -> None:
    """A Python caller's value JSON cannot write (a tuple is fine, a set is not) is checked directly, every time."""
    odd = {"type": "object", "enum": {1, 2}}
    for _ in range(2):
        with pytest.raises(ValidationError, match="not a valid JSON Schema at enum"):
            ToolSpec.model_validate(_tool(odd))
    assert len(checks) == 2


def test_a_stored_open_is_not_checked_again(checks: list[Any]) -> None:
    ToolSpec.model_validate(_tool(BROKEN), context=STORED)
    assert checks == []
