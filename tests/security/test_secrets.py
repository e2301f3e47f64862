"""No secret in logs, errors, metrics or traces.

The gateway of this package holds every kind of secret a config can hold (the admin key, tenant
keys, upstream keys, a Redis password in the Redis URL), each drawn at random from letters that
no id, hash or log field is made of. One test drives it through as many failures as it can
reach: upstream 401/403/429/5xx, timeouts, garbage, cut streams, an upstream that echoes the
credentials it was sent, wrong and near-miss tenant keys, the admin key where a tenant key
belongs and the other way round, a key made and revoked through the admin API, and Redis going
away and coming back. Then everything an operator or a client could see (the JSON log at debug
level, the spans the console exporter printed, ``/metrics``, the admin views, every response's
status line, headers and body) is searched for each secret and for every 8-character piece of it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.secret import key_hash
from tests.harness import wait_for
from tests.security.conftest import (
    ADMIN,
    OTHER,
    SCRIPTED_ANT_KEY,
    SCRIPTED_KEY,
    SECRETS,
    TENANT,
    UP_KEY,
    World,
)
from tests.security.support import leaks, log_lines

AUTH = {"authorization": f"Bearer {TENANT}"}
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
ECHOED_STATUSES = (401, 403, 408, 409, 429, 500, 502, 503)
"""Upstream statuses the gateway answers with its own error: an upstream body that echoes the
credentials it was sent must not get through. (Other 4xx are passed back as they came: see
``test_a_passed_back_upstream_error_does_not_carry_the_gateways_key``.)"""


def chat_body(model: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 5,
    }


@dataclass
class Seen:
    """Everything the gateway let out, as text."""

    web: httpx.Client
    base: str
    texts: list[str] = field(default_factory=list)
    last_request_id: str = ""

    def call(
        self, method: str, path: str, headers: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        self.last_request_id = f"sec-{uuid.uuid4().hex[:12]}"
        headers = {"x-request-id": self.last_request_id, **(headers or {})}
        response = self.web.request(method, f"{self.base}{path}", headers=headers, **kw)
        self.texts.append(f"{response.status_code}\n{dict(response.headers)}\n{response.text}")
        return response

    def chat(self, model: str, stream: bool = False, headers: dict[str, str] | None = None) -> int:
        response = self.call(
            "POST", "/v1/chat/completions", {**AUTH, **(headers or {})}, json=chat_body(model, stream)
        )
        return response.status_code


def drive_upstream_failures(sec: World, seen: Seen) -> None:
    modes: list[dict[str, Any]] = [
        {"mode": "status", "status": 401},
        {"mode": "status", "status": 403},
        {"mode": "status", "status": 429},
        {"mode": "status", "status": 500},
        {"mode": "garbage"},
        {"mode": "close_mid_body"},
    ]
    for settings in modes:
        sec.mock.configure(**settings)
        for model in ("gpt-4o-mini", "claude-sonnet"):
            assert seen.chat(model) >= 400, (settings, model)
            seen.chat(model, stream=True)  # 200 with an error event when cut after its first chunk
    sec.mock.configure(mode="hang")
    assert seen.chat("gpt-4o-mini") == 504
    assert seen.chat("claude-sonnet", stream=True) == 504
    sec.mock.configure(mode="stall", stall_after=1)
    assert seen.chat("gpt-4o-mini", stream=True) == 200  # cut mid-stream: an error event
    sec.mock.reset()

    for status in ECHOED_STATUSES:
        sec.scripted.set(status=status, echo=True)
        for model in ("scripted", "scripted-claude"):
            answered = seen.chat(model)
            assert sec.scripted.received, "the scripted upstream was called"
            assert answered >= 400
    sec.scripted.set()


def drive_key_misuse(seen: Seen) -> None:
    near_misses = [TENANT[:-1], TENANT[1:], TENANT + "x", TENANT.upper(), TENANT[:20], f" {TENANT}x"]
    others = [ADMIN, ADMIN[:-1], UP_KEY, key_hash(TENANT), f"sha256:{key_hash(OTHER)}"]
    for key in near_misses + others:
        for scheme in ("Bearer", "Basic", "bearer"):
            auth = {"authorization": f"{scheme} {key}"}
            assert seen.call("GET", "/v1/models", auth).status_code == 401
        assert (
            seen.call("POST", "/v1/chat/completions", {"authorization": f"Bearer {key}"}).status_code == 401
        )
    assert seen.call("GET", "/v1/models", {"authorization": TENANT}).status_code == 401
    for key in (TENANT, OTHER, ADMIN[:-1], ADMIN + "x", UP_KEY):
        auth = {"authorization": f"Bearer {key}"}
        assert seen.call("GET", "/admin/tenants/acme", auth).status_code == 401
        assert seen.call("PUT", "/admin/tenants/acme", auth, json={"rpm": 1}).status_code == 401
        assert seen.call("GET", "/metrics", auth).status_code == 401
    # the admin API's own errors
    assert seen.call("PUT", "/admin/tenants/acme", ADMIN_AUTH, content=b"{not json").status_code == 400
    assert seen.call("PUT", "/admin/tenants/acme/budget", ADMIN_AUTH, json={"usd": "x"}).status_code == 400
    assert seen.call("DELETE", "/admin/tenants/acme/keys/key_000000000000", ADMIN_AUTH).status_code == 404


def drive_a_created_key(seen: Seen) -> str:
    """A key made through the admin API, used, revoked, used again. Its one showing is not kept."""
    made = seen.web.post(f"{seen.base}/admin/tenants/acme/keys", headers=ADMIN_AUTH)
    assert made.status_code == 201
    key: str = made.json()["key"]
    key_id: str = made.json()["key_id"]
    auth = {"authorization": f"Bearer {key}"}
    assert seen.call("POST", "/v1/chat/completions", auth, json=chat_body("mock")).status_code == 200
    assert seen.call("POST", "/v1/chat/completions", auth, json=chat_body("gpt-4o-mini")).status_code == 200
    assert seen.call("DELETE", f"/admin/tenants/acme/keys/{key_id}", ADMIN_AUTH).status_code == 200
    assert seen.call("POST", "/v1/chat/completions", auth, json=chat_body("mock")).status_code == 401
    assert seen.call("GET", "/v1/models", {"authorization": f"Bearer {key[:-1]}"}).status_code == 401
    return key


def drive_a_redis_outage(sec: World, seen: Seen) -> None:
    sec.redis.stop()
    try:
        assert seen.chat("mock") == 503
        assert seen.call("GET", "/readyz").status_code == 503
        seen.call("GET", "/metrics", ADMIN_AUTH)
        seen.call("GET", "/admin/tenants/acme", ADMIN_AUTH)
        seen.call("GET", "/admin/breakers", ADMIN_AUTH)
    finally:
        sec.redis.start()
    wait_for(
        lambda: seen.web.get(f"{seen.base}/readyz").status_code == 200, 15, "the gateway to see Redis again"
    )
    wait_for(lambda: seen.chat("mock") == 200, 15, "requests to pass again")


def test_no_secret_in_logs_errors_metrics_or_traces(sec: World) -> None:
    with httpx.Client(timeout=15) as web:
        seen = Seen(web, sec.gateway.url)
        assert seen.chat("gpt-4o-mini") == 200
        drive_upstream_failures(sec, seen)
        drive_key_misuse(seen)
        created = drive_a_created_key(seen)
        drive_a_redis_outage(sec, seen)
        for path in ("/metrics", "/admin/tenants/acme", "/admin/tenants/other", "/admin/breakers", "/readyz"):
            assert seen.call("GET", path, ADMIN_AUTH).status_code == 200, path
        seen.call("GET", "/schema/openapi.json")
        # the last request's span out means every earlier span is out too
        assert seen.chat("mock") == 200
        span = f'"modelgate.request_id": "{seen.last_request_id}"'
        wait_for(lambda: span in sec.gateway.output(), 10, "the last request's span")

    output = sec.gateway.output()
    entries = list(log_lines(output))
    errors = {entry.get("error") for entry in entries if entry.get("msg") == "request"}
    expected = {
        "upstream_error",
        "upstream_unavailable",
        "upstream_timeout",
        "invalid_api_key",
        "state_unavailable",
    }
    assert expected <= errors, f"the failures did not all happen: {expected - errors}"
    assert any(entry.get("msg") == "redis connectivity changed" for entry in entries)
    assert any(entry.get("level") == "debug" for entry in entries), "debug logging is on"
    assert '"name": "upstream attempt"' in output, "spans were exported"
    assert "modelgate_upstream_requests_total" in "\n".join(seen.texts)

    everything = "\n".join([output, *seen.texts])
    found = {name: leaks(everything, secret) for name, secret in SECRETS.items()}
    found["key made by the admin API"] = leaks(everything, created.removeprefix("mg-"))
    assert not {name: pieces for name, pieces in found.items() if pieces}


@pytest.mark.parametrize("model", ["scripted", "scripted-claude"])
def test_a_passed_back_upstream_error_does_not_carry_the_gateways_key(sec: World, model: str) -> None:
    sec.scripted.set(status=400, echo=True)
    response = httpx.post(f"{sec.gateway.url}/v1/chat/completions", json=chat_body(model), headers=AUTH)
    assert response.status_code == 400
    assert sec.scripted.received, "the scripted upstream was called"
    text = f"{dict(response.headers)}\n{response.text}"
    assert not leaks(text, SCRIPTED_KEY) and not leaks(text, SCRIPTED_ANT_KEY)
