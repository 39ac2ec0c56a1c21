"""Migrations: applied once, and a database a newer release migrated further is run on as it is and reported."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.client import Client

from activities.migrations import MIGRATIONS
from activities.store import Store
from harness.worker_process import worker_process


async def _versions(store: Store) -> list[int]:
    return [r["version"] for r in await store.pool.fetch("SELECT version FROM schema_migrations ORDER BY version")]


async def test_migrate_applies_each_migration_once(pg_dsn: str) -> None:
    async with Store.from_dsn(pg_dsn) as store:
        assert await store.migrate() == len(MIGRATIONS)
        assert await store.migrate() == len(MIGRATIONS)
        assert await _versions(store) == list(range(1, len(MIGRATIONS) + 1))


async def _migrated_by_a_newer_release(store: Store) -> int:
    """What a newer release's worker leaves: one more migration recorded, and what it made."""
    newer = len(MIGRATIONS) + 1
    await store.migrate()
    await store.pool.execute("CREATE TABLE from_a_newer_release (id int PRIMARY KEY)")
    await store.pool.execute("INSERT INTO from_a_newer_release VALUES (7)")
    await store.pool.execute("INSERT INTO schema_migrations (version) VALUES ($1)", newer)
    return newer


async def test_a_newer_schema_is_kept_and_its_version_returned(pg_dsn: str) -> None:
    async with Store.from_dsn(pg_dsn) as store:
        newer = await _migrated_by_a_newer_release(store)
        assert await store.migrate() == newer
        assert await _versions(store) == list(range(1, newer + 1))
        assert await store.pool.fetchval("SELECT id FROM from_a_newer_release") == 7


async def test_a_worker_on_a_newer_schema_says_so_and_runs(
    temporal_client: Client, temporal_address: str, pg_dsn: str, task_queue: str, tmp_path: Path
) -> None:
    async with Store.from_dsn(pg_dsn) as store:
        newer = await _migrated_by_a_newer_release(store)
    async with worker_process(
        temporal_client, temporal_address=temporal_address, dsn=pg_dsn, task_queue=task_queue, home=tmp_path
    ) as worker:
        lines = [json.loads(line) for line in worker.log_path.read_text().splitlines() if line.startswith("{")]
    newer_lines = [line for line in lines if line.get("event") == "worker.schema_newer"]
    assert len(newer_lines) == 1, worker.log_tail()
    assert newer_lines[0]["schema_version"] == newer
    assert newer_lines[0]["release_schema_version"] == len(MIGRATIONS)
    assert newer_lines[0]["level"] == "warning"
    starting = [line for line in lines if line.get("event") == "worker.starting"]
    assert starting and starting[0]["schema_version"] == newer
