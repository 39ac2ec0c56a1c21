"""Every environment variable ctxengine reads, in one pydantic-settings object (docs/operations.md).

Production code reads configuration only through `settings()`; nothing else touches `os.environ`. Values are
validated when read, so a malformed variable fails at start with its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from contract.names import TASK_QUEUE


class Settings(BaseSettings):
    """The process's configuration. Field aliases are the variable names (no prefix magic), and only they are
    read: a field's own name is not a variable (`HOME`, `DATABASE_URL` and `TASK_QUEUE` belong to the shell and to
    other programs)."""

    # Names are matched as written (upper case): `ctxengine_database_url` is another variable, not this one.
    model_config = SettingsConfigDict(frozen=True, extra="ignore", case_sensitive=True)

    temporal_address: str | None = Field(default=None, validation_alias="TEMPORAL_ADDRESS")
    temporal_namespace: str = Field(default="default", min_length=1, validation_alias="TEMPORAL_NAMESPACE")
    database_url: str | None = Field(default=None, validation_alias="CTXENGINE_DATABASE_URL")
    home: Path = Field(default=Path(".ctxengine"), validation_alias="CTXENGINE_HOME")
    task_queue: str = Field(default=TASK_QUEUE, min_length=1, validation_alias="CTXENGINE_TASK_QUEUE")
    # Eager activity execution (Temporal's default): the worker that ran the workflow task runs the activity it
    # scheduled, which keeps a session's activities on the worker that holds its caches. False: any worker.
    eager_activities: bool = Field(default=True, validation_alias="CTXENGINE_EAGER_ACTIVITIES")
    # host:port of the worker's Prometheus endpoint; "" picks 127.0.0.1:9464 or a free port; "off" disables it.
    metrics_address: str = Field(default="", validation_alias="CTXENGINE_METRICS_ADDRESS")
    tiktoken_cache_dir: Path | None = Field(default=None, validation_alias="TIKTOKEN_CACHE_DIR")
    openai_api_key: SecretStr | None = Field(default=None, validation_alias="OPENAI_API_KEY")
    openai_base_url: str | None = Field(default=None, validation_alias="OPENAI_BASE_URL")
    anthropic_api_key: SecretStr | None = Field(default=None, validation_alias="ANTHROPIC_API_KEY")
    anthropic_base_url: str | None = Field(default=None, validation_alias="ANTHROPIC_BASE_URL")
    # OpenTelemetry (the `otel` extra): spans are exported over OTLP/HTTP when either endpoint is set; the
    # exporter reads the other standard OTEL_* variables itself.
    otel_exporter_otlp_endpoint: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT")
    otel_exporter_otlp_traces_endpoint: str | None = Field(
        default=None, validation_alias="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    otel_service_name: str | None = Field(default=None, validation_alias="OTEL_SERVICE_NAME")

    @field_validator("temporal_address")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is not None:
            _host_port(value)
        return value

    @field_validator("metrics_address")
    @classmethod
    def _metrics(cls, value: str) -> str:
        if value.lower() == "off":
            return "off"
        if value:
            _host_port(value)
        return value

    @field_validator("home", "tiktoken_cache_dir", mode="before")
    @classmethod
    def _directory(cls, value: Any, info: ValidationInfo) -> Any:
        """An empty directory variable is unset (its default), not the current directory."""
        if isinstance(value, str) and not value.strip():
            return Path(".ctxengine") if info.field_name == "home" else None
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("postgresql", "postgres"):
            raise ValueError(f"{value!r} is not a PostgreSQL URL (postgresql://user@host:port/database)")
        return value


def _host_port(value: str) -> None:
    """Refuse what is not `host:port` (an IPv6 host in brackets), with a port from 1 to 65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65_536:
        raise ValueError(f"{value!r} is not host:port")


class _GivenSettings(Settings):
    """Settings from a mapping of variable names alone: nothing is read from the process's environment."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class SettingsError(ValueError):
    """An environment variable that does not validate; the message names it."""


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """The configuration as the environment says now (read at each call: tests and the CLI set variables),
    or as `env` says (a mapping of variable names, nothing read from the process)."""
    try:
        if env is None:
            return Settings()
        given: dict[str, Any] = dict(env)  # variable names, not the initialiser's keyword arguments
        return _GivenSettings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        raise SettingsError(f"environment variable {name}: {first['msg']}") from None
