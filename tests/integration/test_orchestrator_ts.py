"""A non-Python service drives a session: the Node example (examples/orchestrator-ts) on the live stack."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from temporalio.client import Client

from services.embedded import temporal_namespace
from tests.integration.session_helpers import stack

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).parents[2] / "examples" / "orchestrator-ts"
NODE = shutil.which("node")
NPM = shutil.which("npm")


async def _run(*argv: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.skipif(NODE is None, reason="node is not installed on this machine: the TypeScript example cannot run")
async def test_node_orchestrator_drives_a_session(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str
) -> None:
    """Start from the schema's shape, three turns (one tool call), a revocation, a runtime working-state write,
    the state query and close, all from @temporalio/client."""
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_address, "TEMPORAL_NAMESPACE": temporal_namespace()}
    if not (EXAMPLE / "node_modules" / "@temporalio" / "client").is_dir():
        assert NPM is not None, "npm is needed to install the example's locked dependencies"
        code, out, err = await _run(NPM, "ci", "--no-audit", "--no-fund", cwd=EXAMPLE, env=env, timeout=100)
        assert code == 0, f"npm ci failed: {err[-2000:]}"
    async with stack(temporal_client, pg_dsn, task_queue) as store:
        code, out, err = await _run(NODE, "orchestrator.mjs", temporal_address, temporal_namespace(), task_queue,
                                    cwd=EXAMPLE, env=env, timeout=90)  # fmt: skip
        assert code == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        turns = result["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3]
        assert turns[1]["tool_calls"] == [{"name": "web.fetch", "allowed": True, "trust": "EXTERNAL_UNTRUSTED"}]
        assert turns[2]["tool_calls"][0]["allowed"] is False
        assert len({t["prefix_sha256"] for t in turns}) == 1 and result["state"]["prefix_hashes"]["1"]
        assert result["retry_returned_first_result"] is True
        assert result["revoked_tools"] == ["web.fetch"]
        assert "Travel by train only." in result["working_state"]["working_state"]
        assert result["state"]["turns"] == 3 and "Travel by train only." in result["state"]["working_state"]
        assert result["closed_status"] == "closed"
        writes = await store.working_state_writes(result["session_id"])
        assert [w["writer"] for w in writes] == ["runtime"]
