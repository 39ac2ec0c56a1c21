"""A ctxengine worker as a real OS process (`python worker.py`), for tests that kill it with SIGKILL.

`worker_process(...)` starts one, waits until Temporal lists it as a poller of both the workflow and the
activity task queue (its identity is ``<pid>@<host>``, the SDK's default), and always kills it on exit.
Its stderr (structlog JSON lines) goes to a file, so a full pipe can never stall it and a failing test
can show its tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from temporalio.api.enums.v1 import DescribeTaskQueueMode, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue, TaskQueueVersionSelection
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

REPO = Path(__file__).resolve().parents[1]
WORKER_SCRIPT = REPO / "worker.py"
_TAIL_CHARS = 3_000
# Answers a describe may get from a busy or just-started dev server: the readiness probe asks again.
_TRANSIENT = frozenset({RPCStatusCode.CANCELLED, RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED})


class WorkerProcess:
    """One `python worker.py` child: `await start(client)`, `kill()` (SIGKILL), `terminate()` (SIGTERM),
    `log_tail()`."""

    def __init__(
        self,
        *,
        temporal_address: str,
        dsn: str,
        task_queue: str,
        home: Path,
        name: str = "worker",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.extra_env = extra_env or {}
        self.temporal_address = temporal_address
        self.dsn = dsn
        self.task_queue = task_queue
        self.home = home
        self.name = name
        self.log_path = home / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "start() has not run"
        return self.proc.pid

    @property
    def identity(self) -> str:
        """The poller identity Temporal reports for this process (the SDK default, `<pid>@<hostname>`)."""
        return f"{self.pid}@{socket.gethostname()}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, client: Client, timeout: float = 60.0) -> None:
        """Spawn the worker and return once it polls both task queue types (or raise with its log tail)."""
        self.home.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": self.temporal_address,
            "TEMPORAL_NAMESPACE": client.namespace,
            "CTXENGINE_DATABASE_URL": self.dsn,
            "CTXENGINE_TASK_QUEUE": self.task_queue,
            "CTXENGINE_HOME": str(self.home),
            "PYTHONUNBUFFERED": "1",
            # No metrics endpoint unless a test asks for one: workers spawned together would race for a port
            # (checked free, then bound), and the loser exits at start (seen killing `gate all` in its chaos gate).
            "CTXENGINE_METRICS_ADDRESS": "off",
            **self.extra_env,
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT)],
                cwd=str(REPO),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if await self.polling(client):
                    return
            except RPCError as exc:
                if exc.status not in _TRANSIENT:
                    raise
            await asyncio.sleep(0.2)
        self.kill()
        raise TimeoutError(f"{self.name} did not poll {self.task_queue} within {timeout}s:\n{self.log_tail()}")

    async def polling(self, client: Client) -> bool:
        """Whether Temporal lists this process as a poller of both the workflow and the activity task queue.

        The plain describe reports the root partition only, where a poller parked on another partition may not
        show for a whole long poll (~60 s); the enhanced describe covers every partition but is cached for ~5 s.
        Either one seeing the process is enough.
        """
        kinds = (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY)
        root: set[TaskQueueType.ValueType] = set()
        for kind in kinds:
            resp = await client.workflow_service.describe_task_queue(
                DescribeTaskQueueRequest(
                    namespace=client.namespace, task_queue=TaskQueue(name=self.task_queue), task_queue_type=kind
                )
            )
            if any(p.identity == self.identity for p in resp.pollers):
                root.add(kind)
        if len(root) == len(kinds):
            return True
        try:
            enhanced = await client.workflow_service.describe_task_queue(
                DescribeTaskQueueRequest(
                    namespace=client.namespace,
                    task_queue=TaskQueue(name=self.task_queue),
                    api_mode=DescribeTaskQueueMode.DESCRIBE_TASK_QUEUE_MODE_ENHANCED,
                    versions=TaskQueueVersionSelection(unversioned=True),
                    task_queue_types=kinds,
                    report_pollers=True,
                )
            )
        except RPCError:  # a server without the enhanced mode: the root partition's answer stands
            return False
        seen = set(root)
        for version in enhanced.versions_info.values():
            for type_number, info in version.types_info.items():
                if any(p.identity == self.identity for p in info.pollers):
                    seen.add(TaskQueueType.ValueType(type_number))
        return len(seen) == len(kinds)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no graceful shutdown, no activity completion, no sticky-queue hand-off."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, as a container runtime or systemd stops a service (a graceful shutdown); the exit code."""
        assert self.proc is not None, "start() has not run"
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_TAIL_CHARS:]
        except OSError:
            return "(no log)"


@asynccontextmanager
async def worker_process(
    client: Client,
    *,
    temporal_address: str,
    dsn: str,
    task_queue: str,
    home: Path,
    name: str = "worker",
    extra_env: dict[str, str] | None = None,
) -> AsyncIterator[WorkerProcess]:
    """A started worker process, killed on exit whatever happens."""
    worker = WorkerProcess(
        temporal_address=temporal_address, dsn=dsn, task_queue=task_queue, home=home, name=name, extra_env=extra_env
    )
    try:
        await worker.start(client)
        yield worker
    finally:
        worker.kill()
