"""The published contract: `ctxengine schema --out DIR` writes a JSON Schema per payload; examples validate."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from contract import names
from ctxengine.cli import app
from ctxengine.schema import UPDATES

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.json"))


@pytest.fixture(scope="module")
def schema_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("schema")
    result = CliRunner().invoke(app, ["schema", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out


def _schema(schema_dir: Path, example: Path) -> dict:  # type: ignore[type-arg]
    name = "session_open.schema.json" if example.stem == "session_open" else f"{example.stem}.input.schema.json"
    return json.loads((schema_dir / name).read_text())


def test_every_update_and_the_query_have_schemas(schema_dir: Path) -> None:
    """The index names every update's input and result, the start input and the state query."""
    index = json.loads((schema_dir / "index.json").read_text())
    assert set(index["updates"]) == set(UPDATES) >= {names.UPDATE_WORKING_STATE, names.UPDATE_GRANT_TOOL}
    assert index["workflow"]["type"] == names.WORKFLOW_SESSION and names.QUERY_STATE in index["queries"]
    for entry in [*index["updates"].values(), *index["queries"].values(), index["workflow"]]:
        for file in entry.values():
            if file.endswith(".json"):
                jsonschema.Draft202012Validator.check_schema(json.loads((schema_dir / file).read_text()))


def test_examples_cover_start_and_updates() -> None:
    """There is an example start input and an example of every update's input."""
    assert {"session_open", *UPDATES} <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_validates(schema_dir: Path, example: Path) -> None:
    """Each examples/*.json validates against its published schema."""
    jsonschema.validate(json.loads(example.read_text()), _schema(schema_dir, example))


def test_schema_rejects_a_typo(schema_dir: Path) -> None:
    """Inputs forbid unknown fields in the schema too, so a typo fails in any language's validator."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"txt": "hello"}, json.loads((schema_dir / "submit_turn.input.schema.json").read_text()))
