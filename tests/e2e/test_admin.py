"""End to end: the admin API, tenant isolation, and admin changes reaching every worker.

Most tests run on the session gateway (one process, in-memory state) and make tenants of their
own with unique names, so they never change the tenants other tests rely on. The propagation
tests use the ``--workers 2`` gateway on Redis shared with ``test_accounting`` (its tenant
``prop``) and tell the workers apart by asking ``/proc`` which process holds the server side of
each connection.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, LIMITED_KEY, TENANT_KEY
from tests.e2e.test_accounting import PROP_KEY, connection_owner, shared_gateway, worker_pids
from tests.harness import Gateway, MockUpstream, RedisServer, wait_for

MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT_ESTIMATE = 8
"""The gateway's estimate for MESSAGES: 3 priming + 4 for the message + ceil(2 chars / 4)."""
COMPLETION = 12
"""The mock's reply: 12 words, 12 completion tokens (with max_tokens = 12 too)."""
REQUEST_TOKENS = PROMPT_ESTIMATE + COMPLETION
"""What one CHAT request reserves and uses: reservation and actual usage are equal."""
CHAT = {"model": "mock", "messages": MESSAGES, "max_tokens": COMPLETION}


# --- helpers: HTTP ---------------------------------------------------------------------------

_CLIENTS: list[httpx.Client] = []


@pytest.fixture(scope="module", autouse=True)
def http_client() -> Iterator[httpx.Client]:
    """One client for the module: making an ``httpx.Client`` per call costs ~80 ms (its TLS context)."""
    with httpx.Client(timeout=10) as client:
        _CLIENTS.append(client)
        yield client
        _CLIENTS.remove(client)


def web() -> httpx.Client:
    return _CLIENTS[-1]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def admin(
    gateway: Gateway, method: str, path: str, body: Any = None, *, raw: bytes | None = None
) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    content = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if content is not None:
        headers["content-type"] = "application/json"
    return web().request(method, f"{gateway.url}/admin{path}", content=content, headers=headers)


def chat(gateway: Gateway, key: str, task_id: str | None = None, **changes: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if task_id is not None:
        headers["x-task-id"] = task_id
    return web().post(f"{gateway.url}/v1/chat/completions", json={**CHAT, **changes}, headers=headers)


def models_of(gateway: Gateway, key: str) -> httpx.Response:
    return web().get(f"{gateway.url}/v1/models", headers={"authorization": f"Bearer {key}"})


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code


def new_tenant(gateway: Gateway, settings: dict[str, Any], prefix: str = "adm") -> tuple[str, str, str]:
    """A tenant made through the admin API, and one key: (name, key_id, key)."""
    name = unique(prefix)
    response = admin(gateway, "PUT", f"/tenants/{name}", settings)
    assert response.status_code == 200, response.text
    created = admin(gateway, "POST", f"/tenants/{name}/keys")
    assert created.status_code == 201, created.text
    return name, created.json()["key_id"], created.json()["key"]


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert error_code(response) == code, response.text
    assert response.headers["x-should-retry"] == "false"


# --- helpers: requests whose worker is known -------------------------------------------------


@dataclass
class Answer:
    status: int
    body: dict[str, Any]
    pid: int | None
    at: float


class Connection:
    """One keep-alive connection to a gateway that knows which worker process serves it."""

    def __init__(self, gateway: Gateway, pids: set[int]) -> None:
        self.gateway, self.pids = gateway, pids
        self.conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
        self.pid: int | None = None

    def request(self, method: str, path: str, key: str, body: Any = None) -> Answer:
        headers = {"authorization": f"Bearer {key}"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        self.conn.request(method, path, body=payload, headers=headers)
        response = self.conn.getresponse()
        data = response.read()
        if self.pid is None:  # the worker has accepted the connection by the time it answers
            assert self.conn.sock is not None
            self.pid = connection_owner(self.gateway.port, self.conn.sock.getsockname()[1], self.pids)
        return Answer(response.status, json.loads(data) if data else {}, self.pid, time.monotonic())

    def close(self) -> None:
        self.conn.close()


def pinned(gateway: Gateway, pids: set[int]) -> dict[int, Connection]:
    """An open connection to each worker, known before any request is sent on it."""
    found: dict[int, Connection] = {}
    for _ in range(50):
        connection = Connection(gateway, pids)
        connection.conn.connect()
        assert connection.conn.sock is not None
        port = connection.conn.sock.getsockname()[1]

        def accepted(c: Connection = connection, p: int = port) -> bool:
            c.pid = connection_owner(gateway.port, p, pids)
            return c.pid is not None

        wait_for(accepted, 5, "the connection to be accepted")
        assert connection.pid is not None
        if connection.pid in found:
            connection.close()
        else:
            found[connection.pid] = connection
        if len(found) == len(pids):
            return found
    raise AssertionError(f"no connection reached every worker: {sorted(found)} of {sorted(pids)}")


@dataclass
class Propagation:
    """How long after a change every worker answered according to it."""

    per_worker: dict[int, float] = field(default_factory=dict)
    probes: int = 0
    stale: int = 0

    @property
    def worst(self) -> float:
        return max(self.per_worker.values())


def until_every_worker_agrees(
    gateway: Gateway,
    pinned: dict[int, Connection],
    request: Callable[[Connection], Answer],
    agrees: Callable[[Answer], bool],
    since: float,
    runs: int = 8,
) -> Propagation:
    """Probe until each worker has given ``runs`` agreeing answers in a row since its last stale one.

    Each round asks every worker on its pinned connection (so each is probed every round) and
    one more on a fresh connection (either worker may take it). A worker's propagation time is
    from ``since`` to the first answer of its final agreeing run.
    """
    pids = set(pinned)
    result = Propagation()
    first_of_run: dict[int, float] = {}
    run: dict[int, int] = dict.fromkeys(pids, 0)
    deadline = since + 5.0
    while time.monotonic() < deadline:
        extra = Connection(gateway, pids)
        try:
            answers = [request(c) for c in pinned.values()] + [request(extra)]
        finally:
            extra.close()
        for answer in answers:
            result.probes += 1
            assert answer.pid in pids, f"could not tell which worker answered: {answer}"
            if not agrees(answer):
                result.stale += 1
                run[answer.pid] = 0
                first_of_run.pop(answer.pid, None)
                continue
            first_of_run.setdefault(answer.pid, answer.at)
            run[answer.pid] += 1
        if all(count >= runs for count in run.values()):
            result.per_worker = {pid: first_of_run[pid] - since for pid in pids}
            return result
    raise AssertionError(f"the workers did not all agree within 5 s: runs {run}, {result}")


# --- the admin API ---------------------------------------------------------------------------


def test_tenant_and_key_lifecycle(gateway: Gateway) -> None:
    name = unique("life")
    assert_refused(admin(gateway, "GET", f"/tenants/{name}"), 404, "not_found")
    settings = {
        "rpm": 100,
        "tpm": 100000,
        "max_concurrency": 4,
        "budget": {"tokens": 1000, "period": "day"},
        "task_max_tokens": 500,
        "models": ["mock"],
    }
    created = admin(gateway, "PUT", f"/tenants/{name}", settings)
    assert created.status_code == 200, created.text
    view = created.json()
    assert {k: view[k] for k in settings} == {
        **settings,
        "budget": {"usd": None, "tokens": 1000, "period": "day"},
    }
    assert view["usage"]["tokens"] == 0 and view["usage"]["requests"] == 0
    assert view["remaining"] == {"tokens": 1000}
    assert view["keys"] == []

    made = admin(gateway, "POST", f"/tenants/{name}/keys")
    assert made.status_code == 201, made.text
    assert set(made.json()) == {"key_id", "key"}
    key_id, key = made.json()["key_id"], made.json()["key"]
    reply = chat(gateway, key)  # at once, on the worker that made it (the only one here)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["total_tokens"] == REQUEST_TOKENS

    shown = admin(gateway, "GET", f"/tenants/{name}")
    assert shown.status_code == 200
    view = shown.json()
    assert view["keys"] == [key_id]
    assert view["usage"]["requests"] == 1 and view["usage"]["tokens"] == REQUEST_TOKENS
    assert view["remaining"] == {"tokens": 1000 - REQUEST_TOKENS}
    assert view["budget"] == {"usd": None, "tokens": 1000, "period": "day"}
    assert key not in shown.text, "key material must never be shown again"

    revoked = admin(gateway, "DELETE", f"/tenants/{name}/keys/{key_id}")
    assert revoked.status_code == 200, revoked.text
    assert_refused(chat(gateway, key), 401, "invalid_api_key")
    assert_refused(models_of(gateway, key), 401, "invalid_api_key")
    assert admin(gateway, "GET", f"/tenants/{name}").json()["keys"] == []
    assert_refused(admin(gateway, "DELETE", f"/tenants/{name}/keys/{key_id}"), 404, "not_found")
    assert_refused(admin(gateway, "DELETE", f"/tenants/{name}/keys/key_000000000000"), 404, "not_found")


def test_put_updates_only_the_fields_given_and_null_clears(gateway: Gateway) -> None:
    name, _, _ = new_tenant(gateway, {"rpm": 10, "tpm": 5000, "models": ["mock"]})
    changed = admin(gateway, "PUT", f"/tenants/{name}", {"tpm": 6000, "models": None}).json()
    assert (changed["rpm"], changed["tpm"], changed["models"]) == (10, 6000, None)
    budget = admin(gateway, "PUT", f"/tenants/{name}/budget", {"usd": 2.5}).json()
    assert budget["budget"] == {"usd": 2.5, "tokens": None, "period": "month"}
    assert budget["remaining"] == {"usd": 2.5}
    assert (budget["rpm"], budget["tpm"]) == (10, 6000)


def test_unknown_tenant_is_404_everywhere(gateway: Gateway) -> None:
    name = unique("ghost")
    assert_refused(admin(gateway, "GET", f"/tenants/{name}"), 404, "not_found")
    assert_refused(admin(gateway, "PUT", f"/tenants/{name}/budget", {"tokens": 5}), 404, "not_found")
    assert_refused(admin(gateway, "POST", f"/tenants/{name}/keys"), 404, "not_found")
    assert_refused(admin(gateway, "DELETE", f"/tenants/{name}/keys/key_000000000000"), 404, "not_found")
    assert admin(gateway, "GET", f"/tenants/{name}").status_code == 404, "nothing was created on the way"


BAD_TENANT_BODIES = {
    "malformed json": b'{"rpm": ',
    "not an object": b"[]",
    "unknown field": b'{"rpm": 5, "colour": "red"}',
    "wrong type": b'{"rpm": "ten"}',
    "not positive": b'{"max_concurrency": 0}',
    "models not a list": b'{"models": "mock"}',
    "unknown model": b'{"models": ["mock", "no-such-model"]}',
    "budget with usd and tokens": b'{"budget": {"usd": 1.0, "tokens": 5}}',
    "budget with neither": b'{"budget": {"period": "day"}}',
    "budget bad period": b'{"budget": {"usd": 1.0, "period": "week"}}',
}
BAD_BUDGET_BODIES = {
    "malformed json": b"{usd: 1}",
    "empty": b"",
    "usd and tokens": b'{"usd": 1.0, "tokens": 5, "period": "day"}',
    "neither": b'{"period": "day"}',
    "unknown field": b'{"usd": 1.0, "currency": "eur"}',
    "wrong type": b'{"usd": "lots"}',
    "negative": b'{"tokens": -1}',
    "fractional tokens": b'{"tokens": 1.5}',
    "bad period": b'{"tokens": 5, "period": "fortnight"}',
}


@pytest.fixture(scope="module")
def steady_tenant(gateway: Gateway) -> str:
    name, _, _ = new_tenant(
        gateway, {"rpm": 10, "budget": {"tokens": 100, "period": "day"}, "models": ["mock"]}
    )
    return name


@pytest.mark.parametrize("body", BAD_TENANT_BODIES.values(), ids=BAD_TENANT_BODIES.keys())
def test_bad_tenant_bodies_are_400_and_change_nothing(
    gateway: Gateway, steady_tenant: str, body: bytes
) -> None:
    before = admin(gateway, "GET", f"/tenants/{steady_tenant}").json()
    assert_refused(admin(gateway, "PUT", f"/tenants/{steady_tenant}", raw=body), 400, "invalid_request")
    assert admin(gateway, "GET", f"/tenants/{steady_tenant}").json() == before


@pytest.mark.parametrize("body", BAD_BUDGET_BODIES.values(), ids=BAD_BUDGET_BODIES.keys())
def test_bad_budget_bodies_are_400_and_change_nothing(
    gateway: Gateway, steady_tenant: str, body: bytes
) -> None:
    before = admin(gateway, "GET", f"/tenants/{steady_tenant}").json()
    assert_refused(
        admin(gateway, "PUT", f"/tenants/{steady_tenant}/budget", raw=body), 400, "invalid_request"
    )
    assert admin(gateway, "GET", f"/tenants/{steady_tenant}").json() == before


def test_bad_tenant_names_are_400(gateway: Gateway) -> None:
    for name in ("-dash-first", "has%20space", "x" * 65):
        assert_refused(admin(gateway, "PUT", f"/tenants/{name}", {}), 400, "invalid_request")


@pytest.mark.parametrize("period", ["day", "month", "total"])
def test_exhausted_budget_is_429_insufficient_quota(gateway: Gateway, period: str) -> None:
    budget = 2 * REQUEST_TOKENS
    name, _, key = new_tenant(gateway, {"budget": {"tokens": budget, "period": period}, "models": ["mock"]})
    for _ in range(2):
        assert chat(gateway, key).status_code == 200
    refused = chat(gateway, key)
    assert_refused(refused, 429, "insufficient_quota")
    assert refused.json()["error"]["type"] == "insufficient_quota"
    assert name in refused.json()["error"]["message"]
    retry_after = refused.headers.get("retry-after")
    if period == "total":
        assert retry_after is None, "no period reset will help: no retry-after"
        assert "retry-after-ms" not in refused.headers
    else:
        limit = 86_400 if period == "day" else 31 * 86_400
        assert retry_after is not None and 1 <= int(retry_after) <= limit
    view = admin(gateway, "GET", f"/tenants/{name}").json()
    assert view["usage"]["tokens"] == budget and view["usage"]["requests"] == 2
    assert view["remaining"] == {"tokens": 0}
    # a smaller request still does not fit in nothing; a raised budget lets it through at once
    assert_refused(chat(gateway, key, max_tokens=1), 429, "insufficient_quota")
    admin(gateway, "PUT", f"/tenants/{name}/budget", {"tokens": budget + REQUEST_TOKENS, "period": period})
    assert chat(gateway, key).status_code == 200


def test_task_max_tokens_is_per_task(gateway: Gateway) -> None:
    name, _, key = new_tenant(gateway, {"task_max_tokens": 2 * REQUEST_TOKENS, "models": ["mock"]})
    task, other = unique("task"), unique("task")
    assert chat(gateway, key, task).status_code == 200
    assert chat(gateway, key, task).status_code == 200
    refused = chat(gateway, key, task)
    assert_refused(refused, 429, "insufficient_quota")
    assert "task_max_tokens" in refused.json()["error"]["message"]
    assert "retry-after" not in refused.headers, "a task's ceiling never resets"
    assert chat(gateway, key, other).status_code == 200, "another task still works"
    assert chat(gateway, key).status_code == 200, "calls outside any task still work"
    # a request whose reservation alone would pass the ceiling is refused before it runs
    assert_refused(chat(gateway, key, unique("task"), max_tokens=100), 429, "insufficient_quota")
    usage = admin(gateway, "GET", f"/tasks/{task}").json()
    assert (usage["tenant"], usage["requests"]) == (name, 2)
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2 * REQUEST_TOKENS


def test_unknown_task_is_404_and_bad_task_id_400(gateway: Gateway) -> None:
    assert_refused(admin(gateway, "GET", f"/tasks/{unique('never')}"), 404, "not_found")
    assert_refused(admin(gateway, "GET", "/tasks/bad%20id"), 400, "invalid_request")


# --- isolation -------------------------------------------------------------------------------


ADMIN_ROUTES = [
    ("GET", "/admin/tenants/acme", None),
    ("PUT", "/admin/tenants/iso-probe-not-created", {"rpm": 1}),
    ("PUT", "/admin/tenants/acme", {"rpm": 1}),
    ("PUT", "/admin/tenants/acme/budget", {"tokens": 1}),
    ("POST", "/admin/tenants/acme/keys", None),
    ("DELETE", "/admin/tenants/acme/keys/key_000000000000", None),
    ("GET", "/admin/tasks/some-task", None),
    ("GET", "/admin/breakers", None),
    ("POST", "/admin/breakers/up/gpt-4o-mini/reset", None),
]
NOT_ADMIN = {
    "missing": None,
    "wrong key": "Bearer not-the-admin-key-0123456789",
    "tenant key": f"Bearer {TENANT_KEY}",
    "other tenant key": f"Bearer {LIMITED_KEY}",
    "admin key, wrong scheme": f"Basic {ADMIN_KEY}",
    "bearer without key": "Bearer",
}


@pytest.mark.parametrize("authorization", NOT_ADMIN.values(), ids=NOT_ADMIN.keys())
def test_admin_routes_refuse_anything_but_the_admin_key(gateway: Gateway, authorization: str | None) -> None:
    headers = {"authorization": authorization} if authorization is not None else {}
    before = admin(gateway, "GET", "/tenants/acme").json()
    for method, path, body in ADMIN_ROUTES:
        response = web().request(method, f"{gateway.url}{path}", json=body, headers=headers)
        assert_refused(response, 401, "invalid_api_key")
    # nothing was changed on the way
    assert admin(gateway, "GET", "/tenants/acme").json() == before
    assert admin(gateway, "GET", "/tenants/iso-probe-not-created").status_code == 404


def test_tenants_see_only_their_own_data(gateway: Gateway, upstream: MockUpstream) -> None:
    a, _, key_a = new_tenant(
        gateway, {"rpm": 50, "models": ["mock"], "task_max_tokens": 2 * REQUEST_TOKENS}, prefix="iso-a"
    )
    b, _, key_b = new_tenant(
        gateway,
        {"rpm": 70, "models": ["gpt-4o-mini"], "task_max_tokens": 2 * REQUEST_TOKENS},
        prefix="iso-b",
    )
    answers: list[httpx.Response] = []

    def as_a(response: httpx.Response) -> httpx.Response:
        answers.append(response)
        return response

    # /v1/models: each its own list
    assert [m["id"] for m in as_a(models_of(gateway, key_a)).json()["data"]] == ["mock"]
    assert [m["id"] for m in models_of(gateway, key_b).json()["data"]] == ["gpt-4o-mini"]
    # the same task id in both tenants: separate accounting, separate ceilings
    task = unique("shared")
    for _ in range(2):
        assert chat(gateway, key_b, task, model="gpt-4o-mini").status_code == 200
    assert_refused(chat(gateway, key_b, task, model="gpt-4o-mini"), 429, "insufficient_quota")
    ok = as_a(chat(gateway, key_a, task))
    assert ok.status_code == 200, "B's use of the task id must not count against A"
    assert ok.headers["x-ratelimit-limit-requests"] == "50", "A's own buckets, not B's"
    assert as_a(chat(gateway, key_a, task)).status_code == 200
    refused = as_a(chat(gateway, key_a, task))
    assert_refused(refused, 429, "insufficient_quota")
    assert a in refused.json()["error"]["message"]
    assert_refused(as_a(chat(gateway, key_a, model="gpt-4o-mini")), 403, "model_not_allowed")
    # no /v1 route reads task usage or other tenants
    for path in (f"/v1/tasks/{task}", "/v1/tenants/self", f"/v1/admin/tasks/{task}"):
        response = as_a(web().get(f"{gateway.url}{path}", headers={"authorization": f"Bearer {key_a}"}))
        assert response.status_code in (404, 405), response.text
    assert_refused(
        as_a(web().get(f"{gateway.url}/admin/tasks/{task}", headers={"authorization": f"Bearer {key_a}"})),
        401,
        "invalid_api_key",
    )
    for response in answers:
        text = response.text + json.dumps(dict(response.headers))
        assert (
            b not in text
            and key_b not in text
            and "gpt-4o-mini" not in text.replace("model 'gpt-4o-mini'", "")
        ), f"tenant B's data in an answer to A: {response.request.url} {text}"


# --- propagation across workers --------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(
    request: pytest.FixtureRequest,
    session_tmp: Path,
    mock_upstream_process: MockUpstream,
    redis_server: RedisServer,
) -> tuple[Gateway, set[int], str]:
    """The ``--workers 2`` gateway on Redis that the accounting tests use too (one start for both)."""
    shared = shared_gateway(request, session_tmp, mock_upstream_process, redis_server)
    return shared.gateway, worker_pids(shared.gateway), PROP_KEY


def test_budget_change_reaches_every_worker_within_a_second(
    two_workers: tuple[Gateway, set[int], str], propagation: dict[str, Any]
) -> None:
    gateway, pids, key = two_workers
    pinned_ = pinned(gateway, pids)
    via = pinned_[min(pids)]  # the worker the admin changes go through

    def chat_on(connection: Connection) -> Answer:
        return connection.request("POST", "/v1/chat/completions", key, CHAT)

    def quota_refused(answer: Answer) -> bool:
        return answer.status == 429 and answer.body["error"]["code"] == "insufficient_quota"

    try:
        until_every_worker_agrees(gateway, pinned_, chat_on, lambda a: a.status == 200, time.monotonic())

        since = time.monotonic()
        changed = via.request("PUT", "/admin/tenants/prop/budget", ADMIN_KEY, {"tokens": 1, "period": "day"})
        assert changed.status == 200, changed.body
        assert quota_refused(chat_on(via)), "the worker that made the change applies it at once"
        lowered = until_every_worker_agrees(gateway, pinned_, chat_on, quota_refused, since)

        since = time.monotonic()
        restored = via.request(
            "PUT", "/admin/tenants/prop/budget", ADMIN_KEY, {"tokens": 10**9, "period": "day"}
        )
        assert restored.status == 200, restored.body
        assert chat_on(via).status == 200
        raised = until_every_worker_agrees(gateway, pinned_, chat_on, lambda a: a.status == 200, since)
    finally:
        for connection in pinned_.values():
            connection.close()

    propagation["budget lowered"] = lowered
    propagation["budget raised"] = raised
    assert lowered.worst < 1.0, lowered
    assert raised.worst < 1.0, raised


def test_key_creation_and_revocation_reach_every_worker_within_a_second(
    two_workers: tuple[Gateway, set[int], str], propagation: dict[str, Any]
) -> None:
    gateway, pids, _ = two_workers
    pinned_ = pinned(gateway, pids)
    via = pinned_[max(pids)]
    try:
        since = time.monotonic()
        made = via.request("POST", "/admin/tenants/prop/keys", ADMIN_KEY)
        assert made.status == 201, made.body
        key_id, key = made.body["key_id"], made.body["key"]
        assert via.request("GET", "/v1/models", key).status == 200, "the same worker takes it at once"

        def models_on(connection: Connection) -> Answer:
            return connection.request("GET", "/v1/models", key)

        created = until_every_worker_agrees(gateway, pinned_, models_on, lambda a: a.status == 200, since)

        since = time.monotonic()
        revoked = via.request("DELETE", f"/admin/tenants/prop/keys/{key_id}", ADMIN_KEY)
        assert revoked.status == 200, revoked.body
        assert via.request("GET", "/v1/models", key).status == 401, "the same worker refuses it at once"
        gone = until_every_worker_agrees(
            gateway,
            pinned_,
            models_on,
            lambda a: a.status == 401 and a.body["error"]["code"] == "invalid_api_key",
            since,
        )
    finally:
        for connection in pinned_.values():
            connection.close()

    propagation["key created"] = created
    propagation["key revoked"] = gone
    assert created.worst < 1.0, created
    assert gone.worst < 1.0, gone


@pytest.fixture(scope="module")
def propagation() -> Iterator[dict[str, Any]]:
    """Collects the measured propagation times; printed at the end of the module (``-s``)."""
    measured: dict[str, Any] = {}
    yield measured
    for what, result in measured.items():
        times = ", ".join(f"{t * 1000:.0f} ms" for t in sorted(result.per_worker.values()))
        print(f"\npropagation, {what}: per worker {times} ({result.probes} probes, {result.stale} stale)")


def test_admin_reads_its_own_writes_on_every_worker(two_workers: tuple[Gateway, set[int], str]) -> None:
    """An operator's script creates a tenant, then its key; with two workers the two calls may
    land on different workers. The second must see the first, as it does on one worker."""
    gateway, pids, _ = two_workers
    connections = pinned(gateway, pids)
    first, second = (connections[pid] for pid in sorted(pids))
    try:
        outcomes = []
        for _ in range(5):  # one try could fall just after the other worker's reload
            name = unique("ryw")
            assert (
                first.request("PUT", f"/admin/tenants/{name}", ADMIN_KEY, {"models": ["mock"]}).status == 200
            )
            outcomes.append(second.request("POST", f"/admin/tenants/{name}/keys", ADMIN_KEY).status)
    finally:
        first.close()
        second.close()
    assert outcomes == [201] * 5, f"POST keys right after PUT through the other worker: {outcomes}"
