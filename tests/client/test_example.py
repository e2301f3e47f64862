"""The example worker module against a real ``modelgate serve``: the gateway is the model boundary."""

from __future__ import annotations

import httpx

from client import Queue
from client.example import handlers
from tests.client.support import running_worker, wait_status
from tests.conftest import ADMIN_KEY, TENANT_KEY
from tests.harness import Gateway


async def test_the_example_summarises_through_the_gateway(queue: Queue, gateway: Gateway) -> None:
    options = {"gateway_url": f"{gateway.url}/v1", "gateway_key": TENANT_KEY}
    good = await queue.enqueue("summarise", {"text": "Queues hold tasks. Workers run them. " * 20})
    bad = await queue.enqueue("summarise", {"url": "no text"})
    async with running_worker(queue, handlers, **options):
        task = await wait_status(queue, good, "done", "failed", "dead")
        rejected = await wait_status(queue, bad, "failed")
    assert task.status == "done", task.error
    assert isinstance(task.result["summary"], str) and task.result["summary"]
    assert task.usage["requests"] == 1 and task.usage["prompt_tokens"] > 0
    assert rejected.error is not None and "payload must be" in rejected.error
    async with httpx.AsyncClient() as http:
        seen = await http.get(
            f"{gateway.url}/admin/tasks/{good}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
    assert seen.status_code == 200 and seen.json()["requests"] == 1  # accounted to X-Task-Id
