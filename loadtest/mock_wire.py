"""The two wire dialects the mock upstream speaks: OpenAI Chat Completions and Anthropic Messages.

Each dialect turns a request body into a :class:`Reply` (a whole body, or the framed SSE events of
a stream) and renders its own error bodies; the fault modes in :mod:`loadtest.mock_faults` then
work on either without knowing which one it is. Replies come from :mod:`providers.mock`, so the
mock server and the in-process mock provider answer alike (``n`` words = ``n`` completion tokens).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

# ``providers`` first: importing ``policies.tokens`` before it runs into an import cycle
# (policies.tokens -> providers/__init__ -> providers.mock -> policies.tokens).
from providers.base import ChatHead
from providers.chunks import ChunkBuilder
from providers.mock import completion_body, reply_words, usage_for

# isort: split
from policies.tokens import REPLY_PRIMING_TOKENS, TOKENS_PER_MESSAGE, estimate_text_tokens

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
DecodeErrors = (msgspec.DecodeError, msgspec.ValidationError)

MODELS_BODY = _encode(
    {"object": "list", "data": [{"id": "mock", "object": "model", "created": 0, "owned_by": "modelgate"}]}
)


@dataclass(frozen=True, slots=True)
class Reply:
    """What to answer one request with: ``body`` for a plain reply, ``events`` for a stream;
    ``usage`` is (prompt, completion) tokens, as the reply reports them."""

    stream: bool
    body: bytes = b""
    events: tuple[bytes, ...] = ()
    usage: tuple[int, int] = (0, 0)


class Dialect(Protocol):
    """One upstream API shape."""

    name: str

    def reply(self, body: bytes, words: int) -> Reply:
        """The reply to a request body; raises ``msgspec`` decode or validation errors."""
        ...

    def error_body(self, status: int, message: str) -> bytes: ...


_OPENAI_ERRORS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "permission_denied"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}


class OpenAIDialect:
    """``POST /v1/chat/completions``."""

    name = "chat"

    def reply(self, body: bytes, words: int) -> Reply:
        head = msgspec.json.decode(body, type=ChatHead)
        text = reply_words(head, default=words)
        usage = usage_for(head, text)
        counts = (usage.prompt_tokens, usage.completion_tokens)
        if not head.stream:
            return Reply(False, body=completion_body(head.model, text, usage), usage=counts)
        chunks = ChunkBuilder(head.model).all(text, usage, head.include_usage)
        return Reply(True, events=(*(b"data: " + c + b"\n\n" for c in chunks), DONE), usage=counts)

    def error_body(self, status: int, message: str) -> bytes:
        kind, code = _OPENAI_ERRORS.get(status, ("server_error", "upstream_error"))
        return _encode({"error": {"message": message, "type": kind, "param": None, "code": code}})


class _Block(msgspec.Struct):
    type: str = "text"
    text: str = ""


class _AnthropicMessage(msgspec.Struct):
    role: str
    content: str | list[_Block] = ""


class AnthropicHead(msgspec.Struct):
    """The few fields of a Messages API request the mock reads; the rest is ignored."""

    model: str
    messages: list[_AnthropicMessage]
    max_tokens: int | None = None
    stream: bool | None = False


def _block_text(blocks: list[_Block]) -> str:
    return "".join(b.text for b in blocks)


def anthropic_input_tokens(messages: list[_AnthropicMessage]) -> int:
    """The gateway's usual estimate: text tokens, plus framing per message and reply priming."""
    texts = [m.content if isinstance(m.content, str) else _block_text(m.content) for m in messages]
    return estimate_text_tokens("".join(texts)) + TOKENS_PER_MESSAGE * len(messages) + REPLY_PRIMING_TOKENS


_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **data}) + b"\n\n"


def _text_delta(text: str) -> dict[str, str]:
    return {"type": "text_delta", "text": text}


def _anthropic_events(message: dict[str, Any], words: list[str]) -> tuple[bytes, ...]:
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    stop = {"stop_reason": "end_turn", "stop_sequence": None}
    return (
        _event("message_start", {"message": start}),
        _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        _event("ping", {}),
        *(_event("content_block_delta", {"index": 0, "delta": _text_delta(w)}) for w in words),
        _event("content_block_stop", {"index": 0}),
        _event("message_delta", {"delta": stop, "usage": {"output_tokens": usage["output_tokens"]}}),
        _event("message_stop", {}),
    )


class AnthropicDialect:
    """``POST /v1/messages``."""

    name = "messages"

    def reply(self, body: bytes, words: int) -> Reply:
        head = msgspec.json.decode(body, type=AnthropicHead)
        text = reply_words(ChatHead(model=head.model, messages=[], max_tokens=head.max_tokens), default=words)
        counts = (anthropic_input_tokens(head.messages), len(text))
        message = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": head.model,
            "content": [{"type": "text", "text": "".join(text)}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": counts[0], "output_tokens": counts[1]},
        }
        if head.stream:
            return Reply(True, events=_anthropic_events(message, text), usage=counts)
        return Reply(False, body=_encode(message), usage=counts)

    def error_body(self, status: int, message: str) -> bytes:
        kind = _ANTHROPIC_ERRORS.get(status, "api_error")
        return _encode({"type": "error", "error": {"type": kind, "message": message}})


OPENAI = OpenAIDialect()
ANTHROPIC = AnthropicDialect()
