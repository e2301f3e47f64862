"""The public surface, the producer side and the key layout."""

from __future__ import annotations

import asyncio
import re
from importlib import resources

import pytest
from redis.asyncio import Redis

import client
from client import Queue
from client.keys import QueueKeys
from client.scripts import NAMES, source
from tests.harness import RedisServer


def test_public_names_are_pinned() -> None:
    assert client.__all__ == ["Fatal", "NeedsHuman", "Queue", "Retryable", "TaskContext", "Worker"]


async def test_enqueue_stores_a_complete_record(queue: Queue) -> None:
    task_id = await queue.enqueue("summarise", {"url": "u"}, tenant="acme", max_attempts=4)
    task = await queue.get(task_id)
    assert task is not None
    assert (task.id, task.kind, task.status, task.tenant) == (task_id, "summarise", "queued", "acme")
    assert (task.payload, task.attempt, task.max_attempts) == ({"url": "u"}, 0, 4)
    assert (task.steps_done, task.result, task.error, task.history) == ([], None, None, [])
    assert task.usage == {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    assert task.created > 0 and task.updated >= task.created
    assert await queue.redis.xlen(queue.keys.stream) == 1
    assert (await queue.counts())["queued"] == 1


async def test_unknown_task_is_none(queue: Queue) -> None:
    assert await queue.get("nope") is None
    assert await queue.cancel("nope") is None
    assert not await queue.approve("nope")
    assert not await queue.requeue("nope")


async def test_concurrent_enqueues_with_one_key_make_one_task(queue: Queue) -> None:
    ids = await asyncio.gather(*(queue.enqueue("k", {"i": i}, idempotency_key="evt_001") for i in range(20)))
    assert len(set(ids)) == 1
    assert await queue.redis.xlen(queue.keys.stream) == 1
    assert (await queue.counts())["queued"] == 1
    task = await queue.get(ids[0])
    assert task is not None and task.idempotency_key == "evt_001"
    assert await queue.enqueue("k", {}, idempotency_key="evt_002") != ids[0]


async def test_max_attempts_must_be_positive(queue: Queue) -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        await queue.enqueue("k", max_attempts=0)


async def test_queue_needs_a_decoding_client(redis_server: RedisServer) -> None:
    raw = Redis.from_url(redis_server.url)
    try:
        with pytest.raises(ValueError, match="decode_responses"):
            Queue(raw)
    finally:
        await raw.aclose()


@pytest.mark.parametrize("name", ["", "a{b}", "x" * 65, "sp ace"])
def test_queue_names_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match="queue name"):
        QueueKeys(name)


def test_every_key_shares_the_queue_hash_tag() -> None:
    keys = QueueKeys("research")
    built = [keys.stream, keys.delayed, keys.idem, keys.limits, keys.stats, keys.workers, *keys.index]
    built += [keys.task("t"), keys.steps("t"), keys.worker("w"), keys.tenant_slots("acme")]
    assert all(key.startswith("{mgq:research}:") for key in built)


def test_one_script_per_operation_with_keys_only_from_KEYS() -> None:
    files = {p.name[:-4] for p in (resources.files("client") / "lua").iterdir() if p.name.endswith(".lua")}
    assert files - {"_lib"} == set(NAMES)
    for name in NAMES:
        text = source(name)
        # keys come from KEYS; no script builds a key name out of strings
        assert not re.search(r"redis\.call\('\w+', *'", text), name
        assert "redis.call('TIME')" in text


async def test_purge_deletes_finished_tasks_and_frees_their_idempotency_keys(queue: Queue) -> None:
    old = await queue.enqueue("k", {}, idempotency_key="once")
    assert await queue.cancel(old) == "cancelled"  # a queued task is cancelled at once
    waiting = await queue.enqueue("k", {})
    assert await queue.purge(3600) == 0, "nothing is an hour old"
    assert await queue.get(old) is not None

    assert await queue.purge(0) == 1
    assert await queue.get(old) is None
    assert await queue.get(waiting) is not None, "a queued task is never purged"
    assert old not in await queue.redis.zrange(queue.keys.status("cancelled"), 0, -1)
    assert not await queue.redis.exists(queue.keys.task(old), queue.keys.steps(old))
    assert await queue.enqueue("k", {}, idempotency_key="once") != old, "the key may be used again"
    with pytest.raises(ValueError, match="finished"):
        await queue.purge(0, statuses=("queued",))
