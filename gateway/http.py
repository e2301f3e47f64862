"""Shared pieces of the HTTP layer: request ids, authentication and error responses."""

from __future__ import annotations

import os
import re
from typing import Any, cast

from litestar import MediaType, Request, Response
from litestar.types import Message, Scope

from gateway.chat_input import ID_PATTERN
from gateway.errors import GatewayError, InvalidApiKey, render
from gateway.runtime import Gateway
from gateway.tenants import Tenant

REQUEST_ID = re.compile(ID_PATTERN)
_SCOPE_REQUEST_ID = "modelgate.request_id"


def request_id_for(scope: Scope) -> str:
    """The request's id: the caller's ``X-Request-Id`` when sane, else a new one; fixed once chosen."""
    state = cast(dict[str, Any], scope)
    request_id: str | None = state.get(_SCOPE_REQUEST_ID)
    if request_id is None:
        request_id = _caller_request_id(scope) or os.urandom(12).hex()
        state[_SCOPE_REQUEST_ID] = request_id
    return request_id


def _caller_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if REQUEST_ID.fullmatch(text) else None
    return None


async def add_request_id(message: Message, scope: Scope) -> None:
    """Echo the request id on every response, routed or not."""
    if message["type"] == "http.response.start":
        header = (b"x-request-id", request_id_for(scope).encode())
        message["headers"] = [*message.get("headers", ()), header]


def gateway_of(request: Request[Any, Any, Any]) -> Gateway:
    return cast(Gateway, request.app.state.gateway)


def bearer_key(request: Request[Any, Any, Any]) -> str:
    """The API key of an ``Authorization: Bearer`` header, or 401."""
    value = request.headers.get("authorization")
    if not value:
        raise InvalidApiKey("missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise InvalidApiKey("malformed Authorization header: expected 'Bearer <key>'")
    return key.strip()


async def tenant_of(request: Request[Any, Any, Any]) -> Tenant:
    """The tenant whose key the request carries, or 401 (429 for an address guessing keys)."""
    gateway, key = _presented_key(request)
    tenant = gateway.tenants.authenticate(key)
    if tenant is None:
        await _refuse(request, gateway, "invalid API key")
    assert tenant is not None
    return tenant


async def require_admin(request: Request[Any, Any, Any]) -> None:
    """401 unless the request carries the admin key (a tenant key is refused like any other)."""
    gateway, key = _presented_key(request)
    if not gateway.is_admin_key(key):
        await _refuse(request, gateway, "invalid admin key")


def _address(request: Request[Any, Any, Any]) -> str:
    return request.client.host if request.client else "unknown"


def _presented_key(request: Request[Any, Any, Any]) -> tuple[Gateway, str]:
    """The key a request presents, once its address has passed the key guard."""
    gateway = gateway_of(request)
    gateway.key_guard.check(_address(request))
    return gateway, bearer_key(request)


async def _refuse(request: Request[Any, Any, Any], gateway: Gateway, message: str) -> None:
    """Count a wrong key against its address (429 once over the limit), else 401."""
    await gateway.key_guard.failed(_address(request))
    raise InvalidApiKey(message)


def error_response(error: GatewayError, extra_headers: dict[str, str] | None = None) -> Response[bytes]:
    status, body, headers = render(error)
    if extra_headers:
        headers = {**extra_headers, **headers}
    return Response(content=body, status_code=status, media_type=MediaType.JSON, headers=headers)
