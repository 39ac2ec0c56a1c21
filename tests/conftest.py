"""Shared fixtures: a real PostgreSQL and a real Temporal dev server, started once per session, lazily.

Nothing starts unless a test asks for it, so unit tests of ``core/`` never start a server. With
``CTXENGINE_DATABASE_URL`` / ``TEMPORAL_ADDRESS`` set, the fixtures use those servers and start nothing.

- ``pg_server`` (session): DSN of the session's PostgreSQL.
- ``pg_dsn`` (function): DSN of a fresh, empty database ``test_<hex>``, dropped afterwards.
- ``pg_restartable`` (session): an ``EmbeddedPostgres`` of its own that a test may ``stop()`` and
  ``start()``; tests that stop it start it again before they end (``start()`` is idempotent).
- ``temporal_address`` (session): ``host:port`` of the session's dev server.
- ``temporal_client`` (session): a ``Client`` on it with the pydantic data converter.
- ``task_queue`` (function): a fresh ``test-<uuid4>`` task queue.
- ``ctxengine_test_home`` (session): the temporary CTXENGINE_HOME the embedded services live in.

Under pytest-xdist (``make test`` runs ``-n 2 --dist loadfile``) each worker is its own session, so each starts
its own dev server (free ports) and PostgreSQL (its own temporary home, unix socket only): nothing is shared
between workers. A test file runs whole on one worker, so a module-scoped fixture is computed once. A test that
must not share the machine with any other test (it asserts on wall-clock latency) carries
``@pytest.mark.exclusive``: the other workers finish their current test and wait while it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client

from contract.converter import DATA_CONVERTER
from services.embedded import (
    ENV_DATABASE_URL,
    ENV_TEMPORAL_ADDRESS,
    EmbeddedPostgres,
    EmbeddedTemporal,
    dsn_with_database,
    embedded_postgres,
    temporal_namespace,
)

# ------------------------------------------------------------------------------------- xdist: exclusive tests

_EXCLUSIVE_LOCKS = "ctxengine_exclusive_locks"  # key in each worker's workerinput: the run's lock directory
_LOCK_DIR = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """On the xdist controller: one lock directory for the run, handed to every worker."""
    config = node.config
    if _LOCK_DIR not in config.stash:
        config.stash[_LOCK_DIR] = tempfile.mkdtemp(prefix="ctxengine-xdist-locks-")
    node.workerinput[_EXCLUSIVE_LOCKS] = config.stash[_LOCK_DIR]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LOCK_DIR in config.stash:  # the controller, once every worker has finished
        shutil.rmtree(config.stash[_LOCK_DIR], ignore_errors=True)


@contextlib.contextmanager
def _alone_or_alongside(item: pytest.Item) -> Iterator[None]:
    """A reader-writer lock across the xdist workers (flock, writer-preferring through a turnstile): a test
    marked ``exclusive`` holds it alone, every other test shares it. Without xdist it does nothing."""
    lock_dir = getattr(item.config, "workerinput", {}).get(_EXCLUSIVE_LOCKS)
    if lock_dir is None:
        yield
        return
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(Path(lock_dir) / "turnstile", "a") as turnstile, open(Path(lock_dir) / "running", "a") as running:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # a waiting exclusive test holds it: no new test starts meanwhile
        fcntl.flock(running, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the files releases both locks


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    # Outermost wrapper (tryfirst): the wait for the lock is outside setup, call and the per-test timeout.
    with _alone_or_alongside(item):
        return (yield)


# ----------------------------------------------------------------------------------------- embedded services


@pytest.fixture(scope="session")
def ctxengine_test_home() -> Iterator[Path]:
    """A temporary CTXENGINE_HOME for the session's embedded services, removed at the end."""
    home = Path(tempfile.mkdtemp(prefix="ctxengine-test-"))
    # mkdtemp makes it 0700; run as root, PostgreSQL runs as the `embedded_postgres` user, which must
    # traverse it to reach its data directory (otherwise embedded.py falls back to a /tmp path).
    home.chmod(0o755)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def pg_server(ctxengine_test_home: Path) -> AsyncIterator[str]:
    """DSN of the session's PostgreSQL: CTXENGINE_DATABASE_URL, or an embedded server started once."""
    async with embedded_postgres(ctxengine_test_home / "main") as dsn:
        yield dsn


@asynccontextmanager
async def fresh_database(server_dsn: str, prefix: str = "test") -> AsyncIterator[str]:
    """A new empty database on `server_dsn`, dropped afterwards (best effort); yields its DSN."""
    name = f"{prefix}_{uuid.uuid4().hex}"
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    yield dsn_with_database(server_dsn, name)
    with contextlib.suppress(OSError, asyncpg.PostgresError):
        conn = await asyncpg.connect(server_dsn, timeout=5)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@pytest_asyncio.fixture(loop_scope="session")
async def pg_dsn(pg_server: str) -> AsyncIterator[str]:
    """DSN of a fresh database created for this test (dropped afterwards, best effort)."""
    async with fresh_database(pg_server) as dsn:
        yield dsn


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def pg_restartable(ctxengine_test_home: Path) -> AsyncIterator[EmbeddedPostgres]:
    """A PostgreSQL of its own (not ``pg_server``) that a test may stop and start again."""
    if os.environ.get(ENV_DATABASE_URL):
        pytest.skip(f"{ENV_DATABASE_URL} is set: no embedded PostgreSQL to stop and restart")
    server = EmbeddedPostgres(ctxengine_test_home / "restartable")
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def temporal_address(ctxengine_test_home: Path) -> AsyncIterator[str]:
    """``host:port`` of the session's Temporal: TEMPORAL_ADDRESS, or an embedded dev server started once.

    The embedded one is headless and on free ports, leaving 7233/8233 to a demo a developer runs meanwhile.
    """
    external = os.environ.get(ENV_TEMPORAL_ADDRESS)
    if external:
        yield external
        return
    async with EmbeddedTemporal(ctxengine_test_home, ui=False, port=0) as server:
        yield server.address


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def temporal_client(temporal_address: str) -> Client:
    """A client of the session's Temporal in TEMPORAL_NAMESPACE, with the pydantic data converter."""
    return await Client.connect(temporal_address, namespace=temporal_namespace(), data_converter=DATA_CONVERTER)


@pytest.fixture
def task_queue() -> str:
    """A task queue no other test uses."""
    return f"test-{uuid.uuid4()}"
