"""The benchmark's processes: a private ``redis-server``, ``modelgate mock-upstream`` and the gateway.

Each runs in its own session with its output in a log file under the run's temp dir, is polled
for readiness with a deadline, and is stopped (SIGTERM, then SIGKILL) when the benchmark ends.
Also here: what the benchmark reads from ``/proc`` (resident memory and CPU time of a process)
and the generated gateway config.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

BENCH_KEY = "bench-tenant-key-0123456789abcdef"
ADMIN_KEY = "bench-admin-key-0123456789abcdef"
UPSTREAM_KEY = "sk-bench-upstream-0123456789"
MODEL = "mock"
"""The model clients name; the gateway's one target is the mock's model of the same name, so the
gateway forwards request bodies untouched (no re-encoding), as it would for most deployments."""
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for(check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def answers_ping(port: int) -> Callable[[], bool]:
    """A readiness check: the Redis on ``port`` answers PING."""

    def check() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return check


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness check: ``GET url`` answers 200."""

    def check() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def steal_s() -> float:
    """CPU seconds the hypervisor has given to other guests (``steal`` in ``/proc/stat``), summed
    over this machine's CPUs; 0 where the kernel does not count it."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return 0.0
    return int(fields[8]) / _CLK_TCK if len(fields) > 8 and fields[0] == "cpu" else 0.0


class Process:
    """One child process, its log file, and its resource use read from ``/proc``."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, check: Callable[[], bool]) -> None:
        _wait_for(check, self.name, self.proc, self.log)

    def rss_kib(self) -> int:
        """Resident set size (``VmRSS``) in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for {self.name}")

    def cpu_s(self) -> float:
        """User + system CPU seconds used so far (this process only, not its children)."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def start_redis(tmp: Path) -> tuple[Process, str]:
    """A private ``redis-server`` (no persistence) on a free port; returns it and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH (Debian: apt-get install redis-server)")
    port = free_port()
    directory = tmp / "redis"
    directory.mkdir()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
    redis = Process("redis-server", args, tmp / "redis.log")
    redis.wait_ready(answers_ping(port))
    return redis, f"redis://127.0.0.1:{port}/0"


def start_mock(tmp: Path, port: int | None = None, latency_ms: float = 0.0) -> tuple[Process, str]:
    """``modelgate mock-upstream``; returns it and its base URL (without ``/v1``)."""
    port = port or free_port()
    args = [sys.executable, "-m", "gateway.cli", "mock-upstream", "--port", str(port)]
    args += ["--latency-ms", str(latency_ms)]
    mock = Process("mock-upstream", args, tmp / "mock-upstream.log")
    url = f"http://127.0.0.1:{port}"
    mock.wait_ready(http_ok(f"{url}/v1/models"))
    return mock, url


def set_mock_latency(mock_url: str, latency_ms: float) -> None:
    """Change the mock's latency at runtime through its control API."""
    response = httpx.post(f"{mock_url}/_mock/config", json={"latency_ms": latency_ms}, timeout=5)
    response.raise_for_status()


def mock_config(mock_url: str, **settings: object) -> None:
    """Change any of the mock's settings (mode, status, ...) through its control API."""
    httpx.post(f"{mock_url}/_mock/config", json=settings, timeout=5).raise_for_status()


def reset_breaker(gateway_url: str) -> None:
    """Close the benchmark target's breaker through the admin API."""
    url = f"{gateway_url}/admin/breakers/mock/{MODEL}/reset"
    httpx.post(url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).raise_for_status()


def gateway_config(mock_url: str, redis_url: str, log_level: str) -> str:
    """One tenant with limits far above what the benchmark sends (so admission runs in Redis on
    every request but never refuses), one model whose one target is the mock upstream."""
    return f"""
[server]
admin_key = "{ADMIN_KEY}"
request_timeout_s = 60
invalid_keys_per_minute = 1000000
log_level = "{log_level}"

[redis]
url = "{redis_url}"
prefix = "mgbench"

[[providers]]
name = "mock"
type = "openai"
base_url = "{mock_url}/v1"
api_key = "{UPSTREAM_KEY}"

[[models]]
name = "{MODEL}"
targets = [{{ provider = "mock", model = "{MODEL}" }}]

[[tenants]]
name = "bench"
keys = ["{BENCH_KEY}"]
rpm = 1000000000
tpm = 1000000000000
max_concurrency = 100000
"""


def start_gateway(tmp: Path, mock_url: str, redis_url: str, log_level: str) -> tuple[Process, str]:
    """``modelgate serve --workers 1`` (the serve process is the worker); returns it and its URL."""
    config = tmp / "gateway.toml"
    config.write_text(gateway_config(mock_url, redis_url, log_level))
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    args += ["--port", str(port), "--workers", "1"]
    gateway = Process("gateway", args, tmp / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    gateway.wait_ready(http_ok(f"{url}/readyz"))
    return gateway, url
