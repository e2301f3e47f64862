"""The admin API: tenants, budgets, keys, task usage and circuit breakers.

    PUT    /admin/tenants/{name}                 create or update a tenant
    GET    /admin/tenants/{name}                 limits, budget, usage, remaining budget, key ids
    PUT    /admin/tenants/{name}/budget          set the budget
    POST   /admin/tenants/{name}/keys            a new key, shown only in this answer
    DELETE /admin/tenants/{name}/keys/{key_id}   revoke a key
    GET    /admin/tasks/{task_id}                a task's usage
    GET    /admin/breakers                       every target's breaker
    POST   /admin/breakers/{provider}/{model}/reset  close one

Every route needs the admin key; a missing key, a wrong key and a tenant key all get 401.
Changes are stored (Redis when configured) and reach every worker within the tenant
directory's refresh bound; the worker that made the change sees it at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import msgspec
from litestar import MediaType, Request, Response, Router, delete, get, post, put
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from redis.exceptions import RedisError

from gateway.chat_input import TASK_ID
from gateway.config import NAME_PATTERN, BudgetConfig
from gateway.errors import InvalidRequest, NotFound
from gateway.http import gateway_of, require_admin
from gateway.runtime import Gateway
from gateway.tenants import Tenant, TenantSettings
from policies.accounting import period

_encode = msgspec.json.encode
_NAME = re.compile(NAME_PATTERN)
_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "tokens", "usd", "estimated_requests")


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Admin key required; then the freshest tenants, so a change made through another worker
    a moment ago is seen here (one Redis read; a reload only when something changed)."""
    await require_admin(connection)  # type: ignore[arg-type]
    with contextlib.suppress(RedisError, OSError):
        await gateway_of(connection).tenants.refresh()  # type: ignore[arg-type]


def _json(value: Any, status: int = 200) -> Response[bytes]:
    return Response(content=_encode(value), status_code=status, media_type=MediaType.JSON)


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid body: {exc}") from None
    except msgspec.DecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None


def _tenant(gateway: Gateway, name: str) -> Tenant:
    tenant = gateway.tenants.get(name)
    if tenant is None:
        raise NotFound(f"no tenant {name!r}")
    return tenant


async def _view(gateway: Gateway, tenant: Tenant) -> dict[str, Any]:
    """A tenant's limits, budget, usage in the current period and remaining budget."""
    budget = tenant.budget
    current = period(budget.period if budget else "month")
    fields = await gateway.limiter.store.read(gateway.limiter.keys.usage(tenant.name, current.id))
    usage: dict[str, Any] = {name: _number(fields.get(name, "0")) for name in _USAGE_FIELDS}
    remaining: dict[str, float] | None = None
    if budget is not None and budget.usd is not None:
        remaining = {"usd": max(0.0, budget.usd - float(usage["usd"]))}
    elif budget is not None and budget.tokens is not None:
        remaining = {"tokens": max(0, budget.tokens - int(usage["tokens"]))}
    return {
        "name": tenant.name,
        "rpm": tenant.rpm,
        "tpm": tenant.tpm,
        "max_concurrency": tenant.max_concurrency,
        "task_max_tokens": tenant.task_max_tokens,
        "models": sorted(tenant.models) if tenant.models is not None else None,
        "budget": msgspec.to_builtins(budget) if budget else None,
        "usage": {"period": current.id, **usage},
        "remaining": remaining,
        "keys": gateway.tenants.key_ids(tenant.name),
    }


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def _check_models(gateway: Gateway, models: list[str] | msgspec.UnsetType | None) -> None:
    if isinstance(models, list):
        unknown = [m for m in models if m not in gateway.routes]
        if unknown:
            raise InvalidRequest(f"unknown models: {', '.join(map(repr, unknown))}", param="models")


@put("/tenants/{name:str}")
async def put_tenant(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
    if not _NAME.fullmatch(name):
        raise InvalidRequest("a tenant name is 1-64 characters of [A-Za-z0-9._:-]", param="name")
    gateway = gateway_of(request)
    settings = _decode(await request.body(), TenantSettings)
    _check_models(gateway, settings.models)
    _check_budget(settings.budget)
    tenant = await gateway.tenants.update(name, settings)
    return _json(await _view(gateway, tenant))


def _check_budget(budget: BudgetConfig | msgspec.UnsetType | None) -> None:
    if isinstance(budget, BudgetConfig) and (budget.usd is None) == (budget.tokens is None):
        raise InvalidRequest("a budget gives exactly one of usd or tokens", param="budget")


@get("/tenants/{name:str}")
async def get_tenant(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
    gateway = gateway_of(request)
    return _json(await _view(gateway, _tenant(gateway, name)))


@put("/tenants/{name:str}/budget")
async def put_budget(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
    gateway = gateway_of(request)
    _tenant(gateway, name)
    budget = _decode(await request.body(), BudgetConfig)
    _check_budget(budget)
    tenant = await gateway.tenants.update(name, TenantSettings(budget=budget))
    return _json(await _view(gateway, tenant))


@post("/tenants/{name:str}/keys")
async def create_key(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
    gateway = gateway_of(request)
    _tenant(gateway, name)
    key_id, key = await gateway.tenants.create_key(name)
    return _json({"key_id": key_id, "key": key}, status=201)


@delete("/tenants/{name:str}/keys/{key_id:str}", status_code=200)
async def revoke_key(
    request: Request[Any, Any, Any], name: FromPath[str], key_id: FromPath[str]
) -> Response[bytes]:
    gateway = gateway_of(request)
    _tenant(gateway, name)
    if not await gateway.tenants.revoke(name, key_id):
        raise NotFound(f"tenant {name!r} has no key {key_id!r}")
    return _json({"key_id": key_id, "revoked": True})


@get("/tasks/{task_id:str}")
async def get_task(request: Request[Any, Any, Any], task_id: FromPath[str]) -> Response[bytes]:
    if not TASK_ID.fullmatch(task_id):
        raise InvalidRequest("a task id is 1-128 characters of [A-Za-z0-9._:-]", param="task_id")
    gateway = gateway_of(request)
    found = []
    for tenant in gateway.tenants.names():
        fields = await gateway.limiter.store.read(gateway.limiter.keys.task(tenant, task_id))
        if fields.get("requests"):
            found.append((float(fields.get("last_seen", 0)), tenant, fields))
    if not found:
        raise NotFound(f"no usage recorded for task {task_id!r}")
    _, tenant, fields = max(found)
    return _json(_task_view(task_id, tenant, fields))


def _task_view(task_id: str, tenant: str, fields: dict[str, str]) -> dict[str, Any]:
    by_model: dict[str, dict[str, int | float]] = {}
    for name, value in fields.items():
        if name.startswith("m:"):
            model, _, field = name[2:].rpartition(":")
            by_model.setdefault(model, {})[field] = _number(value)
    return {
        "task_id": task_id,
        "tenant": tenant,
        **{name: _number(fields.get(name, "0")) for name in _USAGE_FIELDS},
        "by_model": by_model,
        "first_seen": float(fields["first_seen"]) if "first_seen" in fields else None,
        "last_seen": float(fields["last_seen"]) if "last_seen" in fields else None,
    }


def _targets(gateway: Gateway) -> list[str]:
    return sorted({t.name for route in gateway.routes.values() for t in route.targets})


@get("/breakers")
async def list_breakers(request: Request[Any, Any, Any]) -> Response[bytes]:
    gateway = gateway_of(request)
    views = await gateway.limiter.breakers.views(gateway.limiter.store, _targets(gateway))
    return _json([dataclasses.asdict(v) for v in views])


@post("/breakers/{provider:str}/{rest:path}", status_code=200)
async def reset_breaker(
    request: Request[Any, Any, Any], provider: FromPath[str], rest: FromPath[str]
) -> Response[bytes]:
    gateway = gateway_of(request)
    model = rest.strip("/").removesuffix("/reset") if rest.endswith("/reset") else None
    target = f"{provider}/{model}"
    if model is None or target not in _targets(gateway):
        raise NotFound(f"no target {target!r}; reset with POST /admin/breakers/<provider>/<model>/reset")
    await gateway.limiter.breakers.reset(gateway.limiter.store, target)
    views = await gateway.limiter.breakers.views(gateway.limiter.store, [target])
    return _json(dataclasses.asdict(views[0]))


ADMIN = Router(
    path="/admin",
    guards=[admin_guard],
    route_handlers=[
        put_tenant,
        get_tenant,
        put_budget,
        create_key,
        revoke_key,
        get_task,
        list_breakers,
        reset_breaker,
    ],
)
