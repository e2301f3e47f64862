"""The scripted upstream for the adapter and pool tests: a real server on 127.0.0.1, fresh per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.scripted_upstream import ScriptedUpstream


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    """A scripted upstream in the test's loop; fails the test if a request went unscripted."""
    async with ScriptedUpstream() as server:
        yield server
    assert not server.errors, server.errors
