"""Worker entry: connect, migrate, register the workflows and activities, run.

`python worker.py` or `ctxengine worker`. With TEMPORAL_ADDRESS / CTXENGINE_DATABASE_URL unset, the
embedded dev server and PostgreSQL are started under CTXENGINE_HOME (see docs/embedded-services.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import structlog
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.compaction import CompactionActivities
from activities.context import SessionActivities
from activities.provider import build_providers
from activities.store import Store
from ctxengine import names
from workflows.child_run import ChildRunWorkflow
from workflows.compaction import CompactionWorkflow
from workflows.session import SessionWorkflow

WORKFLOWS = [SessionWorkflow, CompactionWorkflow, ChildRunWorkflow]


def configure_logging(level: int = logging.INFO) -> None:
    """JSON lines on stderr; activities bind session_id, turn and epoch."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


async def connect(address: str, namespace: str | None = None) -> Client:
    return await Client.connect(
        address,
        namespace=namespace or os.environ.get("TEMPORAL_NAMESPACE", "default"),
        data_converter=pydantic_data_converter,
    )


async def search_attributes_registered(client: Client) -> bool:
    """Whether this namespace has ctxengine's search attributes (upserting unknown ones would fail tasks)."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

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
    fault_prefix_timestamp: bool | None = None,
) -> AsyncIterator[Worker]:
    """A started worker with every workflow and activity registered; stopped on exit."""
    if fault_prefix_timestamp is None:
        fault_prefix_timestamp = os.environ.get("CTXENGINE_FAULT_PREFIX_TIMESTAMP") == "1"
    activities = SessionActivities(
        store,
        build_providers(),
        search_attributes=await search_attributes_registered(client),
        fault_prefix_timestamp=fault_prefix_timestamp,
    )
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        activities=[*activities.all(), *CompactionActivities(activities).all()],
        max_cached_workflows=max_cached_workflows,
    )
    async with worker:
        yield worker


async def main() -> None:
    from ctxengine.embedded import ctxengine_home, embedded_postgres, temporal_dev_server

    configure_logging()
    log = structlog.get_logger("ctxengine.worker")
    async with AsyncExitStack() as stack:
        home = ctxengine_home()
        address = await stack.enter_async_context(temporal_dev_server(home))
        dsn = await stack.enter_async_context(embedded_postgres(home))
        client = await connect(address)
        store = await stack.enter_async_context(Store.from_dsn(dsn))
        version = await store.migrate()
        task_queue = os.environ.get("CTXENGINE_TASK_QUEUE", names.TASK_QUEUE)
        log.info(
            "worker.starting",
            temporal=address,
            task_queue=task_queue,
            schema_version=version,
            pid=os.getpid(),
        )
        async with running_worker(client, store, task_queue=task_queue):
            await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
