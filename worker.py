"""Worker entry: connect, migrate, register the workflows and activities, run.

`python worker.py` or `ctxengine worker`. With TEMPORAL_ADDRESS / CTXENGINE_DATABASE_URL unset, the
embedded dev server and PostgreSQL are started under CTXENGINE_HOME (see docs/embedded-services.md).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any, TextIO, TypeVar, cast

import asyncpg
import structlog
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import (
    Interceptor,
    PollerBehaviorAutoscaling,
    Worker,
    WorkflowInstance,
    WorkflowInstanceDetails,
    WorkflowRunner,
)
from temporalio.worker._command_aware_visitor import CommandInfo
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox._runner import _Instance as SandboxedInstance

from activities.compaction import CompactionActivities
from activities.failures import FailureInterceptor
from activities.migrations import MIGRATIONS
from activities.provider import ModelProvider
from activities.providers import build_providers, close_providers
from activities.session import SessionActivities
from activities.store import Store
from activities.tools import Executor
from contract import names
from contract.converter import DATA_CONVERTER
from contract.settings import SettingsError, settings
from services.embedded import (
    EmbeddedUnavailable,
    ctxengine_home,
    embedded_postgres,
    free_port,
    port_is_free,
    temporal_dev_server,
)
from workflows.child_run import ChildRunWorkflow
from workflows.compaction import CompactionWorkflow
from workflows.session import SessionWorkflow

WORKFLOWS = [SessionWorkflow, CompactionWorkflow, ChildRunWorkflow]
# A workflow task waits this long on a dead worker's sticky queue before any worker may take it (SDK default
# 10 s): part of what a worker crash costs a turn (docs/reliability.md, "Failover").
STICKY_SCHEDULE_TO_START = timedelta(seconds=1)
# So short a sticky wait needs a poll waiting on the sticky queue whenever a task arrives, however busy the worker
# is: with the SDK's default of 5 fixed workflow-task polls, a worker saturated by 100 sessions left tasks waiting
# on the server for over 1 s, and each one that timed out was handed back with its full history and replayed
# (docs/operations.md, "Workflow-task polls"). The server scales the polls to the backlog instead.
WORKFLOW_TASK_POLLS = PollerBehaviorAutoscaling()
# On SIGTERM or SIGINT the worker stops polling and gives the activities it runs this long to finish (under the
# 10 s a container runtime waits before SIGKILL); what is still running then is cancelled and Temporal retries it
# on another worker. The server is told the worker is gone, so its sessions' next workflow tasks skip the sticky
# wait.
GRACEFUL_SHUTDOWN = timedelta(seconds=8)
# At start, PostgreSQL or Temporal may not be up yet (a host boot, a compose start): wait with backoff.
STARTUP_WAIT_S = 120.0
# The garbage collector's thresholds once the worker has started (`tuned_gc`): the young generation is collected
# every 20,000 net allocations instead of CPython's 700, the middle one every 20 of those (CPython: 10) and the
# oldest, at most, every 20 of the middle one's (CPython: 10; and only once its long-lived objects grew by 25%).
GC_THRESHOLDS = (20_000, 20, 20)


class SandboxedRunner(SandboxedWorkflowRunner):
    """The SDK's sandboxed workflow runner, except that the payload codec's context lookups do not enter the sandbox
    (docs/operations.md, "The workflow runner").

    temporalio 1.35 looks up the serialization context of each payload sequence a workflow task decodes or encodes
    (three passes each way: references, external storage, codec) even when there is no codec and no external
    storage. Each lookup runs a line of code in the workflow's sandbox: compiled anew, with the sandbox's import
    overrides applied around it. A plain turn makes 29 of them: 2.35 ms of the worker's CPU a turn, against 0.18
    called directly. A lookup reads the workflow's pending commands and runs no workflow code, so these instances
    call the sandboxed instance's own lookup directly. Workflow code still runs only in the sandbox, under its
    restrictions."""

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return DirectLookups(det, self.runner_class, self.restrictions)


class DirectLookups(SandboxedInstance):
    """A sandboxed workflow instance whose context lookups call the instance inside the sandbox directly."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # The instance inside the sandbox (the SDK's name for it); None if an SDK release renames it, and then
        # the lookups go through the sandbox as the SDK's do (tests/integration/test_workflow_runner.py says so).
        self.in_sandbox: Any = self.globals_and_locals.get("__temporal_in_sandbox")

    def get_serialization_context(self, command_info: CommandInfo | None) -> Any:
        if self.in_sandbox is None:
            return super().get_serialization_context(command_info)
        return self.in_sandbox.get_serialization_context(command_info)

    def get_external_store_context(self, command_info: CommandInfo | None) -> Any:
        if self.in_sandbox is None:
            return super().get_external_store_context(command_info)
        return self.in_sandbox.get_external_store_context(command_info)


class _CurrentStderr:
    """``sys.stderr`` as it is at each write. A stream bound at configure time goes stale when the caller swaps
    ``sys.stderr`` for a while (click's CliRunner, a test's capture) and closes it: every later log line in the
    process would then raise ``ValueError: I/O operation on closed file``."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: int = logging.INFO) -> None:
    """JSON lines on stderr (whichever stream it is when a line is written); activities bind session_id, turn
    and epoch. Warnings and errors logged through Python's `logging` (the Temporal SDK's workflow, activity and
    worker loggers, the core's lines forwarded by `install_runtime`) and Python's own warnings are written as JSON
    lines too, with the logger's name."""
    stamp: list[Any] = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *_trace_ids(),
            *stamp,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, _JsonLines)]
    root.addHandler(_JsonLines(stamp))
    root.setLevel(max(level, logging.WARNING))  # as Python's own last resort: other libraries' info stays out
    logging.captureWarnings(True)  # Python's warnings (a coroutine never awaited) too, as logger `py.warnings`


class _JsonLines(logging.StreamHandler[TextIO]):
    """Python `logging` records as the JSON lines structlog writes: event, level, timestamp, logger, the
    record's extra fields (the SDK's `temporal_workflow` / `temporal_activity`) and any exception."""

    def __init__(self, stamp: list[Any]) -> None:
        super().__init__(cast(TextIO, _CurrentStderr()))
        self.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[*stamp, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(default=str),
                ],
            )
        )


def _trace_ids() -> list[Any]:
    """The structlog processor adding trace and span ids, when the `otel` extra is installed."""
    try:  # imported here: the `otel` extra is optional
        from activities.tracing import add_trace_ids
    except ImportError:
        return []
    return [add_trace_ids]


def tracing_interceptors() -> list[Any]:
    """OpenTelemetry interceptors when an OTLP endpoint is configured and the `otel` extra installed."""
    try:  # imported here: the `otel` extra is optional
        from activities.tracing import interceptors_from_env
    except ImportError:
        return []
    return list(interceptors_from_env())


def install_runtime(metrics_address: str | None = None) -> Runtime:
    """The process's Temporal runtime: core logs forwarded to Python logging (stderr, never stdout), and when
    `metrics_address` is given one Prometheus endpoint for the SDK's metrics and ctxengine's."""
    runtime = Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(
                filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
                forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
            ),
            metrics=PrometheusConfig(bind_address=metrics_address) if metrics_address else None,
        )
    )
    Runtime.set_default(runtime, error_if_already_set=False)
    return runtime


async def connect(address: str, namespace: str | None = None) -> Client:
    return await Client.connect(
        address,
        namespace=namespace or settings().temporal_namespace,
        data_converter=DATA_CONVERTER,
    )


async def search_attributes_registered(client: Client) -> bool:
    """Whether this namespace has ctxengine's search attributes (upserting unknown ones would fail tasks)."""
    try:
        resp = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
    except Exception:
        return False
    wanted = {names.SA_EPOCH, names.SA_TURNS, names.SA_PREFIX_HASH}
    return wanted <= set(resp.custom_attributes)


@asynccontextmanager
async def running_worker(
    client: Client,
    store: Store,
    *,
    task_queue: str = names.TASK_QUEUE,
    max_cached_workflows: int = 1_000,
    providers: Mapping[str, ModelProvider] | None = None,
    executors: Mapping[str, Executor] | None = None,
    activities_class: type[SessionActivities] = SessionActivities,
    interceptors: Sequence[Interceptor] = (),
    embedded_services: bool = False,
    eager_activities: bool = True,
    graceful_shutdown: timedelta = timedelta(0),
    workflow_runner: WorkflowRunner | None = None,
) -> AsyncIterator[Worker]:
    """A started worker with every workflow and activity registered; stopped on exit, and the SDK clients of the
    providers it built closed.

    `providers`, `executors`, `activities_class` and `interceptors` are how the development harness registers
    its adversarial models, tools and faults (production passes none of them). `embedded_services`: the worker
    runs on the embedded dev server and PostgreSQL, where a session that names no `model_route` gets the
    scripted model; any other worker refuses such a session at open (ModelRouteRequired). `graceful_shutdown`:
    how long running activities may take to finish when the worker stops (`main` passes `GRACEFUL_SHUTDOWN`).
    `workflow_runner`: `SandboxedRunner()` unless given (the tests compare it with the SDK's own).
    """
    built = build_providers()  # closed when the worker stops (the harness's own `providers` are its caller's)
    try:
        activities = activities_class(
            store,
            {**built, **(providers or {})},
            search_attributes=await search_attributes_registered(client),
            executors=executors,
            scripted_by_default=embedded_services,
        )
        worker = Worker(
            client,
            task_queue=task_queue,
            workflows=WORKFLOWS,
            activities=[*activities.all(), *CompactionActivities(activities.state).all()],
            max_cached_workflows=max_cached_workflows,
            interceptors=[FailureInterceptor(), *interceptors],
            sticky_queue_schedule_to_start_timeout=STICKY_SCHEDULE_TO_START,
            workflow_task_poller_behavior=WORKFLOW_TASK_POLLS,
            disable_eager_activity_execution=not eager_activities,
            graceful_shutdown_timeout=graceful_shutdown,
            workflow_runner=workflow_runner or SandboxedRunner(),
        )
        async with worker:
            yield worker
    finally:
        await close_providers(built.values())


@contextmanager
def tuned_gc() -> Iterator[None]:
    """Keep the garbage collector off a started worker's hot path (docs/operations.md, "A worker process's run
    time"); the thresholds as they were on exit, and the heap unfrozen unless it was frozen before.

    A worker's heap is mostly long-lived: its imports, the cached workflows, the sessions' memos. With CPython's
    defaults a full collection walks all of it every time the long-lived objects have grown by a quarter, and
    the young generation is collected every 700 allocations. So what start-up made moves out of the collector's
    view (`gc.freeze`), and the young generation is collected less often (`GC_THRESHOLDS`). Cycles are still
    collected; they wait longer."""
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if not frozen_before:  # a freeze made before (a pre-fork one, an outer tuned_gc) stays
            gc.unfreeze()


T = TypeVar("T")


class StartupError(Exception):
    """A setting names something that is there but refuses it (a database or role that does not exist, a wrong
    password, a namespace the server does not have, a metrics address in use): waiting does not help, so the worker
    exits 2 naming the variable, as for a malformed value."""


def _permanent_postgres(exc: Exception) -> str | None:
    if isinstance(
        exc,
        asyncpg.InvalidCatalogNameError | asyncpg.InvalidAuthorizationSpecificationError | asyncpg.InvalidPasswordError,
    ):
        return f"CTXENGINE_DATABASE_URL: PostgreSQL refused it: {exc}"
    return None


def _permanent_temporal(exc: Exception) -> str | None:
    if isinstance(exc, RPCError) and exc.status is RPCStatusCode.NOT_FOUND:
        return f"TEMPORAL_NAMESPACE: the Temporal server has no such namespace: {exc}"
    return None


async def connect_to_namespace(address: str) -> Client:
    """A client of the namespace the settings name, checked to exist (a missing one fails the worker at start with
    the variable named, not with a traceback once the worker validates)."""
    client = await connect(address)
    await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=client.namespace))
    return client


async def with_backoff(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    deadline_s: float = STARTUP_WAIT_S,
    permanent: Callable[[Exception], str | None] = lambda exc: None,
) -> T:
    """`attempt()` until it succeeds, waiting 0.5 s, doubling, at most 10 s apart, logging each failure; after
    `deadline_s` the last error is raised (a worker that cannot reach its services exits, with the reason). An error
    `permanent` names (returns a message for) raises `StartupError` at once: waiting would not change it."""
    log = structlog.get_logger("ctxengine.worker")
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    delay = 0.5
    while True:
        try:
            return await attempt()
        except Exception as exc:  # whatever the dependency raises while it is down: logged, retried
            if (message := permanent(exc)) is not None:
                raise StartupError(message) from exc
            if loop.time() + delay > give_up:
                log.error("worker.dependency_unavailable", dependency=what, error=f"{type(exc).__name__}: {exc}")
                raise
            log.warning("worker.waiting", dependency=what, retry_in_s=delay, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)


async def main() -> None:
    configure_logging()
    log = structlog.get_logger("ctxengine.worker")
    config = settings()
    # SIGTERM or SIGINT: a graceful shutdown once the worker runs; while it is still starting (waiting for Temporal
    # or PostgreSQL), the start is cancelled, and what it started is stopped.
    stop = asyncio.Event()
    received: list[str] = []
    starting = asyncio.current_task()

    def stopping(sig: signal.Signals) -> None:
        received.append(sig.name)
        if stop.is_set() or starting is None:
            return
        stop.set()
        if not serving:
            starting.cancel()

    serving = False

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping, sig)
    metrics = config.metrics_address
    if not metrics:  # the default port, or a free one when another worker on this host holds it
        metrics = f"127.0.0.1:{9464 if port_is_free(9464) else free_port()}"
    try:
        install_runtime(None if metrics == "off" else metrics)
    except (RuntimeError, ValueError) as exc:  # the SDK's exporter could not bind it
        raise StartupError(f"CTXENGINE_METRICS_ADDRESS: cannot serve metrics at {metrics}: {exc}") from exc
    async with AsyncExitStack() as stack:
        home = ctxengine_home()
        address = await stack.enter_async_context(temporal_dev_server(home))
        dsn = await stack.enter_async_context(embedded_postgres(home))
        client = await with_backoff("temporal", lambda: connect_to_namespace(address), permanent=_permanent_temporal)
        store = await with_backoff(
            "postgresql", lambda: stack.enter_async_context(Store.from_dsn(dsn)), permanent=_permanent_postgres
        )
        version = await with_backoff("postgresql", store.migrate, permanent=_permanent_postgres)
        if version > len(MIGRATIONS):
            log.warning(
                "worker.schema_newer",
                schema_version=version,
                release_schema_version=len(MIGRATIONS),
                meaning="a newer release migrated this database; this worker runs on it as during a rolling upgrade",
            )
        task_queue = config.task_queue
        # On the embedded dev stack alone, a session that names no model route gets the scripted model.
        embedded = not config.temporal_address and not config.database_url
        log.info(
            "worker.starting",
            metrics=None if metrics == "off" else f"http://{metrics}/metrics",
            temporal=address,
            task_queue=task_queue,
            schema_version=version,
            embedded_services=embedded,
            pid=os.getpid(),
        )
        async with running_worker(
            client,
            store,
            task_queue=task_queue,
            interceptors=tracing_interceptors(),
            embedded_services=embedded,
            eager_activities=config.eager_activities,
            graceful_shutdown=GRACEFUL_SHUTDOWN,
        ):
            serving = True
            with tuned_gc():  # once started, so what the worker made at start-up is frozen too
                await stop.wait()
            log.info("worker.stopping", signal=received[0], graceful_shutdown_s=GRACEFUL_SHUTDOWN.total_seconds())
    log.info("worker.stopped", signal=received[0])


def run() -> None:
    """Run the worker; a missing service or a bad variable exits with its message, not a traceback."""
    try:
        asyncio.run(main())
    except asyncio.CancelledError:  # stopped by a signal while it was starting
        return
    except (EmbeddedUnavailable, SettingsError, StartupError) as exc:
        sys.stderr.write(f"ctxengine worker: {exc}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit without finalizing the interpreter: the services are stopped by now, but a Temporal client's runtime
        # thread may still call into Python, which aborts a finalizing interpreter ("PyGILState_Release", exit -6)
        # instead of exiting 2 (seen once in CI, after "the Temporal server has no such namespace").
        os._exit(2)


if __name__ == "__main__":
    run()
