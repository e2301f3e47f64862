"""Running the ASGI server: uvicorn with uvloop and httptools, one process or several.

Graceful shutdown on SIGTERM (or SIGINT): the listening socket closes at once, so new connections
are refused; idle keep-alive connections are closed; requests and streams in flight finish,
for at most ``server.shutdown_grace_s`` (uvicorn's ``timeout_graceful_shutdown``; past it the
rest are cancelled); then the app's shutdown closes upstream pools and Redis. ``/readyz`` answers
503 from the signal on.

uvicorn re-raises the signal after its graceful shutdown, so the process would die "by the
signal"; a gateway that drained cleanly should exit 0, which orchestrators read as a clean stop.
:class:`GatewayServer` keeps uvicorn's shutdown and only drops that re-raise. With ``--workers N``
uvicorn's supervisor runs a plain server per worker (those exit by the signal; the supervisor,
the process an orchestrator watches, exits 0). :class:`GatewaySupervisor` also closes the
supervisor's own copy of the listening socket when it stops: otherwise the kernel keeps
accepting connections into the backlog that no worker will ever serve, until the drain is over.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from gateway import shutdown
from gateway.config import ServerConfig
from gateway.http_protocol import GatewayHttpProtocol, GatewayServerConfig

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GatewayServer(uvicorn.Server):
    """A uvicorn server whose graceful stop on SIGTERM/SIGINT marks the drain and ends with exit 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        shutdown.begin()
        super().handle_exit(sig, frame)


class GatewaySupervisor(Multiprocess):
    """uvicorn's worker supervisor, which stops listening before it asks the workers to drain.

    It notices a signal at its next half-second poll (its handler only queues it: setting an event
    from a signal handler can deadlock), so workers stop accepting within about 0.5 s of it.
    """

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


def server_options(host: str, port: int, server: ServerConfig | None = None) -> dict[str, Any]:
    """uvicorn settings for the gateway: uvloop, httptools with the client limits of ``server``
    (:mod:`gateway.http_protocol`), no access log."""
    server = server or ServerConfig()
    return {
        "host": host,
        "port": port,
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": GatewayHttpProtocol,
        "log_config": None,
        "access_log": False,
        "server_header": False,
        # uvicorn would otherwise take the client address from X-Forwarded-For sent from
        # 127.0.0.1, and the key guard counts failures per address: a local client (or one behind
        # a same-host proxy passing the header on) could pick a fresh address for every guess.
        "proxy_headers": False,
        "timeout_graceful_shutdown": server.shutdown_grace_s,
        "timeout_keep_alive": server.idle_timeout_s,
        "max_header_bytes": server.max_header_bytes,
        "client_timeout_s": server.client_timeout_s,
        "max_connections": server.max_connections,
    }


def run(app: Any, options: dict[str, Any], workers: int = 1) -> int:
    """Serve ``app`` (an ASGI app, or an import string of a factory when ``workers`` > 1) until
    stopped; the exit status (0, or uvicorn's startup failure status when a worker could not start)."""
    if workers == 1:
        GatewayServer(GatewayServerConfig(app, **options)).run()
        return 0
    config = GatewayServerConfig(app, factory=True, workers=workers, **options)
    supervisor = GatewaySupervisor(config, sockets=[config.bind_socket()])
    supervisor.run()
    failed = any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes)
    return STARTUP_FAILURE if failed else 0
