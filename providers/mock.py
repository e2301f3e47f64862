"""The built-in mock provider: deterministic replies with exact usage, no network.

It serves model ``mock`` in dev mode and in tests. The same reply and chunk builders are used by
``modelgate mock-upstream``, so the in-process mock and the mock server answer alike: a reply of
``n`` words is ``n`` completion tokens, and prompt tokens are the gateway's own estimate.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from gateway.config import ProviderConfig
from policies.tokens import estimate_prompt_tokens
from providers.base import ChatCall, ChatHead, Completion, Usage, each_chunk
from providers.chunks import ChunkBuilder, usage_dict

DEFAULT_REPLY_WORDS = 12
_WORDS = ("this", "is", "a", "mock", "reply", "from", "modelgate", "that")
_encode = msgspec.json.encode


def reply_words(head: ChatHead, default: int = DEFAULT_REPLY_WORDS) -> list[str]:
    """The words of the reply: ``default`` of them, fewer when the request limits output."""
    limit = head.output_limit
    count = max(1, min(default, limit)) if limit is not None else default
    return [w + " " for w in itertools.islice(itertools.cycle(_WORDS), count)]


def usage_for(head: ChatHead, words: list[str]) -> Usage:
    return Usage(prompt_tokens=estimate_prompt_tokens(head.messages), completion_tokens=len(words))


def completion_body(model: str, words: list[str], usage: Usage) -> bytes:
    """A ``chat.completion`` body."""
    return _encode(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(words)},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage_dict(usage),
        }
    )


class MockChunkStream:
    """A reply streamed from memory."""

    def __init__(self, chunks: list[bytes], usage: Usage) -> None:
        self._chunks = chunks
        self.usage: Usage | None = usage
        self.ended = True

    async def batches(self) -> AsyncIterator[list[bytes]]:
        if self._chunks:
            yield self._chunks

    def __aiter__(self) -> AsyncIterator[bytes]:
        return each_chunk(self)

    async def aclose(self) -> None:
        return None


class MockProvider:
    """Answers every call itself, instantly."""

    def __init__(self, config: ProviderConfig) -> None:
        """Takes the provider's config, like every adapter; the mock needs nothing from it."""

    async def complete(self, call: ChatCall) -> Completion:
        words = reply_words(call.head)
        usage = usage_for(call.head, words)
        return Completion(body=completion_body(call.upstream_model, words, usage), usage=usage)

    async def stream(self, call: ChatCall) -> MockChunkStream:
        words = reply_words(call.head)
        usage = usage_for(call.head, words)
        chunks = ChunkBuilder(call.upstream_model).all(words, usage, call.head.include_usage)
        return MockChunkStream(chunks, usage)

    async def aclose(self) -> None:
        return None
