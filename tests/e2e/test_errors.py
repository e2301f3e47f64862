"""End to end: every error row the gateway core owns, through real sockets and the real SDK."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import LIMITED_KEY, TENANT_KEY, gateway_config
from tests.harness import Gateway, MockUpstream

MESSAGES = [{"role": "user", "content": "hi"}]
AUTH = {"authorization": f"Bearer {TENANT_KEY}"}


def post(gateway: Gateway, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers={**AUTH, **(headers or {})})


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return dict(error)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"messages": []}', "model"),
        (b'{"model": "gpt-4o-mini"}', "messages"),
        (b'{"model": 42, "messages": []}', "model"),
        (b'{"model": "gpt-4o-mini", "messages": "hi"}', "messages"),
        (b'{"model": "gpt-4o-mini", "messages": [{"content": "no role"}]}', "messages[0].role"),
        (b'{"model": "gpt-4o-mini", "messages": [{"role": "user"}], "stream": "yes"}', "stream"),
        (b'{"model": "gpt-4o-mini", "messages": [{"role": "user"}], "max_tokens": "10"}', "max_tokens"),
        # a limit below 1 would make the reservation negative: a credit to the buckets and budget
        (b'{"model": "gpt-4o-mini", "messages": [{"role": "user"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "gpt-4o-mini", "messages": [{"role": "user"}], "max_tokens": -100000}', "max_tokens"),
        (
            b'{"model": "gpt-4o-mini", "messages": [{"role": "user"}], "max_completion_tokens": -1}',
            "max_completion_tokens",
        ),
        (b'{"model": "gpt-\xff\xfe", "messages": []}', None),
    ],
)
def test_bad_bodies_are_400(gateway: Gateway, body: bytes, param: str | None) -> None:
    error = assert_error(post(gateway, body), 400, "invalid_request")
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("task_id", ["", "has space", "x" * 129, "semi;colon", "ünï"])
def test_bad_task_id_is_400(gateway: Gateway, task_id: str) -> None:
    body = json.dumps({"model": "mock", "messages": MESSAGES}).encode()
    headers = {**AUTH, "x-task-id": task_id.encode()}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers)
    error = assert_error(response, 400, "invalid_request")
    assert error["param"] == "X-Task-Id"


def test_good_task_id_is_accepted(gateway: Gateway) -> None:
    body = json.dumps({"model": "mock", "messages": MESSAGES}).encode()
    assert post(gateway, body, {"x-task-id": "task:2026-11.a_b-c"}).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer nope-not-a-key-0000"},
        {"authorization": "Basic abc"},
        {"authorization": "Bearer"},
    ],
)
def test_missing_or_unknown_key_is_401(gateway: Gateway, headers: dict[str, str]) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": "mock", "messages": MESSAGES}, headers=headers
    )
    assert_error(response, 401, "invalid_api_key")


def test_sdk_sees_401_403_404_as_typed_errors(gateway: Gateway) -> None:
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong-key-0000000000")
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="mock", messages=MESSAGES)  # type: ignore[arg-type]
    limited = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=LIMITED_KEY)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        limited.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
    assert denied.value.code == "model_not_allowed"
    with pytest.raises(openai.NotFoundError) as missing:
        limited.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found"


def test_models_lists_only_allowed(gateway: Gateway) -> None:
    limited = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=LIMITED_KEY)
    assert [m.id for m in limited.models.list()] == ["mock"]
    everyone = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=TENANT_KEY)
    assert {m.id for m in everyone.models.list()} == {"gpt-4o-mini", "renamed", "claude-sonnet", "mock"}


def test_huge_body_is_413(gateway: Gateway) -> None:
    body = b'{"model":"mock","messages":[{"role":"user","content":"' + b"x" * (5 * 1024 * 1024) + b'"}]}'
    assert_error(post(gateway, body), 413, "request_too_large")


def test_unknown_route_and_method_keep_the_error_shape(gateway: Gateway) -> None:
    assert_error(httpx.get(f"{gateway.url}/v1/nope"), 404, "not_found")
    assert_error(httpx.get(f"{gateway.url}/v1/chat/completions", headers=AUTH), 405, "method_not_allowed")


def test_request_id_is_echoed_when_sane_and_replaced_when_not(gateway: Gateway) -> None:
    body = json.dumps({"model": "mock", "messages": MESSAGES}).encode()
    assert post(gateway, body, {"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    replaced = post(gateway, body, {"x-request-id": "bad id\twith junk"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{24}", replaced)


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_garbage_is_502_and_logged(gateway: Gateway, upstream: MockUpstream, stream: bool) -> None:
    upstream.configure(mode="garbage")
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES, "stream": stream}).encode()
    response = post(gateway, body, {"x-request-id": f"garbage-{stream}"})
    assert_error(response, 502, "upstream_error")
    assert f'"request_id":"garbage-{stream}"' in gateway.output()


def test_upstream_closing_mid_body_is_502(gateway: Gateway, upstream: MockUpstream) -> None:
    upstream.configure(mode="close_mid_body")
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES}).encode()
    assert_error(post(gateway, body), 502, "upstream_error")


def test_upstream_500_forever_is_503(gateway: Gateway, upstream: MockUpstream) -> None:
    upstream.configure(mode="status", status=500)
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES}).encode()
    assert_error(post(gateway, body), 503, "upstream_unavailable")


def test_upstream_400_passes_through_unchanged(gateway: Gateway, upstream: MockUpstream) -> None:
    upstream.configure(mode="status", status=400)
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES}).encode()
    response = post(gateway, body)
    assert response.status_code == 400
    assert response.headers["x-should-retry"] == "false"
    assert "error" in response.json()
    assert upstream.stats()["chat_requests"] == 1


def test_upstream_that_hangs_is_504(gateway: Gateway, upstream: MockUpstream) -> None:
    upstream.configure(mode="hang")
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES}).encode()
    assert_error(post(gateway, body), 504, "upstream_timeout")


def test_stream_stalled_mid_way_ends_with_error_event_and_done(
    gateway: Gateway, upstream: MockUpstream
) -> None:
    upstream.configure(mode="stall", stall_after=3)
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True}).encode()
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", content=body, headers=AUTH, timeout=10
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_timeout"
    assert len(events) == 3 + 2


def test_sdk_raises_on_a_stream_cut_mid_way(gateway: Gateway, upstream: MockUpstream) -> None:
    upstream.configure(mode="close_mid_body", stall_after=2)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=TENANT_KEY, max_retries=0)
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    with pytest.raises(openai.APIError):
        list(stream)


def test_an_address_guessing_keys_is_slowed(session_tmp: Path, upstream: MockUpstream) -> None:
    process = Gateway(session_tmp, gateway_config(upstream.url, invalid_keys_per_minute=5)).start()
    try:
        url = f"{process.url}/v1/models"
        statuses = [
            httpx.get(url, headers={"authorization": f"Bearer guess-{i:04d}"}).status_code for i in range(7)
        ]
        assert statuses[:5] == [401] * 5
        assert statuses[5:] == [429, 429]
        blocked = httpx.get(url, headers=AUTH)
        assert blocked.status_code == 429, "while blocked, even a right key is refused"
        assert int(blocked.headers["retry-after"]) >= 1
        assert blocked.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        process.stop()
