"""Keeping the cyclic garbage collector off the request path's tail latency.

CPython's full (generation 2) collection walks every tracked object. A started gateway holds
about 100k of them (Litestar, msgspec types, OpenTelemetry, the config) that live as long as the
process; under load the full collection then ran every 1-2 s and stopped the worker for 55-90 ms
each time (measured with ``gc.callbacks`` at concurrency 64, upstream 50 ms): every request in
flight waited for it, which set p99 and bunched the closed-loop clients into bursts.

Once the app has started, :func:`freeze_startup_objects` collects what startup left behind and
moves the survivors to the permanent generation (``gc.freeze``), which later collections skip.
Objects created afterwards are collected as before; only the startup heap is exempt, and it is
never garbage anyway.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def freeze_startup_objects() -> None:
    """Collect startup's garbage, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD)
