"""Adapter for Anthropic's Messages API, so Claude models can sit behind the OpenAI-shaped gateway.

Unlike the OpenAI adapter, nothing passes through byte for byte: each request is translated into a
Messages body (``POST {base_url}/messages``), each reply or stream event back into Chat Completions
payloads. The request, whole-reply and error-body mappings live in
:mod:`providers.anthropic_translate`; this module is the HTTP edge (credentials, status codes) and
the stream: a :class:`StreamTranslator` turns each event into chunks, relayed as it arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import msgspec

from gateway.config import ProviderConfig
from gateway.errors import UpstreamError
from providers.anthropic_translate import (
    AnthropicError,
    AnthropicMessage,
    AnthropicUsage,
    ContentBlock,
    anthropic_request,
    error_type,
    finish_reason,
    openai_completion,
    openai_error_body,
)
from providers.base import ChatCall, Completion, Usage
from providers.chunks import ChunkBuilder
from providers.http import MAX_RESPONSE_BYTES, SSEChunkStream, make_pool, send_ok
from providers.pool import UpstreamResponse

ANTHROPIC_VERSION = "2023-06-01"


class AnthropicProvider:
    """Calls ``{base_url}/messages``, translating to and from OpenAI Chat Completions."""

    def __init__(self, config: ProviderConfig) -> None:
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "anthropic-version": ANTHROPIC_VERSION,
        }
        if config.api_key is not None and config.api_key.reveal():  # "" (an unset ${VAR:-}) sends none
            headers["x-api-key"] = config.api_key.reveal()
        self._pool = make_pool(config, headers)

    async def complete(self, call: ChatCall) -> Completion:
        content = anthropic_request(call, stream=False)
        response = await send_ok(self._pool, "/messages", content, call.headers, openai_error_body)
        try:
            body = await response.read(MAX_RESPONSE_BYTES)
        finally:
            await response.aclose()
        return openai_completion(body, call.upstream_model)

    async def stream(self, call: ChatCall) -> AnthropicChunkStream:
        content = anthropic_request(call, stream=True)
        headers = {**call.headers, "accept": "text/event-stream"}
        response = await send_ok(self._pool, "/messages", content, headers, openai_error_body)
        return AnthropicChunkStream(response, StreamTranslator(call.upstream_model, call.head.include_usage))

    async def aclose(self) -> None:
        await self._pool.aclose()


# --- Anthropic stream events ---------------------------------------------------------------------


class _Delta(msgspec.Struct):
    type: str = ""
    text: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None


class _Event(msgspec.Struct):
    type: str
    index: int = 0
    message: AnthropicMessage | None = None
    content_block: ContentBlock | None = None
    delta: _Delta | None = None
    usage: AnthropicUsage | None = None
    error: AnthropicError | None = None


_decode_event = msgspec.json.Decoder(_Event).decode


class StreamTranslator:
    """Turns Anthropic stream events, one at a time, into ``chat.completion.chunk`` payloads.

    ``usage`` is set when ``message_delta`` reports the output count; ``finished`` once
    ``message_stop`` arrives. An ``error`` event or an unreadable one raises ``UpstreamError``.
    """

    def __init__(self, model: str, include_usage: bool) -> None:
        self._model = model
        self._include_usage = include_usage
        self._chunks = ChunkBuilder(model)
        self._tool_index: dict[int, int] = {}  # content block index -> OpenAI tool call index
        self._tools_with_arguments: set[int] = set()
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._finish_sent = False
        self.usage: Usage | None = None
        self.finished = False
        self._handlers: dict[str, Callable[[_Event], list[bytes]]] = {
            "message_start": self._message_start,
            "content_block_start": self._block_start,
            "content_block_delta": self._block_delta,
            "content_block_stop": self._block_stop,
            "message_delta": self._message_delta,
            "message_stop": self._message_stop,
            "error": self._error,
        }

    def feed(self, data: bytes) -> list[bytes]:
        """The chunks one event's data stands for (often none); unknown events are skipped."""
        try:
            event = _decode_event(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise UpstreamError("the upstream sent an unusable stream event") from exc
        handler = self._handlers.get(event.type)
        return handler(event) if handler is not None else []

    def _message_start(self, event: _Event) -> list[bytes]:
        if event.message is not None:
            self._chunks = ChunkBuilder(event.message.model or self._model)
            self._prompt_tokens = event.message.usage.prompt_tokens
            self._completion_tokens = event.message.usage.output_tokens or 0
        return [self._chunks.delta({"role": "assistant", "content": ""})]

    def _block_start(self, event: _Event) -> list[bytes]:
        block = event.content_block
        if block is None or block.type not in ("text", "tool_use"):
            return []
        if block.type == "text":
            return [self._chunks.delta({"content": block.text})] if block.text else []
        index = self._tool_index[event.index] = len(self._tool_index)
        function = {"name": block.name, "arguments": ""}
        return [self._tool_delta({"index": index, "id": block.id, "type": "function", "function": function})]

    def _block_delta(self, event: _Event) -> list[bytes]:
        delta = event.delta
        if delta is None:
            return []
        if delta.type == "text_delta" and delta.text:
            return [self._chunks.delta({"content": delta.text})]
        if delta.type == "input_json_delta" and delta.partial_json and event.index in self._tool_index:
            self._tools_with_arguments.add(event.index)
            return [self._arguments_delta(event.index, delta.partial_json)]
        return []

    def _block_stop(self, event: _Event) -> list[bytes]:
        """A tool call whose input streamed no JSON at all still needs arguments a client can parse."""
        if event.index in self._tool_index and event.index not in self._tools_with_arguments:
            return [self._arguments_delta(event.index, "{}")]
        return []

    def _message_delta(self, event: _Event) -> list[bytes]:
        if event.usage is not None:
            if event.usage.input_tokens is not None:
                self._prompt_tokens = event.usage.prompt_tokens
            if event.usage.output_tokens is not None:
                self._completion_tokens = event.usage.output_tokens
            self.usage = Usage(self._prompt_tokens, self._completion_tokens)
        if event.delta is None or event.delta.stop_reason is None:
            return []
        return [self._finish(event.delta.stop_reason)]

    def _message_stop(self, event: _Event) -> list[bytes]:
        self.finished = True
        chunks = [] if self._finish_sent else [self._finish(None)]
        if self.usage is None:
            self.usage = Usage(self._prompt_tokens, self._completion_tokens)
        if self._include_usage:
            chunks.append(self._chunks.usage(self.usage))
        return chunks

    def _error(self, event: _Event) -> NoReturn:
        kind = event.error.type if event.error is not None else ""
        transient = kind in ("overloaded_error", "api_error")
        what = error_type(kind) or "an error"
        raise UpstreamError(
            f"the upstream reported {what} mid-stream", retryable=transient, breaker_failure=transient
        )

    def _finish(self, stop_reason: str | None) -> bytes:
        self._finish_sent = True
        return self._chunks.delta({}, finish_reason(stop_reason))

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        return self._chunks.delta({"tool_calls": [call]})

    def _arguments_delta(self, block_index: int, fragment: str) -> bytes:
        return self._tool_delta({"index": self._tool_index[block_index], "function": {"arguments": fragment}})


class AnthropicChunkStream(SSEChunkStream):
    """Relays an Anthropic SSE stream as OpenAI chunks, as its events arrive."""

    missing_end = "the upstream stream ended before message_stop"

    def __init__(self, response: UpstreamResponse, translator: StreamTranslator) -> None:
        super().__init__(response)
        self._translator = translator

    def convert(self, data: bytes) -> list[bytes]:
        chunks = self._translator.feed(data)
        self.usage = self._translator.usage
        self.ended = self._translator.finished
        return chunks
