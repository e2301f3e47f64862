"""Locust users sending chat completions through the gateway: streams and whole replies, several
tenants, and one tenant deliberately over its ``rpm`` limit.

Run headless against a gateway in dev mode (``modelgate serve`` with no config)::

    export MODELGATE_DEV_KEY=dev-key-0123456789 MODELGATE_ADMIN_KEY=admin-key-0123456789
    modelgate serve &
    locust -f loadtest/locustfile.py --headless -u 20 -r 5 -t 30s --host http://127.0.0.1:8080 \
        --only-summary

With the admin key, the test start creates (through the admin API) ``MODELGATE_LOAD_TENANTS``
extra tenants with generous limits and the over-limit tenant ``slow`` (``rpm`` =
``MODELGATE_LOAD_SLOW_RPM``), and takes a fresh key for each. Without it, give the keys yourself:
``MODELGATE_LOAD_KEYS`` (comma-separated, for the normal users) and ``MODELGATE_LOAD_SLOW_KEY``.

Environment (all optional):

| variable | default | meaning |
| --- | --- | --- |
| ``MODELGATE_GATEWAY_URL`` | ``http://127.0.0.1:8080`` | the gateway, when ``--host`` is not given |
| ``MODELGATE_DEV_KEY`` | | a tenant key (the dev tenant's in dev mode) |
| ``MODELGATE_LOAD_KEYS`` | | more tenant keys, comma-separated |
| ``MODELGATE_ADMIN_KEY`` | | the admin key: creates the tenants and keys below at test start |
| ``MODELGATE_LOAD_TENANTS`` | ``2`` | extra tenants ``load-1`` .. ``load-N`` to create |
| ``MODELGATE_LOAD_SLOW_RPM`` | ``30`` | the over-limit tenant's ``rpm`` |
| ``MODELGATE_LOAD_SLOW_RPS`` | ``3`` | requests per second of the one over-limit user (6x an rpm of 30) |
| ``MODELGATE_LOAD_SLOW_KEY`` | | the over-limit tenant's key, when no admin key is given |
| ``MODELGATE_LOAD_MODEL`` | ``mock`` | the model every request names |
| ``MODELGATE_LOAD_STREAM_SHARE`` | ``0.5`` | the share of requests sent with ``"stream": true`` |
| ``MODELGATE_LOAD_MAX_TOKENS`` | ``32`` | ``max_tokens`` of every request |

How outcomes are recorded: every request is reported by firing locust's ``events.request``
ourselves (the users share one ``httpx`` client, which gevent makes cooperative; they are
plain ``User``s, not ``HttpUser``s), under a name that says what happened:

* ``chat`` / ``chat stream``: a 200 (for a stream: it ended with ``data: [DONE]`` and no error
  event), or a failure (any other status, a cut stream) under the same name; the over-limit
  user's are ``chat [slow]`` / ``chat stream [slow]``, so its admitted count is visible too;
* ``429 <code> [<tenant>]``: refused by admission (``rate_limit_exceeded`` or
  ``insufficient_quota``), reported as a *success* under its own name, so the intended 429s of
  the over-limit tenant neither count as failures nor hide among the 200s;
* ``503 breaker open``: ``upstream_unavailable`` answered with ``x-modelgate-attempts: 0`` (no
  upstream call made: every breaker was open), a success under its own name; a 503 after real
  attempts is a failure named ``503 upstream_unavailable``.

So locust's failure count (and its exit code) covers only real errors. Time to first token of
streams is printed at the end of the run (it is not a request, so it is not in locust's table).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

import httpx
from locust import User, between, constant_throughput, events
from locust.env import Environment

log = logging.getLogger("modelgate.locust")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

_GATEWAY_URL = os.environ.get("MODELGATE_GATEWAY_URL", "http://127.0.0.1:8080")
_MODEL = os.environ.get("MODELGATE_LOAD_MODEL", "mock")
_STREAM_SHARE = float(os.environ.get("MODELGATE_LOAD_STREAM_SHARE", "0.5"))
_MAX_TOKENS = int(os.environ.get("MODELGATE_LOAD_MAX_TOKENS", "32"))
_TIMEOUT_S = 60.0


class _Keys:
    """The tenant keys the users take, filled in at test start."""

    def __init__(self) -> None:
        self.normal: list[tuple[str, str]] = []
        """(tenant label, key) for the normal users."""
        self.slow: tuple[str, str] | None = None
        self.ttfts: list[float] = []
        self.lock = threading.Lock()
        self.next = 0
        self.client: httpx.Client | None = None
        """One client (connection pool) shared by every user: building an ``httpx.Client`` loads
        a TLS context, too costly to do per user while others are sending."""

    def take(self) -> tuple[str, str] | None:
        """The next normal key, round robin over tenants."""
        with self.lock:
            if not self.normal:
                return None
            label_key = self.normal[self.next % len(self.normal)]
            self.next += 1
            return label_key


KEYS = _Keys()


def _admin(host: str, admin_key: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    assert KEYS.client is not None
    response = KEYS.client.request(
        method, f"{host}{path}", json=body, headers={"authorization": f"Bearer {admin_key}"}, timeout=10
    )
    response.raise_for_status()
    return response.json()


def _create_tenants(host: str, admin_key: str) -> None:
    """The extra tenants and the over-limit one, each with a fresh key."""
    for i in range(1, int(os.environ.get("MODELGATE_LOAD_TENANTS", "2")) + 1):
        name = f"load-{i}"
        _admin(host, admin_key, "PUT", f"/admin/tenants/{name}", {"rpm": 1_000_000, "models": [_MODEL]})
        KEYS.normal.append((name, _admin(host, admin_key, "POST", f"/admin/tenants/{name}/keys")["key"]))
    rpm = int(os.environ.get("MODELGATE_LOAD_SLOW_RPM", "30"))
    _admin(host, admin_key, "PUT", "/admin/tenants/slow", {"rpm": rpm, "models": [_MODEL]})
    KEYS.slow = ("slow", _admin(host, admin_key, "POST", "/admin/tenants/slow/keys")["key"])


def _on_test_start(environment: Environment, **_: Any) -> None:
    host = (environment.host or _GATEWAY_URL).rstrip("/")
    if KEYS.client is None:
        limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=10_000)
        KEYS.client = httpx.Client(base_url=host, timeout=_TIMEOUT_S, limits=limits)
    KEYS.normal.clear()
    KEYS.ttfts.clear()
    if dev_key := os.environ.get("MODELGATE_DEV_KEY"):
        KEYS.normal.append(("dev", dev_key))
    for i, key in enumerate(k for k in os.environ.get("MODELGATE_LOAD_KEYS", "").split(",") if k.strip()):
        KEYS.normal.append((f"key-{i + 1}", key.strip()))
    if slow_key := os.environ.get("MODELGATE_LOAD_SLOW_KEY"):
        KEYS.slow = ("slow", slow_key)
    if admin_key := os.environ.get("MODELGATE_ADMIN_KEY"):
        _create_tenants(host, admin_key)
    if not KEYS.normal:
        log.error("no tenant key: set MODELGATE_DEV_KEY, MODELGATE_LOAD_KEYS or MODELGATE_ADMIN_KEY")
    log.info("tenants: %s; over-limit: %s", [t for t, _ in KEYS.normal], KEYS.slow and KEYS.slow[0])


def _on_test_stop(environment: Environment, **_: Any) -> None:
    ttfts = sorted(KEYS.ttfts)
    if not ttfts:
        return
    pick = [ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000 for q in (0.5, 0.9, 0.99)]
    print(
        f"stream time to first token over {len(ttfts)} streams: "
        f"p50 {pick[0]:.1f} ms, p90 {pick[1]:.1f} ms, p99 {pick[2]:.1f} ms",
        flush=True,
    )


events.test_start.add_listener(_on_test_start)  # type: ignore[no-untyped-call, unused-ignore]
events.test_stop.add_listener(_on_test_stop)  # type: ignore[no-untyped-call, unused-ignore]


def _send(user: _ChatUser) -> None:
    user.chat()


class _ChatUser(User):  # type: ignore[misc, unused-ignore]
    """Sends chat completions with one tenant key and reports each outcome under its own name."""

    abstract = True
    tasks = [_send]
    host = _GATEWAY_URL
    tenant: str = ""
    key: str | None = None
    suffix = ""
    """Appended to the names of this user's ordinary outcomes."""

    def chat(self) -> None:
        client = KEYS.client
        if self.key is None or client is None:
            time.sleep(1)
            return
        stream = random.random() < _STREAM_SHARE
        body: dict[str, Any] = {
            "model": _MODEL,
            "messages": [{"role": "user", "content": f"Load test message {random.randrange(10**6)}."}],
            "max_tokens": _MAX_TOKENS,
        }
        if stream:
            body["stream"] = True
        started = time.perf_counter()
        name = ("chat stream" if stream else "chat") + self.suffix
        length, error, first = 0, None, None
        try:
            with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {self.key}"}
            ) as response:
                if response.status_code == 200 and stream:
                    length, error, first = _read_stream(response, started)
                else:
                    length = len(response.read())
                    name, error = _classify(response, name, self.tenant)
        except httpx.HTTPError as exc:
            error = exc
        self.environment.events.request.fire(
            request_type="POST",
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=error,
            context={"tenant": self.tenant},
        )
        if first is not None and error is None:
            KEYS.ttfts.append(first)


def _read_stream(response: httpx.Response, started: float) -> tuple[int, Exception | None, float | None]:
    """Read an SSE stream to its end: (bytes, error or None, seconds to the first event)."""
    length, first, done = 0, None, False
    for line in response.iter_lines():
        if not line:
            continue
        if first is None:
            first = time.perf_counter() - started
        length += len(line)
        if line.startswith('data: {"error"'):
            return length, RuntimeError(f"stream cut: {line[6:200]}"), first
        done = line == "data: [DONE]"
    return length, None if done else RuntimeError("stream ended without data: [DONE]"), first


def _classify(response: httpx.Response, name: str, tenant: str) -> tuple[str, Exception | None]:
    """The name to report a non-stream answer under, and its error (None: not a failure)."""
    status = response.status_code
    if status == 200:
        return name, None
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    if status == 429:
        return f"429 {code} [{tenant}]", None
    if status == 503 and code == "upstream_unavailable":
        if response.headers.get("x-modelgate-attempts") == "0":
            return "503 breaker open", None
        return "503 upstream_unavailable", RuntimeError(response.text[:200])
    return name, RuntimeError(f"HTTP {status} {code}: {response.text[:200]}")


class AgentUser(_ChatUser):
    """A well-behaved agent: one of the normal tenants' keys, a short think time between calls."""

    weight = 10
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        taken = KEYS.take()
        if taken is not None:
            self.tenant, self.key = taken


class OverLimitUser(_ChatUser):
    """Exactly one user on the ``slow`` tenant, sending several times its ``rpm``: it gets 429s."""

    fixed_count = 1
    wait_time = constant_throughput(float(os.environ.get("MODELGATE_LOAD_SLOW_RPS", "3")))

    def on_start(self) -> None:
        if KEYS.slow is None:
            log.warning("no over-limit tenant: set MODELGATE_ADMIN_KEY or MODELGATE_LOAD_SLOW_KEY")
        else:
            self.tenant, self.key = KEYS.slow
            self.suffix = f" [{self.tenant}]"
