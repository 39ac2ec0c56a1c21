"""`ctxengine demo` end to end: scripted (what `make demo` runs), and against local servers speaking the
OpenAI and Anthropic protocols, configured the way a user configures a real endpoint."""

from __future__ import annotations

import pytest
from rich.console import Console

from ctxengine.demo import run_demo
from tests.integration.fake_llm_servers import anthropic_server, openai_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.mark.parametrize("provider", ["scripted", "openai", "anthropic"])
async def test_demo_runs_end_to_end(
    provider: str, temporal_address: str, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripted session runs every turn on one prefix hash and closes, whichever provider serves it."""
    monkeypatch.setenv("TEMPORAL_ADDRESS", temporal_address)
    monkeypatch.setenv("CTXENGINE_DATABASE_URL", pg_dsn)
    server = None
    if provider == "openai":
        server = openai_server()
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1")
    elif provider == "anthropic":
        server = anthropic_server()
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    try:
        result = await run_demo(provider=provider, console=Console(file=open("/dev/null", "w")))
        served = len(server.requests) if server is not None else None
    finally:
        if server is not None:
            server.stop()
    assert result["turns"] == 7 and result["distinct_prefix_hashes"] == 1
    if served is not None:
        assert served >= 7


def test_unconfigured_provider_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a key, `demo --provider openai` stops at once naming the variables to set."""
    import asyncio

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="OPENAI_API_KEY"):
        asyncio.run(run_demo(provider="openai"))
