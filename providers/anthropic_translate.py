"""Pure translation between OpenAI Chat Completions and Anthropic's Messages API.

The gateway speaks OpenAI to its clients; Anthropic speaks its own dialect. The request, whole-reply
and error-body mappings live here, apart from the HTTP adapter in :mod:`providers.anthropic`
(which also turns stream events into chunks), so they can be read and tested without a network.
A request the gateway cannot express for Anthropic is the client's fault (``InvalidRequest``); a
reply it cannot read is the upstream's (``UpstreamError``).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import msgspec

from gateway.errors import ErrorBody, ErrorEnvelope, InvalidRequest, UpstreamError
from providers.base import ChatCall, Completion, Usage
from providers.chunks import usage_dict

DEFAULT_MAX_TOKENS = 4096
Block = dict[str, Any]

_encode = msgspec.json.encode
_SYSTEM_ROLES = frozenset({"system", "developer"})
_TOOL_CHOICES = {"auto": "auto", "none": "none", "required": "any"}
_EMPTY_SCHEMA: Block = {"type": "object", "properties": {}}
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_ERROR_TYPE = re.compile(r"^[a-z_]{1,64}$")


def error_type(kind: str) -> str | None:
    """Anthropic's error type if it looks like one, safe to put in a message; else None."""
    return kind if _ERROR_TYPE.match(kind) else None


def _present(raw: msgspec.Raw) -> bool:
    """Whether a raw JSON field held a value (``msgspec.Raw | None`` cannot be decoded)."""
    return len(raw) > 0 and bytes(raw) != b"null"


# --- the OpenAI request, as far as the translation reads it -------------------------------------


class _ImageUrl(msgspec.Struct):
    url: str


class _Part(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: _ImageUrl | None = None


class _Function(msgspec.Struct):
    name: str
    arguments: str = ""


class _ToolCall(msgspec.Struct):
    id: str
    function: _Function


class _Message(msgspec.Struct):
    role: str
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty when absent


class _Tool(msgspec.Struct):
    type: str
    function: _FunctionDef | None = None


class _ChoiceFunction(msgspec.Struct):
    name: str


class _NamedChoice(msgspec.Struct):
    function: _ChoiceFunction


class _Request(msgspec.Struct):
    messages: list[_Message]
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | _NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


_decode_request = msgspec.json.Decoder(_Request).decode


def anthropic_request(call: ChatCall, *, stream: bool) -> bytes:
    """The Messages API body for ``call``; fields Anthropic has no equivalent for are dropped."""
    try:
        request = _decode_request(call.body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the request cannot be translated for this model: {exc}") from exc
    system, messages = _conversation(request.messages)
    limit = call.head.output_limit
    body: Block = {
        "model": call.upstream_model,
        "max_tokens": DEFAULT_MAX_TOKENS if limit is None else limit,
        "messages": messages,
    }
    if system:
        body["system"] = system
    body.update(_sampling(request))
    body.update(_tool_fields(request))
    if request.user:
        body["metadata"] = {"user_id": request.user}
    if stream:
        body["stream"] = True
    return _encode(body)


def _sampling(request: _Request) -> Block:
    fields: Block = {}
    if request.stop is not None:
        fields["stop_sequences"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.temperature is not None:
        fields["temperature"] = request.temperature
    if request.top_p is not None:
        fields["top_p"] = request.top_p
    return fields


def _conversation(messages: list[_Message]) -> tuple[str, list[Block]]:
    """The joined system prompt and the turns, same-role neighbours merged to keep alternation."""
    system: list[str] = []
    turns: list[Block] = []
    for message in messages:
        if message.role in _SYSTEM_ROLES:
            system.append(_plain_text(message.content))
            continue
        role, blocks = _turn(message)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(text for text in system if text), turns


def _turn(message: _Message) -> tuple[str, list[Block]]:
    if message.role == "user":
        return "user", _content_blocks(message.content)
    if message.role == "assistant":
        tool_uses = [_tool_use(call) for call in message.tool_calls or []]
        return "assistant", _content_blocks(message.content) + tool_uses
    if message.role == "tool":
        return "user", [_tool_result(message)]
    raise InvalidRequest(
        f"message role {message.role[:32]!r} is not supported by this model", param="messages"
    )


def _plain_text(content: str | list[_Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" for part in content):
        raise InvalidRequest("system messages may contain only text", param="messages")
    return "".join(part.text or "" for part in content)


def _content_blocks(content: str | list[_Part] | None) -> list[Block]:
    if content is None or isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return [_part_block(part) for part in content if part.type != "text" or part.text]


def _part_block(part: _Part) -> Block:
    if part.type == "text":
        return {"type": "text", "text": part.text}
    if part.type == "image_url" and part.image_url is not None:
        return _image_block(part.image_url.url)
    raise InvalidRequest(f"content parts of type {part.type[:32]!r} are not supported", param="messages")


def _image_block(url: str) -> Block:
    if url.startswith(("https://", "http://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    header, comma, data = url.partition(",")
    params = header.removeprefix("data:").split(";")
    if not url.startswith("data:") or not comma or params[-1] != "base64" or not params[0]:
        raise InvalidRequest("images must be http(s) URLs or base64 data URLs", param="messages")
    return {"type": "image", "source": {"type": "base64", "media_type": params[0], "data": data}}


def _tool_use(call: _ToolCall) -> Block:
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": _arguments(call)}


def _arguments(call: _ToolCall) -> dict[str, Any]:
    if not call.function.arguments.strip():
        return {}
    try:
        return msgspec.json.decode(call.function.arguments, type=dict[str, Any])
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequest(
            f"the arguments of tool call {call.id[:64]!r} are not a JSON object", param="messages"
        ) from exc


def _tool_result(message: _Message) -> Block:
    if not message.tool_call_id:
        raise InvalidRequest("a tool message needs a tool_call_id", param="messages")
    block: Block = {"type": "tool_result", "tool_use_id": message.tool_call_id}
    content = message.content if isinstance(message.content, str) else _content_blocks(message.content)
    if content:
        block["content"] = content
    return block


def _tool_fields(request: _Request) -> Block:
    if not request.tools:
        return {}
    fields: Block = {"tools": [_tool(tool) for tool in request.tools]}
    choice = _tool_choice(request.tool_choice)
    if request.parallel_tool_calls is False and (choice is None or choice["type"] != "none"):
        choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
    if choice is not None:
        fields["tool_choice"] = choice
    return fields


def _tool(tool: _Tool) -> Block:
    if tool.type != "function" or tool.function is None:
        raise InvalidRequest(f"tools of type {tool.type[:32]!r} are not supported", param="tools")
    function = tool.function
    schema = function.parameters if _present(function.parameters) else _EMPTY_SCHEMA
    block: Block = {"name": function.name, "input_schema": schema}
    if function.description:
        block["description"] = function.description
    return block


def _tool_choice(choice: str | _NamedChoice | None) -> Block | None:
    if choice is None:
        return None
    if isinstance(choice, _NamedChoice):
        return {"type": "tool", "name": choice.function.name}
    if choice not in _TOOL_CHOICES:
        raise InvalidRequest(f"tool_choice {choice[:32]!r} is not supported", param="tool_choice")
    return {"type": _TOOL_CHOICES[choice]}


# --- Anthropic replies ---------------------------------------------------------------------------


class AnthropicUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None

    @property
    def prompt_tokens(self) -> int:
        parts = (self.input_tokens, self.cache_creation_input_tokens, self.cache_read_input_tokens)
        return sum(part or 0 for part in parts)


class ContentBlock(msgspec.Struct):
    type: str
    text: str | None = None
    id: str = ""
    name: str = ""
    input: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty when absent


class AnthropicMessage(msgspec.Struct):
    id: str = ""
    model: str = ""
    content: list[ContentBlock] = msgspec.field(default_factory=list)
    stop_reason: str | None = None
    usage: AnthropicUsage = msgspec.field(default_factory=AnthropicUsage)


class AnthropicError(msgspec.Struct):
    type: str = ""
    message: str = ""


class _ErrorReply(msgspec.Struct):
    error: AnthropicError


_decode_reply = msgspec.json.Decoder(AnthropicMessage).decode
_decode_error = msgspec.json.Decoder(_ErrorReply).decode


def finish_reason(stop_reason: str | None) -> str:
    """The OpenAI ``finish_reason`` for an Anthropic ``stop_reason``."""
    return _FINISH_REASONS.get(stop_reason or "", "stop")


def openai_completion(body: bytes, model: str) -> Completion:
    """A ``chat.completion`` for an Anthropic message body; ``model`` names it if the body does not."""
    try:
        reply = _decode_reply(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise UpstreamError("the upstream answered with an unusable message") from exc
    texts = [block.text for block in reply.content if block.type == "text" and block.text]
    calls = [_openai_tool_call(block) for block in reply.content if block.type == "tool_use"]
    message: Block = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    usage = Usage(reply.usage.prompt_tokens, reply.usage.output_tokens or 0)
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason(reply.stop_reason),
    }
    completion = {
        "id": reply.id or f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model or model,
        "choices": [choice],
        "usage": usage_dict(usage),
    }
    return Completion(body=_encode(completion), usage=usage)


def _openai_tool_call(block: ContentBlock) -> Block:
    arguments = bytes(block.input).decode() if _present(block.input) else "{}"
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def openai_error_body(body: bytes, status: int) -> bytes:
    """An OpenAI error body for an Anthropic one; ``code`` is Anthropic's error type."""
    try:
        error = _decode_error(body).error
    except (msgspec.DecodeError, RecursionError):
        error = AnthropicError()
    code = error_type(error.type) or "upstream_rejected"
    message = error.message or f"the upstream rejected the request with status {status}"
    return _encode(ErrorEnvelope(ErrorBody(message, "invalid_request_error", None, code)))
