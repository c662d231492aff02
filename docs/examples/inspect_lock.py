"""A look at a lock in Redis: its key, its value and its TTL, during and after."""

import asyncio
import math
import os
import uuid

import redis.asyncio
from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"inspect-{uuid.uuid4().hex[:8]}"
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX, default_ttl=60),
)
started = asyncio.Event()
finish = asyncio.Event()


@broker.task
async def resize_image(image_id: int) -> None:
    print(f"resizing image {image_id}")
    started.set()
    await finish.wait()


async def show(client: redis.asyncio.Redis, moment: str) -> None:
    keys = [key async for key in client.scan_iter(match=f"{PREFIX}:*")]
    if not keys:
        print(f"{moment}: no lock")
    for key in keys:
        value, ttl_ms = await client.get(key), await client.pttl(key)
        print(f"{moment}: {key} = {value!r}, expires within {math.ceil(ttl_ms / 1000)} s")


async def main() -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    await broker.startup()
    task = await resize_image.kiq(image_id=5)
    print(f"sent task {task.task_id}")
    await started.wait()
    await asyncio.sleep(0.1)  # the extension to the full TTL goes out in the background
    await show(client, "while it runs")  # "<token> <task_id>", about 60 s left
    finish.set()
    await broker.wait_all()
    await asyncio.sleep(0.1)
    await show(client, "after it ended")
    await broker.shutdown()
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
