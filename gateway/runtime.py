"""The gateway's runtime state, built once from a validated config: providers, routes, tenants, limits."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import Config
from gateway.key_guard import KeyGuard
from gateway.secret import key_hash, stored_key_hash
from gateway.tenant_store import MemoryTenantStore, RedisTenantStore, TenantStore
from gateway.tenants import TenantDirectory
from policies.admission import AdmissionStore
from policies.breakers import Breakers
from policies.keys import Keys
from policies.limiter import Limiter, Limits
from policies.memory_store import MemoryStore
from policies.redis_pipe import RedisPipe
from policies.redis_store import RedisStore
from policies.routing import ModelRoute, build_routes
from providers import Provider, build_provider

REDIS_CONNECT_TIMEOUT_S = 0.5
REDIS_COMMAND_TIMEOUT_S = 1.0


@dataclass(slots=True)
class Gateway:
    """Everything a request needs, made once at start and shared by all requests of a process."""

    config: Config
    providers: dict[str, Provider]
    routes: dict[str, ModelRoute]
    tenants: TenantDirectory
    limiter: Limiter
    redis: aioredis.Redis | None
    admin_key_hash: str | None
    key_guard: KeyGuard

    @classmethod
    def build(cls, config: Config, workers: int = 1) -> Gateway:
        providers = {p.name: build_provider(p) for p in config.providers}
        admin = config.server.admin_key
        redis = _redis_client(config)
        limiter = _limiter(config, redis, workers)
        store: TenantStore = (
            RedisTenantStore(redis, limiter.keys) if redis is not None else MemoryTenantStore()
        )
        return cls(
            config=config,
            providers=providers,
            routes=build_routes(config.models, providers),
            tenants=TenantDirectory(config.tenants, store),
            limiter=limiter,
            redis=redis,
            admin_key_hash=stored_key_hash(admin.reveal()) if admin is not None else None,
            key_guard=KeyGuard(config.server.invalid_keys_per_minute),
        )

    def is_admin_key(self, key: str) -> bool:
        return self.admin_key_hash is not None and key_hash(key) == self.admin_key_hash

    async def start(self) -> None:
        # Load stored admin changes before serving, so a (re)started worker does not answer with
        # the file's tenants alone; if Redis does not answer now, the poller catches up later.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(REDIS_COMMAND_TIMEOUT_S * 2):
                await self.tenants.refresh()
        self.limiter.start()
        self.tenants.start()

    async def aclose(self) -> None:
        await self.tenants.stop()
        await self.limiter.stop()
        await asyncio.gather(*(p.aclose() for p in self.providers.values()))
        if self.redis is not None:
            await self.redis.aclose()


def _redis_client(config: Config) -> aioredis.Redis | None:
    if config.redis is None:
        return None
    # One quick retry covers a pooled connection that died with a Redis restart; more would
    # hold requests while Redis is down, which on_failure exists to decide instead.
    return aioredis.Redis.from_url(
        config.redis.url.reveal(),
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_COMMAND_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1),
    )


def _limiter(config: Config, redis: aioredis.Redis | None, workers: int) -> Limiter:
    limits = {
        p.name: Limits(p.rpm, p.tpm, p.max_concurrency)
        for p in config.providers
        if p.rpm is not None or p.tpm is not None or p.max_concurrency is not None
    }
    max_tokens = config.server.default_max_tokens
    # A half-open probe is forgotten once it has outlived any request (its worker died).
    probe_ttl_s = config.server.request_timeout_s + 5
    if redis is None or config.redis is None:
        keys = Keys()
        return Limiter(MemoryStore(), keys, limits, max_tokens, Breakers(keys, config.breaker, probe_ttl_s))
    keys = Keys(config.redis.prefix)
    lease_ms = int(config.redis.slot_lease_s * 1000)
    pipe = RedisPipe(
        config.redis.url.reveal(),
        connect_timeout_s=REDIS_CONNECT_TIMEOUT_S,
        command_timeout_s=REDIS_COMMAND_TIMEOUT_S,
    )
    store: AdmissionStore = RedisStore(pipe, lease_ms)
    share = 1.0 / workers if config.redis.on_failure == "open" else None
    breakers = Breakers(keys, config.breaker, probe_ttl_s)
    return Limiter(store, keys, limits, max_tokens, breakers, fallback_share=share, lease_ms=lease_ms)
