"""The Anthropic adapter: request translation, replies, streams and errors, against a scripted upstream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from gateway.config import ProviderConfig
from gateway.errors import (
    InvalidRequest,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
    render,
)
from gateway.secret import Secret
from providers.anthropic import AnthropicProvider
from providers.anthropic_translate import anthropic_request
from providers.base import ChatCall, ChatHead, Usage
from tests.scripted_upstream import ScriptedUpstream, Stream

SSE_HEADERS = {"content-type": "text/event-stream"}
API_KEY = "sk-ant-test-0123456789-SECRET"
MODEL = "claude-test-1"


def make_call(body: dict[str, Any], upstream_model: str = MODEL) -> ChatCall:
    raw = json.dumps({"model": "smart", **body}).encode()
    return ChatCall(body=raw, head=msgspec.json.decode(raw, type=ChatHead), upstream_model=upstream_model)


def translate(body: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(anthropic_request(make_call(body), stream=stream))
    return result


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def message_start(input_tokens: int = 11) -> dict[str, Any]:
    message: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1},
    }
    return {"type": "message_start", "message": message}


def text_block(index: int, *deltas: str) -> list[dict[str, Any]]:
    start = {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
    body = [
        {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": d}}
        for d in deltas
    ]
    return [start, *body, {"type": "content_block_stop", "index": index}]


def tool_block(index: int, tool_id: str, name: str, *fragments: str) -> list[dict[str, Any]]:
    block = {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
    start = {"type": "content_block_start", "index": index, "content_block": block}
    body = [
        {
            "type": "content_block_delta",
            "index": index,
            "delta": {"type": "input_json_delta", "partial_json": f},
        }
        for f in fragments
    ]
    return [start, *body, {"type": "content_block_stop", "index": index}]


def message_end(stop_reason: str = "end_turn", output_tokens: int = 7) -> list[dict[str, Any]]:
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
    }
    return [delta, {"type": "message_stop"}]


def reply(content: list[dict[str, Any]], stop_reason: str = "end_turn", **usage: int) -> dict[str, Any]:
    return {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 5, **usage},
    }


@pytest.fixture
async def provider(upstream: ScriptedUpstream) -> AsyncIterator[AnthropicProvider]:
    config = ProviderConfig(
        name="claude",
        type="anthropic",
        base_url=upstream.url + "/v1",
        api_key=Secret(API_KEY),
        read_timeout_s=0.5,
        connect_timeout_s=0.5,
    )
    adapter = AnthropicProvider(config)
    yield adapter
    await adapter.aclose()
    # every request of every test went to the one endpoint
    assert {(r.method, r.path) for r in upstream.requests} <= {("POST", "/v1/messages")}


async def collect(provider: AnthropicProvider, call: ChatCall) -> tuple[list[dict[str, Any]], Usage | None]:
    stream = await provider.stream(call)
    try:
        chunks = [json.loads(chunk) async for chunk in stream]
    finally:
        await stream.aclose()
    return chunks, stream.usage


def deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


# --- request translation -------------------------------------------------------------------------


def test_system_messages_are_hoisted_and_defaults_filled() -> None:
    body = translate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use metric units."}]},
                {"role": "user", "content": "Hi"},
            ],
            "frequency_penalty": 0.5,
            "n": 1,
            "response_format": {"type": "text"},
        }
    )
    assert body == {
        "model": MODEL,
        "max_tokens": 4096,
        "system": "Be brief.\n\nUse metric units.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }


def test_sampling_fields_limits_and_user() -> None:
    body = translate(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 100,
            "max_completion_tokens": 50,
            "stop": "END",
            "temperature": 0.2,
            "top_p": 0.9,
            "user": "agent-7",
            "stream": True,
        },
        stream=True,
    )
    assert body["max_tokens"] == 50
    assert body["stop_sequences"] == ["END"]
    assert body["temperature"] == 0.2
    assert body["top_p"] == 0.9
    assert body["metadata"] == {"user_id": "agent-7"}
    assert body["stream"] is True


def test_max_tokens_and_stop_list() -> None:
    body = translate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 77, "stop": ["a", "b"]})
    assert body["max_tokens"] == 77
    assert body["stop_sequences"] == ["a", "b"]
    assert "stream" not in body


def test_tool_calls_and_results_become_blocks_in_alternating_turns() -> None:
    tool_calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "clock", "arguments": ""}},
    ]
    body = translate(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "user", "content": "And time?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": tool_calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "4C"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
                {"role": "user", "content": "Thanks"},
            ]
        }
    )
    assert body["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "And time?"}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "call_2", "name": "clock", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "4C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": [{"type": "text", "text": "12:00"}],
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]


def test_tools_translate_to_input_schemas() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = translate(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "weather", "description": "Now", "parameters": schema},
                },
                {"type": "function", "function": {"name": "ping"}},
            ],
        }
    )
    assert body["tools"] == [
        {"name": "weather", "description": "Now", "input_schema": schema},
        {"name": "ping", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert "tool_choice" not in body


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("auto", None, {"type": "auto"}),
        ("none", None, {"type": "none"}),
        ("required", None, {"type": "any"}),
        ({"type": "function", "function": {"name": "ping"}}, None, {"type": "tool", "name": "ping"}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
    ],
)
def test_tool_choice(choice: Any, parallel: bool | None, expected: dict[str, Any]) -> None:
    request: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "ping"}}],
    }
    if choice is not None:
        request["tool_choice"] = choice
    if parallel is not None:
        request["parallel_tool_calls"] = parallel
    assert translate(request)["tool_choice"] == expected


def test_images_become_base64_or_url_sources() -> None:
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg", "detail": "high"}},
    ]
    body = translate({"messages": [{"role": "user", "content": content}]})
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "Compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.jpg"}},
    ]


@pytest.mark.parametrize(
    "message",
    [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
        },
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,raw"}}]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
        {"role": "tool", "content": "no id"},
        {"role": "function", "name": "f", "content": "legacy"},
    ],
)
def test_untranslatable_requests_are_the_clients_fault(message: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        translate({"messages": [{"role": "user", "content": "Hi"}, message]})
    assert caught.value.status == 400


# --- whole replies -------------------------------------------------------------------------------


async def test_text_reply_and_request_shape(upstream: ScriptedUpstream, provider: AnthropicProvider) -> None:
    upstream.respond(
        200,
        json=reply(
            [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
            cache_creation_input_tokens=3,
            cache_read_input_tokens=100,
        ),
    )
    completion = await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))

    sent = upstream.last
    assert (sent.method, sent.path) == ("POST", "/v1/messages")
    assert sent.headers == {
        "host": f"127.0.0.1:{upstream.port}",
        "content-type": "application/json",
        "accept-encoding": "identity",
        "anthropic-version": "2023-06-01",
        "x-api-key": API_KEY,
        "content-length": str(len(sent.body)),
    }
    assert sent.json()["model"] == MODEL
    assert "stream" not in sent.json()

    body = json.loads(completion.body)
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello there"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 123, "completion_tokens": 5, "total_tokens": 128}
    assert completion.usage == Usage(prompt_tokens=123, completion_tokens=5)


async def test_tool_use_reply(upstream: ScriptedUpstream, provider: AnthropicProvider) -> None:
    content = [
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo", "days": 2}},
        {"type": "tool_use", "id": "toolu_2", "name": "clock", "input": {}},
    ]
    upstream.respond(200, json=reply(content, stop_reason="tool_use"))
    completion = await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))

    choice = json.loads(completion.body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["id"], c["type"], c["function"]["name"]) for c in calls] == [
        ("toolu_1", "function", "weather"),
        ("toolu_2", "function", "clock"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert json.loads(calls[1]["function"]["arguments"]) == {}


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [
        ("max_tokens", "length"),
        ("stop_sequence", "stop"),
        ("end_turn", "stop"),
        ("refusal", "content_filter"),
    ],
)
async def test_stop_reasons(
    upstream: ScriptedUpstream, provider: AnthropicProvider, stop_reason: str, finish: str
) -> None:
    upstream.respond(200, json=reply([{"type": "text", "text": "x"}], stop_reason))
    completion = await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    assert json.loads(completion.body)["choices"][0]["finish_reason"] == finish


@pytest.mark.parametrize("body", [b"<html>oops</html>", b'{"content": "not a list"}', b""])
async def test_unusable_reply_is_an_upstream_error(
    upstream: ScriptedUpstream, provider: AnthropicProvider, body: bytes
) -> None:
    upstream.respond(200, body=body)
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    assert caught.value.status == 502
    assert not caught.value.retryable


# --- errors --------------------------------------------------------------------------------------


async def test_client_error_is_passed_back_in_openai_shape(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too big"}}
    upstream.respond(400, json=error)
    with pytest.raises(UpstreamRejected) as caught:
        await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    status, body, _ = render(caught.value)
    assert status == 400
    assert json.loads(body) == {
        "error": {
            "message": "max_tokens: too big",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request_error",
        }
    }


async def test_unreadable_client_error_still_gets_openai_shape(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    upstream.respond(404, body=b"not found")
    with pytest.raises(UpstreamRejected) as caught:
        await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    error = json.loads(caught.value.body())["error"]
    assert caught.value.upstream_status == 404
    assert error["code"] == "upstream_rejected"
    assert "404" in error["message"]


@pytest.mark.parametrize("status", [500, 529])
async def test_server_errors_are_retryable(
    upstream: ScriptedUpstream, provider: AnthropicProvider, status: int
) -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    upstream.respond(status, json=error, headers={"retry-after": "2"})
    with pytest.raises(UpstreamUnavailable) as caught:
        await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert caught.value.retry_after_s == 2.0


async def test_stream_open_failure_is_raised_by_stream(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    upstream.respond(529, json={"type": "error", "error": {"type": "overloaded_error"}})
    with pytest.raises(UpstreamUnavailable):
        await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}], "stream": True}))


async def test_bad_credentials_never_leak_the_key(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    error = {
        "type": "error",
        "error": {"type": "authentication_error", "message": f"invalid x-api-key {API_KEY}"},
    }
    upstream.respond(401, json=error)
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    failure = caught.value
    assert type(failure) is UpstreamError
    assert failure.status == 502
    assert not failure.retryable
    for text in (str(failure), repr(failure), failure.message, failure.body().decode()):
        assert API_KEY not in text


# --- streams -------------------------------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [True, False])
async def test_text_stream(
    upstream: ScriptedUpstream, provider: AnthropicProvider, include_usage: bool
) -> None:
    events = [message_start(), {"type": "ping"}, *text_block(0, "Hel", "lo"), *message_end("end_turn", 9)]
    # Anything after message_stop must not be read, so trailing garbage is harmless.
    upstream.respond(200, body=sse(*events) + b"data: {garbage\n\n", headers=SSE_HEADERS)
    request: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    if include_usage:
        request["stream_options"] = {"include_usage": True}

    chunks, usage = await collect(provider, make_call(request))

    assert upstream.last.json()["stream"] is True
    assert upstream.last.headers["accept"] == "text/event-stream"
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert deltas(chunks) == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, None, "stop"]
    usage_chunks = [c for c in chunks if not c["choices"]]
    if include_usage:
        assert chunks[-1] is usage_chunks[0]
        assert usage_chunks[0]["usage"] == {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20}
    else:
        assert usage_chunks == []
    assert usage == Usage(prompt_tokens=11, completion_tokens=9)


async def test_tool_call_stream(upstream: ScriptedUpstream, provider: AnthropicProvider) -> None:
    events = [
        message_start(),
        *text_block(0, "Let me check."),
        *tool_block(1, "toolu_1", "weather", '{"city":', ' "Oslo"}'),
        *tool_block(2, "toolu_2", "clock"),
        *message_end("tool_use", 30),
    ]
    upstream.stream([sse(*events)])
    chunks, usage = await collect(provider, make_call({"messages": [{"role": "user", "content": "Hi"}]}))

    tool_deltas = [d["tool_calls"][0] for d in deltas(chunks) if "tool_calls" in d]
    assert tool_deltas == [
        {"index": 0, "id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city":'}},
        {"index": 0, "function": {"arguments": ' "Oslo"}'}},
        {"index": 1, "id": "toolu_2", "type": "function", "function": {"name": "clock", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert usage == Usage(prompt_tokens=11, completion_tokens=30)


async def test_stream_relays_each_event_without_buffering(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    first_chunk_seen = asyncio.Event()

    # the second part is sent only once the first has come out as chunks (or the server gives up)
    upstream.stream(
        [
            sse(message_start(), *text_block(0, "one")[:2]),
            first_chunk_seen,
            sse(*text_block(0, "two")[1:], *message_end()),
        ]
    )
    stream = await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    received: list[dict[str, Any]] = []
    try:
        async for chunk in stream:
            received.append(json.loads(chunk))
            if len(received) == 2:
                first_chunk_seen.set()
    finally:
        await stream.aclose()
    assert deltas(received)[:3] == [
        {"role": "assistant", "content": ""},
        {"content": "one"},
        {"content": "two"},
    ]


async def test_error_event_mid_stream(upstream: ScriptedUpstream, provider: AnthropicProvider) -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    upstream.stream([sse(message_start(), *text_block(0, "par")[:2], error)])
    stream = await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    received: list[bytes] = []
    with pytest.raises(UpstreamError) as caught:
        async for chunk in stream:
            received.append(chunk)
    await stream.aclose()
    assert len(received) == 2
    assert "overloaded_error" in caught.value.message
    assert caught.value.status == 502
    assert caught.value.retryable  # overloaded is transient, as its 529 would be


async def test_stream_cut_before_message_stop(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    events = [message_start(), *text_block(0, "par"), message_end()[0]]
    upstream.stream([sse(*events)])
    stream = await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    with pytest.raises(UpstreamError) as caught:
        async for _ in stream:
            pass
    await stream.aclose()
    assert type(caught.value) is UpstreamError
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert stream.usage == Usage(prompt_tokens=11, completion_tokens=7)


async def test_garbage_stream_event(upstream: ScriptedUpstream, provider: AnthropicProvider) -> None:
    upstream.stream([sse(message_start()) + b"data: {not json\n\n"])
    stream = await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    with pytest.raises(UpstreamError) as caught:
        async for _ in stream:
            pass
    await stream.aclose()
    assert not caught.value.retryable


async def test_stream_stalled_mid_way_times_out(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    upstream.stream([sse(message_start(), *text_block(0, "par")[:2])], end="stall")
    stream = await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    received: list[bytes] = []
    with pytest.raises(UpstreamTimeout) as caught:
        async for chunk in stream:
            received.append(chunk)
    await stream.aclose()
    assert len(received) == 2
    assert caught.value.retryable
    await upstream.wait_closed()  # a connection whose body never ended is not kept


async def test_stream_closed_mid_way_is_a_retryable_error(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    upstream.stream([sse(message_start(), *text_block(0, "par")[:2])], end="close")
    stream = await provider.stream(make_call({"messages": [{"role": "user", "content": "Hi"}]}))
    with pytest.raises(UpstreamError) as caught:
        async for _ in stream:
            pass
    await stream.aclose()
    assert caught.value.retryable
    assert caught.value.breaker_failure


async def test_abandoned_stream_is_closed_and_a_finished_one_reused(
    upstream: ScriptedUpstream, provider: AnthropicProvider
) -> None:
    events = [message_start(), *text_block(0, "hi"), *message_end()]
    upstream.script(
        Stream([sse(*events)]), Stream([sse(*events)]), Stream([sse(message_start())], end="stall")
    )
    call = make_call({"messages": [{"role": "user", "content": "Hi"}]})
    for _ in range(2):
        chunks, _usage = await collect(provider, call)
        assert deltas(chunks)[1] == {"content": "hi"}
    abandoned = await provider.stream(call)
    await abandoned.aclose()
    await upstream.wait_closed()
    assert [r.connection for r in upstream.requests] == [1, 1, 1]
