"""The fuzzed gateway and the properties every one of its answers must have.

One real ``modelgate serve`` process for the whole fuzz package, on the session's private Redis
(its own key prefix, so admission and accounting run their real Lua scripts) and in front of the
session's mock upstream. It has the e2e config's models (``mock`` served in process, OpenAI- and
Anthropic-type targets on the mock upstream) plus two tenants of its own: ``fuzz-chat``, with every
kind of limit, for the chat body properties, and ``fuzz-admin``, which the schema fuzz may change
at will through the admin API. The body limit is small (64 KiB) so "huge" bodies stay cheap.

The properties are SPEC.md's "Errors" section: no 5xx but 502/503/504 with their documented codes,
and every error body exactly ``{"error": {"message", "type", "param", "code"}}`` as
``gateway.errors.render`` writes it, with ``x-should-retry: false``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck

from tests.conftest import ADMIN_KEY, TENANT_KEY, gateway_config
from tests.harness import Gateway, MockUpstream, RedisServer

BODY_LIMIT = 64 * 1024
"""``server.max_body_bytes`` of the fuzzed gateway."""
CHAT_TENANT = "fuzz-chat"
CHAT_KEY = "tenant-key-fuzz-chat-0123456789"
ADMIN_TENANT = "fuzz-admin"
ADMIN_TENANT_KEY = "tenant-key-fuzz-admin-0123456789"
MODELS = ("mock", "gpt-4o-mini", "renamed", "claude-sonnet")
"""The models of the e2e config: ``mock`` in process, the others on the mock upstream."""
TARGETS = ("local/mock", "up/gpt-4o-mini", "up/upstream-name", "claude/claude-sonnet-4-5")
KNOWN_TASK = "fuzz-known-task"
"""A task with recorded usage, so ``GET /admin/tasks/{task_id}`` has a 200 to find."""

CODES_BY_STATUS: dict[int, frozenset[str]] = {
    400: frozenset({"invalid_request"}),
    401: frozenset({"invalid_api_key"}),
    403: frozenset({"model_not_allowed"}),
    404: frozenset({"model_not_found", "not_found"}),
    405: frozenset({"method_not_allowed"}),
    413: frozenset({"request_too_large"}),
    429: frozenset({"rate_limit_exceeded", "insufficient_quota"}),
    502: frozenset({"upstream_error"}),
    503: frozenset({"upstream_unavailable", "state_unavailable"}),
    504: frozenset({"upstream_timeout"}),
}
"""SPEC.md's error table, plus the gateway's own 404 ``not_found`` (no such route or admin
resource) and 405 ``method_not_allowed``; README documents both."""
DOCUMENTED_5XX = frozenset({502, 503, 504})
SLOW_OR_BIG = [
    HealthCheck.too_slow,
    HealthCheck.filter_too_much,
    HealthCheck.data_too_large,
    HealthCheck.large_base_example,
]
"""Health checks the fuzz suppresses: every example is a real HTTP round trip (slow by Hypothesis's
measure) and some bodies are large on purpose."""


def fuzz_config(upstream_url: str, redis_url: str, prefix: str) -> str:
    """The e2e config with a small body limit, Redis, and the fuzz package's own tenants."""
    return (
        gateway_config(upstream_url, max_body_bytes=BODY_LIMIT)
        + f"""
[[tenants]]
name = "{CHAT_TENANT}"
keys = ["{CHAT_KEY}"]
rpm = 1000000
tpm = 1000000000
max_concurrency = 64
task_max_tokens = 100000000000
budget = {{ tokens = 1000000000000, period = "day" }}

[[tenants]]
name = "{ADMIN_TENANT}"
keys = ["{ADMIN_TENANT_KEY}"]

[redis]
url = "{redis_url}"
prefix = "{prefix}"
"""
    )


@dataclass
class FuzzTarget:
    """The fuzzed gateway: where it is, how to reach it and what the fixture prepared in it."""

    process: Gateway
    client: httpx.Client
    revocable_key_ids: list[str] = field(default_factory=list)
    """Ids of keys of ``fuzz-admin`` made for the schema fuzz to revoke."""

    @property
    def url(self) -> str:
        return self.process.url

    def log_size(self) -> int:
        return self.process.process.log_path.stat().st_size

    def error_lines(self, since: int = 0) -> list[str]:
        """Log lines at level error written after byte ``since``: each is an unhandled exception
        (a 500) or worse."""
        with self.process.process.log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        return [line for line in text.splitlines() if '"level":"error"' in line]


@pytest.fixture(scope="package")
def fuzz_gateway(
    session_tmp: Path, mock_upstream_process: MockUpstream, redis_server: RedisServer
) -> Iterator[FuzzTarget]:
    mock_upstream_process.reset()
    prefix = f"fuzz-{uuid.uuid4().hex[:10]}"
    process = Gateway(session_tmp, fuzz_config(mock_upstream_process.url, redis_server.url, prefix))
    process.start()
    client = httpx.Client(base_url=process.url, timeout=15.0)
    try:
        target = FuzzTarget(process, client)
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        for _ in range(3):
            created = client.post(f"/admin/tenants/{ADMIN_TENANT}/keys", headers=admin)
            created.raise_for_status()
            target.revocable_key_ids.append(created.json()["key_id"])
        headers = {"authorization": f"Bearer {TENANT_KEY}", "x-task-id": KNOWN_TASK}
        normal = client.post("/v1/chat/completions", headers=headers, content=normal_chat_body())
        normal.raise_for_status()
        yield target
    finally:
        client.close()
        process.stop()
        mock_upstream_process.reset()


@pytest.fixture
def stays_healthy(request: pytest.FixtureRequest, fuzz_gateway: FuzzTarget) -> Iterator[None]:
    """The test ends with the gateway serving and no unhandled exception in its log (but for a
    test that is expected to fail: its known bug logs one)."""
    before = fuzz_gateway.log_size()
    yield
    if request.node.get_closest_marker("xfail") is None:
        assert fuzz_gateway.error_lines(since=before) == []
    assert_still_serving(fuzz_gateway)


def normal_chat_body(model: str = "mock", **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def assert_still_serving(target: FuzzTarget) -> None:
    """Liveness, and an ordinary request, whole and streamed, still succeeds."""
    assert target.client.get("/healthz").status_code == 200
    auth = {"authorization": f"Bearer {CHAT_KEY}"}
    whole = target.client.post("/v1/chat/completions", headers=auth, content=normal_chat_body())
    assert whole.status_code == 200, whole.text
    assert whole.json()["object"] == "chat.completion"
    streamed = target.client.post("/v1/chat/completions", headers=auth, content=normal_chat_body(stream=True))
    assert streamed.status_code == 200, streamed.text
    assert streamed.text.endswith("data: [DONE]\n\n")


def assert_well_formed(
    status: int, headers: Mapping[str, str], body: bytes, what: str, path: str = ""
) -> None:
    """SPEC.md "Errors": no undocumented 5xx, every error in the OpenAI shape with
    ``x-should-retry: false``, and an ``x-request-id`` on every answer.

    ``headers`` must be case-insensitive (httpx's and requests' are). An error an upstream answered
    (``x-modelgate-attempts`` >= 1 on a 4xx) is passed back as it came, so its ``code`` is the
    upstream's; its shape is still checked. A stream's error event (a failure after the first
    byte) is an OpenAI error too. ``/readyz``'s 503 is SPEC.md's ``503 with the reason``.
    """
    assert headers.get("x-request-id"), f"{what}: no x-request-id"
    assert status != 500, f"{what}: 500 {body[:500]!r}"
    assert status < 500 or status in DOCUMENTED_5XX, f"{what}: undocumented status {status} {body[:500]!r}"
    if status == 503 and path == "/readyz":
        assert set(json.loads(body)) == {"status", "reason"}, f"{what}: {body[:500]!r}"
        return
    if status < 400:
        if headers.get("content-type", "").startswith("text/event-stream"):
            assert_stream_well_formed(body, what)
        return
    error = error_of(body, what, status)
    assert headers.get("x-should-retry") == "false", f"{what}: an error without x-should-retry: false"
    attempts = int(headers.get("x-modelgate-attempts", "0"))
    if status < 500 and attempts >= 1:
        assert error["code"] is None or isinstance(error["code"], str), f"{what}: {error}"
    else:
        assert error["code"] in CODES_BY_STATUS.get(status, frozenset()), (
            f"{what}: status {status} with code {error['code']!r}, not one SPEC.md gives that status"
        )


def assert_stream_well_formed(body: bytes, what: str) -> None:
    """Events of JSON ending with ``[DONE]``; an error event is an OpenAI error with a 5xx code."""
    events = [event for event in body.split(b"\n\n") if event.strip()]
    assert events and events[-1] == b"data: [DONE]", f"{what}: stream ends {events[-2:]!r}"
    for event in events[:-1]:
        assert event.startswith(b"data: "), f"{what}: {event[:200]!r}"
        chunk = json.loads(event.removeprefix(b"data: "))
        if "error" in chunk:
            error = error_of(event.removeprefix(b"data: "), what, 200)
            assert error["code"] in CODES_BY_STATUS[502] | CODES_BY_STATUS[503] | CODES_BY_STATUS[504]


def error_of(body: bytes, what: str, status: int) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error body, its shape checked."""
    try:
        parsed = json.loads(body)
    except ValueError:
        raise AssertionError(f"{what}: {status} body is not JSON: {body[:500]!r}") from None
    assert isinstance(parsed, dict), f"{what}: {status} body is not an object: {parsed!r}"
    assert set(parsed) == {"error"}, f"{what}: {status} body is not the OpenAI error shape: {parsed!r}"
    error = parsed["error"]
    assert isinstance(error, dict), f"{what}: {parsed!r}"
    assert set(error) == {"message", "type", "param", "code"}, f"{what}: {parsed!r}"
    assert isinstance(error["message"], str), f"{what}: {parsed!r}"
    assert error["message"].strip(), f"{what}: empty error message: {parsed!r}"
    assert isinstance(error["type"], str), f"{what}: {parsed!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{what}: {parsed!r}"
    return error
