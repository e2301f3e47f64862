"""Shared pieces of the HTTP layer: request ids, authentication and error responses."""

from __future__ import annotations

import os
import re
from typing import Any, NoReturn, cast

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


def bearer_key(authorization: str | None) -> str:
    """The API key of an ``Authorization: Bearer`` header value, or 401."""
    if not authorization:
        raise InvalidApiKey("missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise InvalidApiKey("malformed Authorization header: expected 'Bearer <key>'")
    return key.strip()


async def authenticate(gateway: Gateway, address: str, authorization: str | None) -> Tenant:
    """The tenant whose key ``authorization`` carries, or 401 (429 for an address guessing keys)."""
    gateway.key_guard.check(address)
    tenant = gateway.tenants.authenticate(bearer_key(authorization))
    if tenant is None:
        await _refuse(gateway, address, "invalid API key")
    return tenant


def client_address(scope: Scope) -> str:
    """The peer's address (never a forwarded-for header: the key guard counts per peer)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def tenant_of(request: Request[Any, Any, Any]) -> Tenant:
    """The tenant whose key the request carries, or 401 (429 for an address guessing keys)."""
    return await authenticate(
        gateway_of(request), client_address(request.scope), request.headers.get("authorization")
    )


async def require_admin(request: Request[Any, Any, Any]) -> None:
    """401 unless the request carries the admin key (a tenant key is refused like any other)."""
    gateway, address = gateway_of(request), client_address(request.scope)
    gateway.key_guard.check(address)
    if not gateway.is_admin_key(bearer_key(request.headers.get("authorization"))):
        await _refuse(gateway, address, "invalid admin key")


async def _refuse(gateway: Gateway, address: str, message: str) -> NoReturn:
    """Count a wrong key against its address (429 once over the limit), else 401."""
    await gateway.key_guard.failed(address)
    raise InvalidApiKey(message)


def error_response(error: GatewayError, extra_headers: dict[str, str] | None = None) -> Response[bytes]:
    status, body, headers = render(error)
    if extra_headers:
        headers = {**extra_headers, **headers}
    return Response(content=body, status_code=status, media_type=MediaType.JSON, headers=headers)
