"""Session-wide real processes: the mock upstream, a gateway in front of it, a private Redis."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, MockUpstream, RedisServer

TENANT_KEY = "tenant-key-acme-0123456789"
LIMITED_KEY = "tenant-key-limited-0123456789"
ADMIN_KEY = "admin-key-e2e-0123456789abcdef"
UPSTREAM_KEY = "sk-upstream-secret-e2e-4242424242"
ANTHROPIC_KEY = "sk-ant-secret-e2e-4343434343"


def toml_table(values: dict[str, object]) -> str:
    return "\n".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in values.items())


def gateway_config(
    upstream_url: str,
    *,
    retry: dict[str, object] | None = None,
    breaker: dict[str, object] | None = None,
    **server: object,
) -> str:
    """The end-to-end config: an OpenAI-type and an Anthropic-type target on the mock upstream.

    By default one attempt per request and breakers that never open, so that tests of single
    failures see exactly them; resilience tests pass their own ``retry`` and ``breaker`` tables.
    """
    settings = {"admin_key": ADMIN_KEY, "request_timeout_s": 5, "invalid_keys_per_minute": 10000, **server}
    return f"""
[server]
{toml_table(settings)}

[retry]
{toml_table(retry or {"attempts": 1})}

[breaker]
{toml_table(breaker or {"failure_threshold": 1000000})}

[[providers]]
name = "up"
type = "openai"
base_url = "{upstream_url}/v1"
api_key = "{UPSTREAM_KEY}"
read_timeout_s = 1.5

[[providers]]
name = "claude"
type = "anthropic"
base_url = "{upstream_url}/v1"
api_key = "{ANTHROPIC_KEY}"
read_timeout_s = 1.5

[[providers]]
name = "local"
type = "mock"

[[models]]
name = "gpt-4o-mini"
targets = [{{ provider = "up", model = "gpt-4o-mini" }}]

[[models]]
name = "renamed"
targets = [{{ provider = "up", model = "upstream-name" }}]

[[models]]
name = "claude-sonnet"
targets = [{{ provider = "claude", model = "claude-sonnet-4-5" }}]

[[models]]
name = "mock"
targets = [{{ provider = "local", model = "mock" }}]

[[tenants]]
name = "acme"
keys = ["{TENANT_KEY}"]

[[tenants]]
name = "limited"
keys = ["{LIMITED_KEY}"]
models = ["mock"]
"""


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    """An app started in the test process freezes its heap out of the cyclic collector and raises
    the young threshold (``gateway.heap``). Undone after each test: otherwise every later test ran
    with objects that are never collected and collections ten times rarer, and garbage left by a
    test (an unclosed client, say) was found only at the session's end, outside any test."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("modelgate")


@pytest.fixture(scope="session")
def mock_upstream_process(session_tmp: Path) -> Iterator[MockUpstream]:
    upstream = MockUpstream(session_tmp).start()
    yield upstream
    upstream.process.stop()


@pytest.fixture
def upstream(mock_upstream_process: MockUpstream) -> Iterator[MockUpstream]:
    """The shared mock upstream, reset to its defaults before and after the test."""
    mock_upstream_process.reset()
    yield mock_upstream_process
    mock_upstream_process.reset()


@pytest.fixture(scope="session")
def gateway(session_tmp: Path, mock_upstream_process: MockUpstream) -> Iterator[Gateway]:
    """One gateway process in front of the mock upstream, for tests that do not change its config."""
    process = Gateway(session_tmp, gateway_config(mock_upstream_process.url)).start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def redis_server(session_tmp: Path) -> Iterator[RedisServer]:
    directory = session_tmp / "redis"
    directory.mkdir()
    server = RedisServer(directory).start()
    yield server
    server.stop()
