"""Tenants as the request path sees them: the file's tenants with the admin API's changes applied.

Keys are never kept in memory in the clear: the directory maps the SHA-256 of each key to its
tenant, so a lookup compares digests of fixed length, never the secret itself.

Admin changes are stored (see :mod:`gateway.tenant_store`) and each worker reloads them when the
store's version moves; it checks every ``REFRESH_S``, so a change made through one worker reaches
every other one within that bound plus one reload. An admin change to a tenant wins over the file
until the file's own values for that tenant change; then the file wins again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.exceptions import RedisError

from gateway.config import BudgetConfig, PositiveInt, TenantConfig
from gateway.secret import key_hash, stored_key_hash
from gateway.tenant_store import StoredState, TenantStore
from policies.tasks import stop_task

log = logging.getLogger("modelgate.tenants")

REFRESH_S = 0.25
_LIMIT_FIELDS = ("rpm", "tpm", "max_concurrency", "task_max_tokens", "budget", "models")


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant's identity and limits."""

    name: str
    models: frozenset[str] | None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    task_max_tokens: int | None = None
    budget: BudgetConfig | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


class TenantSettings(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The body of ``PUT /admin/tenants/{name}``: fields left out stay as they are; null clears."""

    rpm: PositiveInt | msgspec.UnsetType | None = msgspec.UNSET
    tpm: PositiveInt | msgspec.UnsetType | None = msgspec.UNSET
    max_concurrency: PositiveInt | msgspec.UnsetType | None = msgspec.UNSET
    task_max_tokens: PositiveInt | msgspec.UnsetType | None = msgspec.UNSET
    budget: BudgetConfig | msgspec.UnsetType | None = msgspec.UNSET
    models: list[str] | msgspec.UnsetType | None = msgspec.UNSET


class _Override(msgspec.Struct):
    settings: dict[str, Any]
    file_fingerprint: str


class _KeyRecord(msgspec.Struct):
    tenant: str
    key_id: str


class TenantDirectory:
    """Finds the tenant an API key belongs to, and applies admin changes."""

    def __init__(self, file_tenants: list[TenantConfig], store: TenantStore) -> None:
        self._file = {t.name: t for t in file_tenants}
        self._store = store
        self._version = -1
        self._state = StoredState()
        self._by_name: dict[str, Tenant] = {}
        self._by_key_hash: dict[str, Tenant] = {}
        self._key_ids: dict[str, dict[str, str]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._rebuild(StoredState())

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant holding ``key``, or None for an unknown or revoked key."""
        return self._by_key_hash.get(key_hash(key))

    def get(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def key_ids(self, name: str) -> list[str]:
        return sorted(self._key_ids.get(name, {}))

    async def refresh(self) -> None:
        """Reload stored changes if the store's version moved."""
        version = await self._store.version()
        if version != self._version:
            self._rebuild(await self._store.load())

    async def update(self, name: str, settings: TenantSettings) -> Tenant:
        """Create or change a tenant; fields not given keep their current values."""
        await self.refresh()
        current = self._override(name)
        changes = msgspec.to_builtins(settings)  # fields left out are omitted (UNSET)
        merged = {**current, **changes}
        doc = _Override(merged, _fingerprint(self._file.get(name)))
        await self._store.put_tenant(name, msgspec.json.encode(doc))
        await self.refresh()
        return self._by_name[name]

    async def create_key(self, name: str) -> tuple[str, str]:
        """A new key for ``name``: (key_id, key). Only its hash is stored."""
        key = "mg-" + secrets.token_urlsafe(32)
        key_id = "key_" + secrets.token_hex(6)
        await self._store.put_key(key_hash(key), msgspec.json.encode(_KeyRecord(name, key_id)))
        await self.refresh()
        return key_id, key

    async def revoke(self, name: str, key_id: str) -> bool:
        """Revoke one of ``name``'s keys; False if it has no such key."""
        await self.refresh()
        digest = self._key_ids.get(name, {}).get(key_id)
        if digest is None:
            return False
        await self._store.revoke(digest, key_id)
        await self.refresh()
        return True

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            await stop_task(self._poller)
            self._poller = None

    async def _poll(self) -> None:
        while True:
            # While Redis is away, keep serving the last known tenants; the limiter reports it.
            with contextlib.suppress(RedisError, OSError):
                await self.refresh()
            await asyncio.sleep(REFRESH_S)

    def _override(self, name: str) -> dict[str, Any]:
        raw = self._state.tenants.get(name)
        if raw is None:
            return {}
        override = msgspec.json.decode(raw, type=_Override)
        return override.settings if override.file_fingerprint == _fingerprint(self._file.get(name)) else {}

    def _rebuild(self, state: StoredState) -> None:
        self._state = state
        names = set(self._file) | set(state.tenants)
        self._by_name = {name: self._effective(name) for name in names}
        key_ids: dict[str, dict[str, str]] = {name: {} for name in names}
        for config in self._file.values():
            for key in config.keys:
                digest = stored_key_hash(key.reveal())
                key_ids[config.name]["file_" + digest[:12]] = digest
        for digest, raw in state.keys.items():
            record = msgspec.json.decode(raw, type=_KeyRecord)
            if record.tenant in key_ids:
                key_ids[record.tenant][record.key_id] = digest
        self._key_ids = {
            n: {k: d for k, d in ids.items() if d not in state.revoked} for n, ids in key_ids.items()
        }
        self._by_key_hash = {d: self._by_name[n] for n, ids in self._key_ids.items() for d in ids.values()}
        self._version = state.version

    def _effective(self, name: str) -> Tenant:
        config = self._file.get(name)
        values: dict[str, Any] = _file_values(config) if config is not None else {}
        values.update(self._override(name))
        budget = values.get("budget")
        models = values.get("models")
        return Tenant(
            name=name,
            models=frozenset(models) if models is not None else None,
            rpm=values.get("rpm"),
            tpm=values.get("tpm"),
            max_concurrency=values.get("max_concurrency"),
            task_max_tokens=values.get("task_max_tokens"),
            budget=msgspec.convert(budget, BudgetConfig) if budget is not None else None,
        )


def _file_values(config: TenantConfig) -> dict[str, Any]:
    return {f: msgspec.to_builtins(getattr(config, f)) for f in _LIMIT_FIELDS}


def _fingerprint(config: TenantConfig | None) -> str:
    """Identifies the file's values for a tenant (keys aside), to tell when the file changed."""
    if config is None:
        return ""
    return hashlib.sha256(msgspec.json.encode(_file_values(config))).hexdigest()[:16]
