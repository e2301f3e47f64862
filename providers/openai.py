"""Adapter for any OpenAI-compatible Chat Completions server.

The client's body goes upstream byte for byte whenever possible, so fields the gateway does not
know pass through untouched. It is rewritten only to name the target's upstream model or to ask
for stream usage; asking for usage on a body without ``stream_options`` is a splice, not a re-encode.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.config import ProviderConfig
from gateway.errors import InvalidRequest, UpstreamError
from providers.base import ChatCall, Completion, Usage
from providers.http import MAX_RESPONSE_BYTES, SSEChunkStream, make_pool, send_ok
from providers.pool import UpstreamResponse


class _CompletionHead(msgspec.Struct):
    choices: list[msgspec.Raw]
    usage: Usage | None = None


class _ChunkHead(msgspec.Struct):
    choices: list[msgspec.Raw] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    error: Any = None


_decode_completion = msgspec.json.Decoder(_CompletionHead).decode
_decode_chunk = msgspec.json.Decoder(_ChunkHead).decode
_USAGE_OPTION = b',"stream_options":{"include_usage":true}}'
_DECIDING_KEYS = (b'"model"', b'"max_tokens"', b'"max_completion_tokens"')


def _names_twice(body: bytes) -> bool:
    """Whether a key the gateway decides on may appear twice (a string value equal to the key
    name also counts; that only costs a re-encode)."""
    return any(body.count(key) > 1 for key in _DECIDING_KEYS)


def upstream_body(call: ChatCall) -> bytes:
    """The body to send: the client's, with the upstream model and stream usage where needed.

    A body naming ``model`` or a token limit twice is re-encoded as the gateway read it (the last
    one wins): an upstream that takes the first could otherwise serve a model this tenant may not
    use, or spend past the limit its reservation was made for.
    """
    head = call.head
    wants_usage_option = bool(head.stream) and not head.include_usage
    ambiguous = _names_twice(call.body)
    if not call.renames_model and not wants_usage_option and not ambiguous:
        return call.body
    if not call.renames_model and not ambiguous and head.stream_options is msgspec.UNSET:
        return call.body.rstrip()[:-1] + _USAGE_OPTION
    try:
        body: dict[str, Any] = msgspec.json.decode(call.body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the request body cannot be forwarded: {exc}") from None
    body["model"] = call.upstream_model
    if wants_usage_option:
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return msgspec.json.encode(body)


class OpenAIProvider:
    """Calls ``{base_url}/chat/completions`` on an OpenAI-compatible server."""

    def __init__(self, config: ProviderConfig) -> None:
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if config.api_key is not None and config.api_key.reveal():  # "" (an unset ${VAR:-}) sends none
            headers["authorization"] = f"Bearer {config.api_key.reveal()}"
        self._pool = make_pool(config, headers)

    async def complete(self, call: ChatCall) -> Completion:
        response = await send_ok(self._pool, "/chat/completions", upstream_body(call), call.headers)
        try:
            body = await response.read(MAX_RESPONSE_BYTES)
        finally:
            await response.aclose()
        try:
            head = _decode_completion(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise UpstreamError("the upstream answered with an unusable completion") from exc
        return Completion(body=body, usage=head.usage)

    async def stream(self, call: ChatCall) -> OpenAIChunkStream:
        headers = {**call.headers, "accept": "text/event-stream"}
        response = await send_ok(self._pool, "/chat/completions", upstream_body(call), headers)
        return OpenAIChunkStream(response, call.head.include_usage)

    async def aclose(self) -> None:
        await self._pool.aclose()


class OpenAIChunkStream(SSEChunkStream):
    """Relays an upstream SSE stream as it arrives, noting usage and dropping the usage chunk if unasked."""

    missing_end = "the upstream stream ended without [DONE]"

    def __init__(self, response: UpstreamResponse, include_usage: bool) -> None:
        super().__init__(response)
        self._include_usage = include_usage

    def convert(self, data: bytes) -> list[bytes]:
        """The chunk itself, or nothing for the end marker and for a usage chunk the client did
        not ask for; notes the usage, raises on an error chunk."""
        if data == b"[DONE]":
            self.ended = True
            return []
        try:
            head = _decode_chunk(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise UpstreamError("the upstream sent an unusable stream chunk") from exc
        if head.error is not None:
            raise UpstreamError("the upstream reported an error mid-stream")
        if head.usage is not None:
            self.usage = head.usage
            if not head.choices and not self._include_usage:
                return []
        return [data]
