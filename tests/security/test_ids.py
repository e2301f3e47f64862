"""Client-chosen ids are validated before they reach logs, metrics, spans or Redis keys.

``X-Task-Id`` must be 1-128 characters of ``[A-Za-z0-9._:-]`` or the request is refused with 400
before anything is recorded; an ``X-Request-Id`` that is not is replaced by a fresh id. Every bad
value carries a marker, and after each request the gateway's whole output (JSON log lines and
the spans the console exporter prints), its metrics and every key of its private Redis are
searched for that marker. Header bytes no HTTP parser accepts (control characters, bare line
feeds, folded lines) are refused before the gateway sees them. Ids that reach Redis through the
admin API (task ids and tenant names in paths) are checked the same way.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.harness import wait_for
from tests.security.conftest import ADMIN, PREFIX, TENANT, World
from tests.security.support import error_of, request_line

MARK = "idmark" + uuid.uuid4().hex[:8]
M = MARK.encode()
PATH_MARK = "pathmark" + uuid.uuid4().hex[:8]
"""Marks ids sent in admin paths: spans record a request's path (``url.path``) as it came."""
AUTH = {"authorization": f"Bearer {TENANT}"}
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
FRESH_ID = re.compile(r"[0-9a-f]{24}")
SAFE_KEY = re.compile(r"[A-Za-z0-9._:/{}%-]+")
"""What any Redis key of the gateway may be made of (target names bring the ``/``; a ``:`` inside
a name or id is escaped as ``%3A``)."""

BAD_IDS: dict[str, bytes] = {
    "empty": b"",
    "129 chars": b"x" * 129,
    "10k chars": M + b"x" * 10_000,
    "hash tag": M + b"{tag}",
    "whole hash tag": b"{" + M + b"}",
    "glob star": M + b"*",
    "star alone": b"*",
    "glob question": M + b"?",
    "glob class": M + b"[ab]",
    "space": M + b" space",
    "tab": M + b"\ttab",
    "slash": M + b"/slash",
    "backslash": M + b"\\back",
    "semicolon": M + b";semi",
    "quote": M + b'"quote',
    "encoded crlf": M + b"%0d%0aX-Evil:1",
    "latin-1": M + "ünï".encode("latin-1"),
    "utf-8 line separator": M + "\u2028".encode(),
    "shell": M + b"$(id)",
    "lookup": M + b"${jndi:ldap://x}",
}
UNPARSEABLE: dict[str, bytes] = {
    "escape": M + b"\x1b[31mred",
    "nul": M + b"\x00nul",
    "del": M + b"\x7fdel",
    "folded line": M + b"\r\n injected",
    "bare line feed": M + b"\nX-Injected: 1",
}


@pytest.fixture(scope="module")
def web(world: World) -> Iterator[httpx.Client]:
    """A client, after one sane request with a task id has put the tenant's state in Redis."""
    with httpx.Client(timeout=10) as client:
        headers = {**AUTH, "x-task-id": f"seed-{uuid.uuid4().hex[:8]}"}
        assert (
            client.post(f"{world.gateway.url}/v1/chat/completions", json=CHAT, headers=headers).status_code
            == 200
        )
        yield client


def chat(web: httpx.Client, world: World, headers: dict[str, Any]) -> httpx.Response:
    return web.post(f"{world.gateway.url}/v1/chat/completions", json=CHAT, headers={**AUTH, **headers})


def recorded(world: World, request_id: str) -> dict[str, Any]:
    """The request's log line, once its span has been exported too (so the output is complete)."""
    span = f'"modelgate.request_id": "{request_id}"'
    wait_for(lambda: span in world.gateway.output(), 10, f"the span of {request_id}")
    line = request_line(world.gateway.output(), request_id)
    assert line is not None, f"no log line for {request_id}"
    return line


def redis_keys(world: World) -> list[str]:
    with world.redis_client() as client:
        return sorted(key.decode("latin-1") for key in client.keys("*"))


def metrics_text(web: httpx.Client, world: World) -> str:
    response = web.get(f"{world.gateway.url}/metrics", headers=ADMIN_AUTH)
    assert response.status_code == 200
    return response.text


def assert_nowhere(web: httpx.Client, world: World, mark: str = MARK) -> None:
    """``mark`` is in no log line, span, metric or Redis key, and every key is well formed.

    ``PATH_MARK`` may be in the ``url.path`` of a span: that attribute is the request's path.
    """
    found = [line for line in world.gateway.output().splitlines() if mark in line]
    if mark == PATH_MARK:
        found = [line for line in found if not line.strip().startswith('"url.path": ')]
    assert not found
    assert mark not in metrics_text(web, world)
    keys = redis_keys(world)
    assert keys, "the gateway keeps its state in this Redis"
    assert not [k for k in keys if mark in k]
    assert not [k for k in keys if not SAFE_KEY.fullmatch(k)]


def raw_request(world: World, header: bytes, value: bytes) -> bytes:
    """One HTTP/1.1 request written byte for byte (no client library would send these headers)."""
    body = json.dumps(CHAT).encode()
    head = [
        b"POST /v1/chat/completions HTTP/1.1",
        b"host: 127.0.0.1",
        b"authorization: Bearer " + TENANT.encode(),
        b"content-type: application/json",
        b"connection: close",
        b"content-length: " + str(len(body)).encode(),
        header + b": " + value,
    ]
    with socket.create_connection(("127.0.0.1", world.gateway.port), timeout=10) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("value", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_a_bad_task_id_is_refused_before_it_is_recorded(
    world: World, web: httpx.Client, value: bytes
) -> None:
    request_id = f"bad-task-{uuid.uuid4().hex[:12]}"
    response = chat(web, world, {"x-task-id": value, "x-request-id": request_id})
    error = error_of(response, 400, "invalid_request")
    assert error["param"] == "X-Task-Id"
    assert MARK not in response.text, "the error does not echo the bad id"
    line = recorded(world, request_id)
    assert (line["status"], line["error"], line["task_id"]) == (400, "invalid_request", None)
    assert_nowhere(web, world)


@pytest.mark.parametrize("value", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_a_bad_request_id_is_replaced_before_it_is_recorded(
    world: World, web: httpx.Client, value: bytes
) -> None:
    response = chat(web, world, {"x-request-id": value})
    assert response.status_code == 200, response.text
    fresh = response.headers["x-request-id"]
    assert FRESH_ID.fullmatch(fresh), fresh
    line = recorded(world, fresh)
    assert line["status"] == 200
    assert_nowhere(web, world)


@pytest.mark.parametrize("header", [b"X-Task-Id", b"X-Request-Id"])
@pytest.mark.parametrize("value", UNPARSEABLE.values(), ids=UNPARSEABLE.keys())
def test_unparseable_header_bytes_never_reach_the_gateway(
    world: World, web: httpx.Client, header: bytes, value: bytes
) -> None:
    answer = raw_request(world, header, value)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    # a sane request after it: once its span is out, everything before it is in the output too
    request_id = f"after-raw-{uuid.uuid4().hex[:12]}"
    assert chat(web, world, {"x-request-id": request_id}).status_code == 200
    recorded(world, request_id)
    assert_nowhere(web, world)


def test_sane_ids_are_kept_and_keyed_exactly(world: World, web: httpx.Client) -> None:
    task_id = f"task:{uuid.uuid4().hex[:8]}.a-b_c"
    request_id = f"req:{uuid.uuid4().hex[:8]}.a-b_c"
    response = chat(web, world, {"x-task-id": task_id, "x-request-id": request_id})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == request_id
    line = recorded(world, request_id)
    assert line["task_id"] == task_id
    escaped = task_id.replace(":", "%3A")  # a ":" inside an id is escaped in key names
    assert [k for k in redis_keys(world) if escaped in k] == [f"{{{PREFIX}}}:t:acme:task:{escaped}"]
    assert_nowhere(web, world)


ADMIN_PATH_IDS = {
    "glob star": PATH_MARK + "*",
    "hash tag": PATH_MARK + "{tag}",
    "space": PATH_MARK + " space",
    "129 chars": PATH_MARK + "x" * 129,
    "latin-1": PATH_MARK + "ünï",
    "line feed": PATH_MARK + "\nX",
}


@pytest.mark.parametrize("task_id", ADMIN_PATH_IDS.values(), ids=ADMIN_PATH_IDS.keys())
def test_the_admin_task_route_validates_its_id(world: World, web: httpx.Client, task_id: str) -> None:
    url = f"{world.gateway.url}/admin/tasks/{quote(task_id, safe='')}"
    error = error_of(web.get(url, headers=ADMIN_AUTH), 400, "invalid_request")
    assert error["param"] == "task_id"
    assert_nowhere(web, world, PATH_MARK)


TENANT_NAMES = {
    "glob star": PATH_MARK + "*",
    "hash tag": PATH_MARK + "{tag}",
    "space": PATH_MARK + " space",
    "65 chars": PATH_MARK + "x" * 65,
    "leading dash": "-" + PATH_MARK,
    "latin-1": PATH_MARK + "ünï",
    "line feed": PATH_MARK + "\nX",
}


@pytest.mark.parametrize("name", TENANT_NAMES.values(), ids=TENANT_NAMES.keys())
def test_admin_tenant_names_are_validated_before_they_are_keys(
    world: World, web: httpx.Client, name: str
) -> None:
    url = f"{world.gateway.url}/admin/tenants/{quote(name, safe='')}"
    response = web.put(url, json={"rpm": 5}, headers=ADMIN_AUTH)
    error = error_of(response, 400, "invalid_request")
    assert error["param"] == "name"
    assert web.get(url, headers=ADMIN_AUTH).status_code == 404
    assert_nowhere(web, world, PATH_MARK)


def test_metrics_carry_no_client_ids(world: World, web: httpx.Client) -> None:
    text = metrics_text(web, world)
    assert "modelgate_requests_total" in text
    labels = set(re.findall(r"[{,]([a-z_]+)=", text))
    assert labels, "the scrape has labelled series"
    assert not labels & {"task_id", "request_id", "task", "request"}


def test_a_task_id_cannot_reach_another_tenants_keys(world: World, web: httpx.Client) -> None:
    tenant = f"colon-{uuid.uuid4().hex[:8]}"
    neighbour = f"{tenant}:task:x"
    keys: dict[str, str] = {}
    for name in (tenant, neighbour):
        assert (
            web.put(f"{world.gateway.url}/admin/tenants/{name}", json={}, headers=ADMIN_AUTH).status_code
            == 200
        )
        made = web.post(f"{world.gateway.url}/admin/tenants/{name}/keys", headers=ADMIN_AUTH)
        assert made.status_code == 201
        keys[name] = made.json()["key"]
    headers = {"authorization": f"Bearer {keys[neighbour]}", "x-task-id": "y"}
    assert web.post(f"{world.gateway.url}/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    headers = {"authorization": f"Bearer {keys[tenant]}", "x-task-id": "x:task:y"}
    assert web.post(f"{world.gateway.url}/v1/chat/completions", json=CHAT, headers=headers).status_code == 200

    # each made one request under its own task; both land in '{prefix}:t:<tenant>:task:x:task:y'
    for task_id, owner in (("y", neighbour), ("x:task:y", tenant)):
        view = web.get(f"{world.gateway.url}/admin/tasks/{task_id}", headers=ADMIN_AUTH).json()
        assert view["requests"] == 1, f"task {task_id!r} of {owner!r} holds another tenant's usage: {view}"
