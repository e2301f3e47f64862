"""Schemathesis over ``/schema/openapi.json``: every route, tenant and admin, with the right key, no
key and wrong keys, against a real gateway on Redis.

The document is fetched from the running gateway and fuzzed as served: its request bodies, path
parameter patterns and header parameters are the inputs, narrowed only where the fuzz must
(:func:`with_documented_inputs`): path parameters and model lists also name the things the fuzz
gateway has, so that its 200 answers are reached, and the chat body is the fuzz's bounded model of
what OpenAI documents, because the served one is what the gateway itself checks and upstreams check
more.

Checks on every answer: the contract's (no 5xx but the documented 502/503/504, every error in the
OpenAI shape, :func:`tests.fuzz.conftest.assert_well_formed`) in place of schemathesis's
``not_a_server_error``, which would also flag the documented 503s; ``positive_data_acceptance`` and
``negative_data_rejection`` against the documented inputs; a gateway log with no unhandled error.
Then schemathesis's conformance checks (status, content type, headers, body schema) hold every
answer to the document, and the tests at the end pin what the document declares.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import given, settings
from schemathesis import GenerationMode
from schemathesis import checks as st_checks
from schemathesis.core.transport import Response as StResponse
from schemathesis.schemas import APIOperation

from gateway import errors, routes_v1
from gateway.app import create_app
from gateway.chat_input import ID_PATTERN
from gateway.config import NAME_PATTERN, Config, ModelConfig, ProviderConfig, ServerConfig, TargetConfig
from tests.conftest import ADMIN_KEY, LIMITED_KEY, TENANT_KEY
from tests.fuzz.conftest import (
    ADMIN_TENANT,
    ADMIN_TENANT_KEY,
    BODY_LIMIT,
    KNOWN_TASK,
    MODELS,
    SLOW_OR_BIG,
    TARGETS,
    FuzzTarget,
    assert_well_formed,
    error_of,
)

Operation = APIOperation[Any, Any, Any, Any]
Case = schemathesis.Case[Any]

OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/admin/tenants/{name}"),
    ("PUT", "/admin/tenants/{name}"),
    ("PUT", "/admin/tenants/{name}/budget"),
    ("POST", "/admin/tenants/{name}/keys"),
    ("DELETE", "/admin/tenants/{name}/keys/{key_id}"),
    ("GET", "/admin/tasks/{task_id}"),
    ("GET", "/admin/breakers"),
    ("POST", "/admin/breakers/{provider}/{model}/reset"),
]
"""SPEC.md's routes as the served document names them; pinned against it below."""
PUBLIC = {"/healthz", "/readyz", "/metrics"}
"""No key needed (``metrics_public`` is true in the fuzz config)."""
NEGATABLE = {
    ("POST", "/v1/chat/completions"),
    ("GET", "/admin/tenants/{name}"),
    ("PUT", "/admin/tenants/{name}"),
    ("PUT", "/admin/tenants/{name}/budget"),
    ("POST", "/admin/tenants/{name}/keys"),
    ("DELETE", "/admin/tenants/{name}/keys/{key_id}"),
    ("GET", "/admin/tasks/{task_id}"),
}
"""Operations whose documented inputs have a constraint to break (a body, a name pattern);
negative generation is impossible for the others."""

FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=SLOW_OR_BIG,
)
"""Bounded and reproducible: the same examples on every run, nothing stored between runs."""
FEW = settings(FUZZ, max_examples=4)


def op_id(operation: tuple[str, str]) -> str:
    return f"{operation[0]} {operation[1]}"


# --- the documented inputs -------------------------------------------------------------------

TEXT_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"anyOf": [{"enum": list(MODELS)}, {"type": "string"}]},
        "messages": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant"]},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "minItems": 1, "maxItems": 3, "items": TEXT_PART},
                        ]
                    },
                },
            },
        },
        "stream": {"type": ["boolean", "null"]},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 4096},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 4096},
        "stream_options": {
            "anyOf": [
                {"type": "null"},
                {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
            ]
        },
    },
}
"""The Chat Completions fields the gateway reads (README "Requests"), as OpenAI documents them."""

BODY_OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("PUT", "/admin/tenants/{name}"),
    ("PUT", "/admin/tenants/{name}/budget"),
]
"""The operations that read a JSON body."""


def with_documented_inputs(served: dict[str, Any], revocable_key_ids: list[str]) -> dict[str, Any]:
    """The served document, narrowed for the fuzz gateway.

    Path parameters also name the things it has (its admin tenant, a task with usage, keys to
    revoke, its breaker targets) and a tenant's ``models`` its models, so that the 200 answers are
    reached too; the chat body is :data:`CHAT_BODY`.
    """
    document = copy.deepcopy(served)
    paths = document["paths"]
    paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] = CHAT_BODY
    tenant = paths["/admin/tenants/{name}"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    models = {"type": "array", "items": {"enum": list(MODELS)}}
    tenant["properties"]["models"] = {"anyOf": [models, {"type": "null"}]}
    known = {
        "name": [ADMIN_TENANT],
        "task_id": [KNOWN_TASK],
        "key_id": revocable_key_ids,
        "provider": sorted({target.split("/")[0] for target in TARGETS}),
        "model": [target.split("/", 1)[1] for target in TARGETS],
    }
    for item in paths.values():
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path" and parameter["name"] in known:
                    parameter["schema"] = {"anyOf": [{"enum": known[parameter["name"]]}, parameter["schema"]]}
    return document


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_document(fuzz_gateway: FuzzTarget) -> dict[str, Any]:
    response = fuzz_gateway.client.get("/schema/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


@pytest.fixture(scope="module")
def api_schema(served_document: dict[str, Any], fuzz_gateway: FuzzTarget) -> schemathesis.BaseSchema:
    document = with_documented_inputs(served_document, fuzz_gateway.revocable_key_ids)
    # The tests choose the Authorization header themselves: no generated credentials.
    config = schemathesis.Config.from_dict({"generation": {"with-security-parameters": False}})
    schema = schemathesis.openapi.from_dict(document, config=config)

    @schema.hook("map_body")
    def integers_as_integers(_: schemathesis.HookContext, body: Any) -> Any:
        return integral_floats_as_ints(body)

    return schema


def integral_floats_as_ints(value: Any) -> Any:
    """``5442.0`` as ``5442``, at every level.

    JSON Schema's ``integer`` admits ``5442.0`` and schemathesis generates it; the gateway (msgspec,
    strict) refuses it for its integer fields with a 400 naming the field, which
    ``positive_data_acceptance`` would flag. No SDK writes an integer that way, so the fuzz does not
    either.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: integral_floats_as_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integral_floats_as_ints(item) for item in value]
    return value


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as http:
        yield http


def operation_of(api_schema: schemathesis.BaseSchema, method: str, path: str) -> Operation:
    operation: Operation = api_schema[path][method]
    return operation


def right_key(path: str) -> dict[str, str]:
    key = ADMIN_KEY if path.startswith("/admin/") else TENANT_KEY
    return {"Authorization": f"Bearer {key}"}


def run_cases(
    operation: Operation,
    mode: GenerationMode,
    budget: settings,
    call: Callable[[Case], None],
) -> None:
    """Call ``call`` on ``budget``'s worth of generated cases of ``operation``."""

    @budget
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Case) -> None:
        call(case)

    fuzz()


def answer_of(response: StResponse) -> tuple[int, httpx.Headers, bytes]:
    headers = httpx.Headers([(name, value) for name, values in response.headers.items() for value in values])
    return response.status_code, headers, response.content


# --- the fuzz --------------------------------------------------------------------------------


def test_the_document_lists_every_route(served_document: dict[str, Any]) -> None:
    served = {(method.upper(), path) for path, item in served_document["paths"].items() for method in item}
    assert served == set(OPERATIONS)


RIGHT_KEY_RUNS = [
    *(pytest.param(op, GenerationMode.POSITIVE, id=f"{op_id(op)}-positive") for op in OPERATIONS),
    *(
        pytest.param(op, GenerationMode.NEGATIVE, id=f"{op_id(op)}-negative")
        for op in OPERATIONS
        if op in NEGATABLE
    ),
]
"""Every operation with valid inputs; those with a constraint to break, with invalid ones too."""


@pytest.mark.usefixtures("stays_healthy")
@pytest.mark.parametrize(("operation", "mode"), RIGHT_KEY_RUNS)
def test_with_the_right_key(
    api_schema: schemathesis.BaseSchema,
    fuzz_gateway: FuzzTarget,
    session: requests.Session,
    operation: tuple[str, str],
    mode: GenerationMode,
) -> None:
    """Generated requests with the key the route wants: only well-formed answers; documented
    inputs accepted (``positive_data_acceptance``), broken ones refused with a 4xx
    (``negative_data_rejection``)."""
    method, path = operation
    headers = right_key(path)
    check = (
        st_checks.positive_data_acceptance
        if mode is GenerationMode.POSITIVE
        else st_checks.negative_data_rejection
    )

    def call(case: Case) -> None:
        response = case.call(base_url=fuzz_gateway.url, session=session, headers=headers, timeout=15)
        assert_well_formed(*answer_of(response), what=f"{method} {response.request.url}", path=path)
        case.validate_response(response, checks=[check], headers=headers)

    run_cases(operation_of(api_schema, method, path), mode, FUZZ, call)


@pytest.mark.usefixtures("stays_healthy")
@pytest.mark.parametrize("operation", [op for op in OPERATIONS if op[1].startswith("/v1/")], ids=op_id)
def test_a_tenant_limited_to_one_model(
    api_schema: schemathesis.BaseSchema,
    fuzz_gateway: FuzzTarget,
    session: requests.Session,
    operation: tuple[str, str],
) -> None:
    """Tenant ``limited`` may use only ``mock``: it lists only that model, and any other model that
    exists is a 403 ``model_not_allowed``."""
    method, path = operation
    headers = {"Authorization": f"Bearer {LIMITED_KEY}"}

    def call(case: Case) -> None:
        response = case.call(base_url=fuzz_gateway.url, session=session, headers=headers, timeout=15)
        status, answer_headers, body = answer_of(response)
        what = f"{method} {response.request.url} as tenant limited: {case.body!r}"
        assert_well_formed(status, answer_headers, body, what, path)
        if method == "GET":
            assert status == 200, what
            assert [model["id"] for model in json.loads(body)["data"]] == ["mock"], what
            return
        model = case.body.get("model") if isinstance(case.body, dict) else None
        if model in MODELS and model != "mock":
            assert status == 403, f"{what}: {status} {body[:300]!r}"
            assert error_of(body, what, status)["code"] == "model_not_allowed", what
        elif status == 200:
            assert model == "mock", what

    run_cases(operation_of(api_schema, method, path), GenerationMode.POSITIVE, FUZZ, call)


@pytest.mark.usefixtures("stays_healthy")
@pytest.mark.parametrize("field", ["rpm", "budget", "models", "unknown"])
@pytest.mark.parametrize("bracket", ["[", '{"a":'])
@pytest.mark.parametrize("path", [f"/admin/tenants/{ADMIN_TENANT}", f"/admin/tenants/{ADMIN_TENANT}/budget"])
def test_deeply_nested_admin_bodies_are_400(
    fuzz_gateway: FuzzTarget, path: str, bracket: str, field: str
) -> None:
    """10,000 levels under any field of an admin body: a 400, not a 500 (the decoder stops at the
    first level that has the wrong type or an unknown name)."""
    closing = "]" if bracket == "[" else "}"
    body = f'{{"{field}":' + bracket * 10_000 + ("" if bracket == "[" else "1") + closing * 10_000 + "}"
    what = f"PUT {path} with {field} nested 10,000 deep"
    response = fuzz_gateway.client.put(path, content=body, headers=right_key(path))
    assert_well_formed(response.status_code, response.headers, response.content, what)
    assert response.status_code == 400, f"{what}: {response.status_code} {response.text[:300]}"


WRONG_KEYS = {
    "missing": None,
    "unknown": "Bearer sk-not-a-key-of-this-gateway-0000",
    "other-role": "other-role",
    "not-bearer": "Basic YWRtaW46YWRtaW4=",
    "empty-bearer": "Bearer ",
    "latin-1": "Bearer cl\xe9-\xff\xfe",
}
"""``other-role``: the admin key on a tenant route, a tenant key on an admin route (SPEC.md:
admin routes answer 401 to a tenant key like any other)."""


def wrong_key(kind: str, path: str) -> dict[str, str]:
    value = WRONG_KEYS[kind]
    if value == "other-role":
        key = ADMIN_TENANT_KEY if path.startswith("/admin/") else ADMIN_KEY
        value = f"Bearer {key}"
    return {} if value is None else {"Authorization": value}


@pytest.mark.usefixtures("stays_healthy")
@pytest.mark.parametrize("kind", list(WRONG_KEYS))
@pytest.mark.parametrize("operation", OPERATIONS, ids=op_id)
def test_without_the_right_key(
    api_schema: schemathesis.BaseSchema,
    fuzz_gateway: FuzzTarget,
    session: requests.Session,
    operation: tuple[str, str],
    kind: str,
) -> None:
    """Every protected route answers 401 ``invalid_api_key`` (and no rate-limit headers: no
    tenant is known) to any key but its own; public routes do not care."""
    method, path = operation
    headers = wrong_key(kind, path)

    def call(case: Case) -> None:
        response = case.call(base_url=fuzz_gateway.url, session=session, headers=headers, timeout=15)
        status, answer_headers, body = answer_of(response)
        what = f"{method} {response.request.url} with {kind} key"
        assert_well_formed(status, answer_headers, body, what, path)
        if path in PUBLIC:
            assert status == 200, what
            return
        assert status == 401, f"{what}: {status} {body[:300]!r}"
        assert error_of(body, what, status)["code"] == "invalid_api_key"
        assert not any(name.startswith("x-ratelimit-") for name in answer_headers), what

    run_cases(operation_of(api_schema, method, path), GenerationMode.POSITIVE, FEW, call)


def allowed_methods(served_document: dict[str, Any], path: str) -> set[str]:
    return {method.upper() for method in served_document["paths"][path]}


@pytest.mark.usefixtures("stays_healthy")
@pytest.mark.parametrize("path", sorted({path for _, path in OPERATIONS}))
def test_undocumented_methods_are_405_with_allow(
    served_document: dict[str, Any], fuzz_gateway: FuzzTarget, path: str
) -> None:
    """What schemathesis's ``unsupported_method`` check asks: 405 and an ``Allow`` header naming
    the documented methods (RFC 9110 15.5.6), in the OpenAI error shape."""
    allowed = allowed_methods(served_document, path)
    concrete = (
        path.replace("{name}", ADMIN_TENANT)
        .replace("{key_id}", "some-key")
        .replace("{task_id}", KNOWN_TASK)
        .replace("{provider}/{model}", "local/mock")
    )
    for method in sorted({"GET", "POST", "PUT", "PATCH", "DELETE"} - allowed):
        response = fuzz_gateway.client.request(method, concrete, headers=right_key(path))
        what = f"{method} {concrete}"
        assert response.status_code == 405, f"{what}: {response.status_code} {response.text}"
        assert_well_formed(response.status_code, response.headers, response.content, what)
        advertised = {m.strip() for m in response.headers.get("allow", "").split(",") if m.strip()}
        assert allowed <= advertised, f"{what}: Allow {response.headers.get('allow')!r}"


# --- what the served document declares -----------------------------------------------------


@pytest.mark.parametrize("operation", OPERATIONS, ids=op_id)
def test_served_document_describes_the_answers(
    api_schema: schemathesis.BaseSchema,
    fuzz_gateway: FuzzTarget,
    session: requests.Session,
    operation: tuple[str, str],
) -> None:
    """Schemathesis's conformance checks: status code, content type, headers and body schema as
    documented."""
    method, path = operation
    headers = right_key(path)
    checks = [
        st_checks.status_code_conformance,
        st_checks.content_type_conformance,
        st_checks.response_headers_conformance,
        st_checks.response_schema_conformance,
    ]

    def call(case: Case) -> None:
        case.call_and_validate(
            base_url=fuzz_gateway.url, session=session, headers=headers, checks=checks, timeout=15
        )

    run_cases(operation_of(api_schema, method, path), GenerationMode.POSITIVE, FEW, call)


def chat(model: str = "mock", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


CHAT = "/v1/chat/completions"
TENANT = "/admin/tenants/{name}"
TASK = "/admin/tasks/{task_id}"
RESET = "/admin/breakers/{provider}/{model}/reset"
NO_KEY: dict[str, str | None] = {"Authorization": None}
AS_LIMITED = {"Authorization": f"Bearer {LIMITED_KEY}"}
AS_TENANT = {"Authorization": f"Bearer {TENANT_KEY}"}
FUZZ_ADMIN = {"name": ADMIN_TENANT}
NO_TENANT = {"name": "no-such-tenant"}
KNOWN_ANSWERS = [
    # (method, path, path parameters, headers besides the right key, body, the status it gets)
    ("POST", CHAT, {}, None, chat(), 200),
    ("POST", CHAT, {}, None, chat(stream=True), 200),
    ("POST", CHAT, {}, None, chat("gpt-4o-mini", stream=True), 200),
    ("POST", CHAT, {}, None, chat("claude-sonnet"), 200),
    ("POST", CHAT, {}, None, {"model": "mock", "messages": "hi"}, 400),
    ("POST", CHAT, {}, {"x-task-id": "not a task id"}, chat(), 400),
    ("POST", CHAT, {}, NO_KEY, chat(), 401),
    ("POST", CHAT, {}, AS_LIMITED, chat("gpt-4o-mini"), 403),
    ("POST", CHAT, {}, None, chat("no-such-model"), 404),
    ("POST", CHAT, {}, None, chat(user="x" * BODY_LIMIT), 413),
    ("GET", "/v1/models", {}, None, None, 200),
    ("GET", "/v1/models", {}, NO_KEY, None, 401),
    ("GET", "/healthz", {}, NO_KEY, None, 200),
    ("GET", "/readyz", {}, NO_KEY, None, 200),
    ("GET", "/metrics", {}, NO_KEY, None, 200),
    ("GET", TENANT, FUZZ_ADMIN, None, None, 200),
    ("GET", TENANT, NO_TENANT, None, None, 404),
    ("GET", TENANT, FUZZ_ADMIN, AS_TENANT, None, 401),
    ("PUT", TENANT, FUZZ_ADMIN, None, {"rpm": 100000}, 200),
    ("PUT", TENANT, FUZZ_ADMIN, None, {"rpm": 0}, 400),
    ("PUT", TENANT, FUZZ_ADMIN, None, {"models": ["x" * BODY_LIMIT]}, 413),
    ("PUT", f"{TENANT}/budget", FUZZ_ADMIN, None, {"tokens": 10**12, "period": "day"}, 200),
    ("PUT", f"{TENANT}/budget", FUZZ_ADMIN, None, {"usd": 1.0, "tokens": 1}, 400),
    ("PUT", f"{TENANT}/budget", NO_TENANT, None, {"usd": 1.0}, 404),
    ("POST", f"{TENANT}/keys", NO_TENANT, None, None, 404),
    ("DELETE", f"{TENANT}/keys/{{key_id}}", {**FUZZ_ADMIN, "key_id": "key_000000000000"}, None, None, 404),
    ("GET", TASK, {"task_id": KNOWN_TASK}, None, None, 200),
    ("GET", TASK, {"task_id": "not*a*task"}, None, None, 400),
    ("GET", TASK, {"task_id": "no-such-task"}, None, None, 404),
    ("GET", "/admin/breakers", {}, None, None, 200),
    ("POST", RESET, {"provider": "local", "model": "mock"}, None, None, 200),
    ("POST", RESET, {"provider": "local", "model": "nope"}, None, None, 404),
]
"""One request for each kind of answer the fuzz is unlikely to produce by itself (a stream, each
error status it can reach), with the status it must get."""


@pytest.mark.parametrize(
    ("method", "path", "path_parameters", "headers", "body", "status"),
    [
        pytest.param(*known, id=f"{known[0]} {known[1]} {known[5]}-{i}")
        for i, known in enumerate(KNOWN_ANSWERS)
    ],
)
def test_served_document_describes_known_answers(
    api_schema: schemathesis.BaseSchema,
    fuzz_gateway: FuzzTarget,
    session: requests.Session,
    method: str,
    path: str,
    path_parameters: dict[str, str],
    headers: dict[str, str | None] | None,
    body: Any,
    status: int,
) -> None:
    """The same conformance checks on answers of every documented kind."""
    wanted = {**right_key(path), **(headers or {})}
    sent = {name: value for name, value in wanted.items() if value is not None}
    case = operation_of(api_schema, method, path).Case(
        path_parameters=path_parameters,
        headers=sent,
        **({} if body is None else {"body": body, "media_type": "application/json"}),
    )
    response = case.call(base_url=fuzz_gateway.url, session=session, timeout=15)
    assert response.status_code == status, response.text[:500]
    case.validate_response(
        response,
        checks=[
            st_checks.status_code_conformance,
            st_checks.content_type_conformance,
            st_checks.response_headers_conformance,
            st_checks.response_schema_conformance,
        ],
    )


@pytest.mark.parametrize("operation", BODY_OPERATIONS, ids=op_id)
def test_served_document_declares_request_bodies(
    served_document: dict[str, Any], operation: tuple[str, str]
) -> None:
    method, path = operation
    body = served_document["paths"][path][method.lower()]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"]["type"] == "object"


def operations_of(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def test_served_document_declares_who_may_call(served_document: dict[str, Any]) -> None:
    """Tenant routes want the tenant's bearer key, admin routes the admin key, the rest nothing
    (``metrics_public`` is true in the fuzz config)."""
    schemes = served_document["components"]["securitySchemes"]
    assert schemes == {
        name: {"type": "http", "scheme": "bearer", "description": schemes[name]["description"]}
        for name in ("tenantKey", "adminKey")
    }
    assert "security" not in served_document
    for method, path, operation in operations_of(served_document):
        expected: list[dict[str, list[str]]] | None = None
        if path.startswith("/v1/"):
            expected = [{"tenantKey": []}]
        elif path.startswith("/admin/"):
            expected = [{"adminKey": []}]
        assert operation.get("security") == expected, f"{method} {path}"
        assert ("401" in operation["responses"]) == (expected is not None), f"{method} {path}"


def test_metrics_behind_the_admin_key_are_documented_so() -> None:
    """``metrics_public = false``: the document says ``/metrics`` wants the admin key."""
    config = Config(
        server=ServerConfig(metrics_public=False),
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
    )
    metrics = create_app(config).openapi_schema.to_schema()["paths"]["/metrics"]["get"]
    assert metrics["security"] == [{"adminKey": []}]
    assert {"200", "401", "429"} <= set(metrics["responses"])


def test_served_document_declares_path_parameter_patterns(served_document: dict[str, Any]) -> None:
    patterns = {
        "name": NAME_PATTERN,
        "provider": NAME_PATTERN,
        "task_id": f"^{ID_PATTERN}$",
        "key_id": r"^(key|file)_[0-9a-f]{12}$",
    }
    seen = set()
    for method, path, operation in operations_of(served_document):
        for parameter in operation.get("parameters", []):
            if parameter["in"] == "path" and parameter["name"] in patterns:
                assert parameter["schema"]["pattern"] == patterns[parameter["name"]], f"{method} {path}"
                seen.add(parameter["name"])
    assert seen == set(patterns)


def test_every_error_is_the_one_error_component(served_document: dict[str, Any]) -> None:
    """Every error answer refers to ``ErrorEnvelope``, which is exactly what ``errors.render``
    writes for every error class (upstream rejections aside: they pass back the upstream's body),
    and carries ``x-should-retry``."""
    components = served_document["components"]["schemas"]
    body = components["ErrorBody"]
    assert set(body["required"]) == set(body["properties"]) == {"message", "type", "param", "code"}
    assert components["ErrorEnvelope"]["required"] == ["error"]
    assert set(components["ErrorEnvelope"]["properties"]) == {"error"}
    validator = jsonschema_rs.validator_for(
        {"$ref": "#/components/schemas/ErrorEnvelope", "components": served_document["components"]}
    )
    kinds: list[type[errors.GatewayError]] = [errors.GatewayError, *all_subclasses(errors.GatewayError)]
    for kind in (kind for kind in kinds if kind is not errors.UpstreamRejected):
        for param in (None, "messages"):
            rendered = json.loads(errors.render(make_error(kind, param))[1])
            validator.validate(rendered)
            assert set(rendered["error"]) == set(body["properties"]), kind
    for method, path, operation in operations_of(served_document):
        for status, response in operation["responses"].items():
            if not status.startswith(("4", "5")) or (method, path, status) == ("GET", "/readyz", "503"):
                continue
            schema = json.dumps(response["content"]["application/json"]["schema"])
            if status != "4XX":
                assert "#/components/schemas/ErrorEnvelope" in schema, f"{method} {path} {status}"
            assert "x-should-retry" in response["headers"], f"{method} {path} {status}"


def all_subclasses(kind: type[errors.GatewayError]) -> list[type[errors.GatewayError]]:
    return [sub for direct in kind.__subclasses__() for sub in [direct, *all_subclasses(direct)]]


def make_error(kind: type[errors.GatewayError], param: str | None) -> errors.GatewayError:
    if issubclass(kind, errors.UpstreamFailure | errors.RateLimited | errors.QuotaExceeded):
        return kind("something happened")
    return kind("something happened", param=param)


def test_the_chat_route_is_only_declared_to_litestar() -> None:
    """Documenting the chat body must not make Litestar parse it: the declaration takes no
    parameters, and a POST never reaches it (it raises; gateway.chat_route serves POSTs before
    routing, which every end-to-end chat test exercises)."""
    assert set(routes_v1.chat_completions.parsed_fn_signature.parameters) == set()
