"""Builders for OpenAI wire objects that adapters synthesise: usage blocks and stream chunks.

Adapters that do not speak OpenAI natively (Anthropic, the mock) build their replies with these,
so every chunk the gateway emits has the same shape.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from providers.base import Usage

_encode = msgspec.json.encode


def usage_dict(usage: Usage) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ChunkBuilder:
    """Builds the ``chat.completion.chunk`` payloads of one streamed reply."""

    def __init__(self, model: str) -> None:
        self._base: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    def delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return _encode({**self._base, "choices": [choice]})

    def usage(self, usage: Usage) -> bytes:
        return _encode({**self._base, "choices": [], "usage": usage_dict(usage)})

    def all(self, words: list[str], usage: Usage, include_usage: bool) -> list[bytes]:
        """Every payload of a text reply: role, one chunk per word, the finish, then usage if asked."""
        chunks = [self.delta({"role": "assistant", "content": ""})]
        chunks.extend(self.delta({"content": w}) for w in words)
        chunks.append(self.delta({}, "stop"))
        if include_usage:
            chunks.append(self.usage(usage))
        return chunks
