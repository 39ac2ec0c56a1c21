"""Configuration: a malformed environment variable is refused when read, naming the variable (docs/operations.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.settings import SettingsError, settings


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CTXENGINE_METRICS_ADDRESS", "garbage"),
        ("CTXENGINE_METRICS_ADDRESS", "127.0.0.1:99999"),
        ("TEMPORAL_ADDRESS", "localhost"),
        ("TEMPORAL_ADDRESS", ":7233"),
        ("CTXENGINE_DATABASE_URL", "notaurl"),
        ("CTXENGINE_DATABASE_URL", "mysql://u@h/db"),
        ("CTXENGINE_EAGER_ACTIVITIES", "sometimes"),
        ("TEMPORAL_NAMESPACE", ""),
    ],
)
def test_a_malformed_variable_is_refused_by_name(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"environment variable {variable}:"):
        settings({variable: value})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CTXENGINE_METRICS_ADDRESS", ""),
        ("CTXENGINE_METRICS_ADDRESS", "off"),
        ("CTXENGINE_METRICS_ADDRESS", "0.0.0.0:9464"),
        ("TEMPORAL_ADDRESS", "temporal.internal:7233"),
        ("TEMPORAL_ADDRESS", "[::1]:7233"),
        ("CTXENGINE_DATABASE_URL", "postgresql://ctx:secret@db:5432/ctxengine"),
        ("CTXENGINE_DATABASE_URL", "postgres://postgres@/ctxengine?host=/run/postgresql&port=5432"),
    ],
)
def test_a_well_formed_variable_is_taken(variable: str, value: str) -> None:
    settings({variable: value})


# Variables of the shell and of other programs named like a field (`home`, `database_url`, `task_queue` ...).
_OTHER_PROGRAMS = {
    "HOME": "/root",
    "DATABASE_URL": "postgresql://someone-else@elsewhere:5432/their_app",
    "TASK_QUEUE": "their-queue",
    "METRICS_ADDRESS": "garbage",
    "EAGER_ACTIVITIES": "sometimes",
}


def test_only_the_documented_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A field's own name is not a variable: `HOME` is not ctxengine's home, nor `DATABASE_URL` its database."""
    for variable in (
        "CTXENGINE_HOME",
        "CTXENGINE_DATABASE_URL",
        "CTXENGINE_TASK_QUEUE",
        "CTXENGINE_METRICS_ADDRESS",
        "CTXENGINE_EAGER_ACTIVITIES",
    ):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in _OTHER_PROGRAMS.items():
        monkeypatch.setenv(variable, value)
    read = settings()
    assert (str(read.home), read.database_url, read.metrics_address) == (".ctxengine", None, "")
    assert read.task_queue != "their-queue" and read.eager_activities is True
    assert settings(_OTHER_PROGRAMS) == settings({})  # a mapping alone: nothing read from the process


def test_names_are_read_as_written_and_blank_or_off_mean_what_they_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the upper-case name is the variable (a lower-case `ctxengine_database_url` was read, and a malformed one
    failed every command); an empty CTXENGINE_HOME is the default home, not the current directory; `OFF` turns the
    metrics endpoint off as `off` does (it was refused)."""
    monkeypatch.delenv("CTXENGINE_DATABASE_URL", raising=False)
    monkeypatch.setenv("ctxengine_database_url", "mysql://not-ours@h/db")
    assert settings().database_url is None
    assert str(settings({"CTXENGINE_HOME": ""}).home) == ".ctxengine"
    assert settings({"TIKTOKEN_CACHE_DIR": ""}).tiktoken_cache_dir is None
    assert settings({"CTXENGINE_METRICS_ADDRESS": "OFF"}).metrics_address == "off"


def test_the_documented_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same values under ctxengine's names are taken."""
    monkeypatch.setenv("CTXENGINE_HOME", "/srv/ctxengine")
    monkeypatch.setenv("CTXENGINE_DATABASE_URL", "postgresql://ctx@db:5432/ctxengine")
    monkeypatch.setenv("CTXENGINE_TASK_QUEUE", "ctx-queue")
    read = settings()
    assert (str(read.home), read.database_url, read.task_queue) == (
        "/srv/ctxengine",
        "postgresql://ctx@db:5432/ctxengine",
        "ctx-queue",
    )


@pytest.mark.parametrize(
    ("command", "variable", "value"),
    [
        (["inspect", "no-such-session"], "TEMPORAL_ADDRESS", "localhost"),
        (["demo"], "CTXENGINE_EAGER_ACTIVITIES", "maybe"),
        (["purge", "--session", "s"], "CTXENGINE_DATABASE_URL", "mysql://u@h/db"),
    ],
)
def test_every_command_exits_2_naming_a_malformed_variable(command: list[str], variable: str, value: str) -> None:
    """The installed console script, not only `ctxengine worker`: exit 2 and one line naming the variable, no
    traceback."""
    script = Path(sys.executable).with_name("ctxengine")  # `make` installs the project into the venv
    done = subprocess.run(
        [str(script), *command], env={**os.environ, variable: value}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"environment variable {variable}:" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["inspect", "s"], ["replay", "s"], ["purge", "--session", "s"]])
def test_a_command_whose_postgresql_is_down_exits_3_in_one_line(command: list[str]) -> None:
    """PostgreSQL not listening where CTXENGINE_DATABASE_URL points: exit 3 and one line saying so. Before, a
    traceback of hundreds of lines and exit 1, which is also what "no such session" returns."""
    script = Path(sys.executable).with_name("ctxengine")
    dsn = "postgresql://ctx@127.0.0.1:1/ctxengine"  # port 1: nothing listens, refused at once
    done = subprocess.run(
        [str(script), *command],
        env={**os.environ, "CTXENGINE_DATABASE_URL": dsn},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("ctxengine: PostgreSQL (CTXENGINE_DATABASE_URL) cannot be used:"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
