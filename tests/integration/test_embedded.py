"""The embedded services and the shared fixtures: real PostgreSQL, real Temporal dev server."""

from __future__ import annotations

import asyncio
import os
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    import asyncpg
    import pytest
    from pydantic import BaseModel
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
    from temporalio.client import Client
    from temporalio.worker import Worker

    from services.embedded import (
        ENV_DATABASE_URL,
        ENV_HOME,
        SEARCH_ATTRIBUTES,
        EmbeddedPostgres,
        EmbeddedTemporal,
        ctxengine_home,
        dev_server_extra_args,
        dsn_with_database,
        temporal_namespace,
    )

pytestmark = pytest.mark.integration


class GreetInput(BaseModel):
    name: str


class GreetResult(BaseModel):
    greeting: str


@activity.defn(name="test.embedded.greet")
async def greet(data: GreetInput) -> GreetResult:
    return GreetResult(greeting=f"hello, {data.name}")


@workflow.defn(name="TestEmbeddedGreeting")
class GreetingWorkflow:
    @workflow.run
    async def run(self, data: GreetInput) -> GreetResult:
        return await workflow.execute_activity(greet, data, start_to_close_timeout=timedelta(seconds=10))


async def _fetchval(dsn: str, sql: str) -> object:
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


class TestHelpers:
    def test_home_from_env_is_created(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """CTXENGINE_HOME names the state directory, which is created when missing."""
        monkeypatch.setenv(ENV_HOME, str(tmp_path / "state"))
        assert ctxengine_home() == (tmp_path / "state").resolve()
        assert (tmp_path / "state").is_dir()

    def test_dsn_with_database_keeps_socket_host(self) -> None:
        """Swapping the database keeps the user, the unix-socket host and the port."""
        dsn = "postgresql://postgres@/postgres?host=/tmp/x/pg&port=5432"
        assert dsn_with_database(dsn, "test_1") == "postgresql://postgres@/test_1?host=/tmp/x/pg&port=5432"
        assert dsn_with_database("postgresql://u:p@h:5433/db", "other") == "postgresql://u:p@h:5433/other"

    def test_dev_server_flags(self) -> None:
        """Every embedded dev server lifts the transfer-queue poll cap, uses WAL and registers our attributes."""
        args = dev_server_extra_args()
        assert "history.transferProcessorMaxPollRPS=1000" in args
        assert {"journal_mode=wal", "synchronous=normal"} <= set(args)
        assert {"CtxEpoch=Int", "CtxTurns=Int", "CtxPrefixHash=Keyword"} <= set(args)


class TestPostgres:
    async def test_server_is_postgres_18(self, pg_server: str) -> None:
        """The embedded server is PostgreSQL 18 (any external one at least 14)."""
        major = int(str(await _fetchval(pg_server, "SHOW server_version_num"))) // 10000
        version = str(await _fetchval(pg_server, "SELECT version()"))
        assert version.startswith("PostgreSQL ")
        assert major >= 14 if os.environ.get(ENV_DATABASE_URL) else major == 18

    async def test_each_test_gets_a_fresh_database(self, pg_dsn: str, pg_server: str) -> None:
        """pg_dsn names a new, empty database distinct from the server's default one."""
        name = await _fetchval(pg_dsn, "SELECT current_database()")
        assert isinstance(name, str) and name.startswith("test_")
        assert name != await _fetchval(pg_server, "SELECT current_database()")
        tables = await _fetchval(pg_dsn, "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")
        assert tables == 0
        _seen_databases.add(name)

    async def test_another_test_gets_another_database(self, pg_dsn: str) -> None:
        """Two tests never share a pg_dsn database."""
        name = await _fetchval(pg_dsn, "SELECT current_database()")
        assert name not in _seen_databases
        _seen_databases.add(str(name))

    async def test_restart_keeps_data(self, pg_restartable: EmbeddedPostgres) -> None:
        """A stopped server refuses connections; started again on the same data dir, the rows are there."""
        dsn = pg_restartable.dsn
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS survivors (id int PRIMARY KEY, name text)")
            await conn.execute("INSERT INTO survivors VALUES (1, 'kept') ON CONFLICT DO NOTHING")
        finally:
            await conn.close()
        pgdata = pg_restartable.pgdata

        await pg_restartable.stop()
        assert not pg_restartable.running
        with pytest.raises((OSError, asyncpg.PostgresError)):
            await asyncpg.connect(dsn, timeout=2)

        await pg_restartable.start()
        assert pg_restartable.pgdata == pgdata
        assert pg_restartable.dsn == dsn
        assert await _fetchval(dsn, "SELECT name FROM survivors WHERE id = 1") == "kept"

    async def test_second_instance_on_same_data_dir_never_stops_the_first(
        self, pg_restartable: EmbeddedPostgres
    ) -> None:
        """An instance that finds the data dir's server already running uses it and leaves it running."""
        second = EmbeddedPostgres(pg_restartable.home)
        assert await second.start() == pg_restartable.dsn
        assert not second.owned
        await second.close()
        assert pg_restartable.running
        assert await _fetchval(pg_restartable.dsn, "SELECT 1") == 1


_seen_databases: set[str] = set()


class TestTemporal:
    async def test_workflow_runs_end_to_end(self, temporal_client: Client, task_queue: str) -> None:
        """A workflow and its activity run on the dev server with pydantic payloads."""
        async with Worker(
            temporal_client,
            task_queue=task_queue,
            workflows=[GreetingWorkflow],
            activities=[greet],
            max_cached_workflows=0,
        ):
            result = await temporal_client.execute_workflow(
                GreetingWorkflow.run,
                GreetInput(name="ctxengine"),
                id=f"test-embedded-{uuid.uuid4()}",
                task_queue=task_queue,
                execution_timeout=timedelta(seconds=30),
            )
        assert result == GreetResult(greeting="hello, ctxengine")

    async def test_search_attributes_are_registered(self, temporal_client: Client) -> None:
        """CtxEpoch, CtxTurns (Int) and CtxPrefixHash (Keyword) exist on the server."""
        response = await temporal_client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=temporal_namespace())
        )
        registered = {
            name: IndexedValueType.Name(kind).removeprefix("INDEXED_VALUE_TYPE_")
            for name, kind in response.custom_attributes.items()
        }
        for name, kind in SEARCH_ATTRIBUTES.items():
            assert registered.get(name) == kind.upper()

    async def test_taken_port_gets_another_and_first_survives(self, tmp_path: Path) -> None:
        """A second server whose preferred ports are taken picks free ones, its own database, and never
        stops the first."""
        home = tmp_path / "home"
        async with EmbeddedTemporal(home, ui=True) as first:
            ui_url = first.ui_url
            assert ui_url is not None
            ui_status = await asyncio.to_thread(lambda: urllib.request.urlopen(ui_url, timeout=5).status)
            assert ui_status == 200
            assert first.port is not None and first.ui_port is not None
            second = EmbeddedTemporal(home, ui=True, port=first.port, ui_port=first.ui_port)
            await second.start()
            try:
                assert second.port not in (first.port, first.ui_port)
                assert second.ui_port not in (first.port, first.ui_port)
                assert second.db_path != first.db_path
                assert second.pid != first.pid
            finally:
                await second.stop()
            assert first.running
            client = await Client.connect(first.address)
            await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=first.namespace))
        assert not first.running
