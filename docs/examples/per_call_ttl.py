"""Choosing the lock TTL for one call, at the call site."""

import asyncio
import math
import os
import uuid

import redis.asyncio
from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"myapp-{uuid.uuid4().hex[:8]}"
broker = InMemoryBroker().with_middlewares(
    # Without the heartbeat, the TTL is all that keeps a lock while its task runs.
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX, default_ttl=300, heartbeat=False),
)


@broker.task
async def export_table(table: str) -> None:
    print(f"exporting {table}")
    await asyncio.sleep(0.5)


async def show_ttl(client: redis.asyncio.Redis, what: str) -> None:
    await asyncio.sleep(0.1)  # the extension to the full TTL is sent in the background
    async for key in client.scan_iter(match=f"{PREFIX}:*"):
        print(f"{what}: lock expires within {math.ceil(await client.pttl(key) / 1000)} s")


async def main() -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    await broker.startup()

    await export_table.kiq(table="orders")
    await show_ttl(client, "default_ttl")
    await broker.wait_all()

    # --8<-- [start:ttl]
    # This one export may take an hour: give its lock a longer safety net.
    hourly = export_table.kicker().with_labels(deduplication_ttl=3600)
    await hourly.kiq(table="orders")
    # --8<-- [end:ttl]
    await show_ttl(client, "deduplication_ttl=3600")
    await broker.wait_all()

    await broker.shutdown()
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
