"""The published contract as JSON Schema: every start input, update input and result, and query result, from
the pydantic models themselves (so they cannot drift). `ctxengine schema --out DIR`; docs/contract.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from contract import names
from contract.payloads import (
    CloseSession,
    DeleteMemory,
    GrantTool,
    MemoryDeleted,
    MemoryResult,
    RevokeTool,
    RotateEpoch,
    SessionOpen,
    SessionState,
    TurnInput,
    TurnResult,
    WorkingStateResult,
    WriteMemory,
)
from core.working_state import WorkingStateUpdate

START: tuple[type[BaseModel], type[BaseModel]] = (SessionOpen, SessionState)  # input, workflow result
UPDATES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    names.UPDATE_SUBMIT_TURN: (TurnInput, TurnResult),
    names.UPDATE_REVOKE_TOOL: (RevokeTool, SessionState),
    names.UPDATE_GRANT_TOOL: (GrantTool, SessionState),
    names.UPDATE_ROTATE_EPOCH: (RotateEpoch, SessionState),
    names.UPDATE_WRITE_MEMORY: (WriteMemory, MemoryResult),
    names.UPDATE_DELETE_MEMORY: (DeleteMemory, MemoryDeleted),
    names.UPDATE_WORKING_STATE: (WorkingStateUpdate, WorkingStateResult),
    names.UPDATE_CLOSE_SESSION: (CloseSession, SessionState),
}
QUERIES: dict[str, type[BaseModel]] = {names.QUERY_STATE: SessionState}
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _schema(model: type[BaseModel], mode: str) -> dict[str, Any]:
    schema = model.model_json_schema(mode=mode)  # type: ignore[arg-type]
    return {"$schema": DIALECT, **schema}


def schemas() -> dict[str, dict[str, Any]]:
    """File name -> schema, plus `index.json` naming the workflow, task queue, updates and queries."""
    out: dict[str, dict[str, Any]] = {
        "session_open.schema.json": _schema(START[0], "validation"),
        f"{names.WORKFLOW_SESSION}.result.schema.json": _schema(START[1], "serialization"),
    }
    index: dict[str, Any] = {
        "task_queue": names.TASK_QUEUE,
        "workflow": {
            "type": names.WORKFLOW_SESSION,
            "input": "session_open.schema.json",
            "result": f"{names.WORKFLOW_SESSION}.result.schema.json",
        },
        "updates": {},
        "queries": {},
    }
    for name, (inp, result) in UPDATES.items():
        out[f"{name}.input.schema.json"] = _schema(inp, "validation")
        out[f"{name}.result.schema.json"] = _schema(result, "serialization")
        index["updates"][name] = {"input": f"{name}.input.schema.json", "result": f"{name}.result.schema.json"}
    for name, result in QUERIES.items():
        out[f"{name}.query.schema.json"] = _schema(result, "serialization")
        index["queries"][name] = {"result": f"{name}.query.schema.json"}
    out["index.json"] = index
    return out


def write_schemas(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in schemas().items():
        path = out_dir / name
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
