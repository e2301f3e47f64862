"""A burst of bad keys from one address is slowed.

A gateway of its own allows 5 unknown keys a minute per address. The tests tell addresses apart
by binding their client sockets to different loopback addresses (``127.0.0.x``), so each test
has its own window and none waits for another's to clear. Past the limit, the address gets 429
``rate_limit_exceeded`` with ``retry-after`` for every key, right or wrong, on tenant and admin
routes alike (README: "gets 429 for every key until its window clears"); other addresses are not
affected, and headers a client writes cannot make it look like another address.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import Gateway
from tests.security.support import error_of, make_secret

LIMIT = 5
ADMIN = make_secret()
TENANT = make_secret()
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
CONFIG = f"""
[server]
admin_key = "{ADMIN}"
invalid_keys_per_minute = {LIMIT}

[[providers]]
name = "local"
type = "mock"

[[models]]
name = "mock"
targets = [{{ provider = "local", model = "mock" }}]

[[tenants]]
name = "acme"
keys = ["{TENANT}"]
"""
GUESS_ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/admin/breakers"),
    ("GET", "/admin/tenants/acme"),
    ("PUT", "/admin/tenants/acme"),
]


@pytest.fixture(scope="module")
def guarded(session_tmp: Path) -> Iterator[Gateway]:
    process = Gateway(session_tmp, CONFIG).start()
    yield process
    process.stop()


class Client:
    """Requests from one source address."""

    def __init__(self, gateway: Gateway, address: str) -> None:
        self.url = gateway.url
        self.web = httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=10)

    def call(self, method: str, path: str, key: str | None, **headers: str) -> httpx.Response:
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        body = CHAT if path.startswith("/v1/chat") else ({"rpm": 1} if method == "PUT" else None)
        return self.web.request(method, f"{self.url}{path}", json=body, headers=headers)

    def close(self) -> None:
        self.web.close()


_ADDRESSES = itertools.count(10)


@pytest.fixture
def client(guarded: Gateway) -> Iterator[Client]:
    """A client on a loopback address of its own (each test has its own window)."""
    made = Client(guarded, f"127.0.0.{next(_ADDRESSES)}")
    yield made
    made.close()


def assert_blocked(response: httpx.Response) -> None:
    error_of(response, 429, "rate_limit_exceeded")
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert 0 <= int(response.headers["retry-after-ms"]) <= 60_000


def guess(client: Client, count: int, **headers: str) -> list[int]:
    """``count`` unknown keys spread over tenant and admin routes; their statuses."""
    statuses = []
    for i in range(count):
        method, path = GUESS_ROUTES[i % len(GUESS_ROUTES)]
        statuses.append(client.call(method, path, f"guess-{uuid.uuid4().hex}", **headers).status_code)
    return statuses


def test_a_burst_of_bad_keys_is_refused_then_even_the_right_keys(client: Client) -> None:
    assert guess(client, LIMIT) == [401] * LIMIT
    assert_blocked(client.call("GET", "/v1/models", f"guess-{uuid.uuid4().hex}"))
    assert_blocked(client.call("GET", "/v1/models", TENANT))
    assert_blocked(client.call("POST", "/v1/chat/completions", TENANT))
    assert_blocked(client.call("GET", "/admin/breakers", ADMIN))
    assert_blocked(client.call("GET", "/v1/models", None))


def test_guessing_the_admin_key_is_slowed_too(client: Client) -> None:
    for i in range(LIMIT):
        assert client.call("GET", "/admin/breakers", f"{ADMIN[:-1]}{i}").status_code == 401
    assert_blocked(client.call("GET", "/admin/breakers", ADMIN[:-1] + "x"))
    assert_blocked(client.call("GET", "/admin/breakers", ADMIN))


def test_a_right_key_does_not_count(client: Client) -> None:
    for _ in range(2 * LIMIT):
        assert client.call("GET", "/v1/models", TENANT).status_code == 200
        assert client.call("GET", "/admin/breakers", ADMIN).status_code == 200
    assert guess(client, LIMIT) == [401] * LIMIT


def test_one_address_is_blocked_not_every_address(guarded: Gateway, client: Client) -> None:
    assert guess(client, LIMIT + 1)[-1] == 429
    neighbour = Client(guarded, "127.0.0.250")
    try:
        assert neighbour.call("GET", "/v1/models", TENANT).status_code == 200
        assert neighbour.call("GET", "/v1/models", "guess-neighbour").status_code == 401
    finally:
        neighbour.close()
    assert_blocked(client.call("GET", "/v1/models", TENANT))


def test_forwarding_headers_from_a_client_do_not_reset_its_count(client: Client) -> None:
    statuses = []
    for i in range(LIMIT + 2):
        spoofed = f"203.0.113.{i + 1}"
        headers = {"x-forwarded-for": spoofed, "x-real-ip": spoofed, "forwarded": f"for={spoofed}"}
        statuses.append(guess(client, 1, **headers)[0])
    assert statuses == [401] * LIMIT + [429, 429]


def test_forwarding_headers_from_loopback_do_not_reset_the_count(guarded: Gateway) -> None:
    loopback = Client(guarded, "127.0.0.1")
    try:
        statuses = []
        for i in range(LIMIT + 2):
            spoofed = f"198.51.100.{i + 1}"
            statuses.append(guess(loopback, 1, **{"x-forwarded-for": spoofed})[0])
    finally:
        loopback.close()
    assert statuses == [401] * LIMIT + [429, 429]
