"""The chat completions flow, independent of the web framework.

Parse only the fields the gateway needs, check the tenant may use the model, try the route's
targets, and hand back either a whole reply or a stream to relay. A stream's first chunk is read
before the response starts, so a failure before any byte reaches the client can still be answered
with a proper status; after that, a failure ends the stream with an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    UpstreamFailure,
    UpstreamTimeout,
    stream_error_event,
)
from gateway.runtime import Gateway
from gateway.tenants import Tenant
from policies.limiter import Limiter, Ticket, new_slot_id
from policies.routing import ModelRoute, Target
from policies.tokens import CHARS_PER_TOKEN, estimate_prompt_tokens
from providers.base import ChatCall, ChatHead, ChunkStream, Completion, Usage

log = logging.getLogger("modelgate.request")

TASK_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TRACE_HEADERS = ("traceparent", "tracestate")
_decode_head = msgspec.json.Decoder(ChatHead).decode
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`")


@dataclass(slots=True)
class RequestRecord:
    """What one request did, for its response headers and its log line."""

    request_id: str
    started: float = field(default_factory=time.perf_counter)
    tenant: str | None = None
    model: str | None = None
    task_id: str | None = None
    target: str | None = None
    attempts: int = 0
    status: int = 200
    error_code: str | None = None
    ttft_ms: float | None = None
    usage: Usage | None = None
    estimated: bool = False
    rate_headers: dict[str, str] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        headers = {**self.rate_headers, "x-modelgate-attempts": str(self.attempts)}
        if self.target is not None:
            headers["x-modelgate-target"] = self.target
        return headers

    def failed(self, error: GatewayError, status: int) -> None:
        self.status = status
        self.error_code = error.code

    def emit(self) -> None:
        """Write the request's log line."""
        fields = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "target": self.target,
            "attempts": self.attempts,
            "status": self.status,
            "latency_ms": round((time.perf_counter() - self.started) * 1000, 3),
            "ttft_ms": self.ttft_ms,
            "prompt_tokens": self.usage.prompt_tokens if self.usage else None,
            "completion_tokens": self.usage.completion_tokens if self.usage else None,
            "task_id": self.task_id,
            "error": self.error_code,
        }
        log.info("request", extra={"fields": fields})


@dataclass(slots=True)
class StreamReply:
    """An opened stream: the SSE bytes to relay."""

    events: AsyncIterator[bytes]


def parse_head(body: bytes) -> ChatHead:
    """The fields the gateway reads, or a 400 naming what is wrong."""
    try:
        return _decode_head(body)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$")
        param = where.rstrip("`").lstrip(".") or None
        missing = _MISSING_FIELD.match(message)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        detail = message[:1].lower() + message[1:]
        raise InvalidRequest(f"invalid request body: {detail}", param=param) from None
    except msgspec.DecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None


def task_id_of(value: str | None) -> str | None:
    if value is None:
        return None
    if not TASK_ID.fullmatch(value):
        raise InvalidRequest("X-Task-Id must be 1-128 characters of [A-Za-z0-9._:-]", param="X-Task-Id")
    return value


class ChatService:
    """Serves ``POST /v1/chat/completions`` for one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._limiter = gateway.limiter
        self._timeout_s = gateway.config.server.request_timeout_s
        self._max_attempts = gateway.config.retry.attempts
        self._default_max_tokens = gateway.config.server.default_max_tokens

    def route_for(self, tenant: Tenant, model: str) -> ModelRoute:
        route = self._gateway.routes.get(model)
        if route is None:
            raise ModelNotFound(f"the model {model!r} does not exist", param="model")
        if not tenant.may_use(model):
            raise ModelNotAllowed(f"this key may not use the model {model!r}", param="model")
        return route

    async def handle(
        self, tenant: Tenant, body: bytes, headers: dict[str, str], record: RequestRecord
    ) -> Completion | StreamReply:
        """Serve one request; raises ``GatewayError`` for anything the client must be told."""
        record.tenant = tenant.name
        record.task_id = task_id_of(headers.get("x-task-id"))
        head = parse_head(body)
        record.model = head.model
        route = self.route_for(tenant, head.model)
        targets = route.plan()[: self._max_attempts]
        prompt = estimate_prompt_tokens(head.messages)
        reserve = prompt + (head.output_limit or self._default_max_tokens)
        ticket = await self._limiter.admit(tenant, targets, reserve, new_slot_id())
        record.rate_headers = ticket.headers
        request = _Request(
            body=body,
            head=head,
            trace={name: headers[name] for name in TRACE_HEADERS if name in headers},
            record=record,
            deadline=asyncio.get_running_loop().time() + self._timeout_s,
            ticket=ticket,
            limiter=self._limiter,
            prompt_estimate=prompt,
        )
        targets = targets[ticket.target_index :]
        try:
            if head.stream:
                return await self._stream(targets, request)
            completion = await self._complete(targets, request)
        except BaseException:
            await request.settle(None, 0)
            raise
        await request.settle(completion.usage, len(completion.body) // CHARS_PER_TOKEN)
        return completion

    async def _complete(self, targets: list[Target], request: _Request) -> Completion:
        last: UpstreamFailure | None = None
        for target in targets:
            call = request.attempt(target)
            try:
                async with asyncio.timeout_at(request.deadline):
                    return await target.provider.complete(call)
            except TimeoutError:
                raise UpstreamTimeout("the request deadline passed") from None
            except UpstreamFailure as failure:
                if not failure.retryable:
                    raise
                last = failure
        assert last is not None
        raise last

    async def _stream(self, targets: list[Target], request: _Request) -> StreamReply:
        last: UpstreamFailure | None = None
        for target in targets:
            call = request.attempt(target)
            try:
                stream, chunks, first = await _open(target, call, request.deadline)
            except UpstreamFailure as failure:
                if not failure.retryable:
                    raise
                last = failure
                continue
            record = request.record
            record.ttft_ms = round((time.perf_counter() - record.started) * 1000, 3)
            return StreamReply(_relay(stream, chunks, first, request))
        assert last is not None
        raise last


@dataclass(slots=True)
class _Request:
    """One admitted client request on its way through the targets."""

    body: bytes
    head: ChatHead
    trace: dict[str, str]
    record: RequestRecord
    deadline: float
    ticket: Ticket
    limiter: Limiter
    prompt_estimate: int

    def attempt(self, target: Target) -> ChatCall:
        """Count an upstream attempt at ``target`` and the call it makes."""
        self.record.attempts += 1
        self.record.target = target.name
        return ChatCall(self.body, self.head, target.upstream_model, self.trace)

    async def settle(self, usage: Usage | None, completion_estimate: int) -> None:
        """Settle the admission to what was used: the upstream's usage, else an estimate."""
        if self.ticket.settled:
            return
        if usage is None and completion_estimate > 0:
            usage = Usage(self.prompt_estimate, completion_estimate)
            self.record.estimated = True
        self.record.usage = usage
        used = usage.prompt_tokens + usage.completion_tokens if usage else 0
        await self.limiter.settle(self.ticket, used)


async def _open(
    target: Target, call: ChatCall, deadline: float
) -> tuple[ChunkStream, AsyncIterator[bytes], bytes | None]:
    """Open a stream and read its first chunk, all before the deadline."""
    try:
        async with asyncio.timeout_at(deadline):
            stream = await target.provider.stream(call)
    except TimeoutError:
        raise UpstreamTimeout("the request deadline passed") from None
    chunks = aiter(stream)
    try:
        async with asyncio.timeout_at(deadline):
            first = await anext(chunks, None)
    except TimeoutError:
        await stream.aclose()
        raise UpstreamTimeout("the request deadline passed") from None
    except BaseException:
        await stream.aclose()
        raise
    return stream, chunks, first


async def _relay(
    stream: ChunkStream, chunks: AsyncIterator[bytes], first: bytes | None, request: _Request
) -> AsyncIterator[bytes]:
    """SSE events for the client, each sent as soon as its upstream chunk arrives.

    The request is settled before the last event goes out, so a client that sees ``[DONE]`` finds
    its concurrency slot already free.
    """
    record, relayed = request.record, 0
    try:
        chunk = first
        while chunk is not None:
            yield b"data: " + chunk + b"\n\n"
            relayed += 1
            try:
                async with asyncio.timeout_at(request.deadline):
                    chunk = await anext(chunks, None)
            except TimeoutError:
                raise UpstreamTimeout("the request deadline passed") from None
        await _finish(stream, request, relayed)
        yield b"data: [DONE]\n\n"
    except UpstreamFailure as failure:
        record.failed(failure, failure.status)
        log.warning("stream cut", extra={"fields": {"request_id": record.request_id, "error": failure.code}})
        await _finish(stream, request, relayed)
        yield stream_error_event(failure)
    finally:
        await _finish(stream, request, relayed)
        record.emit()


async def _finish(stream: ChunkStream, request: _Request, relayed: int) -> None:
    """Close the upstream stream and settle (once) to its usage, or to the chunks relayed."""
    await stream.aclose()
    await request.settle(stream.usage, relayed)
