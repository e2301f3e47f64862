"""The mock upstream server, driven over real HTTP: replies, streams, the control API, fault modes.

The server runs the way ``modelgate mock-upstream`` runs it (uvicorn, uvloop, httptools) in a
subprocess on a free port; each test resets it through ``/_mock/reset``. Its log must stay free
of errors, which also proves the deliberate connection aborts are not reported as bugs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import providers.base  # noqa: F401  (before policies.tokens, which alone hits an import cycle)
from loadtest.mock_settings import SettingsError
from loadtest.mock_upstream import MockSettings, create_app
from policies.tokens import estimate_prompt_tokens, estimate_text_tokens
from providers.base import Message

ROOT = Path(__file__).resolve().parents[1]
SERVE = (
    "import sys; from loadtest.mock_upstream import MockSettings, serve; "
    "serve('127.0.0.1', int(sys.argv[1]), MockSettings())"
)
CHAT_URL = "/v1/chat/completions"
PROMPT = "hello there, upstream"
CHAT: dict[str, Any] = {"model": "mock", "messages": [{"role": "user", "content": PROMPT}]}
STREAM: dict[str, Any] = {**CHAT, "stream": True}
ANTHROPIC: dict[str, Any] = {
    "model": "claude-x",
    "max_tokens": 100,
    "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
}
SHORT_READ = httpx.Timeout(5.0, read=0.3)


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> str:
        """Stop it with SIGTERM, as an operator would; its log."""
        self.process.terminate()
        returncode = self.process.wait(timeout=10)
        assert returncode in (0, -signal.SIGTERM)
        return self.log.read_text()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(server: Server, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log.read_text()
        try:
            if httpx.get(server.url + "/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.02)
    raise AssertionError("mock upstream did not start")


def start_server(log: Path) -> Server:
    port = _free_port()
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], cwd=ROOT, stderr=out, stdout=out)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_ready(server)
    except BaseException:
        server.process.kill()
        server.process.wait()
        raise
    return server


def assert_clean(log: str) -> None:
    assert "Traceback" not in log and "ERROR" not in log and "WARNING" not in log, log


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_server(tmp_path_factory.mktemp("mock") / "server.log")
    yield server.url
    assert_clean(server.stop())


@pytest.fixture
async def client(upstream: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=upstream, timeout=5.0) as client:
        (await client.post("/_mock/reset")).raise_for_status()
        yield client


async def configure(client: httpx.AsyncClient, **changes: Any) -> None:
    (await client.post("/_mock/config", json=changes)).raise_for_status()


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/_mock/stats")
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


async def wait_until_idle(client: httpx.AsyncClient, deadline_s: float = 3.0) -> None:
    """Until no request waits on its client: the server noticed every disconnect."""
    deadline = time.monotonic() + deadline_s
    while (await stats(client))["waiting"]:
        assert time.monotonic() < deadline, "a hanging request outlived its client"
        await asyncio.sleep(0.01)


async def collect_data(response: httpx.Response, into: list[str]) -> None:
    """Append the stream's ``data:`` payloads to ``into`` as they arrive (kept if reading fails)."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            into.append(line[6:])


async def data_lines(response: httpx.Response) -> list[str]:
    seen: list[str] = []
    await collect_data(response, seen)
    return seen


async def stream_data(client: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", CHAT_URL, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        return await data_lines(response)


# Replies


async def test_models_lists_mock(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == ["mock"]


async def test_non_stream_body_and_usage(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT_URL, json=CHAT)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "mock"
    assert len(body["choices"][0]["message"]["content"].split()) == 12
    prompt = estimate_prompt_tokens([Message(role="user", content=PROMPT)])
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12}


async def test_max_tokens_lowers_the_word_count(client: httpx.AsyncClient) -> None:
    body = (await client.post(CHAT_URL, json={**CHAT, "max_tokens": 3})).json()
    assert body["usage"]["completion_tokens"] == 3


async def test_stream_has_one_chunk_per_word_and_done_last(client: httpx.AsyncClient) -> None:
    await configure(client, chunks=5)
    data = await stream_data(client, STREAM)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    words = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(words) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


async def test_stream_usage_chunk_only_when_asked(client: httpx.AsyncClient) -> None:
    data = await stream_data(client, {**STREAM, "stream_options": {"include_usage": True}})
    assert data[-1] == "[DONE]"
    usage_chunk = json.loads(data[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12


async def test_invalid_json_is_a_400_error_body(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT_URL, content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_unknown_route_is_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/nothing")).status_code == 404
    assert (await client.get(CHAT_URL)).status_code == 405


# Anthropic Messages


async def test_anthropic_non_stream(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/messages", json=ANTHROPIC)
    assert response.status_code == 200
    body = response.json()
    assert body["type"] == "message"
    assert body["role"] == "assistant"
    assert body["model"] == "claude-x"
    assert body["stop_reason"] == "end_turn"
    assert len(body["content"][0]["text"].split()) == 12
    assert body["usage"] == {"input_tokens": estimate_text_tokens(PROMPT) + 4 + 3, "output_tokens": 12}


async def test_anthropic_stream_event_sequence(client: httpx.AsyncClient) -> None:
    await configure(client, chunks=3)
    async with client.stream("POST", "/v1/messages", json={**ANTHROPIC, "stream": True}) as response:
        lines = [line async for line in response.aiter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    head = ["message_start", "content_block_start", "ping"]
    tail = ["content_block_stop", "message_delta", "message_stop"]
    assert names == [*head, *["content_block_delta"] * 3, *tail]
    assert [d["type"] for d in data] == names
    assert "".join(d["delta"]["text"] for d in data[3:6]) == "this is a "
    assert data[-2]["delta"]["stop_reason"] == "end_turn"
    assert data[-2]["usage"]["output_tokens"] == 3


async def test_anthropic_errors_have_anthropic_shape(client: httpx.AsyncClient) -> None:
    await configure(client, mode="status", status=500)
    response = await client.post("/v1/messages", json=ANTHROPIC)
    assert response.status_code == 500
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "api_error"


# Control API


async def test_stats_count_requests_and_keep_the_last_one(client: httpx.AsyncClient) -> None:
    await client.post(CHAT_URL, json=CHAT, headers={"X-Trace-Id": "abc"})
    await client.post("/v1/messages", json=ANTHROPIC)
    await client.post(CHAT_URL, content=b"nope")
    seen = await stats(client)
    assert (seen["requests"], seen["chat_requests"], seen["messages_requests"]) == (3, 2, 1)
    assert seen["by_status"] == {"200": 2, "400": 1}
    assert seen["last_body"] is None
    await client.post(CHAT_URL, json=CHAT, headers={"X-Trace-Id": "abc"})
    seen = await stats(client)
    assert seen["last_headers"]["x-trace-id"] == "abc"
    assert seen["last_body"] == CHAT


async def test_config_changes_behaviour_and_reset_restores_it(client: httpx.AsyncClient) -> None:
    await configure(client, chunks=2)
    assert (await client.post(CHAT_URL, json=CHAT)).json()["usage"]["completion_tokens"] == 2
    (await client.post("/_mock/reset")).raise_for_status()
    assert (await client.post(CHAT_URL, json=CHAT)).json()["usage"]["completion_tokens"] == 12
    assert (await stats(client))["requests"] == 1
    assert (await client.get("/_mock/config")).json()["chunks"] == 12


@pytest.mark.parametrize(
    "patch",
    [
        {"bogus": 1},
        {"error_rate": 2},
        {"mode": "nope"},
        {"chunks": "x"},
        {"error_rate": 0.6, "rate_429": 0.6},
    ],
)
async def test_config_refuses_invalid_patches(client: httpx.AsyncClient, patch: dict[str, Any]) -> None:
    response = await client.post("/_mock/config", json=patch)
    assert response.status_code == 400
    assert "invalid mock config" in response.json()["error"]["message"]


def test_create_app_refuses_invalid_settings() -> None:
    with pytest.raises(SettingsError):
        create_app(MockSettings(chunks=0))


# Faults


async def test_rate_429_answers_429_with_retry_after(client: httpx.AsyncClient) -> None:
    await configure(client, rate_429=1.0)
    response = await client.post(CHAT_URL, json=CHAT)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


async def test_error_rate_answers_500(client: httpx.AsyncClient) -> None:
    await configure(client, error_rate=1.0)
    response = await client.post(CHAT_URL, json=CHAT)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


async def test_mode_status_answers_that_status_every_time(client: httpx.AsyncClient) -> None:
    await configure(client, mode="status", status=500)
    statuses = [(await client.post(CHAT_URL, json=CHAT)).status_code for _ in range(3)]
    assert statuses == [500, 500, 500]
    await configure(client, status=401)
    response = await client.post(CHAT_URL, json=STREAM)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert (await stats(client))["by_status"] == {"401": 1, "500": 3}


async def test_garbage(client: httpx.AsyncClient) -> None:
    await configure(client, mode="garbage", chunks=3)
    response = await client.post(CHAT_URL, json=CHAT)
    assert response.status_code == 200
    with pytest.raises(ValueError):
        response.json()
    assert await stream_data(client, STREAM) == ["not json"] * 3


async def test_hang_ends_when_the_client_gives_up(client: httpx.AsyncClient) -> None:
    await configure(client, mode="hang")
    with pytest.raises(httpx.ReadTimeout):
        await client.post(CHAT_URL, json=CHAT, timeout=SHORT_READ)
    await wait_until_idle(client)
    assert (await stats(client))["by_status"] == {}


async def test_stall_sends_stall_after_chunks_then_nothing(client: httpx.AsyncClient) -> None:
    await configure(client, mode="stall", stall_after=3)
    seen: list[str] = []
    with pytest.raises(httpx.ReadTimeout):
        async with client.stream("POST", CHAT_URL, json=STREAM, timeout=SHORT_READ) as response:
            await collect_data(response, seen)
    assert len(seen) == 3
    await wait_until_idle(client)


async def test_stall_non_stream_sends_headers_and_half_a_body(client: httpx.AsyncClient) -> None:
    await configure(client, mode="stall")
    async with client.stream("POST", CHAT_URL, json=CHAT, timeout=SHORT_READ) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            await response.aread()
    await wait_until_idle(client)


async def test_close_mid_body_stream_breaks_the_connection(client: httpx.AsyncClient) -> None:
    await configure(client, mode="close_mid_body", stall_after=2)
    seen: list[str] = []
    with pytest.raises(httpx.TransportError):
        async with client.stream("POST", CHAT_URL, json=STREAM) as response:
            await collect_data(response, seen)
    assert len(seen) == 2
    assert "[DONE]" not in seen


async def test_close_mid_body_non_stream_breaks_the_connection(client: httpx.AsyncClient) -> None:
    await configure(client, mode="close_mid_body")
    with pytest.raises(httpx.TransportError):
        await client.post(CHAT_URL, json=CHAT)


async def test_chunk_delay_spreads_the_stream_out(client: httpx.AsyncClient) -> None:
    await configure(client, chunks=4, chunk_delay_ms=50)
    arrivals: list[float] = []
    async with client.stream("POST", CHAT_URL, json=STREAM) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 7  # role, 4 words, finish, [DONE]: 6 pauses of 50 ms
    assert arrivals[-1] - arrivals[0] >= 0.25


async def stalled_stream(client: httpx.AsyncClient) -> list[str]:
    """The data a stalled stream delivered before its connection broke."""
    seen: list[str] = []
    with pytest.raises(httpx.TransportError):
        async with client.stream("POST", CHAT_URL, json=STREAM) as response:
            await collect_data(response, seen)
    return seen


async def wait_for_waiting(client: httpx.AsyncClient, count: int) -> None:
    deadline = time.monotonic() + 3
    while (await stats(client))["waiting"] < count:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_shutdown_releases_hanging_and_stalled_requests(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.log")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
            await configure(client, mode="stall", stall_after=2)
            stall = asyncio.create_task(stalled_stream(client))
            await wait_for_waiting(client, 1)
            await configure(client, mode="hang")
            hang = asyncio.create_task(client.post(CHAT_URL, json=CHAT))
            await wait_for_waiting(client, 2)
            log = await asyncio.to_thread(server.stop)
            assert (await hang).status_code == 503
            assert len(await stall) == 2
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    assert_clean(log)
