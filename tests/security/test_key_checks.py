"""Timing-safe key checks, proven by structure rather than by timing (a busy machine is too noisy).

A key check is timing-safe when the presented key is never compared with a stored key byte by
byte: the gateway hashes the presented key (SHA-256) and looks the digest up, so how long the
lookup takes says nothing about how much of a real key an attacker has guessed. These tests pin
that: the tenant directory and the admin check hold digests only, they decide on the digest of
the presented key alone (swapping the hash function swaps the answer), and they never read a
configured secret while checking. Comparing two ``Secret`` values goes through
``hmac.compare_digest``.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

import gateway.runtime
import gateway.tenants
from gateway.config import Config, ModelConfig, ProviderConfig, ServerConfig, TargetConfig, TenantConfig
from gateway.runtime import Gateway
from gateway.secret import Secret, key_hash
from gateway.tenant_store import MemoryTenantStore
from gateway.tenants import TenantDirectory
from tests.security.support import make_secret

FILE_KEY = make_secret()
HASHED_FILE_KEY = make_secret()
OTHER_KEY = make_secret()
ADMIN_KEY = make_secret()
DIGEST = re.compile(r"[0-9a-f]{64}")


def tenants() -> list[TenantConfig]:
    return [
        TenantConfig(name="acme", keys=[Secret(FILE_KEY), Secret(f"sha256:{key_hash(HASHED_FILE_KEY)}")]),
        TenantConfig(name="other", keys=[Secret(OTHER_KEY)]),
    ]


async def loaded_directory() -> tuple[TenantDirectory, str]:
    """A directory with file keys and one key made through the admin API; that key too."""
    directory = TenantDirectory(tenants(), MemoryTenantStore())
    await directory.refresh()
    _, created = await directory.create_key("acme")
    return directory, created


def strings_in(root: object) -> Iterator[str]:
    """Every string (and decoded bytes) reachable from ``root``; ``Secret`` values stay opaque."""
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, Secret | int | float | bool | type(None)):
            continue
        seen.add(id(item))
        if isinstance(item, str):
            yield item
        elif isinstance(item, bytes | bytearray):
            yield bytes(item).decode("latin-1")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif isinstance(item, msgspec.Struct):
            stack.extend(getattr(item, name) for name in item.__struct_fields__)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif type(item).__module__.split(".")[0] in {"gateway", "policies"}:
            stack.extend(vars(item).values() if hasattr(item, "__dict__") else ())


def secrets_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, reading or comparing a configured secret fails the test."""

    def refuse(*_: Any) -> Any:
        raise AssertionError("a configured secret was read while checking a presented key")

    monkeypatch.setattr(Secret, "reveal", refuse)
    monkeypatch.setattr(Secret, "__eq__", refuse)


async def test_the_tenant_directory_holds_digests_never_keys() -> None:
    directory, created = await loaded_directory()
    held = list(strings_in(directory))
    assert held, "the walk found nothing: it cannot vouch for anything"
    for key in (FILE_KEY, HASHED_FILE_KEY, OTHER_KEY, created):
        assert not [text for text in held if key in text], "a raw key is held by the tenant directory"
    index = directory._by_key_hash  # the lookup table itself: digest -> tenant
    assert len(index) == 4
    assert all(DIGEST.fullmatch(digest) for digest in index)


async def test_tenant_lookup_decides_on_the_digest_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    directory, created = await loaded_directory()
    secrets_unreadable(monkeypatch)
    for key, tenant in (
        (FILE_KEY, "acme"),
        (HASHED_FILE_KEY, "acme"),
        (OTHER_KEY, "other"),
        (created, "acme"),
    ):
        found = directory.authenticate(key)
        assert found is not None and found.name == tenant
    for wrong in (FILE_KEY[:-1], FILE_KEY + "x", key_hash(FILE_KEY), f"sha256:{key_hash(FILE_KEY)}", ""):
        assert directory.authenticate(wrong) is None, wrong

    hashed: list[str] = []

    def other_digest(key: str) -> str:
        hashed.append(key)
        return key_hash(OTHER_KEY)

    monkeypatch.setattr(gateway.tenants, "key_hash", other_digest)
    found = directory.authenticate("not-a-key-at-all")
    assert hashed == ["not-a-key-at-all"], "the presented key is hashed, once"
    assert found is not None and found.name == "other", "the digest alone picks the tenant"


def gateway_with_admin() -> Gateway:
    config = Config(
        server=ServerConfig(admin_key=Secret(ADMIN_KEY)),
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
        tenants=[TenantConfig(name="acme", keys=[Secret(FILE_KEY)])],
    )
    return Gateway.build(config)


async def test_the_admin_check_compares_digests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    built = gateway_with_admin()
    secrets_unreadable(monkeypatch)
    assert built.admin_key_hash is not None and DIGEST.fullmatch(built.admin_key_hash)
    held = list(strings_in(built))
    assert built.admin_key_hash in held
    assert not [text for text in held if ADMIN_KEY in text or FILE_KEY in text], "a raw key is held"
    assert built.is_admin_key(ADMIN_KEY)
    for wrong in (
        ADMIN_KEY[:-1],
        ADMIN_KEY + "x",
        ADMIN_KEY.upper(),
        FILE_KEY,
        key_hash(ADMIN_KEY),
        f"sha256:{key_hash(ADMIN_KEY)}",
        "",
    ):
        assert not built.is_admin_key(wrong), wrong

    hashed: list[str] = []

    def admin_digest(key: str) -> str:
        hashed.append(key)
        return key_hash(ADMIN_KEY)

    monkeypatch.setattr(gateway.runtime, "key_hash", admin_digest)
    assert built.is_admin_key("not-the-admin-key"), "the digest alone decides"
    assert hashed == ["not-the-admin-key"]


def test_secret_equality_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert Secret("same-value") == Secret("same-value")
    assert Secret("same-value") != Secret("same-valuf")
    assert len(calls) == 2
