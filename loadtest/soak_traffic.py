"""The soak's load: chat completions from four tenants over both gateway instances, and queued tasks.

Each request is recorded as an :class:`Outcome` (what the client saw, with wall-clock times so it
can be matched against the chaos loop's fault windows and the gateway's log lines). Tenants:

* ``steady`` -- no limits; closed-loop agents, half streams (half of those ask for the usage chunk);
* ``limited`` -- ``rpm`` 30, sent 2 a second (4x its refill rate), open loop: its bucket drains in
  the first minute and stays drained;
* ``narrow`` -- ``max_concurrency`` 2, four closed-loop agents that barely pause;
* ``budgeted`` -- a ``usd`` budget (period ``total``) set through the admin API, about 40% of what
  it asks for over the run, so it is used up halfway;
* ``tasks`` -- the queue workers' key: tasks are enqueued here through :class:`client.Queue`.

Bodies are random but seeded; the mock answers ``min(12, max_tokens)`` words, so the most any
request can use is known in advance (its prompt estimate plus its reply), see :func:`chat_body`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from redis.exceptions import RedisError

from client import Queue
from loadtest.soak_procs import DEFAULT_MAX_TOKENS, MODEL, TenantSpec
from policies.tokens import REPLY_PRIMING_TOKENS, TOKENS_PER_MESSAGE, estimate_text_tokens

MOCK_WORDS = 12
"""Words (= completion tokens) the mock answers when ``max_tokens`` allows."""
_WORDS = ("agent", "plan", "tool", "result", "summary", "context", "step", "review", "retry", "budget")
REFUSALS = ("rate_limit_exceeded", "insufficient_quota")
"""The 429 codes admission answers; any other 4xx is unexpected in the soak."""
ENQUEUE_GIVE_UP_S = 60.0
NEVER_SENT = ("ConnectError", "ConnectTimeout")
"""Client errors that mean no connection was made: the gateway never saw the request."""


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. Times are ``time.time()`` seconds."""

    tenant: str
    instance: int
    stream: bool
    sent: float
    most_tokens: int
    """The most the request can use: its prompt estimate plus the reply the mock gives it."""
    done: float = 0.0
    status: int = 0
    """The HTTP status; 0 when no response arrived."""
    code: str | None = None
    """The error code of an error answer or of a stream's error event."""
    transport: str | None = None
    """The client-side exception that ended the exchange (connection refused, reset, ...)."""
    finished: bool = False
    """A stream that ended with ``data: [DONE]``."""
    tokens: int | None = None
    attempts: int | None = None

    @property
    def failure(self) -> str | None:
        """Why the request needs explaining by an injected fault, or ``None`` for a normal answer.

        ``transport`` (no complete answer: connection failed or dropped, stream cut without an
        error event), ``status`` (a 5xx), ``stream_error`` (200, then an error event), or
        ``unexpected`` (a 4xx other than an admission refusal, which no fault explains).
        """
        if self.transport is not None:
            return "transport"
        if self.status >= 500:
            return "status"
        if self.status == 429 and self.code in REFUSALS:
            return None
        if self.status != 200:
            return "unexpected"
        if self.stream and self.code is not None:
            return "stream_error"
        if self.stream and not self.finished:
            return "transport"
        return None

    @property
    def admitted(self) -> bool | None:
        """Whether admission let it through (it took from the tenant's buckets); ``None``: unknown."""
        if self.transport in NEVER_SENT:
            return False
        if self.transport is not None:
            return None
        return self.status == 200 or (self.status >= 500 and (self.attempts or 0) > 0)


def prompt_estimate(messages: list[dict[str, str]]) -> int:
    """The gateway's prompt estimate (README, "Token estimates"), which the mock reports as usage."""
    return REPLY_PRIMING_TOKENS + sum(
        TOKENS_PER_MESSAGE + estimate_text_tokens(m["content"]) for m in messages
    )


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def chat_body(rng: random.Random, stream: bool) -> tuple[dict[str, Any], int]:
    """A random request and the most it can use (prompt estimate + the mock's reply)."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _text(rng, 3, 30)})
    messages.append({"role": "user", "content": _text(rng, 3, 100)})
    max_tokens = rng.choice((4, 8, 16, 32, None))
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    reply = max(1, min(MOCK_WORDS, max_tokens or DEFAULT_MAX_TOKENS))
    return body, prompt_estimate(messages) + reply


def _error_code(content: bytes) -> str | None:
    try:
        payload = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return "not_json"
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else None


def _usage_tokens(payload: Any) -> int | None:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return int(usage["total_tokens"]) if isinstance(usage, dict) else None


async def _read_stream(response: httpx.Response, out: Outcome) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            out.finished = True
            continue
        payload = msgspec.json.decode(data)
        if isinstance(payload, dict) and "error" in payload:
            out.code = _error_code(data.encode())
        elif (tokens := _usage_tokens(payload)) is not None:
            out.tokens = tokens


async def send(
    client: httpx.AsyncClient, instance: int, url: str, tenant: TenantSpec, body: dict[str, Any], most: int
) -> Outcome:
    """One chat completion; never raises for what the gateway or the network does."""
    out = Outcome(tenant.name, instance, bool(body.get("stream")), time.time(), most)
    headers = {"authorization": f"Bearer {tenant.key}"}
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            out.status = response.status_code
            attempts = response.headers.get("x-modelgate-attempts")
            out.attempts = int(attempts) if attempts and attempts.isdigit() else None
            if response.status_code != 200:
                out.code = _error_code(await response.aread())
            elif out.stream:
                await _read_stream(response, out)
            else:
                out.tokens = _usage_tokens(msgspec.json.decode(await response.aread()))
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        out.transport = type(exc).__name__
    out.done = time.time()
    return out


@dataclass(slots=True)
class Traffic:
    """Drives the gateways until :meth:`stop`; every outcome lands in :attr:`outcomes`."""

    client: httpx.AsyncClient
    urls: list[str]
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    """Enqueued task id -> the most its model call can use."""
    enqueue_failures: int = 0
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _pending: set[asyncio.Task[None]] = field(default_factory=set)

    def stop(self) -> None:
        self._stopped.set()

    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` (pacing the load) unless stopped first; whether to go on."""
        try:
            await asyncio.wait_for(self._stopped.wait(), max(0.0, seconds))
        except TimeoutError:
            return True
        return False

    async def _one(self, rng: random.Random, tenant: TenantSpec) -> None:
        instance = rng.randrange(len(self.urls))
        body, most = chat_body(rng, stream=rng.random() < 0.5)
        self.outcomes.append(await send(self.client, instance, self.urls[instance], tenant, body, most))

    async def agent(self, tenant: TenantSpec, number: int, think_s: tuple[float, float]) -> None:
        """A closed-loop agent: one request, a pause, the next."""
        rng = random.Random(f"{self.seed}:{tenant.name}:{number}")
        while not self._stopped.is_set():
            await self._one(rng, tenant)
            if not await self._pause(rng.uniform(*think_s)):
                return

    async def paced(self, tenant: TenantSpec, per_s: float) -> None:
        """An open-loop sender: ``per_s`` requests a second whatever the answers."""
        rng = random.Random(f"{self.seed}:{tenant.name}:paced")
        started, sent = time.monotonic(), 0
        while await self._pause(started + sent / per_s - time.monotonic()):
            task = asyncio.create_task(self._one(rng, tenant))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            sent += 1
        await asyncio.gather(*self._pending)

    async def enqueue(self, queue: Queue, per_s: float) -> None:
        """Enqueue tasks at ``per_s``; a Redis outage is retried with the same idempotency key."""
        rng = random.Random(f"{self.seed}:tasks")
        number = 0
        while await self._pause(1 / per_s):
            number += 1
            prompt = _text(rng, 3, 60)
            max_tokens = rng.choice((4, 8, 16))
            payload = {"prompt": prompt, "max_tokens": max_tokens}
            most = prompt_estimate([{"role": "user", "content": prompt}]) + min(MOCK_WORDS, max_tokens)
            task_id = await _enqueue(queue, payload, f"soak-{self.seed}-{number}")
            if task_id is None:
                self.enqueue_failures += 1
            else:
                self.tasks[task_id] = most


async def _enqueue(queue: Queue, payload: dict[str, Any], key: str) -> str | None:
    deadline = time.monotonic() + ENQUEUE_GIVE_UP_S
    while True:
        try:
            return await queue.enqueue("ask", payload, idempotency_key=key, max_attempts=6)
        except (RedisError, OSError):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.2)  # Redis is being restarted by the chaos loop: try again
