"""What a handler gets: checkpointed steps, the gateway client, cancellation and identity.

``await ctx.step(name, fn)`` runs ``fn`` (which may return a value or an awaitable) once and
checkpoints its output (JSON via msgspec) under ``name``; on a later attempt of the same task the
checkpoint is returned and ``fn`` is not called. Step names must be unique within a task.

Outputs are stored as JSON: an openai SDK object (any pydantic model) is stored via
``.model_dump(mode="json")`` and, on replay, comes back as a plain dict, as do dataclasses and
msgspec structs. Pass ``returns=ChatCompletion`` (a pydantic model, or any type msgspec can
``convert`` to) to get that type back on replay too; the first run always returns ``fn``'s own value.

Side effects. ``ctx.step(name, fn, side_effect=True)`` marks a step that changes the outside world.
Before ``fn`` runs, a marker is stored; it is dropped when the step is checkpointed or fails with a
definite answer (``Retryable``, ``Fatal``, ``NeedsHuman`` or a gateway status error: it did not
happen). So:

* if an earlier attempt started the step and never finished it (the worker died, froze past its
  lease, or the task timeout cut it), the next attempt does not run it again: the task is parked in
  ``waiting_human``; ``Queue.approve`` then lets it run again, or ``approve(resolve={name: output})``
  records what happened;
* if ``fn`` raises anything else (a timeout, a connection error, a bug), its outcome is ambiguous
  and the task is parked the same way;
* ``idempotent=True`` declares that running ``fn`` twice is harmless (typically it passes
  ``ctx.idempotency_key(name)`` to the system it calls, which deduplicates): then the step is simply
  run again and its errors are retried like any other.

A cancel requested with ``Queue.cancel`` is seen at the next step boundary: ``ctx.step`` raises an
internal ``TaskCancelled`` and the task ends ``cancelled``. ``ctx.cancelled()`` reports whether one
has been seen (heartbeats and step boundaries refresh it), for handlers that loop between steps.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import openai

from client import codec
from client.claim import BeatReply, Claim
from client.errors import Fatal, InDoubt, LeaseLost, NeedsHuman, Retryable, TaskCancelled

StepFn = Callable[[], Awaitable[Any] | Any]
ModelFactory = Callable[[str], openai.AsyncOpenAI]

_DEFINITE = (Retryable, Fatal, NeedsHuman, openai.APIStatusError)


class TaskContext:
    """One attempt of one task, as its handler sees it."""

    def __init__(self, claim: Claim, model_factory: ModelFactory) -> None:
        self._claim = claim
        self._model_factory = model_factory
        self._model: openai.AsyncOpenAI | None = None
        self._cancel_seen = claim.fields.get("cancel") == "1"
        self._names: set[str] = set()
        self.task_id = claim.task_id
        self.attempt = claim.attempt
        self.kind = claim.fields["kind"]
        self.tenant = claim.fields.get("tenant") or None

    @property
    def model(self) -> openai.AsyncOpenAI:
        """The gateway as an OpenAI client: ``max_retries=0``, every call tagged ``X-Task-Id``."""
        if self._model is None:
            self._model = self._model_factory(self.task_id)
        return self._model

    def cancelled(self) -> bool:
        return self._cancel_seen

    def idempotency_key(self, name: str) -> str:
        """A key for step ``name`` that is the same on every attempt of this task."""
        return f"{self.task_id}:{name}"

    async def step(
        self,
        name: str,
        fn: StepFn,
        *,
        side_effect: bool = False,
        idempotent: bool = False,
        returns: type[Any] | None = None,
    ) -> Any:
        """Run ``fn`` once for this task and checkpoint its output; replay the checkpoint later."""
        self._enter(name)
        stored = self._claim.steps.get(f"out:{name}")
        if stored is not None:
            return codec.decode(stored, returns)
        strict = side_effect and not idempotent
        if strict and f"sfx:{name}" in self._claim.steps:
            attempt = self._claim.steps[f"sfx:{name}"]
            raise InDoubt(name, f"started in attempt {attempt} and never finished")
        self.note(await self._claim.begin_step(name, side_effect))
        if self._cancel_seen:
            raise TaskCancelled(self.task_id)
        value = await self._run(name, fn, side_effect, strict)
        output = codec.encode(f"the output of step {name!r}", value)
        self.note(await self._claim.end_step(name, output, codec.usage(value)))
        return value

    def note(self, reply: BeatReply) -> None:
        """Act on what a fenced write answered: the lease is gone, or a cancel is pending."""
        if reply == "lost":
            raise LeaseLost(f"task {self.task_id}: lease lost")
        if reply == "cancel":
            self._cancel_seen = True

    def _enter(self, name: str) -> None:
        if name in self._names:
            raise Fatal(f"step {name!r} ran twice in one attempt: step names must be unique in a task")
        self._names.add(name)
        if self._cancel_seen:
            raise TaskCancelled(self.task_id)

    async def _run(self, name: str, fn: StepFn, side_effect: bool, strict: bool) -> Any:
        try:
            value = fn()
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            if side_effect and isinstance(exc, _DEFINITE):
                self.note(await self._claim.abort_step(name))
            elif strict:
                raise InDoubt(name, f"raised {type(exc).__name__} ({exc}), outcome unknown") from exc
            raise
        return value
