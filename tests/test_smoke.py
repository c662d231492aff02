from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio

from taskiq_deduplication import DuplicateTaskError


async def test_duplicate_rejected_then_accepted_after_completion(
    make_broker: Any, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker()
    release = asyncio.Event()

    @broker.task
    async def work(x: int) -> int:
        await release.wait()
        return x

    first = await work.kiq(x=1)
    with pytest.raises(DuplicateTaskError) as caught:
        await work.kiq(x=1)
    assert caught.value.holder_task_id == first.task_id
    release.set()
    assert (await first.wait_result(timeout=5)).return_value == 1
    assert await redis_client.keys(f"{prefix}:*") == []
    await work.kiq(x=1)
