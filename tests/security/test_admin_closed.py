"""Admin routes are closed to tenant keys (and to anything else that is not the admin key).

The routes are read from the app's own route table, so a route added later is covered without
touching this file: every route is an admin route unless it is listed as public or as a tenant
route below. Each is then called on the real gateway process with every way of not being the
admin (no key, wrong keys, tenant keys, a prefix of the admin key, its digest, the admin key in
the wrong scheme or header) and must answer 401 ``invalid_api_key`` and change nothing.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from gateway.secret import key_hash
from tests.security.conftest import ADMIN, OTHER, TENANT, UP_KEY, World
from tests.security.support import error_of, make_secret

PUBLIC = re.compile(r"^/(healthz|readyz|schema(/.*)?)$")
"""Routes anyone may call: liveness, readiness and the OpenAPI document."""
TENANT_ROUTES = re.compile(r"^/v1/")
"""Routes for tenant keys; every other route needs the admin key."""
DOCUMENTED_ADMIN_ROUTES = {
    ("PUT", "/admin/tenants/{name:str}"),
    ("GET", "/admin/tenants/{name:str}"),
    ("PUT", "/admin/tenants/{name:str}/budget"),
    ("POST", "/admin/tenants/{name:str}/keys"),
    ("DELETE", "/admin/tenants/{name:str}/keys/{key_id:str}"),
    ("GET", "/admin/tasks/{task_id:str}"),
    ("GET", "/admin/breakers"),
    ("POST", "/admin/breakers/{provider:str}/{rest:path}"),
    ("GET", "/metrics"),  # metrics_public = false
}
PATH_VALUES = {
    "name": "acme",
    "key_id": "key_000000000000",
    "task_id": "task-1",
    "provider": "up",
    "rest": "gpt-4o-mini/reset",
}
BODIES = {"PUT": b'{"rpm": 1, "models": ["mock"]}', "POST": b"{}", "DELETE": b""}
NOT_ADMIN: dict[str, dict[str, str]] = {
    "no key": {},
    "wrong key": {"authorization": f"Bearer {make_secret()}"},
    "tenant key": {"authorization": f"Bearer {TENANT}"},
    "other tenant key": {"authorization": f"Bearer {OTHER}"},
    "upstream key": {"authorization": f"Bearer {UP_KEY}"},
    "admin key prefix": {"authorization": f"Bearer {ADMIN[:-1]}"},
    "admin key and more": {"authorization": f"Bearer {ADMIN}0"},
    "admin key digest": {"authorization": f"Bearer {key_hash(ADMIN)}"},
    "admin key as sha256": {"authorization": f"Bearer sha256:{key_hash(ADMIN)}"},
    "admin key, basic scheme": {"authorization": f"Basic {ADMIN}"},
    "admin key, no scheme": {"authorization": ADMIN},
    "bearer without key": {"authorization": "Bearer"},
    "tenant key, then admin key": {"authorization": f"Bearer {TENANT} {ADMIN}"},
    "admin key in x-api-key": {"x-api-key": ADMIN},
    "admin key in api-key": {"api-key": ADMIN},
    "admin key in x-admin-key": {"x-admin-key": ADMIN},
}


def routes(world: World) -> list[tuple[str, str]]:
    """(method, path template) of every route of the app the gateway runs, HEAD aside."""
    app = create_app(parse_config(world.config, {}))
    return sorted(
        (method, route.path)
        for route in app.routes
        for method in getattr(route, "methods", ())
        if method != "HEAD"
    )


def admin_routes(world: World) -> list[tuple[str, str]]:
    return [(m, p) for m, p in routes(world) if not PUBLIC.match(p) and not TENANT_ROUTES.match(p)]


def concrete(template: str) -> str:
    return re.sub(r"\{(\w+):\w+\}", lambda m: PATH_VALUES.get(m.group(1), "probe"), template)


@pytest.fixture(scope="module")
def web() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as client:
        yield client


def admin_view(web: httpx.Client, world: World, name: str) -> httpx.Response:
    return web.get(f"{world.gateway.url}/admin/tenants/{name}", headers={"authorization": f"Bearer {ADMIN}"})


def test_the_route_table_holds_every_documented_admin_route(world: World) -> None:
    found = set(admin_routes(world))
    assert found >= DOCUMENTED_ADMIN_ROUTES, DOCUMENTED_ADMIN_ROUTES - found


@pytest.mark.parametrize("headers", NOT_ADMIN.values(), ids=NOT_ADMIN.keys())
def test_every_admin_route_refuses_all_but_the_admin_key(
    world: World, web: httpx.Client, headers: dict[str, str]
) -> None:
    before = admin_view(web, world, "acme").json()
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    answered = 0
    for method, template in admin_routes(world):
        for path in {concrete(template), concrete(template.replace("{name:str}", probe))}:
            url = f"{world.gateway.url}{path}"
            response = web.request(method, url, content=BODIES.get(method), headers=headers)
            if method == "OPTIONS" and response.status_code == 204:
                assert not response.content, (path, "an OPTIONS answer reveals no more than Allow")
                continue
            assert response.status_code == 401, (method, path, response.status_code, response.text)
            error_of(response, 401, "invalid_api_key")
            answered += 1
        # the key in the query string is no key either
        if method != "OPTIONS":
            query = {"api_key": ADMIN, "key": ADMIN}
            url = f"{world.gateway.url}{concrete(template)}"
            response = web.request(method, url, params=query, headers=headers)
            assert response.status_code == 401, (method, template, "query key", response.text)
    assert answered >= 2 * len(DOCUMENTED_ADMIN_ROUTES)
    assert admin_view(web, world, "acme").json() == before, "a refused request changed a tenant"
    assert admin_view(web, world, probe).status_code == 404, "a refused request made a tenant"


def test_every_admin_route_answers_the_admin_key(world: World, web: httpx.Client) -> None:
    """The other half: the paths above reach their handlers, so their 401s are the guard's."""
    auth = {"authorization": f"Bearer {ADMIN}"}
    for method, template in admin_routes(world):
        body = b"{}" if method in ("PUT", "POST") else None
        response = web.request(method, f"{world.gateway.url}{concrete(template)}", content=body, headers=auth)
        assert response.status_code != 401, (method, template, response.text)
        if response.status_code == 404:
            assert "unknown route" not in response.text, (method, template)


@pytest.mark.parametrize("route", ["/v1/models", "/v1/chat/completions"])
def test_tenant_routes_refuse_the_admin_key(world: World, web: httpx.Client, route: str) -> None:
    """Keys do not cross over the other way either: the admin key is no tenant key."""
    method = "POST" if route.endswith("completions") else "GET"
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
    for headers in (
        {"authorization": f"Bearer {ADMIN}"},
        {},
        {"authorization": f"Bearer {key_hash(TENANT)}"},
    ):
        response = web.request(method, f"{world.gateway.url}{route}", json=body, headers=headers)
        error_of(response, 401, "invalid_api_key")


def test_the_config_file_is_not_served(world: World, web: httpx.Client, session_tmp: Path) -> None:
    """No route hands out the config (which holds every secret), whatever the path."""
    config_name = f"gateway-{world.gateway.port}.toml"
    assert (session_tmp / config_name).exists()
    for path in (
        config_name,
        f"schema/{config_name}",
        f"schema/../{config_name}",
        "schema/..%2f" + config_name,
    ):
        response = web.get(f"{world.gateway.url}/{path}", headers={"authorization": f"Bearer {ADMIN}"})
        assert ADMIN not in response.text and response.status_code in (400, 404), (path, response.status_code)
