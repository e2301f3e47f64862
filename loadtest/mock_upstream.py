"""The fake upstream behind ``modelgate mock-upstream``: an OpenAI/Anthropic look-alike for demos,
end-to-end tests with fault injection, and load tests.

It must never be the bottleneck of a benchmark, so it is a bare ASGI 3 app (no framework) served by
uvicorn on uvloop and httptools. Routes:

* ``POST /v1/chat/completions`` and ``POST /v1/messages`` -- replies built by :mod:`providers.mock`
  in the OpenAI or Anthropic shape, streamed or not; see :mod:`loadtest.mock_wire`;
* ``GET /v1/models`` -- one model, ``mock``;
* ``GET /_mock/stats``, ``GET|POST /_mock/config``, ``POST /_mock/reset`` -- the control API tests
  use to see what the upstream received and to change its behaviour at runtime.

``/_mock/stats`` also tallies the tokens the mock served (``tokens``), so a soak can compare the
gateway's accounting with the upstream's: ``replies``, ``prompt_tokens`` and ``completion_tokens``
of the replies answered in mode ``ok`` (their reported usage); and for streams cut by ``stall`` or
``close_mid_body`` after some events (which carry no usage), ``cut_streams``, their
``cut_prompt_tokens`` (the usage they would have reported) and ``cut_events`` (the data events sent
before the cut).

Per chat request: count it, decode it (400 if it is not valid), wait ``latency_ms`` (give or take
``jitter_ms``), answer 500 or 429 with probability ``error_rate`` / ``rate_429``, then answer as
``mode`` says (:mod:`loadtest.mock_faults`).
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections import Counter
from collections.abc import Awaitable, Callable

import msgspec
import uvicorn

from loadtest.mock_asgi import (
    ASGIApp,
    ClientGone,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    Watchers,
    header_dict,
    install_abort_filter,
    lifespan,
    read_body,
    send_bytes,
)
from loadtest.mock_faults import Exchange, answer, send_error
from loadtest.mock_settings import MockSettings, SettingsError, as_dict, patched, validate
from loadtest.mock_wire import ANTHROPIC, DONE, MODELS_BODY, OPENAI, DecodeErrors, Dialect, Reply

__all__ = ["ASGIApp", "MockSettings", "MockUpstream", "create_app", "serve"]

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
TOKEN_TALLIES = (
    "replies",
    "prompt_tokens",
    "completion_tokens",
    "cut_streams",
    "cut_prompt_tokens",
    "cut_events",
)


class Stats:
    """What the chat routes have received and answered since the start or the last reset."""

    def __init__(self) -> None:
        self.by_route: Counter[str] = Counter()
        self.by_status: Counter[int] = Counter()
        self.tokens: Counter[str] = Counter()
        self.last_headers: Headers = []
        self.last_body: bytes | None = None

    def counting(self, send: Send) -> Send:
        """``send``, tallying the response status."""

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.by_status[message["status"]] += 1
            await send(message)

        return counted

    def served(self, settings: MockSettings, reply: Reply) -> None:
        """Tally the tokens of a reply just answered under ``settings`` (see the module docstring)."""
        prompt, completion = reply.usage
        if settings.mode == "ok":
            self.tokens.update(replies=1, prompt_tokens=prompt, completion_tokens=completion)
        elif settings.mode in ("stall", "close_mid_body") and reply.stream:
            sent = sum(1 for event in reply.events[: settings.stall_after] if event != DONE)
            if sent:
                self.tokens.update(cut_streams=1, cut_prompt_tokens=prompt, cut_events=sent)

    def remember(self, headers: Headers, body: bytes) -> None:
        self.last_headers = headers
        self.last_body = body

    def to_json(self, waiting: int) -> bytes:
        return msgspec.json.encode(
            {
                "requests": self.by_route.total(),
                "chat_requests": self.by_route["chat"],
                "messages_requests": self.by_route["messages"],
                "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                "last_headers": header_dict(self.last_headers),
                "last_body": _json_or_none(self.last_body),
                "waiting": waiting,
                "tokens": {name: self.tokens[name] for name in TOKEN_TALLIES},
            }
        )


def _json_or_none(body: bytes | None) -> object:
    try:
        return msgspec.json.decode(body) if body else None
    except msgspec.DecodeError:
        return None


def _injected_status(settings: MockSettings) -> int | None:
    """500 with probability ``error_rate``, else 429 with probability ``rate_429``."""
    if not (settings.error_rate or settings.rate_429):
        return None
    draw = random.random()
    if draw < settings.error_rate:
        return 500
    if draw < settings.error_rate + settings.rate_429:
        return 429
    return None


class MockUpstream:
    """The ASGI app. ``settings`` may be swapped at runtime; ``initial`` is what reset restores."""

    def __init__(self, settings: MockSettings) -> None:
        install_abort_filter()
        self.initial = validate(settings)
        self.settings = self.initial
        self.stats = Stats()
        self.watchers = Watchers()
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/messages"): self._messages,
            ("GET", "/v1/models"): self._models,
            ("GET", "/_mock/stats"): self._stats,
            ("GET", "/_mock/config"): self._get_config,
            ("POST", "/_mock/config"): self._set_config,
            ("POST", "/_mock/reset"): self._reset,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._routes.get((scope["method"], scope["path"]))
            await (handler or self._no_route)(scope, receive, send)
        elif scope["type"] == "lifespan":
            await lifespan(receive, send)

    def close(self) -> None:
        """The server is shutting down: end every hang and stall now."""
        self.watchers.close()

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._answer(scope, receive, send, OPENAI)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._answer(scope, receive, send, ANTHROPIC)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, dialect: Dialect) -> None:
        stats = self.stats
        stats.by_route[dialect.name] += 1
        send = stats.counting(send)
        try:
            body = await read_body(receive)
        except ClientGone:
            return
        stats.remember(scope["headers"], body)
        settings = self.settings
        try:
            reply = dialect.reply(body, settings.chunks)
        except DecodeErrors as exc:
            await send_error(send, dialect, 400, f"invalid request body: {exc}")
            return
        delay_ms = settings.latency_ms
        if delay_ms > 0 and settings.jitter_ms > 0:
            delay_ms = max(0.0, delay_ms + random.uniform(-settings.jitter_ms, settings.jitter_ms))
        if delay_ms > 0:
            await asyncio.sleep(delay_ms / 1000)
        injected = _injected_status(settings)
        if injected is not None:
            await send_error(send, dialect, injected, f"mock upstream: injected {injected}")
            return
        await answer(Exchange(send, receive, self.watchers, dialect, reply, settings))
        stats.served(settings, reply)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, MODELS_BODY)

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.stats.to_json(len(self.watchers)))

    async def _get_config(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, msgspec.json.encode(as_dict(self.settings)))

    async def _set_config(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self.settings = patched(self.settings, await read_body(receive))
        except ClientGone:
            return
        except SettingsError as exc:
            await send_error(send, OPENAI, 400, f"invalid mock config: {exc}")
            return
        await self._get_config(scope, receive, send)

    async def _reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.settings = self.initial
        self.stats = Stats()
        await self._get_config(scope, receive, send)

    async def _no_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in self._paths:
            await send_error(send, OPENAI, 405, f"method {scope['method']} not allowed")
        else:
            await send_error(send, OPENAI, 404, f"no route {scope['path']}")


def create_app(settings: MockSettings) -> ASGIApp:
    """The mock upstream as an ASGI app; raises :class:`SettingsError` for invalid settings."""
    return MockUpstream(settings)


class _Server(uvicorn.Server):
    """uvicorn, but on shutdown it first releases hanging requests, which would otherwise block it."""

    def __init__(self, config: uvicorn.Config, app: MockUpstream) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._app.close()
        await super().shutdown(sockets)


def serve(host: str, port: int, settings: MockSettings) -> None:
    """Serve the mock upstream until interrupted (blocking)."""
    app = MockUpstream(settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        proxy_headers=False,
        access_log=False,
        log_level="warning",
        server_header=False,
    )
    _Server(config, app).run()
