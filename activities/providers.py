"""The providers a worker can route to, built once at start: the scripted model and the real adapters."""

from __future__ import annotations

from collections.abc import Iterable

from activities.anthropic_provider import AnthropicProvider
from activities.openai_provider import OpenAIProvider
from activities.provider import ModelProvider, ScriptedProvider
from activities.tokens import TiktokenCounter


def build_providers(counter: TiktokenCounter | None = None) -> dict[str, ModelProvider]:
    """The providers this worker can route to: `scripted` always; `openai` and `anthropic` as adapters when
    their API key is set in the environment, else as a stand-in whose every call fails non-retryably with a
    message naming the variables to set (docs/providers.md)."""
    return {
        "scripted": ScriptedProvider(counter),
        "openai": OpenAIProvider.from_env(counter=counter),
        "anthropic": AnthropicProvider.from_env(),
    }


async def close_providers(providers: Iterable[ModelProvider]) -> None:
    """Close the SDK clients of the providers that hold one (`aclose`: the adapters' connection pools)."""
    for provider in providers:
        close = getattr(provider, "aclose", None)
        if close is not None:
            await close()
