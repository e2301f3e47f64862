"""Upstream adapters, one per provider type, behind the small interface in :mod:`providers.base`."""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import ProviderConfig
from providers.anthropic import AnthropicProvider
from providers.base import ChatCall, ChatHead, ChunkStream, Completion, Provider, Usage
from providers.mock import MockProvider
from providers.openai import OpenAIProvider

PROVIDERS: dict[str, Callable[[ProviderConfig], Provider]] = {
    "openai": OpenAIProvider,
    "anthropic": AnthropicProvider,
    "mock": MockProvider,
}


def build_provider(config: ProviderConfig) -> Provider:
    """The adapter for one configured provider."""
    return PROVIDERS[config.type](config)


__all__ = [
    "PROVIDERS",
    "ChatCall",
    "ChatHead",
    "ChunkStream",
    "Completion",
    "Provider",
    "Usage",
    "build_provider",
]
