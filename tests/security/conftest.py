"""The security tests' world: one gateway with every secret the config can hold, drawn at random.

The gateway (``sec``) runs with JSON logs at debug level and spans printed by the console
exporter into the same output file, on a private Redis that wants a password. Its providers
point at the shared mock upstream and at a scripted upstream the tests control; a trap
listener stands by for anything that would make the gateway connect where the config does not
say. Its admin key guards ``/metrics`` too (``metrics_public = false``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis

from gateway.secret import key_hash
from tests.harness import Gateway, MockUpstream
from tests.security.support import PasswordRedis, ScriptedUpstream, Trap, make_secret

ADMIN = make_secret()
TENANT = make_secret()
OTHER = make_secret()
UP_KEY = make_secret()
ANT_KEY = make_secret()
SCRIPTED_KEY = make_secret()
SCRIPTED_ANT_KEY = make_secret()
REDIS_PASSWORD = make_secret()
SECRETS = {
    "admin key": ADMIN,
    "tenant key": TENANT,
    "other tenant key": OTHER,
    "openai upstream key": UP_KEY,
    "anthropic upstream key": ANT_KEY,
    "scripted upstream key": SCRIPTED_KEY,
    "scripted anthropic key": SCRIPTED_ANT_KEY,
    "redis password": REDIS_PASSWORD,
}
PREFIX = "sec" + uuid.uuid4().hex[:6]
TRACE_ENV = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "50"}
PUBLIC_MODELS = ("gpt-4o-mini", "renamed", "claude-sonnet", "mock")
"""Models served by the shared mock upstream (or the built-in mock)."""


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def toml_table(values: dict[str, object]) -> str:
    return "\n".join(f"{key} = {toml_value(value)}" for key, value in values.items())


def security_config(upstream: str, scripted: str, redis_url: str, **server: object) -> str:
    settings = {
        "admin_key": ADMIN,
        "request_timeout_s": 5,
        "invalid_keys_per_minute": 100000,
        "metrics_public": False,
        "log_level": "debug",
        **server,
    }
    return f"""
[server]
{toml_table(settings)}

[redis]
url = "{redis_url}"
prefix = "{PREFIX}"

[retry]
attempts = 1

[breaker]
failure_threshold = 1000000

[[providers]]
name = "up"
type = "openai"
base_url = "{upstream}/v1"
api_key = "{UP_KEY}"
read_timeout_s = 1.0

[[providers]]
name = "claude"
type = "anthropic"
base_url = "{upstream}/v1"
api_key = "{ANT_KEY}"
read_timeout_s = 1.0

[[providers]]
name = "scripted"
type = "openai"
base_url = "{scripted}/v1"
api_key = "{SCRIPTED_KEY}"
read_timeout_s = 2.0

[[providers]]
name = "scripted-claude"
type = "anthropic"
base_url = "{scripted}/v1"
api_key = "{SCRIPTED_ANT_KEY}"
read_timeout_s = 2.0

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
name = "scripted"
targets = [{{ provider = "scripted", model = "m" }}]

[[models]]
name = "scripted-claude"
targets = [{{ provider = "scripted-claude", model = "c" }}]

[[models]]
name = "mock"
targets = [{{ provider = "local", model = "mock" }}]

[[tenants]]
name = "acme"
keys = ["{TENANT}"]

[[tenants]]
name = "other"
keys = ["sha256:{key_hash(OTHER)}"]
models = ["mock"]
"""


@dataclass
class World:
    gateway: Gateway
    mock: MockUpstream
    scripted: ScriptedUpstream
    trap: Trap
    redis: PasswordRedis
    config: str

    def redis_client(self) -> Redis:
        return Redis.from_url(self.redis.url, socket_timeout=5)


@pytest.fixture(scope="package")
def world(session_tmp: Path, mock_upstream_process: MockUpstream) -> Iterator[World]:
    directory = session_tmp / "security-redis"
    directory.mkdir()
    store = PasswordRedis(directory, REDIS_PASSWORD).start()
    scripted = ScriptedUpstream()
    trap = Trap()
    config = security_config(mock_upstream_process.url, scripted.url, store.url)
    gateway = Gateway(session_tmp, config, env=TRACE_ENV)
    try:
        gateway.start()
        yield World(gateway, mock_upstream_process, scripted, trap, store, config)
    finally:
        gateway.stop()
        trap.close()
        scripted.close()
        store.stop()


@pytest.fixture
def sec(world: World, upstream: MockUpstream) -> Iterator[World]:
    """The world with the mock upstream reset (by ``upstream``) and the scripted one too."""
    world.scripted.set()
    yield world
    world.scripted.set()
