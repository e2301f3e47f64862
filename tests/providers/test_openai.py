"""The OpenAI-compatible adapter and the shared HTTP edge, against a scripted upstream on 127.0.0.1.

Covers the body sent upstream (byte for byte, rename, stream usage splice), headers, non-stream
replies, the status and transport error translation, SSE streaming and ``parse_retry_after``.
Transport failures are real ones: a refused port, a full listen backlog, a server that hangs,
stalls, never reads or closes mid-body; timeouts are a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest

import providers.http
import providers.openai
from gateway.config import ProviderConfig
from gateway.errors import (
    GatewayError,
    UpstreamError,
    UpstreamFailure,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
    render,
)
from gateway.secret import Secret
from providers.base import ChatCall, ChatHead, Usage
from providers.http import parse_retry_after
from providers.openai import OpenAIProvider, upstream_body
from tests.scripted_upstream import FullBacklog, Hang, Reply, ScriptedUpstream, Stream, unused_port

TIMEOUT_S = 0.3
API_KEY = "sk-test-0123456789-SECRET-abcdef"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# Unknown fields at every level, escapes, raw non-ASCII, a float spelled oddly, a huge integer and
# irregular whitespace: none of it may change when the body goes upstream as it came.
ODD_BODY = (
    '{ "model" : "gpt-4o-mini",\n  "messages": [{"role": "user", "content": "h\\u00e9llo \\ud83d\\ude00 '
    'caf\u00e9 \u2028 \U0001f600 \\"q\\" \\/", "x_msg": {"deep": [1, 2.50, null]}}],\n'
    '  "temperature": 1.0e0, "seed": 123456789012345678901234567890,\n'
    '  "response_format": {"type": "json_schema", "json_schema": {"strict": true, "extra": []}},\n'
    '  "vendor_ext": {"a": {"b": {"c": "\\t"}}}, "stream": false }\n'
).encode()

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46},
}


def body_of(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({**base, **fields}).encode()


def make_call(
    body: bytes, upstream_model: str | None = None, headers: dict[str, str] | None = None
) -> ChatCall:
    head = msgspec.json.decode(body, type=ChatHead)
    return ChatCall(
        body=body,
        head=head,
        upstream_model=head.model if upstream_model is None else upstream_model,
        headers=headers or {},
    )


def chunk(content: str | None = None, *, usage: dict[str, int] | None = None, empty: bool = False) -> bytes:
    choices = [] if empty else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    payload = {"id": "c1", "object": "chat.completion.chunk", "choices": choices, "usage": usage}
    return json.dumps(payload, separators=(",", ":")).encode()


USAGE_CHUNK = chunk(usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}, empty=True)
CONTENT_CHUNKS = [chunk("Hel"), chunk("lo \u00e9"), chunk("!")]


def sse(*payloads: bytes, newline: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + p + newline + newline for p in payloads)


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def config(base_url: str, **settings: Any) -> ProviderConfig:
    fields: dict[str, Any] = {
        "api_key": Secret(API_KEY),
        "read_timeout_s": TIMEOUT_S,
        "connect_timeout_s": TIMEOUT_S,
        **settings,
    }
    return ProviderConfig(name="up", type="openai", base_url=base_url, **fields)


@pytest.fixture
async def provider(upstream: ScriptedUpstream) -> AsyncIterator[OpenAIProvider]:
    adapter = OpenAIProvider(config(upstream.url + "/v1"))
    yield adapter
    await adapter.aclose()
    # every request of every test went to the one endpoint
    assert {(r.method, r.path) for r in upstream.requests} <= {("POST", "/v1/chat/completions")}


@pytest.fixture
async def one_connection(upstream: ScriptedUpstream) -> AsyncIterator[OpenAIProvider]:
    """A provider allowed one upstream connection: a response it fails to release blocks the next call."""
    adapter = OpenAIProvider(config(upstream.url + "/v1", max_connections=1))
    yield adapter
    await adapter.aclose()


async def collect(stream: Any) -> list[bytes]:
    return [data async for data in stream]


# --- the body sent upstream ----------------------------------------------------------------------


async def test_body_goes_upstream_byte_for_byte(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.respond(200, json=COMPLETION)
    await provider.complete(make_call(ODD_BODY))
    assert upstream.last.body == ODD_BODY
    assert (upstream.last.method, upstream.last.path) == ("POST", "/v1/chat/completions")
    assert upstream.last.headers["content-length"] == str(len(ODD_BODY))


async def test_stream_with_usage_asked_goes_byte_for_byte(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    body = (
        b'{"model":"m","messages":[],"stream":true,'
        b'"stream_options":{"include_usage":true,"x":1}, "z":"\\u00e9"}'
    )
    upstream.stream([sse(b"[DONE]")])
    stream = await provider.stream(make_call(body))
    assert await collect(stream) == []
    assert upstream.last.body == body


def test_upstream_body_is_the_same_object_when_nothing_changes() -> None:
    call = make_call(ODD_BODY)
    assert upstream_body(call) is call.body


@pytest.mark.parametrize("key", ["model", "max_tokens", "max_completion_tokens"])
def test_a_key_named_twice_goes_upstream_once_as_the_gateway_read_it(key: str) -> None:
    first, last = ('"gpt-4o"', '"gpt-4o-mini"') if key == "model" else ("100000", "10")
    body = f'{{"{key}": {first}, "model": "gpt-4o-mini", "messages": [], "{key}": {last}}}'.encode()
    if key == "model":
        body = b'{"model": "gpt-4o", "messages": [], "model": "gpt-4o-mini"}'
    call = make_call(body)
    sent = upstream_body(call)
    assert sent.count(f'"{key}"'.encode()) == 1
    assert json.loads(sent)[key] == json.loads(last)
    assert msgspec.json.decode(sent, type=ChatHead) == call.head


async def test_rename_reencodes_with_the_upstream_model(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.respond(200, json=COMPLETION)
    await provider.complete(make_call(ODD_BODY, upstream_model="upstream-name"))
    sent = upstream.last.json()
    original = json.loads(ODD_BODY)
    assert sent["model"] == "upstream-name"
    assert {k: v for k, v in sent.items() if k != "model"} == {
        k: v for k, v in original.items() if k != "model"
    }
    assert sent["seed"] == 123456789012345678901234567890
    assert sent["messages"][0]["content"] == original["messages"][0]["content"]
    assert "stream_options" not in sent


async def test_stream_without_options_gets_usage_spliced(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    body = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"caf\\u00e9"}],'
        b'"stream":true,"x":{}}  \n'
    )
    upstream.stream([sse(b"[DONE]")])
    await collect(await provider.stream(make_call(body)))
    sent = upstream.last.body
    parsed = json.loads(sent)
    assert parsed["stream_options"] == {"include_usage": True}
    assert parsed["stream"] is True
    assert parsed["x"] == {}
    # a splice: everything the client sent is still there, byte for byte, before the new member
    assert sent.startswith(body.rstrip()[:-1])


async def test_stream_rename_and_usage_together(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(b"[DONE]")])
    body = body_of(stream=True, temperature=0.2, unknown={"k": [1, "two"]})
    await collect(await provider.stream(make_call(body, upstream_model="gpt-4o-mini-2024")))
    sent = upstream.last.json()
    assert sent["model"] == "gpt-4o-mini-2024"
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["temperature"] == 0.2
    assert sent["unknown"] == {"k": [1, "two"]}


async def test_include_usage_false_is_turned_on_and_other_options_kept(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    body = body_of(stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True})
    upstream.stream([sse(*CONTENT_CHUNKS, USAGE_CHUNK, b"[DONE]")])
    stream = await provider.stream(make_call(body))
    # the client still did not ask, so the usage chunk it caused is not relayed
    assert await collect(stream) == CONTENT_CHUNKS
    assert stream.usage == Usage(prompt_tokens=5, completion_tokens=7)
    sent = upstream.last.json()
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["model"] == "gpt-4o-mini"


async def test_null_stream_options_is_not_duplicated(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    body = b'{"model":"m","messages":[],"stream":true,"stream_options":null}'
    upstream.stream([sse(b"[DONE]")])
    await collect(await provider.stream(make_call(body)))
    pairs = json.loads(upstream.last.body, object_pairs_hook=lambda items: items)
    keys = [key for key, _ in pairs]
    assert keys.count("stream_options") == 1
    assert dict(pairs)["stream_options"] == [("include_usage", True)]


async def test_rename_of_a_body_msgspec_cannot_hold_fails_as_a_gateway_error(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    # valid JSON that ChatHead accepts (the field is skipped) but a float cannot hold
    body = b'{"model":"m","messages":[],"logit_scale":1e400}'
    upstream.respond(200, json=COMPLETION)  # whether or not it is called
    # the adapter edge may refuse it, but only as one of the gateway's errors
    with contextlib.suppress(GatewayError):
        await provider.complete(make_call(body, upstream_model="n"))


# --- headers ---------------------------------------------------------------------------------------


async def test_authorization_carries_the_configured_key(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.respond(200, json=COMPLETION)
    body = body_of()
    await provider.complete(make_call(body, headers={"traceparent": TRACEPARENT}))
    # exactly these, each once: the pool adds only host and content-length
    assert upstream.last.headers == {
        "host": f"127.0.0.1:{upstream.port}",
        "content-type": "application/json",
        "accept-encoding": "identity",
        "authorization": f"Bearer {API_KEY}",
        "traceparent": TRACEPARENT,
        "content-length": str(len(body)),
    }
    assert len(upstream.last.header_list) == len(upstream.last.headers)


async def test_only_call_headers_are_added(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(b"[DONE]")])
    await collect(await provider.stream(make_call(body_of(stream=True))))
    headers = upstream.last.headers
    assert set(headers) == {
        "host",
        "content-length",
        "authorization",
        "content-type",
        "accept-encoding",
        "accept",
    }
    assert headers["accept"] == "text/event-stream"
    assert headers["accept-encoding"] == "identity"
    assert "x-request-id" not in headers
    assert "x-task-id" not in headers


@pytest.mark.parametrize("key", [None, ""], ids=["no-key", "empty-key"])
async def test_provider_without_key_sends_no_authorization(
    upstream: ScriptedUpstream, key: str | None
) -> None:
    upstream.respond(200, json=COMPLETION)
    api_key = None if key is None else Secret(key)
    adapter = OpenAIProvider(config(upstream.url + "/v1/", api_key=api_key))
    try:
        await adapter.complete(make_call(body_of()))
    finally:
        await adapter.aclose()
    assert "authorization" not in upstream.last.headers
    assert upstream.last.path == "/v1/chat/completions"


# --- non-stream replies ----------------------------------------------------------------------------


async def test_completion_body_and_usage(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    raw = json.dumps(COMPLETION, indent=1).encode()
    upstream.respond(200, body=raw, headers={"content-type": "application/json"})
    completion = await provider.complete(make_call(body_of()))
    assert completion.body == raw
    assert completion.usage == Usage(prompt_tokens=12, completion_tokens=34)


@pytest.mark.parametrize("framing", ["chunked", "close"])
async def test_completion_body_in_any_framing(
    upstream: ScriptedUpstream, provider: OpenAIProvider, framing: str
) -> None:
    raw = json.dumps(COMPLETION).encode()
    upstream.script(Reply(200, body=raw, framing="chunked" if framing == "chunked" else "close"))
    assert (await provider.complete(make_call(body_of()))).body == raw


async def test_completion_without_usage(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    reply = {k: v for k, v in COMPLETION.items() if k != "usage"}
    upstream.respond(200, json=reply)
    completion = await provider.complete(make_call(body_of()))
    assert completion.usage is None
    assert json.loads(completion.body) == reply


@pytest.mark.parametrize(
    "content",
    [b"<html>502 Bad Gateway</html>", b"", b'{"object": "chat.completion"}', b'{"choices": "nope"}'],
    ids=["html", "empty", "no-choices", "choices-not-list"],
)
async def test_unusable_completion_is_an_upstream_error(
    upstream: ScriptedUpstream, provider: OpenAIProvider, content: bytes
) -> None:
    upstream.respond(200, body=content)
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.status == 502
    assert caught.value.code == "upstream_error"
    assert render(caught.value)[0] == 502


async def test_oversized_completion_is_an_upstream_error(
    upstream: ScriptedUpstream, provider: OpenAIProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = json.dumps(COMPLETION).encode()
    headers = {"content-type": "application/json"}
    # the second body never ends: only the adapter giving up on it can close its connection
    upstream.script(
        Stream(split(raw, 50), headers=headers), Stream(split(raw, 50), headers=headers, end="stall")
    )

    monkeypatch.setattr(providers.openai, "MAX_RESPONSE_BYTES", len(raw))
    assert (await provider.complete(make_call(body_of()))).body == raw  # exactly at the limit: fine

    monkeypatch.setattr(providers.openai, "MAX_RESPONSE_BYTES", len(raw) - 1)
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.status == 502
    assert str(len(raw) - 1) in caught.value.message
    await upstream.wait_closed()  # abandoned part-way, so it must have been closed explicitly


# --- upstream statuses ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504, 529])
async def test_server_errors_are_retryable_breaker_failures(
    upstream: ScriptedUpstream, provider: OpenAIProvider, status: int
) -> None:
    upstream.respond(status, json={"error": {"message": "boom"}})
    with pytest.raises(UpstreamUnavailable) as caught:
        await provider.complete(make_call(body_of()))
    error = caught.value
    assert not isinstance(error, UpstreamRateLimited)
    assert error.retryable
    assert error.breaker_failure
    assert error.status == 503
    assert error.outcome == "error"


async def test_server_error_carries_retry_after(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.respond(503, headers={"Retry-After": "7"})  # any case: the pool lowercases names
    with pytest.raises(UpstreamUnavailable) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.retry_after_s == 7.0


async def test_429_is_rate_limited_not_a_breaker_failure(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.respond(429, headers={"retry-after": "2"}, json={"error": {"code": "rate"}})
    with pytest.raises(UpstreamRateLimited) as caught:
        await provider.complete(make_call(body_of()))
    error = caught.value
    assert error.retryable
    assert not error.breaker_failure
    assert error.retry_after_s == 2.0
    assert error.outcome == "rate_limited"


async def test_429_honours_retry_after_ms(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.respond(429, headers={"retry-after-ms": "1500", "retry-after": "9"})
    with pytest.raises(UpstreamRateLimited) as caught:
        await provider.stream(make_call(body_of(stream=True)))
    assert caught.value.retry_after_s == pytest.approx(1.5)


async def test_429_without_retry_after(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.respond(429)
    with pytest.raises(UpstreamRateLimited) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.retry_after_s is None


@pytest.mark.parametrize(("status", "breaker"), [(408, True), (409, False)])
async def test_408_and_409_are_retryable(
    upstream: ScriptedUpstream, provider: OpenAIProvider, status: int, breaker: bool
) -> None:
    upstream.respond(status)
    with pytest.raises(UpstreamUnavailable) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.retryable
    assert caught.value.breaker_failure is breaker
    assert not isinstance(caught.value, UpstreamRateLimited)


@pytest.mark.parametrize("status", [400, 404, 413, 422])
async def test_client_errors_are_passed_back_as_they_came(
    upstream: ScriptedUpstream, provider: OpenAIProvider, status: int
) -> None:
    error_body = (
        b'{"error":{"message":"bad \\u00e9 param","type":"invalid_request_error","param":"x","code":null}}'
    )
    upstream.respond(status, body=error_body, headers={"content-type": "application/json"})
    with pytest.raises(UpstreamRejected) as caught:
        await provider.complete(make_call(body_of()))
    error = caught.value
    assert error.upstream_status == status
    assert error.upstream_body == error_body
    assert not error.retryable
    assert not error.breaker_failure
    rendered_status, rendered_body, headers = render(error)
    assert (rendered_status, rendered_body) == (status, error_body)
    assert headers["x-should-retry"] == "false"


async def test_rejection_is_raised_when_opening_a_stream(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.respond(400, json={"error": {"message": "no"}})
    with pytest.raises(UpstreamRejected) as caught:
        await provider.stream(make_call(body_of(stream=True)))
    assert caught.value.upstream_status == 400
    assert json.loads(caught.value.upstream_body) == {"error": {"message": "no"}}


@pytest.mark.parametrize("status", [401, 403])
async def test_credential_refusal_does_not_leak_the_key(
    upstream: ScriptedUpstream, provider: OpenAIProvider, status: int
) -> None:
    upstream_says = {
        "error": {"message": f"Incorrect API key provided: {API_KEY}", "code": "invalid_api_key"}
    }
    upstream.respond(status, json=upstream_says)
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call(body_of()))
    error = caught.value
    assert not isinstance(error, UpstreamRejected)
    assert not error.retryable
    assert error.status == 502
    status_out, body_out, _ = render(error)
    assert status_out == 502
    for text in (error.message, str(error), body_out.decode(), repr(error)):
        assert API_KEY not in text
        assert "sk-test" not in text


@pytest.mark.parametrize("status", [201, 204, 302])
async def test_unexpected_status_is_an_upstream_error(
    upstream: ScriptedUpstream, provider: OpenAIProvider, status: int
) -> None:
    headers = {"location": "http://elsewhere.test/"} if status == 302 else {}
    upstream.respond(status, headers=headers)
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call(body_of()))
    assert not caught.value.retryable
    assert str(status) in caught.value.message
    assert len(upstream.requests) == 1  # a redirect is not followed


async def test_oversized_error_body_still_maps_the_status(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    huge = split(b"x" * (providers.http.MAX_ERROR_BYTES + 1), 4096)
    upstream.script(Stream(huge, status=400, headers={"content-type": "text/plain"}, end="stall"))
    with pytest.raises(UpstreamRejected) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.upstream_status == 400
    assert caught.value.upstream_body == b""
    await upstream.wait_closed()  # abandoned part-way, so it must have been closed explicitly


# --- transport failures --------------------------------------------------------------------------


@pytest.fixture
async def refused() -> AsyncIterator[OpenAIProvider]:
    """A provider whose base URL is a port nothing listens on."""
    adapter = OpenAIProvider(config(f"http://127.0.0.1:{unused_port()}/v1"))
    yield adapter
    await adapter.aclose()


async def test_connect_error_is_unavailable(refused: OpenAIProvider) -> None:
    with pytest.raises(UpstreamUnavailable) as caught:
        await refused.complete(make_call(body_of()))
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert caught.value.status == 503


async def test_connect_error_when_opening_a_stream(refused: OpenAIProvider) -> None:
    with pytest.raises(UpstreamUnavailable) as caught:
        await refused.stream(make_call(body_of(stream=True)))
    assert caught.value.retryable


@contextlib.contextmanager
def deaf_listener() -> Iterator[str]:
    """A listener that never accepts, so nothing reads what is sent to it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def timed_out_call(how: str, upstream: ScriptedUpstream, provider: OpenAIProvider) -> UpstreamTimeout:
    """Make a call fail with the timeout ``how`` names; returns the failure."""
    if how == "read":  # no response head within read_timeout_s
        upstream.script(Hang())
        with pytest.raises(UpstreamTimeout) as caught:
            await provider.complete(make_call(body_of()))
        return caught.value
    if how == "connect":  # no TCP handshake within connect_timeout_s
        with FullBacklog() as url:
            adapter = OpenAIProvider(config(url))
            try:
                with pytest.raises(UpstreamTimeout) as caught:
                    await adapter.complete(make_call(body_of()))
            finally:
                await adapter.aclose()
        return caught.value
    if how == "write":  # the body cannot be written within read_timeout_s
        with deaf_listener() as url:
            adapter = OpenAIProvider(config(url))
            big = body_of(messages=[{"role": "user", "content": "x" * (32 << 20)}])
            try:
                with pytest.raises(UpstreamTimeout) as caught:
                    await adapter.complete(make_call(big))
            finally:
                await adapter.aclose()
        return caught.value
    # "pool": no free connection within connect_timeout_s
    upstream.script(Stream([sse(CONTENT_CHUNKS[0])], end="stall"))
    adapter = OpenAIProvider(config(upstream.url + "/v1", max_connections=1))
    try:
        holder = await adapter.stream(make_call(body_of(stream=True)))
        try:
            with pytest.raises(UpstreamTimeout) as caught:
                await adapter.complete(make_call(body_of()))
        finally:
            await holder.aclose()
    finally:
        await adapter.aclose()
    assert len(upstream.requests) == 1
    return caught.value


@pytest.mark.parametrize("how", ["read", "connect", "pool", "write"])
async def test_timeouts_are_upstream_timeouts(
    upstream: ScriptedUpstream, provider: OpenAIProvider, how: str
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    error = await timed_out_call(how, upstream, provider)
    assert loop.time() - started < TIMEOUT_S + 2.0
    assert error.status == 504
    assert error.code == "upstream_timeout"
    assert error.outcome == "timeout"
    assert error.retryable
    # waiting for one of the pool's own connections says nothing about the upstream's health
    assert error.breaker_failure is (how != "pool")


async def test_read_timeout_mid_body(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    raw = json.dumps(COMPLETION).encode()
    upstream.respond(200, body=raw, stall_after=len(b'{"id":"chatcmpl-1"'))
    with pytest.raises(UpstreamTimeout) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.retryable
    await upstream.wait_closed()


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_connection_closed_mid_body(
    upstream: ScriptedUpstream, provider: OpenAIProvider, framing: str
) -> None:
    raw = json.dumps(COMPLETION).encode()
    upstream.script(
        Reply(200, body=raw, cut_after=20, framing="chunked" if framing == "chunked" else "length")
    )
    with pytest.raises(UpstreamError) as caught:
        await provider.complete(make_call(body_of()))
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert caught.value.status == 502


# --- streaming -------------------------------------------------------------------------------------


async def test_stream_relays_chunks_in_order_and_drops_unasked_usage(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.stream([sse(*CONTENT_CHUNKS, USAGE_CHUNK, b"[DONE]")])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert stream.usage is None
    assert await collect(stream) == CONTENT_CHUNKS
    assert stream.usage == Usage(prompt_tokens=5, completion_tokens=7)


async def test_stream_keeps_usage_chunk_when_asked(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.stream([sse(*CONTENT_CHUNKS, USAGE_CHUNK, b"[DONE]")])
    call = make_call(body_of(stream=True, stream_options={"include_usage": True}))
    stream = await provider.stream(call)
    assert await collect(stream) == [*CONTENT_CHUNKS, USAGE_CHUNK]
    assert stream.usage == Usage(prompt_tokens=5, completion_tokens=7)


async def test_usage_on_a_content_chunk_is_noted_and_the_chunk_relayed(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    last = chunk("end", usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
    upstream.stream([sse(CONTENT_CHUNKS[0], last, b"[DONE]")])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == [CONTENT_CHUNKS[0], last]
    assert stream.usage == Usage(prompt_tokens=3, completion_tokens=4)


async def test_done_ends_the_stream(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(CONTENT_CHUNKS[0], b"[DONE]", CONTENT_CHUNKS[1], b"not json")])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == [CONTENT_CHUNKS[0]]


async def test_done_without_a_final_blank_line(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(CONTENT_CHUNKS[0]) + b"data: [DONE]"])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == [CONTENT_CHUNKS[0]]


async def test_stream_without_done_is_an_error(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(*CONTENT_CHUNKS)])
    stream = await provider.stream(make_call(body_of(stream=True)))
    seen: list[bytes] = []
    with pytest.raises(UpstreamError) as caught:
        async for data in stream:
            seen.append(data)
    assert seen == CONTENT_CHUNKS
    assert "[DONE]" in caught.value.message
    assert caught.value.retryable
    assert caught.value.breaker_failure


async def test_stream_cut_mid_event_is_a_truncation(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.stream([sse(CONTENT_CHUNKS[0]) + b'data: {"choices": [{"index"'])
    stream = await provider.stream(make_call(body_of(stream=True)))
    with pytest.raises(UpstreamError) as caught:
        await collect(stream)
    assert "[DONE]" in caught.value.message
    assert caught.value.retryable


async def test_non_json_chunk_is_an_error(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(CONTENT_CHUNKS[0], b"{not json", b"[DONE]")])
    stream = await provider.stream(make_call(body_of(stream=True)))
    seen: list[bytes] = []
    with pytest.raises(UpstreamError) as caught:
        async for data in stream:
            seen.append(data)
    assert seen == [CONTENT_CHUNKS[0]]
    assert caught.value.status == 502


async def test_error_chunk_is_an_error(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    error = json.dumps({"error": {"message": "overloaded", "type": "server_error", "code": None}}).encode()
    upstream.stream([sse(CONTENT_CHUNKS[0], error, b"[DONE]")])
    stream = await provider.stream(make_call(body_of(stream=True)))
    seen: list[bytes] = []
    with pytest.raises(UpstreamError) as caught:
        async for data in stream:
            seen.append(data)
    assert seen == [CONTENT_CHUNKS[0]]
    assert "error" in caught.value.message


async def test_crlf_delimited_events(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    payload = sse(*CONTENT_CHUNKS, USAGE_CHUNK, b"[DONE]", newline=b"\r\n")
    upstream.stream([payload])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == CONTENT_CHUNKS
    assert stream.usage == Usage(prompt_tokens=5, completion_tokens=7)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
async def test_events_split_across_network_chunks(
    upstream: ScriptedUpstream, provider: OpenAIProvider, newline: bytes, size: int
) -> None:
    payload = (
        b": keep-alive" + newline + newline + sse(*CONTENT_CHUNKS, USAGE_CHUNK, b"[DONE]", newline=newline)
    )
    upstream.stream(split(payload, size))
    stream = await provider.stream(make_call(body_of(stream=True, stream_options={"include_usage": True})))
    assert await collect(stream) == [*CONTENT_CHUNKS, USAGE_CHUNK]


async def test_comments_event_fields_and_no_space_after_colon(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    payload = (
        b": OPENROUTER PROCESSING\n\n"
        b"event: message\nid: 1\ndata:" + CONTENT_CHUNKS[0] + b"\n\n"
        b"retry: 1000\n\n"
        b"data: " + CONTENT_CHUNKS[1] + b"\n\n"
        b"data: [DONE]\n\n"
    )
    upstream.stream([payload])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == CONTENT_CHUNKS[:2]


async def test_a_stream_read_to_its_end_leaves_no_generator_to_finalize(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    # A body generator left suspended at the end marker is finalized through the loop's asyncgen
    # hook: a task and a wake-up of the loop for every stream. Reading the body with ``receive``
    # leaves none behind.
    upstream.stream([sse(*CONTENT_CHUNKS, b"[DONE]")])
    hooks = sys.get_asyncgen_hooks()
    finalized: list[object] = []

    def finalizer(agen: Any) -> None:
        finalized.append(agen)
        assert hooks.finalizer is not None
        hooks.finalizer(agen)

    sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)
    try:
        stream = await provider.stream(make_call(body_of(stream=True)))
        batches = stream.batches()
        seen = [chunk async for batch in batches for chunk in batch]
        await stream.aclose()
        del stream, batches
        gc.collect()
    finally:
        sys.set_asyncgen_hooks(*hooks)
    assert seen == CONTENT_CHUNKS
    assert finalized == []


async def test_oversized_event_is_an_error(
    upstream: ScriptedUpstream, provider: OpenAIProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(providers.http, "MAX_EVENT_BYTES", 64)
    big = chunk("x" * 200)
    upstream.stream([sse(CONTENT_CHUNKS[0]), *split(sse(big, b"[DONE]"), 16)])
    stream = await provider.stream(make_call(body_of(stream=True)))
    seen: list[bytes] = []
    with pytest.raises(UpstreamError):
        async for data in stream:
            seen.append(data)
    assert seen == [CONTENT_CHUNKS[0]]


async def test_read_timeout_mid_stream(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(CONTENT_CHUNKS[0])], end="stall")
    stream = await provider.stream(make_call(body_of(stream=True)))
    seen: list[bytes] = []
    with pytest.raises(UpstreamTimeout) as caught:
        async for data in stream:
            seen.append(data)
    assert seen == [CONTENT_CHUNKS[0]]
    assert caught.value.retryable
    await stream.aclose()
    await upstream.wait_closed()


async def test_slow_stream_within_the_read_timeout_is_fine(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    # the read timeout bounds each wait, not the whole stream: four pauses of a third of it
    pause = TIMEOUT_S / 3
    parts: list[bytes | float] = [
        sse(CONTENT_CHUNKS[0]),
        pause,
        sse(CONTENT_CHUNKS[1]),
        pause,
        sse(CONTENT_CHUNKS[2]),
        pause,
    ]
    upstream.stream([*parts, pause, sse(b"[DONE]")])
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == CONTENT_CHUNKS


async def test_protocol_error_mid_stream(upstream: ScriptedUpstream, provider: OpenAIProvider) -> None:
    upstream.stream([sse(CONTENT_CHUNKS[0])], end="close")  # the last chunk never comes
    stream = await provider.stream(make_call(body_of(stream=True)))
    seen: list[bytes] = []
    with pytest.raises(UpstreamError) as caught:
        async for data in stream:
            seen.append(data)
    assert seen == [CONTENT_CHUNKS[0]]
    assert caught.value.retryable
    assert isinstance(caught.value, UpstreamFailure)


async def test_aclose_releases_an_abandoned_stream(
    upstream: ScriptedUpstream, provider: OpenAIProvider
) -> None:
    upstream.stream([sse(*CONTENT_CHUNKS, b"[DONE]")], end="stall")
    stream = await provider.stream(make_call(body_of(stream=True)))
    assert upstream.open_connections == 1
    await stream.aclose()
    await upstream.wait_closed()  # its body had not ended: the connection cannot be reused
    assert stream.usage is None


async def test_a_finished_stream_leaves_its_connection_for_the_next_call(
    upstream: ScriptedUpstream, one_connection: OpenAIProvider
) -> None:
    upstream.script(Stream([sse(*CONTENT_CHUNKS, b"[DONE]")]), Reply(200, json=COMPLETION))
    stream = await one_connection.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == CONTENT_CHUNKS
    await stream.aclose()
    await one_connection.complete(make_call(body_of()))
    assert [r.connection for r in upstream.requests] == [1, 1]


async def test_a_stream_whose_last_chunk_comes_after_done_keeps_its_connection(
    upstream: ScriptedUpstream, one_connection: OpenAIProvider
) -> None:
    upstream.script(Stream([sse(*CONTENT_CHUNKS, b"[DONE]"), 0.05]), Reply(200, json=COMPLETION))
    stream = await one_connection.stream(make_call(body_of(stream=True)))
    assert await collect(stream) == CONTENT_CHUNKS
    await stream.aclose()
    await one_connection.complete(make_call(body_of()))
    assert [r.connection for r in upstream.requests] == [1, 1]


@pytest.mark.parametrize("status", [200, 400, 500])
async def test_complete_always_releases_the_response(
    upstream: ScriptedUpstream, one_connection: OpenAIProvider, status: int
) -> None:
    # With one connection allowed, a response left unreleased would make the next call time out
    # waiting for it.
    upstream.script(Reply(status, json=COMPLETION), Reply(200, json=COMPLETION))
    if status == 200:
        await one_connection.complete(make_call(body_of()))
    else:
        with pytest.raises(UpstreamFailure):
            await one_connection.complete(make_call(body_of()))
    assert (await one_connection.complete(make_call(body_of()))).usage == Usage(12, 34)
    assert len(upstream.requests) == 2


async def test_error_status_on_stream_open_releases_the_response(
    upstream: ScriptedUpstream, one_connection: OpenAIProvider
) -> None:
    upstream.script(Reply(429, json={"error": {"message": "slow down"}}), Stream([sse(b"[DONE]")]))
    with pytest.raises(UpstreamRateLimited):
        await one_connection.stream(make_call(body_of(stream=True)))
    assert await collect(await one_connection.stream(make_call(body_of(stream=True)))) == []
    assert len(upstream.requests) == 2


# --- parse_retry_after -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after": " 3 "}, 3.0),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after-ms": "soon", "retry-after": "3"}, 3.0),
        ({"retry-after-ms": "-5", "retry-after": "4"}, 4.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
        ({"retry-after": "-1"}, None),
        ({"retry-after": "3600"}, None),
        ({"retry-after": "3599"}, 3599.0),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": ""}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    # names as the pool gives them, lowercased (test_server_error_carries_retry_after sends "Retry-After")
    result = parse_retry_after(headers)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)
