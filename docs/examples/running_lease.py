"""A running lease: the full TTL while a task is queued, a short one while it runs."""

import asyncio
import os
import uuid

import redis.asyncio
from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"lease-{uuid.uuid4().hex[:8]}"

# --8<-- [start:lease]
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(
        redis_url=REDIS_URL,
        key_prefix=PREFIX,
        default_ttl=300,  # while queued
        running_ttl=15,  # while running: refreshed every 5 s, gone 15 s after a crash
    ),
)
# --8<-- [end:lease]

redis_client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)


async def seconds_left() -> float:
    keys = [key async for key in redis_client.scan_iter(match=f"{PREFIX}:*")]
    return await redis_client.pttl(keys[0]) / 1000 if keys else 0.0


@broker.task
async def import_orders() -> None:
    print(f"running: the lock has at most {await seconds_left():.0f} s left")


async def main() -> None:
    await broker.startup()
    task = await import_orders.kiq()
    await task.wait_result(timeout=5)
    print(f"ended: the lock has {await seconds_left():.0f} s left (released)")
    await broker.shutdown()
    await redis_client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
