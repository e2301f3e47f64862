"""Where admin changes to tenants and keys live: Redis when configured, else process memory.

Three hashes and a version counter, all under the deployment's hash tag:

- ``tenants``: tenant name → JSON of the fields the admin API set, and a fingerprint of the
  file's values for that tenant at the time (file changes win over older admin changes);
- ``keys``: SHA-256 of a key → JSON ``{tenant, key_id}`` for keys made through the admin API;
- ``revoked``: SHA-256 of a key → key id, for revoked keys (from the file or the API);
- ``version``: bumped by every change, in the same transaction, so each worker can see that
  something changed with one cheap read and reload only then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as aioredis

from policies.keys import Keys


@dataclass(slots=True)
class StoredState:
    version: int = 0
    tenants: dict[str, bytes] = field(default_factory=dict)
    keys: dict[str, bytes] = field(default_factory=dict)
    revoked: dict[str, bytes] = field(default_factory=dict)


class TenantStore(Protocol):
    async def version(self) -> int: ...

    async def load(self) -> StoredState: ...

    async def put_tenant(self, name: str, doc: bytes) -> None: ...

    async def put_key(self, key_hash: str, doc: bytes) -> None: ...

    async def revoke(self, key_hash: str, key_id: str) -> None: ...


class MemoryTenantStore:
    """Dev mode: admin changes last as long as the process."""

    def __init__(self) -> None:
        self.state = StoredState()

    async def version(self) -> int:
        return self.state.version

    async def load(self) -> StoredState:
        s = self.state
        return StoredState(s.version, dict(s.tenants), dict(s.keys), dict(s.revoked))

    async def put_tenant(self, name: str, doc: bytes) -> None:
        self.state.tenants[name] = doc
        self.state.version += 1

    async def put_key(self, key_hash: str, doc: bytes) -> None:
        self.state.keys[key_hash] = doc
        self.state.version += 1

    async def revoke(self, key_hash: str, key_id: str) -> None:
        self.state.keys.pop(key_hash, None)
        self.state.revoked[key_hash] = key_id.encode()
        self.state.version += 1


class RedisTenantStore:
    """Shared by every worker of every instance; each change is one MULTI/EXEC transaction."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._client = client
        tag = keys.tag
        self._tenants, self._keys, self._revoked = f"{tag}:tenants", f"{tag}:keys", f"{tag}:revoked"
        self._version = f"{tag}:tenants:version"

    async def version(self) -> int:
        value = await self._client.get(self._version)
        return int(value or 0)

    async def load(self) -> StoredState:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.get(self._version)
            pipe.hgetall(self._tenants)
            pipe.hgetall(self._keys)
            pipe.hgetall(self._revoked)
            version, tenants, keys, revoked = await pipe.execute()
        return StoredState(int(version or 0), _texts(tenants), _texts(keys), _texts(revoked))

    async def put_tenant(self, name: str, doc: bytes) -> None:
        await self._change(lambda pipe: pipe.hset(self._tenants, name, doc))

    async def put_key(self, key_hash: str, doc: bytes) -> None:
        await self._change(lambda pipe: pipe.hset(self._keys, key_hash, doc))

    async def revoke(self, key_hash: str, key_id: str) -> None:
        def change(pipe: aioredis.client.Pipeline) -> None:
            pipe.hdel(self._keys, key_hash)
            pipe.hset(self._revoked, key_hash, key_id)

        await self._change(change)

    async def _change(self, write: object) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            write(pipe)  # type: ignore[operator]
            pipe.incr(self._version)
            await pipe.execute()


def _texts(fields: dict[bytes | str, bytes]) -> dict[str, bytes]:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
