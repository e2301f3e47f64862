"""Fixtures for the queue client tests: a fresh queue per test on the session's private Redis, and
the scripted fake gateway."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from client import Queue
from tests.client.support import FakeGateway
from tests.harness import RedisServer


@pytest.fixture
async def queue(redis_server: RedisServer) -> AsyncIterator[Queue]:
    async with Queue(redis_server.url, name=f"t-{uuid.uuid4().hex[:12]}") as fresh:
        yield fresh


@pytest.fixture(scope="session")
def fake_gateway_server() -> Iterator[FakeGateway]:
    server = FakeGateway().start()
    yield server
    server.stop()


@pytest.fixture
def fake_gateway(fake_gateway_server: FakeGateway) -> Iterator[FakeGateway]:
    fake_gateway_server.reset()
    yield fake_gateway_server
    fake_gateway_server.reset()
