"""How a failed attempt is judged, and how long the task waits before the next one.

:func:`classify` turns what a handler raised into a :class:`Verdict`; it reads exception types,
status codes and the structured error ``code`` of gateway answers, never message text:

==========================================================  ==========================================
raised                                                      verdict
==========================================================  ==========================================
``NeedsHuman``                                              park in ``waiting_human``
``Fatal``; gateway 400/401/403/404 and other 4xx;           ``failed`` at once
gateway 429 with code ``insufficient_quota``
``Retryable``; gateway 429, 408, 409, 5xx (503, 504, ...);  retry after backoff; the gateway's
``APIConnectionError`` / ``APITimeoutError``; the task      ``retry-after-ms`` / ``retry-after`` (or
timeout; any other exception                                ``Retryable.retry_after_s``) is a floor
==========================================================  ==========================================

:class:`Backoff` is exponential with full jitter: ``uniform(0, min(max_s, base_s * 2**(attempt-1)))``
times ``scale``; ``scale=0`` turns it off (tests), while a retry-after floor always holds.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Literal

import openai

from client.errors import Fatal, NeedsHuman, Retryable

RETRY_STATUSES = frozenset({408, 409, 429})
MAX_RETRY_AFTER_S = 3600.0

Outcome = Literal["retry", "failed", "waiting_human"]


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    error: str
    floor_s: float = 0.0


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter; ``scale`` multiplies it (0 turns it off)."""

    base_s: float = 1.0
    max_s: float = 300.0
    scale: float = 1.0
    rng: Callable[[], float] = field(default=random.random, compare=False)

    def delay(self, attempt: int, floor_s: float = 0.0) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        cap = min(self.max_s, self.base_s * 2.0 ** max(attempt - 1, 0))
        return max(floor_s, self.rng() * cap * self.scale)


def describe(exc: BaseException) -> str:
    """``Type: message``; for a gateway answer, its status and error code too."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        message = body.get("message") or exc.message
        return f"{type(exc).__name__}: gateway answered {exc.status_code} {exc.code or '-'}: {message}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(exc: BaseException) -> Verdict:
    """What to do with the task after ``exc`` ended its attempt."""
    if isinstance(exc, NeedsHuman):
        return Verdict("waiting_human", describe(exc))
    if isinstance(exc, Fatal):
        return Verdict("failed", describe(exc))
    if isinstance(exc, Retryable):
        return Verdict("retry", describe(exc), exc.retry_after_s or 0.0)
    if isinstance(exc, openai.APIStatusError):
        return _status_verdict(exc)
    return Verdict("retry", describe(exc))


def _status_verdict(exc: openai.APIStatusError) -> Verdict:
    status = exc.status_code
    if status == 429 and exc.code == "insufficient_quota":
        return Verdict("failed", describe(exc))
    if status in RETRY_STATUSES or status >= 500:
        return Verdict("retry", describe(exc), retry_after_s(exc.response.headers))
    return Verdict("failed", describe(exc))


def retry_after_s(headers: Mapping[str, str]) -> float:
    """The wait a response asks for: ``retry-after-ms``, else ``retry-after`` (seconds or a date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return _bounded(float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return 0.0
    try:
        return _bounded(float(value))
    except ValueError:
        return _bounded(_date_delay(value))


def _date_delay(value: str) -> float:
    try:
        return parsedate_to_datetime(value).timestamp() - time.time()
    except (TypeError, ValueError):
        return 0.0


def _bounded(seconds: float) -> float:
    if math.isnan(seconds):
        return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
