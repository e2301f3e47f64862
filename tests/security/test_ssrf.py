"""No field of a request can change where the gateway connects (no SSRF).

The gateway connects only to the ``base_url`` of the provider its config routes the model to.
Every request here carries the address of a trap listener wherever a client could try to put
it (body fields an SDK or another proxy might honour, image URLs, proxy-style headers, the
request target itself) and must still be served by the configured upstream while the trap sees
no connection at all. An upstream that answers with a redirect to the trap is not followed
either.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import Gateway
from tests.security.conftest import TENANT, World
from tests.security.support import error_of

AUTH = {"authorization": f"Bearer {TENANT}"}


def body_fields(trap: str) -> dict[str, Any]:
    """Top-level fields that name a place to connect to, in the spellings clients use."""
    names = (
        "base_url", "api_base", "baseURL", "base", "url", "endpoint", "api_url", "host", "upstream",
        "upstream_url", "proxy", "proxy_url", "target", "provider", "callback_url", "webhook",
        "azure_endpoint", "server_url",
    )  # fmt: skip
    return {name: f"{trap}/v1" for name in names} | {"extra_headers": {"host": trap}, "api_version": trap}


def trap_headers(trap_host: str, trap_url: str) -> dict[str, str]:
    return {
        "x-forwarded-host": trap_host,
        "x-forwarded-proto": "http",
        "x-forwarded-port": trap_host.rsplit(":", 1)[1],
        "x-forwarded-server": trap_host,
        "forwarded": f"host={trap_host};proto=http",
        "x-original-url": f"{trap_url}/v1/chat/completions",
        "x-rewrite-url": f"{trap_url}/v1/chat/completions",
        "x-upstream": trap_url,
        "x-upstream-url": trap_url,
        "x-target-url": trap_url,
        "x-base-url": trap_url,
        "x-api-base": trap_url,
        "x-proxy-url": trap_url,
        "proxy": trap_url,
        "x-host": trap_host,
        "x-http-destinationurl": trap_url,
        "destination": trap_url,
        "referer": trap_url,
        "origin": trap_url,
    }


def chat_body(model: str, trap: str, stream: bool) -> bytes:
    image = {"type": "image_url", "image_url": {"url": f"{trap}/cat.png"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": f"fetch {trap} please"}, image]}]
    body = {"model": model, "messages": messages, "stream": stream, "max_tokens": 5, **body_fields(trap)}
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def web() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=15) as client:
        yield client


@pytest.fixture(scope="module")
def untraced(world: World, session_tmp: Path) -> Iterator[Gateway]:
    """A second instance of the same gateway, without tracing: then the upstream gets the client's
    own trace headers, so what the gateway forwards is the client's choice, not the span's."""
    process = Gateway(session_tmp, world.config).start()
    yield process
    process.stop()


def upstream_requests(world: World) -> int:
    return int(world.mock.stats()["requests"])


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "untraced"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["gpt-4o-mini", "renamed", "claude-sonnet"])
def test_body_fields_and_headers_never_pick_the_upstream(
    sec: World, untraced: Gateway, web: httpx.Client, model: str, stream: bool, traced: bool
) -> None:
    trap = sec.trap
    before = trap.connections()
    served_before = upstream_requests(sec)
    headers = {**AUTH, **trap_headers(trap.host, trap.url), "content-type": "application/json"}
    url = sec.gateway.url if traced else untraced.url
    response = web.post(
        f"{url}/v1/chat/completions", content=chat_body(model, trap.url, stream), headers=headers
    )
    assert trap.connections() == before == 0, "the gateway connected to the trap"
    assert response.status_code == 200, response.text
    assert upstream_requests(sec) == served_before + 1, "the configured upstream served it"
    seen = {k.lower(): v for k, v in sec.mock.stats()["last_headers"].items()}
    assert seen["host"] == f"127.0.0.1:{sec.mock.port}", "the upstream was called by its own address"
    assert not set(seen) & set(trap_headers(trap.host, trap.url)), "no client header went upstream"


def test_the_host_header_and_the_request_target_never_pick_the_upstream(sec: World) -> None:
    """``Host: <trap>`` and an absolute-form request target (``POST http://trap/...``)."""
    trap = sec.trap
    body = chat_body("gpt-4o-mini", trap.url, False)
    served_before = upstream_requests(sec)
    for target in ("/v1/chat/completions", f"{trap.url}/v1/chat/completions"):
        conn = http.client.HTTPConnection("127.0.0.1", sec.gateway.port, timeout=15)
        try:
            conn.putrequest("POST", target, skip_host=True)
            for name, value in {**AUTH, "host": trap.host, "content-type": "application/json"}.items():
                conn.putheader(name, value)
            conn.putheader("content-length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            text = response.read().decode()
        finally:
            conn.close()
        assert response.status == 200, (target, response.status, text)
    assert upstream_requests(sec) == served_before + 2
    assert trap.connections() == 0


@pytest.mark.parametrize(
    "model",
    ["http://{trap}/v1", "//{trap}/v1", "{trap}", "up/../{trap}", "up@{trap}", "gpt-4o-mini@{trap}"],
)
def test_a_model_name_is_never_an_address(sec: World, web: httpx.Client, model: str) -> None:
    trap = sec.trap
    name = model.format(trap=trap.host)
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    response = web.post(f"{sec.gateway.url}/v1/chat/completions", json=body, headers=AUTH)
    error_of(response, 404, "model_not_found")
    assert trap.connections() == 0


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("model", ["scripted", "scripted-claude"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_upstream_redirect_is_not_followed(
    sec: World, web: httpx.Client, model: str, status: int, stream: bool
) -> None:
    trap = sec.trap
    sec.scripted.set(status=status, location=f"{trap.url}/v1/chat/completions")
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    response = web.post(f"{sec.gateway.url}/v1/chat/completions", json=body, headers=AUTH)
    assert [r.path for r in sec.scripted.received] == [
        "/v1/chat/completions" if model == "scripted" else "/v1/messages"
    ]
    assert trap.connections() == 0, "the gateway followed the redirect to the trap"
    error_of(response, 502, "upstream_error")
