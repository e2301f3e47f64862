"""The admin API: tenants, budgets, keys, task usage and circuit breakers.

    PUT    /admin/tenants/{name}                 create or update a tenant
    GET    /admin/tenants/{name}                 limits, budget, usage, remaining budget, key ids
    PUT    /admin/tenants/{name}/budget          set the budget
    POST   /admin/tenants/{name}/keys            a new key, shown only in this answer
    DELETE /admin/tenants/{name}/keys/{key_id}   revoke a key
    GET    /admin/tasks/{task_id}[?tenant=NAME]  a task's usage
    GET    /admin/breakers                       every target's breaker
    POST   /admin/breakers/{provider}/{model}/reset  close one

Every route needs the admin key; a missing key, a wrong key and a tenant key all get 401.
Changes are stored (Redis when configured) and reach every worker within the tenant
directory's refresh bound; the worker that made the change sees it at once.

The handlers read raw bodies and check their path parameters themselves (answering in the OpenAI
error shape); the decorators only document them (:mod:`gateway.openapi`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from typing import Annotated, Any

import msgspec
from litestar import MediaType, Request, Response, Router, delete, get, post, put
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import QueryParameter
from redis.exceptions import RedisError

from gateway import openapi
from gateway.chat_input import TASK_ID
from gateway.config import NAME_PATTERN, BudgetConfig
from gateway.errors import InvalidRequest, NotFound
from gateway.http import gateway_of, require_admin
from gateway.runtime import Gateway
from gateway.tenants import Tenant, TenantSettings
from policies.accounting import period

TenantName = Annotated[str, openapi.TENANT_NAME]
REFUSALS = {401: openapi.ADMIN_KEY_REFUSED, 429: openapi.KEY_GUESSING}
"""What every admin route may answer: the key is not the admin key, or this address is guessing."""
BAD_BODY = "`invalid_request`: the body is not JSON, or has an unknown field or a wrong type or value"

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


@put(
    "/tenants/{name:str}",
    responses={
        200: openapi.ok(openapi.Tenant, "The tenant as it now is."),
        400: openapi.error(
            f"{BAD_BODY}, or names a model that does not exist, or gives a budget without exactly one "
            "of `usd` and `tokens`; or the name is not a valid tenant name."
        ),
        413: openapi.REQUEST_TOO_LARGE,
        **REFUSALS,
    },
    operation_class=openapi.operation(
        body=openapi.json_body(
            TenantSettings,
            "The tenant's settings: fields left out keep their value, null clears a limit. `models` "
            "names configured models.",
            BudgetConfig=openapi.BUDGET_RULE,
        )
    ),
)
async def put_tenant(request: Request[Any, Any, Any], name: TenantName) -> Response[bytes]:
    """Create or change a tenant. The change wins over the config file until the file's own values
    for that tenant change."""
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


@get(
    "/tenants/{name:str}",
    responses={
        200: openapi.ok(openapi.Tenant, "The tenant."),
        400: openapi.MALFORMED,
        404: openapi.NO_SUCH_TENANT,
        **REFUSALS,
    },
)
async def get_tenant(request: Request[Any, Any, Any], name: TenantName) -> Response[bytes]:
    """A tenant's limits, budget, usage in the current period, remaining budget and key ids."""
    gateway = gateway_of(request)
    return _json(await _view(gateway, _tenant(gateway, name)))


@put(
    "/tenants/{name:str}/budget",
    responses={
        200: openapi.ok(openapi.Tenant, "The tenant with its new budget."),
        400: openapi.error(f"{BAD_BODY}, or gives not exactly one of `usd` and `tokens`."),
        404: openapi.NO_SUCH_TENANT,
        413: openapi.REQUEST_TOO_LARGE,
        **REFUSALS,
    },
    operation_class=openapi.operation(
        body=openapi.json_body(
            BudgetConfig,
            'The budget: `{"usd": 20.0, "period": "day"}` or `{"tokens": N, "period": ...}`.',
            BudgetConfig=openapi.BUDGET_RULE,
        )
    ),
)
async def put_budget(request: Request[Any, Any, Any], name: TenantName) -> Response[bytes]:
    """Set a tenant's budget; it takes effect on the next request in every worker."""
    gateway = gateway_of(request)
    _tenant(gateway, name)
    budget = _decode(await request.body(), BudgetConfig)
    _check_budget(budget)
    tenant = await gateway.tenants.update(name, TenantSettings(budget=budget))
    return _json(await _view(gateway, tenant))


@post(
    "/tenants/{name:str}/keys",
    responses={
        201: openapi.ok(openapi.NewKey, "The new key, shown only here."),
        400: openapi.MALFORMED,
        404: openapi.NO_SUCH_TENANT,
        **REFUSALS,
    },
)
async def create_key(request: Request[Any, Any, Any], name: TenantName) -> Response[bytes]:
    """A new key for a tenant; only its SHA-256 is stored."""
    gateway = gateway_of(request)
    _tenant(gateway, name)
    key_id, key = await gateway.tenants.create_key(name)
    return _json({"key_id": key_id, "key": key}, status=201)


@delete(
    "/tenants/{name:str}/keys/{key_id:str}",
    status_code=200,
    responses={
        200: openapi.ok(openapi.RevokedKey, "The key is revoked."),
        400: openapi.MALFORMED,
        404: openapi.error("`not_found`: no such tenant, or the tenant has no such key."),
        **REFUSALS,
    },
)
async def revoke_key(
    request: Request[Any, Any, Any], name: TenantName, key_id: Annotated[str, openapi.KEY_ID]
) -> Response[bytes]:
    """Revoke a key: the next request with it gets a 401 in every worker."""
    gateway = gateway_of(request)
    _tenant(gateway, name)
    if not await gateway.tenants.revoke(name, key_id):
        raise NotFound(f"tenant {name!r} has no key {key_id!r}")
    return _json({"key_id": key_id, "revoked": True})


@get(
    "/tasks/{task_id:str}",
    responses={
        200: openapi.ok(openapi.TaskUsage, "The task's usage."),
        400: openapi.error("`invalid_request`: the task id is not 1-128 characters of `[A-Za-z0-9._:-]`."),
        404: openapi.error("`not_found`: no usage is recorded for this task."),
        **REFUSALS,
    },
)
async def get_task(
    request: Request[Any, Any, Any],
    task_id: Annotated[str, openapi.TASK_ID],
    tenant: Annotated[
        str | None,
        QueryParameter(
            name="tenant",
            required=False,
            description="Only this tenant's record of the task (the same id may be used by several).",
        ),
    ] = None,
) -> Response[bytes]:
    """A task's usage: under the tenant named by ``?tenant=``, else under whichever used it last."""
    if not TASK_ID.fullmatch(task_id):
        raise InvalidRequest("a task id is 1-128 characters of [A-Za-z0-9._:-]", param="task_id")
    gateway = gateway_of(request)
    tenants = gateway.tenants.names() if tenant is None else [_tenant(gateway, tenant).name]
    store, keys = gateway.limiter.store, gateway.limiter.keys
    # All the reads at once: over Redis they go out together, one round trip rather than one a tenant.
    records = await asyncio.gather(*(store.read(keys.task(tenant, task_id)) for tenant in tenants))
    found = [
        (float(fields.get("last_seen", 0)), tenant, fields)
        for tenant, fields in zip(tenants, records, strict=True)
        if fields.get("requests")
    ]
    if not found:
        raise NotFound(f"no usage recorded for task {task_id!r}")
    _, owner, fields = max(found)
    return _json(_task_view(task_id, owner, fields))


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


@get("/breakers", responses={200: openapi.ok(list[openapi.Breaker], "Every target's breaker."), **REFUSALS})
async def list_breakers(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Every target's circuit breaker."""
    gateway = gateway_of(request)
    views = await gateway.limiter.breakers.views(gateway.limiter.store, _targets(gateway))
    return _json([dataclasses.asdict(v) for v in views])


@post(
    "/breakers/{provider:str}/{rest:path}",
    status_code=200,
    operation_id="AdminBreakersProviderModelResetBreaker",
    responses={
        200: openapi.ok(openapi.Breaker, "The breaker, closed."),
        400: openapi.MALFORMED,
        404: openapi.error("`not_found`: no such target."),
        **REFUSALS,
    },
    opt={openapi.DOCUMENTED_PATH: openapi.PathDocs(rename={"rest": "model"}, suffix="/reset")},
)
async def reset_breaker(
    request: Request[Any, Any, Any],
    provider: Annotated[str, openapi.PROVIDER],
    rest: Annotated[str, openapi.UPSTREAM_MODEL],
) -> Response[bytes]:
    """Close a target's circuit breaker."""
    # The route is ``{provider}/{model}/reset``; a model may contain "/", so ``rest`` takes the
    # model and the suffix, and the document spells it as it is (``PathDocs``).
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
    security=openapi.ADMIN,
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
