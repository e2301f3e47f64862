"""Tenants as the request path sees them, and the lookup from an API key to its tenant.

Keys are never kept in memory in the clear: the directory maps the SHA-256 of each key to its
tenant, so a lookup compares digests of fixed length, never the secret itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import BudgetConfig, TenantConfig
from gateway.secret import key_hash, stored_key_hash


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

    @classmethod
    def from_config(cls, config: TenantConfig) -> Tenant:
        return cls(
            name=config.name,
            models=frozenset(config.models) if config.models is not None else None,
            rpm=config.rpm,
            tpm=config.tpm,
            max_concurrency=config.max_concurrency,
            task_max_tokens=config.task_max_tokens,
            budget=config.budget,
        )


class TenantDirectory:
    """Finds the tenant an API key belongs to."""

    def __init__(self, tenants: list[TenantConfig]) -> None:
        self._by_name = {t.name: Tenant.from_config(t) for t in tenants}
        self._by_key_hash = {
            stored_key_hash(key.reveal()): self._by_name[t.name] for t in tenants for key in t.keys
        }

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant holding ``key``, or None for an unknown key."""
        return self._by_key_hash.get(key_hash(key))

    def get(self, name: str) -> Tenant | None:
        return self._by_name.get(name)
