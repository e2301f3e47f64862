"""Go-style durations (``20ms``, ``1s``, ``1.5s``, ``6m0s``), the format of OpenAI's rate-limit headers."""

from __future__ import annotations

import math


def go_duration(seconds: float) -> str:
    """Format ``seconds`` as Go's ``time.Duration`` prints it, to the millisecond."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-9))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = _seconds(rest)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _seconds(ms: int) -> str:
    whole, frac = divmod(ms, 1000)
    return f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
