"""Whether this process is shutting down: set by SIGTERM/SIGINT, read by ``/readyz``.

The server stops listening at once on those signals and lets requests in flight finish; from the
same moment ``/readyz`` answers 503, so a check that still reaches the process sees it draining.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_draining = threading.Event()


def begin() -> None:
    _draining.set()


def draining() -> bool:
    return _draining.is_set()


def mark_on_signals() -> None:
    """Make SIGINT/SIGTERM mark the drain before the handler already installed (the server's) runs.

    For worker processes, whose server uvicorn's supervisor creates: the app is built after that
    server installed its handlers, so wrapping them is the one place the drain can be seen from.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        previous = signal.getsignal(sig)
        if callable(previous):
            signal.signal(sig, _marking(previous))


def _marking(previous: Callable[[int, FrameType | None], Any]) -> Callable[[int, FrameType | None], None]:
    def handler(sig: int, frame: FrameType | None) -> None:
        begin()
        previous(sig, frame)

    return handler
