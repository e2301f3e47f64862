"""The soak's fleet: a private ``redis-server`` with an append-only file, the mock upstream, two
gateway instances (``modelgate serve --workers 2``) and the queue workers (``modelgate worker``).

Everything listens on 127.0.0.1 and logs into the run's temp dir. Each member can be killed with
SIGKILL (its whole process group: a gateway's supervisor and its workers together) and restarted
on the same port, which is what the chaos loop does; :meth:`Fleet.stop` ends them all (SIGTERM,
then SIGKILL). Redis runs with ``appendonly yes`` and ``appendfsync always``, so a crash loses no
acknowledged write: usage, budgets, buckets, breakers and the queue survive its restarts, and the
accounting checks can cover the whole run instead of the windows between restarts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench_procs import Process, answers_ping, free_port, http_ok

REPO = Path(__file__).resolve().parents[1]
ADMIN_KEY = "soak-admin-key-0123456789abcdef"
UPSTREAM_KEY = "sk-soak-upstream-0123456789"
PREFIX = "soak"
"""The gateway's Redis key prefix (every gateway key starts with ``{soak}:``)."""
QUEUE = "soak"
MODEL = "mock"
SLOT_LEASE_S = 15.0
READ_TIMEOUT_S = 1.5
REQUEST_TIMEOUT_S = 10.0
BREAKER_RESET_S = 2.0
DEFAULT_MAX_TOKENS = 64
INPUT_USD_PER_MTOK = 1.0
OUTPUT_USD_PER_MTOK = 4.0
WORKER_LEASE_S = 6.0
READY_TIMEOUT_S = 60.0
"""How long a (re)started process may take to answer: generous, the machine may be busy."""
MOCK_LATENCY_MS = 20.0
"""Every upstream answer takes this long, so requests overlap and concurrency limits bite."""


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant of the soak's config file."""

    name: str
    key: str
    rpm: int | None = None
    max_concurrency: int | None = None


STEADY = TenantSpec("steady", "soak-steady-key-0123456789abcdef")
LIMITED = TenantSpec("limited", "soak-limited-key-0123456789abcdef", rpm=30)
NARROW = TenantSpec("narrow", "soak-narrow-key-0123456789abcdef", max_concurrency=2)
BUDGETED = TenantSpec("budgeted", "soak-budgeted-key-0123456789abcdef")
TASKS = TenantSpec("tasks", "soak-tasks-key-0123456789abcdef")
TENANTS = (STEADY, LIMITED, NARROW, BUDGETED, TASKS)


def _tenant_toml(tenant: TenantSpec) -> str:
    lines = ["[[tenants]]", f'name = "{tenant.name}"', f'keys = ["{tenant.key}"]']
    if tenant.rpm is not None:
        lines.append(f"rpm = {tenant.rpm}")
    if tenant.max_concurrency is not None:
        lines.append(f"max_concurrency = {tenant.max_concurrency}")
    return "\n".join(lines)


def gateway_config(mock_url: str, redis_url: str) -> str:
    """One config file for both instances: short timeouts so faults resolve within seconds."""
    head = f"""
[server]
admin_key = "{ADMIN_KEY}"
request_timeout_s = {REQUEST_TIMEOUT_S}
invalid_keys_per_minute = 1000000
default_max_tokens = {DEFAULT_MAX_TOKENS}
shutdown_grace_s = 5
log_level = "info"

[redis]
url = "{redis_url}"
prefix = "{PREFIX}"
on_failure = "closed"
slot_lease_s = {SLOT_LEASE_S}

[retry]
attempts = 3
base_delay_ms = 100
max_delay_ms = 1000

[breaker]
failure_threshold = 5
reset_timeout_s = {BREAKER_RESET_S}
half_open_max_calls = 1

[[providers]]
name = "up"
type = "openai"
base_url = "{mock_url}/v1"
api_key = "{UPSTREAM_KEY}"
connect_timeout_s = 2
read_timeout_s = {READ_TIMEOUT_S}
max_concurrency = 64

[[models]]
name = "{MODEL}"
input_usd_per_mtok = {INPUT_USD_PER_MTOK}
output_usd_per_mtok = {OUTPUT_USD_PER_MTOK}
targets = [{{ provider = "up", model = "{MODEL}" }}]
"""
    return head + "\n\n".join(_tenant_toml(t) for t in TENANTS) + "\n"


class Member(Process):
    """A child process started from the repository root with extra environment variables."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self.log_offset = log.stat().st_size if log.exists() else 0
        """Where this run of the process starts writing in its (appended) log."""
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=REPO,
                env={**os.environ, **(env or {})},
            )

    def wait_ready(self, check: Callable[[], bool], timeout: float = READY_TIMEOUT_S) -> None:
        """Until ``check`` passes; ``RuntimeError`` if the process exits or the timeout passes."""
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready within {timeout:.0f} s")
            time.sleep(0.05)

    def output(self) -> str:
        """What this run of the process has logged."""
        with self.log.open("rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")


def _kill_group(process: Process) -> None:
    """SIGKILL the process and everything in its session, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.proc.wait(10)


class _Restartable:
    """A member of the run that chaos may kill (SIGKILL to its process group) and the end stops."""

    process: Member | None = None

    def kill(self) -> None:
        if self.process is not None:
            _kill_group(self.process)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class RedisServer(_Restartable):
    """``redis-server`` on a fixed port with its data (AOF) in a fixed dir, so a restart keeps it."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tmp / "redis"
        self._dir.mkdir()
        self._log = tmp / "redis.log"
        self._args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self._dir)]
        self._args += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self._args += ["--protected-mode", "no"]
        self.process: Member | None = None

    def start(self) -> None:
        self.process = Member("redis-server", self._args, self._log)
        self.process.wait_ready(answers_ping(self.port))


class GatewayInstance(_Restartable):
    """``modelgate serve --workers N`` on a fixed port; ``TMPDIR`` points into the run's temp dir, so
    the metrics dir a killed instance leaves behind is removed with it."""

    def __init__(self, tmp: Path, index: int, config: Path, workers: int) -> None:
        self.index = index
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tmp / f"gateway-{index}.log"
        self._args = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
        self._args += ["--port", str(self.port), "--workers", str(workers)]
        self._tmpdir = tmp / "tmp"
        self._tmpdir.mkdir(exist_ok=True)
        self.process: Member | None = None

    @property
    def log(self) -> Path:
        return self._log

    def start(self) -> None:
        env = {"TMPDIR": str(self._tmpdir)}
        self.process = Member(f"gateway-{self.index}", self._args, self._log, env)
        self.process.wait_ready(http_ok(f"{self.url}/readyz"))

    def worker_pids(self) -> list[int]:
        """The pids of the instance's worker processes (uvicorn's supervisor's spawned children)."""
        if self.process is None:
            return []
        return children(self.process.pid, "spawn_main")


class QueueWorker(_Restartable):
    """``modelgate worker loadtest.soak_handlers:handlers`` calling one gateway instance."""

    def __init__(self, tmp: Path, index: int, redis_url: str, gateway: GatewayInstance, key: str) -> None:
        self.index = index
        self._log = tmp / f"worker-{index}.log"
        self._args = [sys.executable, "-m", "gateway.cli", "worker", "loadtest.soak_handlers:handlers"]
        self._args += ["--queue", QUEUE, "--concurrency", "4", "--lease-s", str(WORKER_LEASE_S)]
        self._args += ["--backoff-scale", "0.5", "--grace-s", "5", "--redis", redis_url]
        self._args += ["--gateway-url", f"{gateway.url}/v1", "--gateway-key", key]
        self._env = {"SOAK_REDIS_URL": redis_url, "SOAK_MODEL": MODEL}
        self.process: Member | None = None
        self.pids: list[int] = []
        """Every pid this worker has had, so task history entries can be traced to it."""

    def start(self) -> None:
        process = self.process = Member(f"worker-{self.index}", self._args, self._log, self._env)
        self.pids.append(process.pid)
        process.wait_ready(lambda: " on queue " in process.output())


def children(pid: int, marker: str) -> list[int]:
    """Child processes of ``pid`` whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == pid and marker in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def rss_kib(pid: int) -> int | None:
    """``VmRSS`` of a process in KiB, ``None`` if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Fleet:
    """Every process of the soak."""

    def __init__(self, tmp: Path, instances: int = 2, workers_per_instance: int = 2) -> None:
        self.tmp = tmp
        self.redis = RedisServer(tmp)
        self.mock_port = free_port()
        self.mock_url = f"http://127.0.0.1:{self.mock_port}"
        self.mock: Member | None = None
        self.config = tmp / "gateway.toml"
        self.config.write_text(gateway_config(self.mock_url, self.redis.url))
        self.gateways = [GatewayInstance(tmp, i, self.config, workers_per_instance) for i in range(instances)]
        self.workers = [
            QueueWorker(tmp, i, self.redis.url, gateway, TASKS.key) for i, gateway in enumerate(self.gateways)
        ]

    def start(self) -> None:
        self.redis.start()
        args = [sys.executable, "-m", "gateway.cli", "mock-upstream", "--port", str(self.mock_port)]
        args += ["--latency-ms", str(MOCK_LATENCY_MS)]
        self.mock = Member("mock-upstream", args, self.tmp / "mock-upstream.log")
        self.mock.wait_ready(http_ok(f"{self.mock_url}/v1/models"))
        for gateway in self.gateways:
            gateway.start()
        for worker in self.workers:
            worker.start()

    def stop(self) -> None:
        members: list[QueueWorker | GatewayInstance] = [*self.workers, *self.gateways]
        for member in members:
            with contextlib.suppress(Exception):
                member.stop()
        if self.mock is not None:
            self.mock.stop()
        self.redis.stop()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")
