"""End to end: real ``modelgate serve`` and ``mock-upstream`` processes, the real ``openai`` SDK."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ANTHROPIC_KEY, LIMITED_KEY, TENANT_KEY, UPSTREAM_KEY, gateway_config
from tests.harness import Gateway, MockUpstream

MESSAGES = [{"role": "user", "content": "Say hello"}]


def sdk(gateway: Gateway, key: str = TENANT_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def async_sdk(gateway: Gateway, key: str = TENANT_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet", "mock"])
def test_sync_sdk_non_stream(gateway: Gateway, upstream: MockUpstream, model: str) -> None:
    raw = sdk(gateway).chat.completions.with_raw_response.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert raw.headers["x-modelgate-attempts"] == "1"
    assert raw.headers["x-modelgate-target"].startswith(("up/", "claude/", "local/"))
    assert raw.headers["x-request-id"]


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet", "mock"])
def test_sync_sdk_stream(gateway: Gateway, upstream: MockUpstream, model: str) -> None:
    stream = sdk(gateway).chat.completions.create(model=model, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    assert all(c.usage is None for c in chunks), "usage chunk must be dropped when not asked for"


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet"])
async def test_async_sdk_stream_with_usage(gateway: Gateway, upstream: MockUpstream, model: str) -> None:
    client = async_sdk(gateway)
    stream = await client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].choices == []
    await client.close()


async def test_async_sdk_non_stream(gateway: Gateway, upstream: MockUpstream) -> None:
    client = async_sdk(gateway)
    reply = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    await client.close()


def test_upstream_receives_body_untouched_with_its_key_only(gateway: Gateway, upstream: MockUpstream) -> None:
    body = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"h\xc3\xa9","x_extra":{"deep":[1,2.50,null]}}],'
        b'"vendor_field":{"a":"\xe2\x9c\x93"},"temperature":0.7}'
    )
    headers = {
        "authorization": f"Bearer {TENANT_KEY}",
        "content-type": "application/json",
        "x-custom": "must-not-pass",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    response = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 200
    stats = upstream.stats()
    assert stats["last_body"] == httpx.Response(200, content=body).json()
    assert stats["last_headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert "x-custom" not in stats["last_headers"]
    assert stats["last_headers"]["traceparent"] == headers["traceparent"]


def test_renamed_model_reaches_upstream_by_its_upstream_name(
    gateway: Gateway, upstream: MockUpstream
) -> None:
    sdk(gateway).chat.completions.create(model="renamed", messages=MESSAGES, temperature=0.1)  # type: ignore[arg-type]
    last = upstream.stats()["last_body"]
    assert last["model"] == "upstream-name"
    assert last["temperature"] == 0.1


def test_first_chunk_arrives_while_upstream_still_sends(gateway: Gateway, upstream: MockUpstream) -> None:
    upstream.configure(chunk_delay_ms=150, chunks=6)
    stream = sdk(gateway).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    arrivals = [time.monotonic() for _ in stream]
    # The upstream pauses 150 ms between chunks: a buffering gateway would deliver all at once.
    assert arrivals[-1] - arrivals[0] > 0.5


def test_dev_mode_serves_with_no_config(session_tmp: Path) -> None:
    process = Gateway(session_tmp, None, env={"MODELGATE_DEV_KEY": "", "MODELGATE_ADMIN_KEY": ""}).start()
    try:
        lines = process.output().splitlines()
        assert any("warning" in line.lower() for line in lines)
        key = next(line.split()[-1] for line in lines if line.startswith("dev tenant key:"))
        client = sdk(process, key)
        reply = client.chat.completions.create(model="mock", messages=MESSAGES)  # type: ignore[arg-type]
        assert reply.choices[0].message.content
        streamed = list(client.chat.completions.create(model="mock", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
        assert streamed
    finally:
        assert process.stop() == 0


def test_no_secret_in_logs_or_errors(session_tmp: Path, upstream: MockUpstream) -> None:
    process = Gateway(session_tmp, gateway_config(upstream.url)).start()
    try:
        client = sdk(process)
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
        bodies = []
        upstream.configure(mode="status", status=401)
        for model in ("gpt-4o-mini", "claude-sonnet"):
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]
            bodies.append(caught.value.response.text)
        bad = httpx.post(
            f"{process.url}/v1/chat/completions", headers={"authorization": f"Bearer {TENANT_KEY}x"}
        )
        bodies.append(bad.text)
    finally:
        process.stop()
    everything = process.output() + "".join(bodies)
    for secret in (TENANT_KEY, UPSTREAM_KEY, ANTHROPIC_KEY, LIMITED_KEY):
        assert secret not in everything
