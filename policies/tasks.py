"""Stopping background tasks reliably.

A cancellation that arrives while a task is inside a Redis call can be swallowed by the client
library; the task then goes back to its loop and a plain ``await task`` never returns. Stopping
therefore cancels until the task is done, with a bound.
"""

from __future__ import annotations

import asyncio

STOP_TIMEOUT_S = 2.0


async def stop_task(task: asyncio.Task[None], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Cancel ``task`` and wait for it to end, cancelling again if it shrugged one off."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not task.done():
        task.cancel()
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return
        await asyncio.wait([task], timeout=min(0.1, remaining))
    if not task.cancelled() and task.exception() is not None:
        task.exception()  # retrieved, so it is not reported as never retrieved
