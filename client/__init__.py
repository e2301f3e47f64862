"""The queue worker client: agent tasks from Redis, every model call through the gateway.

Producers ``enqueue`` on a :class:`Queue`; a :class:`Worker` claims tasks under fenced, renewed
leases and runs ``async def handler(ctx: TaskContext, payload)``, whose steps are checkpointed and
whose model calls go to the gateway (``ctx.model``, an ``openai.AsyncOpenAI`` with ``max_retries=0``
and ``X-Task-Id``). Handlers steer their task by raising :class:`Retryable`, :class:`Fatal` or
:class:`NeedsHuman`. See ``client/README.md``.
"""

from client.context import TaskContext
from client.errors import Fatal, NeedsHuman, Retryable
from client.queue import Queue
from client.worker import Worker

__all__ = ["Fatal", "NeedsHuman", "Queue", "Retryable", "TaskContext", "Worker"]
