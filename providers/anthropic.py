"""Adapter for Anthropic's Messages API (placeholder until the translation lands)."""

from __future__ import annotations

from gateway.config import ProviderConfig
from gateway.errors import UpstreamError
from providers.base import ChatCall, ChunkStream, Completion


class AnthropicProvider:
    def __init__(self, config: ProviderConfig) -> None:
        self._config = config

    async def complete(self, call: ChatCall) -> Completion:
        raise UpstreamError("not implemented")

    async def stream(self, call: ChatCall) -> ChunkStream:
        raise UpstreamError("not implemented")

    async def aclose(self) -> None:
        return None
