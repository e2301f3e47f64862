"""End to end: budgets under concurrency, task usage, and usage surviving a restart.

One ``modelgate serve --workers 2`` on the private Redis, in front of the mock upstream, with
priced models; the admin propagation tests share it and use only their tenant ``prop``.

The mock's usage is exact: completion tokens = words replied (``max_tokens`` when it is at most
the default 12), prompt tokens = the gateway's own estimate. With ``max_tokens`` = 12 a request's
reservation (prompt estimate + max_tokens) therefore equals its actual usage, so a budget of ten
reservations fits exactly ten requests and the reservation-vs-actual gap is zero.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from policies.accounting import period
from policies.keys import Keys
from tests.conftest import ADMIN_KEY
from tests.harness import Gateway, MockUpstream, RedisServer, wait_for

MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT_ESTIMATE = 8
"""The gateway's estimate for MESSAGES: 3 priming + 4 for the message + ceil(2 chars / 4)."""
COMPLETION = 12
RESERVATION = PROMPT_ESTIMATE + COMPLETION
"""Tokens one race request reserves, and (the mock being exact) uses."""

PRICES = {"gpt-4o-mini": (30_000.0, 11_250.0), "claude-sonnet": (3.0, 15.0)}
"""USD per million tokens (input, output). gpt-4o-mini's make a race request cost exactly 0.375
(8 x 0.03 + 12 x 0.01125, all binary fractions), so sums of them are exact; claude-sonnet's are
ordinary prices, compared with a tolerance."""
RACE_USD = 0.375
FITS = 10
CONCURRENT = 64
USD_TOLERANCE = 1e-9

PROP_KEY = "tenant-key-prop-0123456789"
"""Tenant ``prop`` (model ``mock``, a huge daily token budget): the admin propagation tests' own."""
KEYS = {
    "race-tokens": "tenant-key-race-tokens-0123456789",
    "race-usd": "tenant-key-race-usd-0123456789",
    "tasks": "tenant-key-tasks-0123456789",
}
BUDGETS = {
    "race-tokens": f'{{ tokens = {FITS * RESERVATION}, period = "total" }}',
    "race-usd": f'{{ usd = {FITS * RACE_USD}, period = "month" }}',
}


def cost(model: str, prompt: int, completion: int) -> float:
    inp, out = PRICES[model]
    return (prompt * inp + completion * out) / 1e6


def priced_config(upstream_url: str, redis_url: str, prefix: str) -> str:
    tenants = f'''
[[tenants]]
name = "prop"
keys = ["{PROP_KEY}"]
models = ["mock"]
budget = {{ tokens = 1000000000, period = "day" }}
'''
    for name, key in KEYS.items():
        tenants += f'\n[[tenants]]\nname = "{name}"\nkeys = ["{key}"]\n'
        if name in BUDGETS:
            tenants += f"budget = {BUDGETS[name]}\n"
    return f"""
[server]
admin_key = "{ADMIN_KEY}"
request_timeout_s = 20
invalid_keys_per_minute = 100000

[redis]
url = "{redis_url}"
prefix = "{prefix}"

[retry]
attempts = 1

[breaker]
failure_threshold = 1000000

[[providers]]
name = "up"
type = "openai"
base_url = "{upstream_url}/v1"
api_key = "sk-upstream-accounting-0123456789"
read_timeout_s = 10

[[providers]]
name = "claude"
type = "anthropic"
base_url = "{upstream_url}/v1"
api_key = "sk-ant-accounting-0123456789"
read_timeout_s = 10

[[providers]]
name = "local"
type = "mock"

[[models]]
name = "mock"
targets = [{{ provider = "local", model = "mock" }}]

[[models]]
name = "gpt-4o-mini"
input_usd_per_mtok = {PRICES["gpt-4o-mini"][0]}
output_usd_per_mtok = {PRICES["gpt-4o-mini"][1]}
targets = [{{ provider = "up", model = "gpt-4o-mini" }}]

[[models]]
name = "claude-sonnet"
input_usd_per_mtok = {PRICES["claude-sonnet"][0]}
output_usd_per_mtok = {PRICES["claude-sonnet"][1]}
targets = [{{ provider = "claude", model = "claude-sonnet-4-5" }}]
{tenants}"""


@dataclass
class Priced:
    gateway: Gateway
    prefix: str
    redis_url: str

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)


_SHARED: list[Priced] = []


def shared_gateway(
    request: pytest.FixtureRequest, tmp: Path, upstream: MockUpstream, redis_server: RedisServer
) -> Priced:
    """The one ``--workers 2`` gateway on Redis of the session, started on first use.

    The accounting tests and the admin propagation tests share it (each start of a two-worker
    gateway costs seconds); each uses tenants of its own. It stops when the session ends.
    """
    if not _SHARED:
        prefix = f"acct-{uuid.uuid4().hex[:10]}"
        gateway = Gateway(tmp, priced_config(upstream.url, redis_server.url, prefix), workers=2)
        request.session.addfinalizer(gateway.stop)
        start_two_workers(gateway)
        _SHARED.append(Priced(gateway, prefix, redis_server.url))
    return _SHARED[0]


def start_two_workers(gateway: Gateway) -> None:
    """Start the gateway and return once both of its workers answer."""
    gateway.process.start()
    gateway.process.wait_http(f"{gateway.url}/readyz")
    wait_for(lambda: len(worker_pids(gateway)) == 2, 20, "two worker processes")
    pids, seen = worker_pids(gateway), set()

    def both_answer() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
        try:
            conn.request("GET", "/readyz")
            if conn.getresponse().read() is not None and conn.sock is not None:
                seen.add(connection_owner(gateway.port, conn.sock.getsockname()[1], pids))
        finally:
            conn.close()
        return pids <= seen

    wait_for(both_answer, 20, "both workers to answer")


@pytest.fixture(scope="module")
def priced(
    request: pytest.FixtureRequest,
    session_tmp: Path,
    mock_upstream_process: MockUpstream,
    redis_server: RedisServer,
) -> Priced:
    return shared_gateway(request, session_tmp, mock_upstream_process, redis_server)


# --- which worker answered ----------------------------------------------------------------


def worker_pids(gateway: Gateway) -> set[int]:
    """The worker processes of a ``--workers N`` gateway (the children uvicorn spawned)."""
    assert gateway.process.proc is not None
    parent = gateway.process.proc.pid
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            found.add(int(entry))
    return found


def connection_owner(server_port: int, client_port: int, pids: set[int]) -> int | None:
    """The process among ``pids`` holding the server side of the connection from ``client_port``."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (
            int(local.rsplit(":", 1)[1], 16) == server_port
            and int(remote.rsplit(":", 1)[1], 16) == client_port
        ):
            inode = fields[9]
            break
    if inode is None or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


def admin_get(gateway: Gateway, path: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/admin{path}", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


# --- the race --------------------------------------------------------------------------------


@dataclass
class RaceResult:
    responses: list[httpx.Response]
    ports: list[int]
    samples: list[float]


async def race(gateway: Gateway, tenant: str, spent_field: str) -> RaceResult:
    """CONCURRENT requests released at once, with a sampler reading the tenant's spend meanwhile."""
    url = f"{gateway.url}/v1/chat/completions"
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": COMPLETION}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    go, done = asyncio.Event(), asyncio.Event()
    samples: list[float] = []

    async with (
        httpx.AsyncClient(limits=limits, timeout=30) as client,
        httpx.AsyncClient(timeout=30) as watcher,
    ):

        async def one() -> tuple[httpx.Response, int]:
            await go.wait()
            response = await client.post(url, json=body, headers=headers)
            return response, response.extensions["network_stream"].get_extra_info("client_addr")[1]

        async def sample() -> None:
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            while not done.is_set():
                view = await watcher.get(f"{gateway.url}/admin/tenants/{tenant}", headers=admin)
                samples.append(float(view.json()["usage"][spent_field]))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        calls = [asyncio.create_task(one()) for _ in range(CONCURRENT)]
        await asyncio.sleep(0.05)  # let every call reach the gate before it opens
        go.set()
        results = await asyncio.gather(*calls)
        done.set()
        await sampler
        result = RaceResult([r for r, _ in results], [p for _, p in results], samples)
        # the connections are still open in the pool: ask which worker held each
        pids = worker_pids(gateway)
        owners = [connection_owner(gateway.port, port, pids) for port in result.ports]
    result.ports = [o or 0 for o in owners]
    return result


@pytest.mark.parametrize(
    ("tenant", "spent_field", "budget"),
    [("race-tokens", "tokens", float(FITS * RESERVATION)), ("race-usd", "usd", FITS * RACE_USD)],
    ids=["tokens-budget", "usd-budget"],
)
async def test_concurrent_requests_cannot_overspend_a_shared_budget(
    priced: Priced, upstream: MockUpstream, tenant: str, spent_field: str, budget: float
) -> None:
    upstream.configure(latency_ms=150)  # the admitted ones are still in flight while the rest arrive
    result = await race(priced.gateway, tenant, spent_field)

    admitted = [r for r in result.responses if r.status_code == 200]
    refused = [r for r in result.responses if r.status_code != 200]
    for response in refused:
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "insufficient_quota"
        assert response.headers["x-should-retry"] == "false"
    assert len(admitted) == FITS, f"{len(admitted)} admitted against a budget of {FITS} reservations"
    by_worker = Counter(result.ports)
    assert 0 not in by_worker, "could not tell which worker answered some requests"
    assert len(by_worker) == 2, f"both workers should take part: {by_worker}"

    # the recorded spend, while the race ran and after it
    gap = 0.0
    actual = 0.0
    for response in admitted:
        usage = response.json()["usage"]
        spent = (
            usage["total_tokens"]
            if spent_field == "tokens"
            else cost("gpt-4o-mini", usage["prompt_tokens"], usage["completion_tokens"])
        )
        reserved = RESERVATION if spent_field == "tokens" else RACE_USD
        gap = max(gap, spent - reserved)
        actual += spent
    assert gap <= USD_TOLERANCE, "with max_tokens = the mock's reply, a reservation is the actual usage"
    assert result.samples, "the sampler never read the usage"
    assert max(result.samples) <= budget + gap + USD_TOLERANCE, result.samples
    view = admin_get(priced.gateway, f"/tenants/{tenant}")
    assert view["usage"]["requests"] == FITS
    assert view["usage"][spent_field] == pytest.approx(budget, abs=USD_TOLERANCE)
    assert view["usage"][spent_field] == pytest.approx(actual, abs=USD_TOLERANCE)
    assert view["usage"]["estimated_requests"] == 0
    assert view["remaining"][spent_field] == pytest.approx(0, abs=USD_TOLERANCE)

    # every reservation was released: nothing is held once the requests are over
    kind = "total" if spent_field == "tokens" else "month"
    client = redis.Redis.from_url(priced.redis_url)
    try:
        stored = client.hgetall(priced.keys.usage(tenant, period(kind).id))
    finally:
        client.close()
    held = float(stored.get(f"{spent_field}_reserved".encode(), b"0"))
    assert held == pytest.approx(0, abs=USD_TOLERANCE), stored

    # and the budget stays shut; retry-after only where a period reset helps
    after = httpx.post(
        f"{priced.gateway.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 1},
        headers={"authorization": f"Bearer {KEYS[tenant]}"},
    )
    assert after.status_code == 429 and after.json()["error"]["code"] == "insufficient_quota"
    assert ("retry-after" in after.headers) == (kind != "total")
    winners = Counter(p for p, r in zip(result.ports, result.responses, strict=True) if r.status_code == 200)
    print(
        f"\nrace {tenant}: admitted per worker {dict(winners)}, answered per worker {dict(by_worker)},"
        f" {len(result.samples)} spend samples during the race, max {max(result.samples)}"
    )


# --- task usage ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    model: str
    messages: list[dict[str, str]]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None


SHORT = [{"role": "user", "content": "Summarise the quarterly report, please."}]
LONG = [
    {"role": "user", "content": "Here is a longer prompt about budgets, tokens and gateways. " * 3},
    {"role": "assistant", "content": "Understood."},
    {"role": "user", "content": "Now answer briefly."},
]
TASK_CALLS = [
    Call("gpt-4o-mini", SHORT),
    Call("gpt-4o-mini", SHORT, stream=True),
    Call("gpt-4o-mini", LONG, stream=True, include_usage=True, max_tokens=5),
    Call("claude-sonnet", LONG),
    Call("claude-sonnet", SHORT, stream=True, include_usage=True, max_tokens=7),
    Call("claude-sonnet", LONG, stream=True),
    Call("gpt-4o-mini", LONG, max_tokens=3),
    Call("claude-sonnet", SHORT, stream=True, max_tokens=4),
]


def make(client: openai.OpenAI, call: Call) -> tuple[int, int] | None:
    """Make ``call``; the upstream-reported usage when the response carries it."""
    max_tokens = call.max_tokens if call.max_tokens is not None else openai.omit
    messages: list[ChatCompletionMessageParam] = call.messages  # type: ignore[assignment]
    if not call.stream:
        reply = client.chat.completions.create(model=call.model, messages=messages, max_tokens=max_tokens)
        assert reply.usage is not None
        return reply.usage.prompt_tokens, reply.usage.completion_tokens
    options: ChatCompletionStreamOptionsParam | openai.Omit = (
        {"include_usage": True} if call.include_usage else openai.omit
    )
    stream = client.chat.completions.create(
        model=call.model, messages=messages, max_tokens=max_tokens, stream=True, stream_options=options
    )
    chunks = list(stream)
    words = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()
    assert words, "the stream carried no text"
    if not call.include_usage:
        assert all(c.usage is None for c in chunks)
        return None
    last = chunks[-1].usage
    assert last is not None and last.completion_tokens == len(words)
    return last.prompt_tokens, last.completion_tokens


def test_task_usage_is_the_sum_of_upstream_usage(priced: Priced, upstream: MockUpstream) -> None:
    task = f"task-{uuid.uuid4().hex[:12]}"
    client = openai.OpenAI(
        base_url=f"{priced.gateway.url}/v1",
        api_key=KEYS["tasks"],
        max_retries=0,
        default_headers={"X-Task-Id": task},
    )
    reference = openai.OpenAI(base_url=f"{priced.gateway.url}/v1", api_key=KEYS["tasks"], max_retries=0)
    started = time.time()
    expected: dict[str, Counter[str]] = {}
    usd: dict[str, float] = {}
    try:
        for call in TASK_CALLS:
            reported = make(client, call)
            if reported is None:  # no usage in the stream: the mock's is deterministic, ask for it
                reported = make(reference, Call(call.model, call.messages, max_tokens=call.max_tokens))
            assert reported is not None
            prompt, completion = reported
            totals = expected.setdefault(call.model, Counter())
            totals.update(
                requests=1, prompt_tokens=prompt, completion_tokens=completion, tokens=prompt + completion
            )
            usd[call.model] = usd.get(call.model, 0.0) + cost(call.model, prompt, completion)
    finally:
        client.close()
        reference.close()
    finished = time.time()

    found = admin_get(priced.gateway, f"/tasks/{task}")
    assert found["task_id"] == task and found["tenant"] == "tasks"
    for name in ("requests", "prompt_tokens", "completion_tokens", "tokens"):
        assert found[name] == sum(t[name] for t in expected.values()), name
    assert found["requests"] == len(TASK_CALLS)
    assert found["usd"] == pytest.approx(sum(usd.values()), abs=USD_TOLERANCE)
    assert found["estimated_requests"] == 0, "every request had upstream usage"
    assert set(found["by_model"]) == set(expected)
    for model, totals in expected.items():
        got = dict(found["by_model"][model])
        assert got.pop("usd") == pytest.approx(usd[model], abs=USD_TOLERANCE), model
        assert got == dict(totals), model
    assert found["first_seen"] <= found["last_seen"]
    assert started - 1 <= found["first_seen"] and found["last_seen"] <= finished + 1


def test_one_task_id_under_two_tenants_is_kept_apart(priced: Priced) -> None:
    task = f"shared-{uuid.uuid4().hex[:12]}"
    body = {"model": "mock", "messages": MESSAGES, "max_tokens": COMPLETION}
    for key, times in ((KEYS["tasks"], 2), (PROP_KEY, 1)):  # "prop" goes last
        for _ in range(times):
            response = httpx.post(
                f"{priced.gateway.url}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}", "x-task-id": task},
                timeout=20,
            )
            assert response.status_code == 200, response.text
    latest = admin_get(priced.gateway, f"/tasks/{task}")
    assert (latest["tenant"], latest["requests"]) == ("prop", 1)
    mine = admin_get(priced.gateway, f"/tasks/{task}?tenant=tasks")
    assert (mine["tenant"], mine["requests"]) == ("tasks", 2)
    missing = httpx.get(
        f"{priced.gateway.url}/admin/tasks/{task}?tenant=race-tokens",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet"])
def test_a_cut_stream_is_charged_an_estimate_and_marked(
    priced: Priced, upstream: MockUpstream, model: str
) -> None:
    upstream.configure(mode="close_mid_body", stall_after=4)
    task = f"task-{uuid.uuid4().hex[:12]}"
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{priced.gateway.url}/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": COMPLETION, "stream": True},
        headers={"authorization": f"Bearer {KEYS['tasks']}", "x-task-id": task},
        timeout=20,
    ) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"error"' in events[-2], events
    relayed = len(events) - 2
    assert relayed >= 1, events

    found = admin_get(priced.gateway, f"/tasks/{task}")
    assert found["requests"] == 1 and found["estimated_requests"] == 1
    assert found["prompt_tokens"] == PROMPT_ESTIMATE
    assert found["completion_tokens"] == relayed, "estimated from the chunks relayed"
    assert found["usd"] == pytest.approx(cost(model, PROMPT_ESTIMATE, relayed), abs=USD_TOLERANCE)
    assert found["by_model"][model]["estimated_requests"] == 1


# --- restart ---------------------------------------------------------------------------------


def key_works_everywhere(gateway: Gateway, key: str) -> bool:
    """Ten answers in a row on fresh connections accept ``key`` (a new key reaches the other worker
    at its next reload, within a quarter second)."""
    with httpx.Client(headers={"authorization": f"Bearer {key}", "connection": "close"}) as client:
        return all(client.get(f"{gateway.url}/v1/models").status_code == 200 for _ in range(10))


def test_usage_and_admin_changes_survive_a_restart(priced: Priced, upstream: MockUpstream) -> None:
    gateway = priced.gateway
    name, task = f"durable-{uuid.uuid4().hex[:8]}", f"task-{uuid.uuid4().hex[:12]}"
    settings = {
        "budget": {"tokens": 1000, "period": "month"},
        "task_max_tokens": 500,
        "models": ["gpt-4o-mini"],
    }
    # one connection, so one worker: a worker reads its own admin writes at once
    with httpx.Client(
        base_url=f"{gateway.url}/admin", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ) as admin:
        assert admin.put(f"/tenants/{name}", json=settings).status_code == 200
        made = admin.post(f"/tenants/{name}/keys")
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    wait_for(lambda: key_works_everywhere(gateway, key), 5, "the new key to reach both workers")
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, default_headers={"X-Task-Id": task}
    )
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    try:
        client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=COMPLETION)
        stream = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, max_tokens=COMPLETION, stream=True
        )
        assert list(stream)
        client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=COMPLETION)
    finally:
        client.close()
    tenant_before = admin_get(gateway, f"/tenants/{name}")
    task_before = admin_get(gateway, f"/tasks/{task}")
    assert tenant_before["usage"]["requests"] == 3 and tenant_before["usage"]["tokens"] == 3 * RESERVATION
    assert task_before["requests"] == 3
    usd_before = admin_get(gateway, "/tenants/race-usd")["usage"]

    gateway.stop()
    start_two_workers(gateway)

    assert admin_get(gateway, f"/tenants/{name}") == tenant_before
    assert admin_get(gateway, f"/tasks/{task}") == task_before
    assert admin_get(gateway, "/tenants/race-usd")["usage"] == usd_before
    # the key made before the restart works after it, and counts on from the stored usage
    after = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": COMPLETION},
        headers={"authorization": f"Bearer {key}", "x-task-id": task},
    )
    assert after.status_code == 200, after.text
    assert admin_get(gateway, f"/tenants/{name}")["usage"]["tokens"] == 4 * RESERVATION
    assert admin_get(gateway, f"/tasks/{task}")["requests"] == 4
