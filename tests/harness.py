"""Real processes for tests: ``modelgate`` commands and a private ``redis-server``.

Each process writes its output to a file so a test can search it (for request ids, or for
secrets that must not be there). Readiness is polled with a deadline, never slept for.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``check`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


class ModelgateProcess:
    """A ``modelgate`` subcommand running in its own process."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ModelgateProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    def wait_http(self, url: str, timeout: float = 20.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout, f"{url} to answer")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait(timeout)


class MockUpstream:
    """``modelgate mock-upstream`` with its control API."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = ModelgateProcess(
            ["mock-upstream", "--port", str(self.port)], tmp / f"mock-{self.port}.log"
        )

    def start(self) -> MockUpstream:
        self.process.start().wait_http(f"{self.url}/v1/models")
        return self

    def configure(self, **settings: Any) -> None:
        httpx.post(f"{self.url}/_mock/config", json=settings).raise_for_status()

    def reset(self) -> None:
        httpx.post(f"{self.url}/_mock/reset").raise_for_status()

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/_mock/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


class Gateway:
    """``modelgate serve`` on a free port, with a config file written for it."""

    def __init__(
        self, tmp: Path, config: str | None, workers: int = 1, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["serve", "--port", str(self.port), "--workers", str(workers)]
        if config is not None:
            path = tmp / f"gateway-{self.port}.toml"
            path.write_text(config)
            args += ["--config", str(path)]
        clean_env = {k: v for k, v in (env or {}).items()}
        self.process = ModelgateProcess(args, tmp / f"gateway-{self.port}.log", clean_env)

    def start(self) -> Gateway:
        self.process.start().wait_http(f"{self.url}/healthz")
        return self

    def stop(self) -> int | None:
        return self.process.stop()

    def output(self) -> str:
        return self.process.output()


class RedisServer:
    """A private ``redis-server`` on a free port in a temp dir; tests may stop and restart it."""

    def __init__(self, tmp: Path) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError(
                "redis-server is not on PATH: install it (Debian: apt-get install redis-server)"
            )
        self.port = free_port()
        self.dir = tmp
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 10.0, "redis-server to answer PING")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
