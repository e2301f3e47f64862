"""Pieces the security tests share: random secrets, a trap listener, a scripted upstream, a Redis
with a password, and readers for the gateway's JSON log lines.

Everything here is a real socket or process; nothing waits by sleeping.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.harness import free_port, wait_for

_ALPHABET = "GHJKLMNPQRSTUVWXYZghjkmnpqrstuvwxyz"
"""Letters only, no hex digit and hardly a vowel: 8 characters of a secret made from them do not
turn up by chance in request ids, trace ids, hashes or words of the log (35^8 ~ 2e12 choices)."""
WINDOW = 8
"""A leak of this many consecutive characters of a secret counts as a leak."""


def make_secret(rng: random.Random | None = None, length: int = 40) -> str:
    chooser = rng or random.SystemRandom()
    return "".join(chooser.choice(_ALPHABET) for _ in range(length))


def leaks(text: str, secret: str) -> list[str]:
    """The ``WINDOW``-character pieces of ``secret`` found in ``text`` (the whole secret included)."""
    pieces = {secret[i : i + WINDOW] for i in range(len(secret) - WINDOW + 1)}
    return sorted(piece for piece in pieces if piece in text)


class Trap:
    """A listening socket that nobody serves: counts every connection made to it.

    The kernel completes each TCP handshake into the accept backlog, so a connection attempt is
    seen even though nothing ever answers (a gateway that connected here would wait for a reply).
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(512)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self._count = 0

    def connections(self) -> int:
        """Connections made so far (accepts and closes those waiting)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return self._count
            conn.close()
            self._count += 1

    def close(self) -> None:
        self._sock.close()


@dataclass
class Script:
    """What the scripted upstream answers to every request."""

    status: int = 200
    location: str | None = None
    echo: bool = False
    """Put every credential header it received into its body and headers."""


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class ScriptedUpstream:
    """A tiny HTTP server (a thread in the test process) answering as its :class:`Script` says."""

    script: Script = field(default_factory=Script)
    received: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                upstream.received.append(Received(self.command, self.path, headers))
                script = upstream.script
                credentials = {k: v for k, v in headers.items() if k in ("authorization", "x-api-key")}
                message = f"scripted {script.status}"
                if script.echo:
                    message += f"; you sent {json.dumps(credentials)}"
                body = json.dumps(
                    {"error": {"message": message, "type": "x", "param": None, "code": "x", **credentials}}
                ).encode()
                self.send_response(script.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                if script.location is not None:
                    self.send_header("location", script.location)
                if script.echo:
                    for name, value in credentials.items():
                        self.send_header(f"x-echo-{name}", value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _answer

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def set(self, **changes: Any) -> None:
        self.script = Script(**changes)
        self.received.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


class PasswordRedis:
    """A private ``redis-server`` that wants a password (so its URL in the config is a secret)."""

    def __init__(self, directory: Path, password: str) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.dir = directory
        self.password = password
        self.url = f"redis://:{password}@127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PasswordRedis:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--save", "", "--appendonly", "no", "--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 10.0, "redis-server to answer PING")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                reply = b""
                while b"PONG" not in reply and len(reply) < 64:
                    chunk = sock.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return b"+PONG" in reply
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


def log_lines(output: str) -> Iterator[dict[str, Any]]:
    """The JSON log lines of a gateway's output (span dumps and other text are skipped)."""
    for line in output.splitlines():
        if line.startswith('{"ts":'):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def request_line(output: str, request_id: str) -> dict[str, Any] | None:
    """The one ``request`` log line of ``request_id``, if written yet."""
    for entry in log_lines(output):
        if entry.get("msg") == "request" and entry.get("request_id") == request_id:
            return entry
    return None


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The OpenAI error object of ``response``, checked for status, shape, code and no-retry."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["x-should-retry"] == "false"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    return error
