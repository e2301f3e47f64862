"""End to end: shared admission (rate limits, concurrency, provider limits) across real processes.

Real ``modelgate serve`` processes (several instances, several workers) share one private Redis;
the mock upstream stands in for the providers. State is polled with deadlines, never slept for;
the load generators sleep only to keep their pace.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from loadtest.admission_accuracy import flood, report, reserved_tokens, used_tokens
from policies.keys import Keys
from tests.harness import Gateway, MockUpstream, RedisServer, free_port, wait_for

ADMIN_KEY = "admin-key-admission-0123456789abcdef"
UPSTREAM_KEY = "sk-upstream-admission-0123456789"
MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT_ESTIMATE = 8
"""What the gateway estimates for MESSAGES: 3 priming + 4 per message + ceil(2 chars / 4)."""
GO_DURATION = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s)$")
RATE_HEADERS = tuple(
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)


# --- config and processes --------------------------------------------------------------------


def key_for(tenant: str) -> str:
    return f"tenant-key-{tenant}-0123456789abcdef"


def tenant(name: str, **limits: int) -> str:
    lines = [f'\n[[tenants]]\nname = "{name}"\nkeys = ["{key_for(name)}"]']
    lines += [f"{k} = {v}" for k, v in limits.items()]
    return "\n".join(lines) + "\n"


def config_text(
    upstream_url: str,
    redis_url: str,
    tenants: str,
    *,
    on_failure: str = "closed",
    slot_lease_s: float = 15,
    extra: str = "",
) -> str:
    """A gateway on the mock upstream (model ``gpt-4o-mini``), its state in Redis under a fresh prefix."""
    return f"""
[server]
admin_key = "{ADMIN_KEY}"
request_timeout_s = 30

[redis]
url = "{redis_url}"
prefix = "adm-{uuid.uuid4().hex[:12]}"
on_failure = "{on_failure}"
slot_lease_s = {slot_lease_s}

[[providers]]
name = "up"
type = "openai"
base_url = "{upstream_url}/v1"
api_key = "{UPSTREAM_KEY}"
read_timeout_s = 30

[[models]]
name = "gpt-4o-mini"
targets = [{{ provider = "up", model = "gpt-4o-mini" }}]
{extra}
{tenants}
"""


def prefix_of(config: str) -> str:
    match = re.search(r'^prefix = "([^"]+)"', config, re.MULTILINE)
    assert match is not None
    return match.group(1)


def start_gateways(tmp: Path, config: str, count: int = 1, workers: int = 1) -> list[Gateway]:
    """Start ``count`` instances of one config side by side; return once every one is ready."""
    gateways = [Gateway(tmp, config, workers=workers) for _ in range(count)]
    for gateway in gateways:
        gateway.process.start()
    try:
        for gateway in gateways:
            gateway.process.wait_http(f"{gateway.url}/readyz")
    except BaseException:
        stop_all(gateways)
        raise
    return gateways


def stop_all(gateways: list[Gateway]) -> None:
    for gateway in gateways:
        gateway.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own, which it may kill and restart."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def kill_redis(server: RedisServer) -> None:
    assert server.proc is not None
    server.proc.kill()
    server.proc.wait(10)
    server.proc = None


# --- requests --------------------------------------------------------------------------------


def body(
    *, max_tokens: int | None = None, stream: bool = False, model: str = "gpt-4o-mini"
) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "messages": MESSAGES, "stream": stream}
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
    return payload


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key_for(name)}"}


def chat(url: str, name: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body(**kwargs), headers=auth(name), timeout=30)


async def achat(client: httpx.AsyncClient, url: str, name: str, **kwargs: Any) -> httpx.Response:
    return await client.post(f"{url}/v1/chat/completions", json=body(**kwargs), headers=auth(name))


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """An error the gateway itself returned, in the OpenAI shape."""
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


def assert_rate_limited(response: httpx.Response, reason: str) -> dict[str, Any]:
    error = assert_error(response, 429, "rate_limit_exceeded")
    assert reason in error["message"], error
    assert re.fullmatch(r"[1-9]\d*", response.headers["retry-after"])
    assert re.fullmatch(r"[1-9]\d*", response.headers["retry-after-ms"])
    return error


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``check`` (without blocking the loop) until true; the time it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return time.monotonic()
        await asyncio.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


# --- 1. accuracy across instances and workers ------------------------------------------------


async def test_two_instances_of_two_workers_admit_what_the_buckets_allow(
    tmp_path: Path, upstream: MockUpstream, redis_server: RedisServer
) -> None:
    """4x overload on two instances x two workers: admitted = what one shared bucket allows.

    Each run drains its (fresh) bucket by a burst, then sends at 4x the refill rate for 6 s.
    Tolerance: from its first admission at t0 to the last decision at t, a bucket of capacity C
    refilled at C/60 per second admits exactly C + C/60 * (t - t0) minus what is left in it at t:
    less than one request for ``rpm``; for ``tpm`` less than one reservation (446 tokens) plus the
    refunds (28 each) of the requests still in flight at t, one or two at this pace. t0 and t are
    known to within tens of ms (the first request is sent alone, the last at a light pace): a tenth
    of a request, a few dozen tokens. So a correct limiter lands within ~1 request / ~550 tokens
    below the figure, inside the +-max(2, 1%) allowed (rpm: ~2.3 requests; tpm: ~550 of ~55000).
    A per-worker or per-instance bucket would admit 2-4x the refill; reservations never settled
    (446 held for 418 used) would admit ~6% fewer tokens.
    """
    rpm, tpm = 120, 48_000
    assert (reserved_tokens(), used_tokens()) == (446, 418)
    tenants = tenant("by-rpm", rpm=rpm) + tenant("by-tpm", tpm=tpm)
    config = config_text(upstream.url, redis_server.url, tenants)
    gateways = start_gateways(tmp_path, config, count=2, workers=2)
    urls = [g.url for g in gateways]
    per_request = used_tokens()
    try:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            by_rpm, by_tpm = await asyncio.gather(
                flood(
                    client, urls, key_for("by-rpm"), limit=rpm, tokens=False, per_s=4 * rpm / 60, seconds=6
                ),
                flood(
                    client,
                    urls,
                    key_for("by-tpm"),
                    limit=tpm,
                    tokens=True,
                    per_s=4 * tpm / 60 / per_request,
                    seconds=6,
                ),
            )
    finally:
        stop_all(gateways)

    for run, reason in ((by_rpm, "rpm"), (by_tpm, "tpm")):
        assert set(run.statuses()) == {200, 429}, run.statuses()
        refused = [o for o in run.outcomes if o.status == 429]
        assert all(o.code == "rate_limit_exceeded" and reason in o.message for o in refused)
        assert all(o.tokens == per_request for o in run.outcomes if o.status == 200)
        tolerance = max(2.0, 0.01 * run.allowed)
        assert abs(run.admitted() - run.allowed) <= tolerance, report(reason, run, reason)


# --- 2. two Redis round trips per request ----------------------------------------------------


class Monitor:
    """Redis ``MONITOR`` on a raw socket: the commands clients send (not those run inside Lua)."""

    END = "modelgate-monitor-end"

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"MONITOR\r\n")
        self._buffer = b""
        assert self._line() == "+OK"
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _line(self) -> str:
        while b"\r\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("MONITOR connection closed")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\r\n", 1)
        return line.decode(errors="replace")

    def _read(self) -> None:
        while True:
            line = self._line()
            if self.END in line:
                return
            self.lines.append(line)

    def finish(self) -> list[str]:
        """Every command seen until now (a marker command sent now ends the feed, in order)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(f"ECHO {self.END}\r\n".encode())
            sock.recv(64)
        self._thread.join(10)
        assert not self._thread.is_alive()
        self.sock.close()
        return [line for line in self.lines if " lua] " not in line]


def background(argv: list[str]) -> bool:
    """Commands that do not belong to any one request: the admin-changes poll (a version read every
    quarter second), connection handshakes and readiness pings."""
    name = argv[0].lower()
    return name in {"hello", "client", "select", "ping"} or (
        name == "get" and argv[1].endswith(":tenants:version")
    )


def test_a_request_costs_at_most_two_redis_round_trips(
    tmp_path: Path, upstream: MockUpstream, private_redis: RedisServer
) -> None:
    # rpm and tpm, no max_concurrency: no slot leases, so no lease renewals during the window.
    config = config_text(upstream.url, private_redis.url, tenant("rt", rpm=100_000, tpm=10_000_000))
    (gateway,) = start_gateways(tmp_path, config)
    try:
        with httpx.Client(base_url=gateway.url, headers=auth("rt"), timeout=30) as client:
            for _ in range(5):  # connections made, scripts loaded
                assert client.post("/v1/chat/completions", json=body()).status_code == 200
            monitor = Monitor(private_redis.port)
            for _ in range(100):
                assert client.post("/v1/chat/completions", json=body()).status_code == 200
            commands = monitor.finish()
    finally:
        gateway.stop()
    counts: dict[str, int] = {}
    per_request = 0
    for line in commands:
        argv = [re.sub(r"\\(.)", r"\1", arg) for arg in re.findall(r'"((?:[^"\\]|\\.)*)"', line)]
        kind = "background " + argv[0].lower() if background(argv) else argv[0].lower()
        counts[kind] = counts.get(kind, 0) + 1
        per_request += not background(argv)
    assert 100 <= per_request <= 200, counts


# --- 3. Redis down mid-load ------------------------------------------------------------------


@dataclass
class Sample:
    sent: float
    done: float
    status: int
    code: str | None = None
    shaped: bool = True
    should_retry: str | None = None


@dataclass
class Load:
    """A few request loops against one gateway, recording every outcome."""

    url: str
    name: str
    samples: list[Sample] = field(default_factory=list)
    running: bool = True

    async def loop(self, client: httpx.AsyncClient) -> None:
        while self.running:
            sent = time.monotonic()
            try:
                response = await achat(client, self.url, self.name)
            except httpx.HTTPError:
                self.samples.append(Sample(sent, time.monotonic(), 0, shaped=False))
                await asyncio.sleep(0.02)
                continue
            sample = Sample(sent, time.monotonic(), response.status_code)
            if response.status_code != 200:
                try:
                    error = response.json()["error"]
                except (ValueError, KeyError, TypeError):
                    error = {}
                sample.code = error.get("code")
                sample.shaped = set(error) == {"message", "type", "param", "code"}
                sample.should_retry = response.headers.get("x-should-retry")
            self.samples.append(sample)
            await asyncio.sleep(0.02)  # keeps the pace

    def sent_after(self, t: float) -> list[Sample]:
        return [s for s in self.samples if s.sent > t]

    def all_ok_since(self) -> float | None:
        """The send time from which every answer (so far) is 200."""
        since = None
        for sample in sorted(self.samples, key=lambda s: s.sent):
            if sample.status != 200:
                since = None
            elif since is None:
                since = sample.sent
        return since


async def test_redis_down_closed_answers_503_state_unavailable_then_recovers(
    tmp_path: Path, upstream: MockUpstream, private_redis: RedisServer
) -> None:
    config = config_text(
        upstream.url, private_redis.url, tenant("outage", rpm=1_000_000), on_failure="closed"
    )
    (gateway,) = start_gateways(tmp_path, config)
    load = Load(gateway.url, "outage")
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            loops = [asyncio.create_task(load.loop(client)) for _ in range(4)]

            async def served(n: int) -> bool:
                return sum(s.status == 200 for s in load.samples) >= n

            await until(lambda: served(10), 10, "requests served before the outage")
            await asyncio.to_thread(kill_redis, private_redis)
            killed = time.monotonic()

            async def answered_after(t: float, n: int) -> bool:
                return len([s for s in load.sent_after(t) if s.done > t]) >= n

            await until(lambda: answered_after(killed, 30), 10, "requests answered during the outage")
            ready = await client.get(f"{gateway.url}/readyz")
            assert ready.status_code == 503
            assert "redis" in ready.text.lower()
            restarting = time.monotonic()
            await asyncio.to_thread(private_redis.start)  # same port; returns once PING answers
            back = time.monotonic()

            async def ready_again() -> bool:
                return (await client.get(f"{gateway.url}/readyz")).status_code == 200

            ready_at = await until(ready_again, 5, "/readyz to turn 200")

            async def steady() -> bool:
                since = load.all_ok_since()
                return since is not None and max(s.sent for s in load.samples) - since >= 1.0

            await until(steady, 10, "a steady second of 200s after Redis came back")
            load.running = False
            await asyncio.gather(*loops)
    finally:
        gateway.stop()

    assert {s.status for s in load.samples} <= {200, 503}, {s.status for s in load.samples}
    outage = [s for s in load.samples if s.sent > killed and s.done < restarting]
    assert len(outage) >= 30
    for sample in (s for s in load.samples if s.status == 503):
        assert sample.code == "state_unavailable" and sample.shaped and sample.should_retry == "false"
    assert all(s.status == 503 for s in outage)
    since = load.all_ok_since()
    assert since is not None
    recovery = max(0.0, since - back)
    assert recovery <= 2.0, f"full service {recovery:.2f} s after Redis answered again"
    assert ready_at - back <= 2.0


def test_redis_down_open_admits_on_the_per_process_share(
    tmp_path: Path, upstream: MockUpstream, private_redis: RedisServer
) -> None:
    config = config_text(upstream.url, private_redis.url, tenant("open", rpm=4), on_failure="open")
    (gateway,) = start_gateways(tmp_path, config, workers=1)
    try:
        assert chat(gateway.url, "open").status_code == 200  # through Redis: its bucket has 3 left
        kill_redis(private_redis)
        # One worker: the fallback holds the whole rpm of 4, independent of what Redis had used.
        statuses = [chat(gateway.url, "open") for _ in range(5)]
        assert [r.status_code for r in statuses] == [200, 200, 200, 200, 429], [r.text for r in statuses]
        assert_rate_limited(statuses[-1], "rpm")
        assert httpx.get(f"{gateway.url}/readyz").status_code == 503

        private_redis.start()
        back = time.monotonic()
        # Redis is fresh (its bucket full again); the fallback's is empty for another ~15 s, so a
        # 200 now comes from Redis.
        wait_for(lambda: chat(gateway.url, "open").status_code == 200, 2.0, "admission through Redis")
        assert time.monotonic() - back <= 2.0
        client = redis.Redis.from_url(private_redis.url)
        try:
            assert client.exists(Keys(prefix_of(config)).tenant("open", "rpm"))
        finally:
            client.close()
    finally:
        gateway.stop()


# --- 4. a killed worker's slots -------------------------------------------------------------


async def test_a_killed_workers_slots_are_freed_after_the_lease(
    tmp_path: Path, upstream: MockUpstream, redis_server: RedisServer
) -> None:
    lease = 2.0
    config = config_text(
        upstream.url, redis_server.url, tenant("conc-kill", max_concurrency=2), slot_lease_s=lease
    )
    doomed, survivor = start_gateways(tmp_path, config, count=2)
    try:
        upstream.configure(mode="hang")
        async with httpx.AsyncClient(timeout=30) as client:
            hung = [asyncio.create_task(achat(client, doomed.url, "conc-kill")) for _ in range(2)]

            async def waiting(n: int) -> bool:
                stats = (await client.get(f"{upstream.url}/_mock/stats")).json()
                return bool(stats["waiting"] == n)

            await until(lambda: waiting(2), 10, "two requests held by the upstream")

            # Live requests keep their slots past one lease: the owner renews them.
            until_renewed = time.monotonic() + lease + 0.25
            while time.monotonic() < until_renewed:
                assert_rate_limited(await achat(client, survivor.url, "conc-kill"), "concurrency")
                await asyncio.sleep(0.1)  # pacing the probe

            doomed.process.signal(signal.SIGKILL)
            assert doomed.process.proc is not None
            await asyncio.to_thread(doomed.process.proc.wait, 10)
            killed = time.monotonic()
            upstream.configure(mode="ok")
            probed = time.monotonic()
            first = await achat(client, survivor.url, "conc-kill")
            if probed - killed < lease - lease / 3:  # the leases surely outlive the kill by this much
                assert_rate_limited(first, "concurrency")

            async def admitted() -> bool:
                return (await achat(client, survivor.url, "conc-kill")).status_code == 200

            freed = await until(admitted, lease + 2, "the dead worker's slots to expire")
            await asyncio.gather(*hung, return_exceptions=True)
    finally:
        stop_all([doomed, survivor])
    assert freed - killed <= lease + 1.0


# --- a shared gateway for the header, concurrency, provider and settlement tests ---------------


SHARED_TENANTS = "".join(
    [
        tenant("hdr", rpm=10, tpm=600),
        tenant("hdr-429", rpm=1, tpm=100_000),
        tenant("tiny", rpm=2),
        tenant("sdk", rpm=1),
        tenant("conc2", max_concurrency=2),
        tenant("routing"),
        tenant("reserve", tpm=1_000_000),
        tenant("settle-stream_cut", tpm=60_000, max_concurrency=1),
        tenant("settle-upstream_500", tpm=60_000, max_concurrency=1),
        tenant("settle-gone", tpm=60_000, max_concurrency=1),
        tenant("one-at-a-time", max_concurrency=1),
    ]
)


def provider_tables(upstream_url: str, dead_url: str) -> str:
    def model(name: str, *providers: str) -> str:
        targets = ", ".join(f'{{ provider = "{p}", model = "gpt-4o-mini" }}' for p in providers)
        return f'\n[[models]]\nname = "{name}"\ntargets = [{targets}]\n'

    def provider(name: str, url: str, limits: str = "") -> str:
        return (
            f'\n[[providers]]\nname = "{name}"\ntype = "openai"\nbase_url = "{url}/v1"\n'
            f'api_key = "{UPSTREAM_KEY}"\nread_timeout_s = 30\n{limits}'
        )

    return "".join(
        [
            provider("p1", upstream_url, "rpm = 2\n"),
            provider("p2", upstream_url, "rpm = 1\n"),
            provider("p3", upstream_url, "rpm = 1\n"),
            provider("dead", dead_url),
            model("dual", "p1", "p2"),
            model("shaky", "dead", "p3"),
        ]
    )


@pytest.fixture(scope="module")
def shared(
    session_tmp: Path, mock_upstream_process: MockUpstream, redis_server: RedisServer
) -> Iterator[Gateway]:
    """One instance with two workers; each test uses tenants (buckets) of its own."""
    dead = f"http://127.0.0.1:{free_port()}"
    extra = provider_tables(mock_upstream_process.url, dead)
    config = config_text(mock_upstream_process.url, redis_server.url, SHARED_TENANTS, extra=extra)
    (gateway,) = start_gateways(session_tmp, config, workers=2)
    yield gateway
    gateway.stop()


# --- 5. headers and errors -------------------------------------------------------------------


def test_rate_headers_in_openai_formats_with_remaining_decreasing(
    shared: Gateway, upstream: MockUpstream
) -> None:
    responses = [chat(shared.url, "hdr", max_tokens=10, stream=i % 2 == 1) for i in range(6)]
    for response in responses:
        assert response.status_code == 200, response.text
        assert all(name in response.headers for name in RATE_HEADERS), dict(response.headers)
        assert GO_DURATION.match(response.headers["x-ratelimit-reset-requests"])
        assert GO_DURATION.match(response.headers["x-ratelimit-reset-tokens"])
    first = responses[0].headers
    # A fresh bucket of 10 rpm after one request: 9 left, 6 s to refill the one taken.
    # Tokens: 8 (prompt) + 10 (max_tokens) reserved of 600, back at 10 a second: in 1.8 s.
    assert first["x-ratelimit-limit-requests"] == "10"
    assert first["x-ratelimit-remaining-requests"] == "9"
    assert first["x-ratelimit-reset-requests"] == "6s"
    assert first["x-ratelimit-limit-tokens"] == "600"
    assert first["x-ratelimit-remaining-tokens"] == str(600 - PROMPT_ESTIMATE - 10)
    assert first["x-ratelimit-reset-tokens"] == "1.8s"
    # Requests follow each other well within the 6 s that refilling one takes, and within the
    # 1.8 s that refilling the 18 tokens each one uses takes.
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in responses]
    assert remaining == list(range(9, 3, -1))
    tokens = [int(r.headers["x-ratelimit-remaining-tokens"]) for r in responses]
    assert all(later < earlier for earlier, later in itertools.pairwise(tokens)), tokens


def test_the_reservation_is_the_prompt_estimate_plus_max_tokens_or_the_default(
    shared: Gateway, upstream: MockUpstream
) -> None:
    # 1M tpm refills ~17 tokens a millisecond: the 20 used by each request are back before the next.
    default = chat(shared.url, "reserve")
    assert default.status_code == 200
    assert default.headers["x-ratelimit-remaining-tokens"] == str(1_000_000 - PROMPT_ESTIMATE - 4096)
    payload = {**body(max_tokens=999), "max_completion_tokens": 50}
    explicit = httpx.post(f"{shared.url}/v1/chat/completions", json=payload, headers=auth("reserve"))
    assert explicit.status_code == 200
    assert explicit.headers["x-ratelimit-remaining-tokens"] == str(1_000_000 - PROMPT_ESTIMATE - 50)


def test_rpm_429_says_when_to_retry_and_not_to_retry_itself(shared: Gateway, upstream: MockUpstream) -> None:
    assert [chat(shared.url, "tiny").status_code for _ in range(2)] == [200, 200]
    refused = chat(shared.url, "tiny")
    assert_rate_limited(refused, "rpm")
    # One request refills in 30 s at 2 rpm (less the few ms since the bucket was drained).
    assert 29_000 <= int(refused.headers["retry-after-ms"]) <= 30_000
    assert refused.headers["retry-after"] == "30"
    assert upstream.stats()["chat_requests"] == 2


def test_a_429_carries_the_rate_headers_too(shared: Gateway, upstream: MockUpstream) -> None:
    assert chat(shared.url, "hdr-429").status_code == 200
    refused = chat(shared.url, "hdr-429")
    assert_rate_limited(refused, "rpm")
    missing = [name for name in RATE_HEADERS if name not in refused.headers]
    assert not missing, f"429 without {missing}"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_every_v1_response_of_a_limited_tenant_carries_the_rate_headers(
    shared: Gateway, upstream: MockUpstream
) -> None:
    headers = auth("hdr")
    url = f"{shared.url}/v1/chat/completions"
    responses = {
        "models": httpx.get(f"{shared.url}/v1/models", headers=headers),
        "400": httpx.post(url, content=b"{not json", headers=headers),
        "404": httpx.post(url, json=body(model="no-such-model"), headers=headers),
    }
    missing = {what: [n for n in RATE_HEADERS if n not in r.headers] for what, r in responses.items()}
    assert not any(missing.values()), missing


def test_the_sdk_sends_one_request_per_429(shared: Gateway, upstream: MockUpstream) -> None:
    request_id = f"sdk-429-{uuid.uuid4().hex[:8]}"
    # Default max_retries (2): the SDK would retry a 429 unless told not to.
    with openai.OpenAI(base_url=f"{shared.url}/v1", api_key=key_for("sdk")) as client:
        assert client.max_retries == 2
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model="gpt-4o-mini",
                messages=MESSAGES,  # type: ignore[arg-type]
                extra_headers={"x-request-id": request_id},
            )
    lines = [json.loads(line) for line in shared.output().splitlines() if request_id in line]
    requests = [line for line in lines if line.get("msg") == "request"]
    assert [line["status"] for line in requests] == [429], lines


async def test_max_concurrency_2_refuses_exactly_one_of_three(
    shared: Gateway, upstream: MockUpstream
) -> None:
    upstream.configure(latency_ms=1000)
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(*(achat(client, shared.url, "conc2") for _ in range(3)))
    assert sorted(r.status_code for r in responses) == [200, 200, 429]
    refused = next(r for r in responses if r.status_code == 429)
    assert_rate_limited(refused, "concurrency")


# --- 6. provider limits ----------------------------------------------------------------------


def test_a_full_provider_routes_to_the_next_target_then_429(shared: Gateway, upstream: MockUpstream) -> None:
    served = [chat(shared.url, "routing", model="dual") for _ in range(3)]
    assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
    targets = [r.headers["x-modelgate-target"] for r in served]
    assert targets == ["p1/gpt-4o-mini", "p1/gpt-4o-mini", "p2/gpt-4o-mini"]
    assert all(r.headers["x-modelgate-attempts"] == "1" for r in served)
    refused = chat(shared.url, "routing", model="dual")
    assert_rate_limited(refused, "provider")
    assert upstream.stats()["chat_requests"] == 3


def test_a_fallback_after_an_upstream_failure_respects_the_next_providers_rpm(
    shared: Gateway, upstream: MockUpstream
) -> None:
    # "dead" (no limits) refuses connections; the retry goes to p3, whose rpm is 1.
    first = chat(shared.url, "routing", model="shaky")
    assert first.status_code == 200, first.text
    assert first.headers["x-modelgate-target"] == "p3/gpt-4o-mini"
    assert first.headers["x-modelgate-attempts"] == "2"
    second = chat(shared.url, "routing", model="shaky")
    assert second.status_code in (429, 503), second.text
    assert second.headers["x-should-retry"] == "false"
    assert upstream.stats()["chat_requests"] == 1, "p3 was sent more than its rpm allows"


# --- 7. settlement ---------------------------------------------------------------------------

BIG = 20_000
"""max_tokens of the settlement tests: a third of the 60000 tpm, so a missing refund shows plainly."""


@pytest.mark.parametrize("fault", ["stream_cut", "upstream_500"])
def test_a_failed_request_refunds_its_tokens_and_frees_its_slot(
    shared: Gateway, upstream: MockUpstream, fault: str
) -> None:
    name = f"settle-{fault}"
    if fault == "stream_cut":
        upstream.configure(mode="close_mid_body")
        failed = chat(shared.url, name, max_tokens=BIG, stream=True)
        assert failed.status_code == 200
        events = [line for line in failed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "error" in json.loads(events[-2].removeprefix("data: "))
    else:
        upstream.configure(mode="status", status=500)
        failed = chat(shared.url, name, max_tokens=BIG)
        assert_error(failed, 503, "upstream_unavailable")
    held = int(failed.headers["x-ratelimit-remaining-tokens"])
    assert held == 60_000 - PROMPT_ESTIMATE - BIG
    upstream.configure(mode="ok")
    after = chat(shared.url, name, max_tokens=BIG)  # max_concurrency = 1: the slot must be free
    assert after.status_code == 200, after.text
    # Refunded: this one reserves BIG again from about the same level (a cut stream used ~10
    # tokens). Without the refund it would be BIG lower.
    assert int(after.headers["x-ratelimit-remaining-tokens"]) >= held - 50


def test_the_next_request_finds_the_slot_free_at_either_worker(shared: Gateway) -> None:
    # A whole answer, like a stream's [DONE], leaves after its settlement was written to Redis
    # (its reply is awaited later): a client that sends its next request the moment it has the
    # last one (on a new connection: either worker) is never refused by max_concurrency = 1.
    statuses: Counter[int] = Counter()
    for i in range(120):
        response = chat(shared.url, "one-at-a-time", max_tokens=8, stream=i % 2 == 1)
        statuses[response.status_code] += 1
        assert response.status_code == 200, (i, response.text)
        if i % 2 == 1:
            assert response.text.rstrip().endswith("data: [DONE]")
    assert statuses == {200: 120}


async def test_a_client_gone_mid_stream_frees_its_slot(shared: Gateway, upstream: MockUpstream) -> None:
    # The upstream stream would take 12 s; the slot lease is 15 s: neither explains a quick release.
    upstream.configure(chunk_delay_ms=1000)
    async with httpx.AsyncClient(timeout=30) as client:
        url, headers = f"{shared.url}/v1/chat/completions", auth("settle-gone")
        async with client.stream(
            "POST", url, json=body(max_tokens=BIG, stream=True), headers=headers
        ) as gone:
            assert gone.status_code == 200
            held = int(gone.headers["x-ratelimit-remaining-tokens"])
            async for line in gone.aiter_lines():
                if line.startswith("data: "):
                    break
        freed: list[httpx.Response] = []

        async def admitted() -> bool:
            response = await achat(client, shared.url, "settle-gone", max_tokens=BIG)
            freed.append(response)
            return response.status_code == 200

        await until(admitted, 3.0, "the slot of the abandoned stream to be freed")
    assert int(freed[-1].headers["x-ratelimit-remaining-tokens"]) >= held - 50
