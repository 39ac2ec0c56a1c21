"""What the CLI commands need up: Temporal and PostgreSQL (external by env, else embedded), the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import asyncpg

from activities.store import Store
from contract.settings import settings
from services.embedded import EmbeddedTemporal, ctxengine_home, embedded_postgres


@dataclass
class Services:
    temporal_address: str
    ui_url: str | None
    store: Store


@asynccontextmanager
async def services(*, temporal: bool = True) -> AsyncIterator[Services]:
    """Temporal (TEMPORAL_ADDRESS or an embedded dev server) and a migrated store; stopped on exit."""
    home = ctxengine_home()
    async with AsyncExitStack() as stack:
        address, ui = "", None
        if temporal:
            external = settings().temporal_address
            if external:
                address = external
            else:
                server = EmbeddedTemporal(home)
                await server.start()
                stack.push_async_callback(server.stop)
                address, ui = server.address, server.ui_url
        dsn = await stack.enter_async_context(embedded_postgres(home))
        try:
            store = await stack.enter_async_context(Store.from_dsn(dsn))
            await store.migrate()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            which = "CTXENGINE_DATABASE_URL" if settings().database_url else f"the embedded one in {home}"
            raise PostgresUnreachable(f"PostgreSQL ({which}) cannot be used: {exc}") from exc
        yield Services(temporal_address=address, ui_url=ui, store=store)


class PostgresUnreachable(Exception):
    """The store could not be reached or refused the connection: a command that needs it exits 3, saying so."""
