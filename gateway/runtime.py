"""The gateway's runtime state, built once from a validated config: providers, routes, tenants."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.config import Config
from gateway.secret import key_hash, stored_key_hash
from gateway.tenants import TenantDirectory
from policies.routing import ModelRoute, build_routes
from providers import Provider, build_provider


@dataclass(slots=True)
class Gateway:
    """Everything a request needs, made once at start and shared by all requests of a process."""

    config: Config
    providers: dict[str, Provider]
    routes: dict[str, ModelRoute]
    tenants: TenantDirectory
    admin_key_hash: str | None

    @classmethod
    def build(cls, config: Config) -> Gateway:
        providers = {p.name: build_provider(p) for p in config.providers}
        admin = config.server.admin_key
        return cls(
            config=config,
            providers=providers,
            routes=build_routes(config.models, providers),
            tenants=TenantDirectory(config.tenants),
            admin_key_hash=stored_key_hash(admin.reveal()) if admin is not None else None,
        )

    def is_admin_key(self, key: str) -> bool:
        return self.admin_key_hash is not None and key_hash(key) == self.admin_key_hash

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in self.providers.values()))
