"""Running the ASGI server: uvicorn with uvloop and httptools, one process or several.

uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die "by the signal";
a gateway that drained cleanly should exit 0, which orchestrators read as a clean stop. The
server class here keeps uvicorn's shutdown and only drops that re-raise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GatewayServer(uvicorn.Server):
    """A uvicorn server whose graceful stop on SIGTERM/SIGINT ends with exit status 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def server_options(host: str, port: int) -> dict[str, Any]:
    """uvicorn settings for the gateway: fastest loop and parser available, no access log."""
    return {
        "host": host,
        "port": port,
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
        "log_config": None,
        "access_log": False,
        "server_header": False,
        "timeout_graceful_shutdown": 30,
    }


def run(app: Any, options: dict[str, Any], workers: int = 1) -> None:
    """Serve ``app`` (an ASGI app, or an import string of a factory when ``workers`` > 1)."""
    if workers > 1:
        uvicorn.run(app, factory=True, workers=workers, **options)
        return
    GatewayServer(uvicorn.Config(app, **options)).run()
