"""Unit tests of the app in process (Litestar's test client), the error table and the public surface."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

import gateway
import providers
from gateway import errors, metrics
from gateway.app import create_app
from gateway.chat_input import parse_head
from gateway.config import Config, ModelConfig, ProviderConfig, ServerConfig, TargetConfig, TenantConfig
from gateway.devmode import dev_config
from gateway.reply_future import ReplyFuture
from gateway.secret import Secret, key_hash
from loadtest.observability_bench import chat_scope

KEY = "unit-test-key-0123456789"


def config(**server: object) -> Config:
    return Config(
        server=ServerConfig(**server),  # type: ignore[arg-type]
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
        tenants=[TenantConfig(name="t", keys=[Secret(f"sha256:{key_hash(KEY)}")])],
    )


def test_public_surface_is_pinned() -> None:
    assert gateway.__all__ == ["create_app"]
    assert gateway.create_app is create_app
    assert set(providers.PROVIDERS) == {"openai", "anthropic", "mock"}


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (errors.InvalidRequest, 400, "invalid_request"),
        (errors.InvalidApiKey, 401, "invalid_api_key"),
        (errors.ModelNotAllowed, 403, "model_not_allowed"),
        (errors.ModelNotFound, 404, "model_not_found"),
        (errors.RequestTooLarge, 413, "request_too_large"),
        (errors.RateLimited, 429, "rate_limit_exceeded"),
        (errors.QuotaExceeded, 429, "insufficient_quota"),
        (errors.UpstreamError, 502, "upstream_error"),
        (errors.UpstreamUnavailable, 503, "upstream_unavailable"),
        (errors.StateUnavailable, 503, "state_unavailable"),
        (errors.UpstreamTimeout, 504, "upstream_timeout"),
    ],
)
def test_error_table_matches_the_contract(cls: type[errors.GatewayError], status: int, code: str) -> None:
    rendered_status, body, headers = errors.render(cls("something happened"))
    assert rendered_status == status
    assert json.loads(body) == {
        "error": {"message": "something happened", "type": cls.error_type, "param": None, "code": code}
    }
    assert headers["x-should-retry"] == "false"


def test_upstream_rejection_keeps_its_status_and_body() -> None:
    status, body, headers = errors.render(errors.UpstreamRejected(422, b'{"error":{"message":"no"}}'))
    assert (status, body, headers["x-should-retry"]) == (422, b'{"error":{"message":"no"}}', "false")


def test_parse_head_reads_only_what_it_needs() -> None:
    head = parse_head(
        b'{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}],"unknown":{"x":1}}'
    )
    assert head.model == "m"
    assert not head.stream
    with pytest.raises(errors.InvalidRequest) as caught:
        parse_head(b'{"model":"m","messages":[{"role":1}]}')
    assert caught.value.param == "messages[0].role"


async def test_body_over_the_limit_is_413_in_process() -> None:
    app = create_app(config(max_body_bytes=1000))
    async with AsyncTestClient(app) as client:
        small = await client.post(
            "/v1/chat/completions",
            json={"model": "mock", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert small.status_code == 200
        big = await client.post(
            "/v1/chat/completions",
            content=b'{"model":"mock","messages":[{"role":"user","content":"' + b"x" * 2000 + b'"}]}',
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"


async def test_sha256_configured_key_authenticates() -> None:
    async with AsyncTestClient(create_app(config())) as client:
        ok = await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        bad = await client.get("/v1/models", headers={"authorization": f"Bearer sha256:{key_hash(KEY)}"})
        assert bad.status_code == 401


async def test_openapi_document_is_served() -> None:
    async with AsyncTestClient(create_app(config())) as client:
        schema = (await client.get("/schema/openapi.json")).json()
    assert "/v1/chat/completions" in schema["paths"]


def test_dev_config_uses_given_keys_and_prints_only_generated_ones() -> None:
    cfg, lines = dev_config({"MODELGATE_DEV_KEY": "dev-key-from-env-000000"})
    assert [t.name for t in cfg.tenants] == ["dev"]
    assert cfg.tenants[0].keys[0].reveal() == "dev-key-from-env-000000"
    assert "warning" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("admin key: mg-")
    assert "dev-key-from-env" not in "".join(lines)
    assert [m.name for m in cfg.models] == ["mock"]


def test_secret_repr_is_redacted() -> None:
    secret = Secret("very-secret-value")
    assert "very-secret" not in repr(secret) + str(secret) + repr(config())


def test_a_started_app_exempts_its_startup_heap_from_full_collections() -> None:
    # In a child process: freezing the heap is process-wide, and the test session keeps its own.
    script = (
        "import asyncio, gc\n"
        "from litestar.testing import AsyncTestClient\n"
        "from gateway import heap\n"
        "from gateway.app import create_app\n"
        "from gateway.devmode import dev_config\n"
        "async def main():\n"
        "    config, _ = dev_config({'MODELGATE_DEV_KEY': 'sk-dev-heap-test-0123456789'})\n"
        "    async with AsyncTestClient(create_app(config)) as client:\n"
        "        assert (await client.get('/healthz')).status_code == 200\n"
        "        print(gc.get_freeze_count(), gc.get_threshold()[0] == heap.YOUNG_THRESHOLD)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    frozen, threshold_set = done.stdout.split()
    assert int(frozen) > 10_000  # Litestar, msgspec and the config: what a full collection skips
    assert threshold_set == "True"


async def test_a_whole_reply_that_cannot_be_sent_is_still_settled_and_counted() -> None:
    # A whole reply goes out with its settlement begun and is settled, counted and logged whatever
    # the sending does; with max_concurrency = 1 the next request finds the slot free.
    key = "unit-test-broken-send-0123456789"
    cfg = Config(
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
        tenants=[TenantConfig(name="broken-send", keys=[Secret(key)], max_concurrency=1)],
    )
    app = create_app(cfg)
    body = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}).encode()
    labels = {"tenant": "broken-send", "model": "mock", "status": "200"}
    counted_before = metrics.REGISTRY.get_sample_value("modelgate_requests_total", labels) or 0.0
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])
        if message["type"] == "http.response.body":
            raise OSError("the client's connection broke")

    async with AsyncTestClient(app) as client:
        with pytest.raises(OSError, match="connection broke"):
            await app(chat_scope(body, key), receive, send)  # type: ignore[arg-type]
        assert sent == ["http.response.start", "http.response.body"]
        counted = metrics.REGISTRY.get_sample_value("modelgate_requests_total", labels)
        assert counted == counted_before + 1
        again = await client.post(
            "/v1/chat/completions",
            content=body,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        assert again.status_code == 200, again.text


class _NeverYourTurn:
    """A reply gate whose turns never come (a stand-in for a worker stopping meanwhile)."""

    def __init__(self) -> None:
        self.waiting: list[ReplyFuture] = []

    def take(self) -> ReplyFuture:
        turn = ReplyFuture(asyncio.get_running_loop())
        self.waiting.append(turn)
        return turn


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_cancelled_while_it_waits_for_its_reply_turn_is_settled(stream: bool) -> None:
    # The upstream has answered; the reply step waits for its turn (gateway.reply_turns) when the
    # request is cancelled (the server stopping past its grace). Its usage is still accounted and
    # its slot freed: with max_concurrency = 1 the next request is admitted.
    key = f"unit-test-turn-cancelled-{stream}-0123456789"
    tenant = f"turn-cancelled-{str(stream).lower()}"
    cfg = Config(
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
        tenants=[TenantConfig(name=tenant, keys=[Secret(key)], max_concurrency=1)],
    )
    app = create_app(cfg)
    chat = app.state.chat
    real_turns, chat._reply_turns = chat._reply_turns, _NeverYourTurn()
    request = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body = json.dumps(request).encode()
    labels = {"tenant": tenant, "model": "mock", "type": "completion"}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is sent before the reply's turn: {message['type']}")

    async with AsyncTestClient(app) as client:
        task = asyncio.get_running_loop().create_task(app(chat_scope(body, key), receive, send))  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while not chat._reply_turns.waiting:
            assert time.monotonic() < deadline, "the reply step never took its turn"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (metrics.REGISTRY.get_sample_value("modelgate_tokens_total", labels) or 0.0) > 0
        chat._reply_turns = real_turns
        again = await client.post(
            "/v1/chat/completions",
            content=json.dumps({**request, "stream": False}).encode(),
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        assert again.status_code == 200, again.text
