"""Limits on what a client controls, against a real ``modelgate serve`` over raw sockets.

Head size (431), time to send a request (408), idle keep-alive connections, open connections per
worker, malformed HTTP (400), body size (413) and message count (400): each answered in the
OpenAI error shape where an answer is possible, and the gateway keeps serving afterwards.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TENANT_KEY, gateway_config
from tests.harness import Gateway, MockUpstream

CLIENT_TIMEOUT_S = 0.6
IDLE_TIMEOUT_S = 0.4
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def limited(session_tmp: Path, mock_upstream_process: MockUpstream) -> Iterator[Gateway]:
    config = gateway_config(
        mock_upstream_process.url,
        max_header_bytes=2048,
        client_timeout_s=CLIENT_TIMEOUT_S,
        idle_timeout_s=IDLE_TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
        max_messages=3,
        max_body_bytes=4096,
    )
    process = Gateway(session_tmp, config).start()
    yield process
    process.stop()


def connect(gateway: Gateway) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
    sock.settimeout(5)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def error_of(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return status, error


def chat(messages: int = 1) -> dict[str, object]:
    return {"model": "mock", "messages": [{"role": "user", "content": "hi"}] * messages}


def post(gateway: Gateway, body: dict[str, object]) -> httpx.Response:
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=5)


def test_a_head_over_the_limit_is_431_and_closed(limited: Gateway) -> None:
    with connect(limited) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4000 + b"\r\n\r\n")
        status, error = error_of(read_all(sock))
    assert status == 431
    assert error["code"] == "headers_too_large"
    assert post(limited, chat()).status_code == 200


def test_a_head_that_trickles_in_is_408_and_closed(limited: Gateway) -> None:
    with connect(limited) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        raw = read_all(sock)
        waited = time.monotonic() - started
    status, error = error_of(raw)
    assert status == 408
    assert error["code"] == "request_timeout"
    assert CLIENT_TIMEOUT_S * 0.8 < waited < CLIENT_TIMEOUT_S + 2


def test_a_body_that_never_completes_is_408(limited: Gateway) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {TENANT_KEY}\r\ncontent-length: 200\r\n\r\n"
    )
    with connect(limited) as sock:
        sock.sendall(head.encode() + b'{"model": "mock", ')
        status, error = error_of(read_all(sock))
    assert status == 408
    assert error["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(limited: Gateway) -> None:
    with connect(limited) as sock:
        started = time.monotonic()
        raw = read_all(sock)
        waited = time.monotonic() - started
    assert error_of(raw)[0] == 408
    assert waited < CLIENT_TIMEOUT_S + 2


def test_an_idle_keep_alive_connection_is_closed(limited: Gateway) -> None:
    with connect(limited) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        raw = read_all(sock)  # one answer, then nothing until the server closes the idle connection
        waited = time.monotonic() - started
    assert raw.startswith(b"HTTP/1.1 200")
    assert raw.endswith(b'{"status":"ok"}')
    assert IDLE_TIMEOUT_S * 0.8 < waited < IDLE_TIMEOUT_S + 2


def test_connections_over_the_limit_are_closed_at_once(limited: Gateway) -> None:
    held = [connect(limited) for _ in range(MAX_CONNECTIONS)]
    try:
        # every held connection is open on the server once it answers a request on it
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        with connect(limited) as extra:
            started = time.monotonic()
            try:
                extra.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = read_all(extra)
            except ConnectionResetError:
                answer = b""
            assert answer == b""
            assert time.monotonic() - started < IDLE_TIMEOUT_S
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while post(limited, chat()).status_code != 200:  # served again once the held ones are gone
        assert time.monotonic() < deadline


def test_malformed_http_is_400_in_the_openai_shape(limited: Gateway) -> None:
    with connect(limited) as sock:
        sock.sendall(b"this is not HTTP\r\n\r\n")
        status, error = error_of(read_all(sock))
    assert status == 400
    assert error["code"] == "invalid_request"


def test_too_many_messages_is_400_naming_messages(limited: Gateway) -> None:
    response = post(limited, chat(messages=4))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert post(limited, chat(messages=3)).status_code == 200


def test_a_body_over_the_limit_is_413(limited: Gateway) -> None:
    body = chat()
    body["messages"] = [{"role": "user", "content": "x" * 5000}]
    response = post(limited, body)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
