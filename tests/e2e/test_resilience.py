"""End to end: retries, jittered backoff, retry-after, fallback, deadlines and shared circuit breakers.

Real processes throughout: ``modelgate serve`` (one worker, or two sharing a private Redis) in
front of faulty upstreams, and the real ``openai`` SDK where the contract is about SDKs. Faults
come from two ``mock-upstream`` processes (targets ``a`` and ``b``). Where the exact arrival time
of each upstream attempt matters (attempt order, gaps between retries) the upstream is instead a
recording stub in this process, which notes ``time.monotonic()`` as each request arrives and
answers 500. Which worker of a two-worker gateway served a request is read from ``/proc``: the
worker process that holds the server end of the client's TCP connection.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import TENANT_KEY, UPSTREAM_KEY, gateway_config
from tests.harness import Gateway, MockUpstream, RedisServer, free_port, wait_for

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
TINY_KEY = "tenant-key-tiny-rpm-0123456789"
RETRY: dict[str, object] = {"attempts": 3, "base_delay_ms": 50, "max_delay_ms": 50}
"""Single-target backoffs are then uniform on [0, 50 ms] for both repeats."""
SHORT_DEADLINE_S = 0.8
READ_TIMEOUT_S = 0.5
"""The per-read timeout of providers ``a`` and ``b``."""
SLACK_S = 0.5
"""Scheduling slack for timing bounds (test machines are small and busy)."""


# --- helpers -------------------------------------------------------------------------------------


def chat_body(model: str, *, stream: bool = False) -> bytes:
    return json.dumps({"model": model, "messages": MESSAGES, "stream": stream}).encode()


_clients: dict[str, httpx.Client] = {}
"""One keep-alive client per gateway URL (closed with the fleet), so requests cost little."""


def post(
    gateway: Gateway, model: str, *, key: str = TENANT_KEY, request_id: str | None = None
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    client = _clients.setdefault(gateway.url, httpx.Client(base_url=gateway.url, timeout=15))
    return client.post("/v1/chat/completions", content=chat_body(model), headers=headers)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == code


def log_entries(gateway: Gateway, msg: str) -> list[dict[str, Any]]:
    """The gateway's JSON log lines whose ``msg`` is ``msg``, in file order."""
    entries = []
    for line in gateway.output().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("msg") == msg:
                entries.append(entry)
    return entries


def request_logs(gateway: Gateway, request_id: str) -> list[dict[str, Any]]:
    """The ``"msg":"request"`` lines (one per HTTP request the gateway served) of one request id."""
    return [e for e in log_entries(gateway, "request") if e.get("request_id") == request_id]


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(4).hex()}"


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def wait_ready(gateway: Gateway, workers: int) -> None:
    """Until ``/healthz`` answers and every worker process has started."""
    gateway.process.wait_http(f"{gateway.url}/healthz", timeout=90)
    wait_for(
        lambda: gateway.output().count("Application startup complete") >= workers,
        90,
        f"{workers} worker(s) of {gateway.url} to start",
    )


def stop_together(gateways: list[Gateway]) -> None:
    """SIGTERM them all first, so their graceful stops overlap."""
    for gateway in gateways:
        if gateway.process.proc is not None and gateway.process.proc.poll() is None:
            gateway.process.signal(signal.SIGTERM)
    for gateway in gateways:
        if gateway.process.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                gateway.process.proc.wait(15)
        gateway.stop()  # SIGKILLs one that did not stop


# --- a recording upstream ------------------------------------------------------------------------


class Recorder:
    """Stub upstreams in this process: each notes (monotonic time, its name) per request and answers
    an error, 500 unless told otherwise (``answer``)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._arrivals: list[tuple[float, str]] = []
        self._answers: dict[str, tuple[int, str | None]] = {}
        self.servers = {name: self._server(name) for name in names}
        for server in self.servers.values():
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.servers[name].server_address[1]}"

    def answer(self, name: str, status: int, retry_after: str | None = None) -> None:
        with self._lock:
            self._answers[name] = (status, retry_after)

    def reset(self) -> None:
        with self._lock:
            self._answers.clear()
            self._arrivals = []

    def take(self) -> list[tuple[float, str]]:
        """The arrivals since the last call, oldest first."""
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        return sorted(arrivals)

    def stop(self) -> None:
        for server in self.servers.values():
            server.shutdown()
            server.server_close()

    def _arrived(self, name: str) -> tuple[int, str | None]:
        with self._lock:
            self._arrivals.append((time.monotonic(), name))
            return self._answers.get(name, (500, None))

    def _server(self, name: str) -> ThreadingHTTPServer:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no delayed-ACK stall between headers and body

            def do_POST(self) -> None:
                status, retry_after = recorder._arrived(name)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                body = json.dumps({"error": {"message": "stub", "type": "server_error", "code": None}})
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                if retry_after is not None:
                    self.send_header("retry-after", retry_after)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        return server


# --- which worker served a connection ------------------------------------------------------------


def process_tree(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return tree


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: dict[str, Any]
    elapsed: float
    conn: http.client.HTTPConnection
    """Still open, so that ``Calls.workers`` can find the process at its other end."""


class Calls:
    """Requests to a multi-worker gateway, noting which worker process served each.

    A new TCP connection lets the kernel pick a worker. The server end of a connection is found
    in ``/proc/net/tcp`` (by the client's port) and then among the gateway's processes' open
    file descriptors. That lookup is done in one batch after the requests, while their
    (keep-alive) connections are still open, so it does not slow the requests down.
    """

    def __init__(self, gateway: Gateway) -> None:
        assert gateway.process.proc is not None
        self.gateway = gateway
        self.pids = process_tree(gateway.process.proc.pid)

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=15)

    def fresh(self, model: str = "gpt-4o-mini") -> Answer:
        return self.on(self.connect(), model)

    def on(self, conn: http.client.HTTPConnection, model: str = "gpt-4o-mini") -> Answer:
        headers = {"authorization": f"Bearer {TENANT_KEY}", "content-type": "application/json"}
        started = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=chat_body(model), headers=headers)
        response = conn.getresponse()
        raw = response.read()
        return Answer(response.status, response.headers, json.loads(raw), time.monotonic() - started, conn)

    def workers(self, answers: list[Answer]) -> list[int | None]:
        """The worker that served each answer; closes their connections."""
        ports = []
        for answer in answers:
            assert answer.conn.sock is not None
            ports.append(answer.conn.sock.getsockname()[1])
        inodes = {}
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
            if local == self.gateway.port and remote in ports:
                inodes[f"socket:[{fields[9]}]"] = remote
        owners: dict[int, int] = {}
        for pid in self.pids:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if link in inodes:
                            owners[inodes[link]] = pid
        for answer in answers:
            answer.conn.close()
        return [owners.get(port) for port in ports]


# --- fixtures ------------------------------------------------------------------------------------


def extra_tables(mock_a: str, mock_b: str, recorder: Recorder) -> str:
    """Providers ``a``/``b`` (the two mocks), ``dead`` (nothing listens), ``rec1``/``rec2`` (stubs)."""
    providers = {
        "a": mock_a,
        "b": mock_b,
        "dead": f"http://127.0.0.1:{free_port()}",
        "rec1": recorder.url("rec1"),
        "rec2": recorder.url("rec2"),
    }
    models = {
        "solo": ["a"],
        "pair": ["a", "b"],
        "down": ["dead", "b"],
        "rec": ["rec1"],
        "recpair": ["rec1", "rec2"],
        "only2": ["rec2"],
    }
    text = ""
    for name, url in providers.items():
        text += f"""
[[providers]]
name = "{name}"
type = "openai"
base_url = "{url}/v1"
api_key = "{UPSTREAM_KEY}"
connect_timeout_s = 1
read_timeout_s = {READ_TIMEOUT_S}
"""
    for name, targets in models.items():
        listed = ", ".join(f'{{ provider = "{t}", model = "x" }}' for t in targets)
        text += f'\n[[models]]\nname = "{name}"\ntargets = [{listed}]\n'
    return text + f'\n[[tenants]]\nname = "tiny"\nkeys = ["{TINY_KEY}"]\nrpm = 1\n'


@pytest.fixture(scope="module")
def mock_b_process(session_tmp: Path) -> Iterator[MockUpstream]:
    process = MockUpstream(session_tmp).start()
    yield process
    process.process.stop()


@pytest.fixture
def second(mock_b_process: MockUpstream) -> Iterator[MockUpstream]:
    """Target ``b``'s mock upstream, reset before and after the test (``upstream`` is target ``a``)."""
    mock_b_process.reset()
    yield mock_b_process
    mock_b_process.reset()


@pytest.fixture(scope="module")
def recorder_servers() -> Iterator[Recorder]:
    stubs = Recorder(("rec1", "rec2"))
    yield stubs
    stubs.stop()


@pytest.fixture
def recorder(recorder_servers: Recorder) -> Iterator[Recorder]:
    """The stubs ``rec1`` and ``rec2``, answering 500 and with no arrivals noted, before and after."""
    recorder_servers.reset()
    yield recorder_servers
    recorder_servers.reset()


THRESHOLD = 4
RESET_S = 1.5
PROBE_LATENCY_MS = 600


@dataclass
class Fleet:
    main: Gateway
    """request_timeout_s 5, attempts 3 with 50 ms backoff, breakers that never open."""
    short: Gateway
    """The same with request_timeout_s 0.8."""
    shared: dict[int, Gateway]
    """Like ``main`` with two workers sharing breakers through Redis (THRESHOLD consecutive
    failures open one for RESET_S), one gateway per ``half_open_max_calls`` (1 and 2)."""


@pytest.fixture(scope="module")
def fleet(
    session_tmp: Path,
    mock_upstream_process: MockUpstream,
    mock_b_process: MockUpstream,
    recorder_servers: Recorder,
    redis_server: RedisServer,
) -> Iterator[Fleet]:
    """Every gateway of this module, launched at once: the two-worker ones take long to start
    and finish doing so while the single-worker tests run."""
    url = mock_upstream_process.url
    extra = extra_tables(url, mock_b_process.url, recorder_servers)
    shared = {}
    for probes in (1, 2):
        breaker: dict[str, object] = {
            "failure_threshold": THRESHOLD,
            "reset_timeout_s": RESET_S,
            "half_open_max_calls": probes,
        }
        redis = f'\n[redis]\nurl = "{redis_server.url}"\nprefix = "{new_id("t")}"\n'
        config = gateway_config(url, retry=RETRY, breaker=breaker) + extra + redis
        shared[probes] = Gateway(session_tmp, config, workers=2)
    started = Fleet(
        main=Gateway(session_tmp, gateway_config(url, retry=RETRY) + extra),
        short=Gateway(
            session_tmp, gateway_config(url, retry=RETRY, request_timeout_s=SHORT_DEADLINE_S) + extra
        ),
        shared=shared,
    )
    everyone = [started.main, started.short, *shared.values()]
    try:
        for gateway in everyone:
            gateway.process.start()
        yield started
    finally:
        for client in _clients.values():
            client.close()
        _clients.clear()
        stop_together(everyone)


@pytest.fixture(scope="module")
def gateways(fleet: Fleet) -> Fleet:
    """The fleet, once its single-worker gateways serve."""
    for gateway in (fleet.main, fleet.short):
        wait_ready(gateway, 1)
    return fleet


@pytest.fixture(scope="module")
def breaker_gateways(fleet: Fleet) -> dict[int, Gateway]:
    """The two-worker gateways, once both workers of each serve."""
    for gateway in fleet.shared.values():
        wait_ready(gateway, 2)
    return fleet.shared


# --- 1. attempts ---------------------------------------------------------------------------------


def test_retries_stop_at_attempts(gateways: Fleet, upstream: MockUpstream) -> None:
    upstream.configure(mode="status", status=500)
    request_id = new_id("attempts")
    response = post(gateways.main, "solo", request_id=request_id)
    assert_error(response, 503, "upstream_unavailable")
    assert response.headers["x-modelgate-attempts"] == "3"
    assert response.headers["x-modelgate-target"] == "a/x"
    assert upstream.stats()["by_status"] == {"500": 3}
    [entry] = request_logs(gateways.main, request_id)
    assert entry["attempts"] == 3
    assert entry["status"] == 503


def test_two_targets_are_tried_a_b_a(gateways: Fleet, recorder: Recorder) -> None:
    """Order from the stubs' arrival times; the retry at the untried ``b`` goes at once, the one
    back at ``a`` after a backoff (uniform on [0, 50 ms]), so over 6 requests the medians differ."""
    to_b, back_to_a = [], []
    for _ in range(6):
        response = post(gateways.main, "recpair")
        assert_error(response, 503, "upstream_unavailable")
        assert response.headers["x-modelgate-attempts"] == "3"
        assert response.headers["x-modelgate-target"] == "rec1/x"
        arrivals = recorder.take()
        assert [name for _, name in arrivals] == ["rec1", "rec2", "rec1"]
        (a1, _), (b, _), (a2, _) = arrivals
        to_b.append(b - a1)
        back_to_a.append(a2 - b)
    assert statistics.median(to_b) < statistics.median(back_to_a)


def test_two_failing_mocks_share_the_attempts(
    gateways: Fleet, upstream: MockUpstream, second: MockUpstream
) -> None:
    upstream.configure(mode="status", status=500)
    second.configure(mode="status", status=502)
    response = post(gateways.main, "pair")
    assert_error(response, 503, "upstream_unavailable")
    assert response.headers["x-modelgate-attempts"] == "3"
    assert upstream.stats()["by_status"] == {"500": 2}
    assert second.stats()["by_status"] == {"502": 1}


# --- 2. jittered backoff, end to end -------------------------------------------------------------


def test_backoff_gaps_between_retries_are_jittered(gateways: Fleet, recorder: Recorder) -> None:
    """50 gaps between consecutive arrivals at one target (base = max = 50 ms), timed at the stub."""
    gaps: list[float] = []
    for _ in range(25):
        response = post(gateways.main, "rec")
        assert_error(response, 503, "upstream_unavailable")
        times = [t for t, _ in recorder.take()]
        assert len(times) == 3
        gaps += [later - earlier for earlier, later in itertools.pairwise(times)]
    assert len(gaps) == 50
    low, high, mean, sd = min(gaps), max(gaps), statistics.fmean(gaps), statistics.pstdev(gaps)
    print(
        f"\nbackoff gaps over {len(gaps)} retries: min {low * 1000:.1f} ms, max {high * 1000:.1f} ms, "
        f"mean {mean * 1000:.1f} ms, sd {sd * 1000:.1f} ms, cv {sd / mean:.2f}"
    )
    assert high <= 0.050 + SLACK_S, "a gap is far past the 50 ms ceiling"
    assert low < high / 2
    assert sd / mean > 0.2  # uniform on [0, 50 ms] plus a few ms of overhead: cv ~ 0.5
    assert 0.010 < mean < 0.050 + 0.030


# --- 3. retry-after ------------------------------------------------------------------------------


def test_retry_waits_for_the_upstreams_retry_after(gateways: Fleet, upstream: MockUpstream) -> None:
    upstream.configure(rate_429=1.0)  # 429 with retry-after: 1
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(post, gateways.main, "solo")
        wait_for(lambda: upstream.stats()["chat_requests"] >= 1, 5, "the first attempt")
        upstream.configure(rate_429=0.0)
        response = pending.result(timeout=10)
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.headers["x-modelgate-attempts"] == "2"
    assert upstream.stats()["by_status"] == {"200": 1, "429": 1}
    assert 1.0 <= elapsed < 1.0 + SLACK_S + 0.5


def test_retry_after_past_the_deadline_is_not_waited_for(gateways: Fleet, upstream: MockUpstream) -> None:
    upstream.configure(rate_429=1.0)  # retry-after: 1 s, longer than the 0.8 s deadline
    started = time.monotonic()
    response = post(gateways.short, "solo")
    elapsed = time.monotonic() - started
    assert_error(response, 503, "upstream_unavailable")
    assert response.headers["x-modelgate-attempts"] == "1"
    assert upstream.stats()["chat_requests"] == 1
    assert elapsed < SHORT_DEADLINE_S


def test_going_back_to_a_target_honours_its_retry_after(gateways: Fleet, recorder: Recorder) -> None:
    """a: 429 retry-after 1 s, b: 500. Going back, the gateway takes the target that is ready
    first (b, after its backoff) rather than calling a before its retry-after has passed."""
    recorder.answer("rec1", 429, retry_after="1")
    response = post(gateways.main, "recpair")
    assert_error(response, 503, "upstream_unavailable")
    arrivals = recorder.take()
    assert [name for _, name in arrivals] == ["rec1", "rec2", "rec2"]
    assert arrivals[2][0] - arrivals[0][0] < 1.0, "b did not wait for a's retry-after"


# --- 4. fallback ---------------------------------------------------------------------------------


@pytest.mark.parametrize("down", ["answers_500", "not_listening"])
def test_fallback_serves_when_the_first_target_is_down(
    gateways: Fleet, upstream: MockUpstream, second: MockUpstream, down: str
) -> None:
    if down == "answers_500":
        upstream.configure(mode="status", status=500)
    response = post(gateways.main, "pair" if down == "answers_500" else "down")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert response.headers["x-modelgate-target"] == "b/x"
    assert response.headers["x-modelgate-attempts"] == "2"
    assert second.stats()["by_status"] == {"200": 1}
    assert upstream.stats()["chat_requests"] == (1 if down == "answers_500" else 0)


# --- 5. client errors pass through once ----------------------------------------------------------


def test_upstream_400_passes_through_once_and_is_never_retried(
    gateways: Fleet, upstream: MockUpstream, second: MockUpstream
) -> None:
    upstream.configure(mode="status", status=400)
    response = post(gateways.main, "pair")
    assert response.status_code == 400
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["message"] == "mock upstream fault: status 400"
    assert response.headers["x-modelgate-attempts"] == "1"
    assert upstream.stats()["chat_requests"] == 1
    assert second.stats()["chat_requests"] == 0, "a client error must not fall back either"


# --- 7. the official SDK with its default retries ------------------------------------------------


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [
        ("bad_key", 401, "invalid_api_key"),
        ("no_model", 404, "model_not_found"),
        ("tenant_rpm", 429, "rate_limit_exceeded"),
        ("upstream_down", 503, "upstream_unavailable"),
        ("deadline", 504, "upstream_timeout"),
    ],
)
def test_sdk_with_default_retries_makes_one_call_per_gateway_error(
    gateways: Fleet, upstream: MockUpstream, case: str, status: int, code: str
) -> None:
    gateway, key, model = gateways.main, TENANT_KEY, "solo"
    if case == "bad_key":
        key = "tenant-key-nobody-0123456789"
    elif case == "no_model":
        model = "no-such-model"
    elif case == "tenant_rpm":
        key, model = TINY_KEY, "mock"
        post(gateway, model, key=key)  # takes the tenant's one request a minute
    elif case == "upstream_down":
        upstream.configure(mode="status", status=500)
    else:
        upstream.configure(mode="hang")
        gateway = gateways.short
    request_id = new_id(f"sdk-{case}")
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key) as client:
        assert client.max_retries == 2
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model=model,
                messages=MESSAGES,
                extra_headers={"x-request-id": request_id},
            )
    assert caught.value.status_code == status
    assert caught.value.code == code
    assert caught.value.response.headers["x-should-retry"] == "false"
    if status == 429:
        assert int(caught.value.response.headers["retry-after"]) >= 1
    assert len(request_logs(gateway, request_id)) == 1, "the SDK retried a gateway error"
    if case == "upstream_down":
        assert upstream.stats()["chat_requests"] == 3, "the gateway's own attempts"


# --- 8. a stream that stalls after its first bytes -----------------------------------------------


def test_stream_stalled_mid_way_is_cut_within_read_timeout_and_not_retried(
    gateways: Fleet, upstream: MockUpstream
) -> None:
    upstream.configure(mode="stall", stall_after=3)
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    started = time.monotonic()
    with httpx.stream(
        "POST",
        f"{gateways.main.url}/v1/chat/completions",
        content=chat_body("solo", stream=True),
        headers=headers,
        timeout=10,
    ) as response:
        assert response.status_code == 200
        events = sse_events(response)
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_timeout"
    assert len(events) == 3 + 2
    assert READ_TIMEOUT_S - 0.05 <= elapsed < READ_TIMEOUT_S + SLACK_S
    assert upstream.stats()["chat_requests"] == 1, "a stream that sent its first byte is never retried"


# --- 9. a stream that fails before its first byte ------------------------------------------------


@pytest.mark.parametrize("fault", ["status_500", "silent_after_headers"])
def test_stream_failing_before_its_first_byte_falls_back_cleanly(
    gateways: Fleet, upstream: MockUpstream, second: MockUpstream, fault: str
) -> None:
    if fault == "status_500":
        upstream.configure(mode="status", status=500)
    else:
        upstream.configure(mode="stall", stall_after=0)  # 200 and headers, then nothing
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    with httpx.stream(
        "POST",
        f"{gateways.main.url}/v1/chat/completions",
        content=chat_body("pair", stream=True),
        headers=headers,
        timeout=10,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-modelgate-target"] == "b/x"
        assert response.headers["x-modelgate-attempts"] == "2"
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    assert (
        len("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).split())
        == 12
    )

    with openai.OpenAI(base_url=f"{gateways.main.url}/v1", api_key=TENANT_KEY, max_retries=0) as client:
        stream = client.chat.completions.create(model="pair", messages=MESSAGES, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text.split()) == 12
    assert upstream.stats()["chat_requests"] == 2
    assert second.stats()["by_status"] == {"200": 2}


# --- 10. the request deadline bounds everything --------------------------------------------------


@pytest.mark.parametrize(
    ("model", "attempts"),
    [
        ("gpt-4o-mini", 1),  # read_timeout 1.5 s > deadline: the first attempt runs into the deadline
        ("solo", 2),  # read_timeout 0.5 s: one timed-out attempt, a retry, cut by the deadline
    ],
)
def test_deadline_bounds_the_whole_request_retries_included(
    gateways: Fleet, upstream: MockUpstream, model: str, attempts: int
) -> None:
    upstream.configure(mode="hang")
    started = time.monotonic()
    response = post(gateways.short, model)
    elapsed = time.monotonic() - started
    assert_error(response, 504, "upstream_timeout")
    assert SHORT_DEADLINE_S - 0.05 <= elapsed < SHORT_DEADLINE_S + SLACK_S
    assert response.headers["x-modelgate-attempts"] == str(attempts)
    assert upstream.stats()["chat_requests"] == attempts


def test_slow_stream_is_cut_at_the_deadline(gateways: Fleet, upstream: MockUpstream) -> None:
    """Chunks 300 ms apart (under the read timeout) for 3.3 s: the 0.8 s deadline ends the stream."""
    upstream.configure(chunk_delay_ms=300)
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    started = time.monotonic()
    with httpx.stream(
        "POST",
        f"{gateways.short.url}/v1/chat/completions",
        content=chat_body("solo", stream=True),
        headers=headers,
        timeout=10,
    ) as response:
        assert response.status_code == 200
        events = sse_events(response)
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_timeout"
    assert 1 <= len(events) - 2 <= 3
    assert SHORT_DEADLINE_S - 0.05 <= elapsed < SHORT_DEADLINE_S + SLACK_S
    assert upstream.stats()["chat_requests"] == 1


# --- 6. breakers shared by two workers -----------------------------------------------------------


def assert_fast_503(answer: Answer, limit_s: float) -> None:
    assert answer.status == 503, answer.body
    assert answer.body["error"]["code"] == "upstream_unavailable"
    assert answer.headers["x-should-retry"] == "false"
    assert 1 <= int(answer.headers["retry-after"]) <= RESET_S + 1
    assert answer.elapsed < limit_s


@pytest.mark.parametrize("probes", [1, 2])
def test_breaker_is_shared_by_workers_and_lets_exactly_its_probes_through(
    breaker_gateways: dict[int, Gateway], upstream: MockUpstream, probes: int
) -> None:
    """Failures seen by one worker open the breaker for both; open, it answers 503 with
    retry-after at once and the upstream's counter does not move; after RESET_S exactly
    ``probes`` requests of a concurrent crowd reach the (healthy, slow) upstream, the rest get a
    fast 503; the probes' success closes it and traffic flows through both workers again."""
    gateway = breaker_gateways[probes]
    calls = Calls(gateway)

    # Open: two requests on one keep-alive connection, so one worker sees every failure: the
    # first makes its 3 attempts, the second's first attempt is the THRESHOLD-th failure, which
    # opens the breaker and so ends that request's retries.
    upstream.configure(mode="status", status=500)
    conn = calls.connect()
    failures = [calls.on(conn) for _ in range(2)]
    opened = time.monotonic()
    assert [a.status for a in failures] == [503, 503]
    assert [a.headers["x-modelgate-attempts"] for a in failures] == ["3", str(THRESHOLD - 3)]
    assert upstream.stats()["chat_requests"] == THRESHOLD
    assert calls.workers(failures[:1]) != [None]

    # Open, fleet-wide: new connections land on both workers; all fail fast, none reaches the upstream.
    fast = [calls.fresh() for _ in range(10)]
    assert time.monotonic() < opened + RESET_S, "too slow to check the open breaker before it half-opens"
    for answer in fast:
        assert_fast_503(answer, 0.3)
    assert upstream.stats()["chat_requests"] == THRESHOLD, "an open breaker let a request through"
    by_worker = Counter(calls.workers(fast))
    assert None not in by_worker and len(by_worker) == 2, f"fail-fast requests by worker: {by_worker}"

    # Half-open: the upstream is healthy but slow, so the probes are still out while many
    # concurrent requests arrive through both workers; only `probes` of them reach it.
    upstream.configure(mode="ok", latency_ms=PROBE_LATENCY_MS)
    time.sleep(max(0.0, opened + RESET_S + 0.2 - time.monotonic()))
    crowd = 12
    barrier = threading.Barrier(crowd)

    def one(_: int) -> Answer:
        barrier.wait(5)
        return calls.fresh()

    with ThreadPoolExecutor(crowd) as pool:
        answers = list(pool.map(one, range(crowd)))
    served = [a for a in answers if a.status == 200]
    assert len(served) == probes, [(a.status, a.body) for a in answers]
    for answer in answers:
        if answer.status != 200:
            assert_fast_503(answer, PROBE_LATENCY_MS / 1000 - 0.1)
    assert upstream.stats()["chat_requests"] == THRESHOLD + probes
    by_worker = Counter(calls.workers(answers))
    assert None not in by_worker and len(by_worker) == 2, f"the crowd by worker: {by_worker}"

    # Closed: traffic flows again, through both workers.
    upstream.configure(latency_ms=0)
    flowing = [calls.fresh() for _ in range(8)]
    assert [a.status for a in flowing] == [200] * 8
    assert upstream.stats()["chat_requests"] == THRESHOLD + probes + 8
    assert len(set(calls.workers(flowing))) == 2

    def transitions() -> list[str]:
        return [
            e["state"] for e in log_entries(gateway, "breaker transition") if e["target"] == "up/gpt-4o-mini"
        ]

    with contextlib.suppress(TimeoutError):
        wait_for(lambda: len(transitions()) >= 3, 5, "breaker transition log lines")
    assert transitions() == ["open", "half_open", "closed"]


def test_going_back_because_the_other_breaker_is_open_still_waits(
    breaker_gateways: dict[int, Gateway], recorder: Recorder
) -> None:
    """rec2's breaker is open; rec1 answers 429 with retry-after 1 s. The retry may not go to rec2,
    so it goes back to rec1: no sooner than rec1's retry-after."""
    gateway = breaker_gateways[1]
    for _ in range(2):  # 3 + 1 attempts: THRESHOLD failures open rec2's breaker
        assert_error(post(gateway, "only2"), 503, "upstream_unavailable")
    assert [name for _, name in recorder.take()] == ["rec2"] * THRESHOLD
    recorder.answer("rec1", 429, retry_after="1")  # rate limiting: not a breaker failure
    assert_error(post(gateway, "recpair"), 503, "upstream_unavailable")
    arrivals = recorder.take()
    assert len(arrivals) >= 2
    again = [t for t, name in arrivals if name == "rec1"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(again)]
    assert all(gap >= 1.0 for gap in gaps), f"went back to rec1 after {[round(g, 3) for g in gaps]} s"
