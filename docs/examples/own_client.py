"""Handing the middleware a Redis client of your own instead of a URL."""

import asyncio
import os
import uuid

from redis.asyncio import Redis
from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# --8<-- [start:client]
# Any redis.asyncio Redis or RedisCluster client, with settings of your choice.
client = Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)

broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(client=client, key_prefix=f"app-{uuid.uuid4().hex}"),
)
# --8<-- [end:client]


@broker.task
async def ping() -> str:
    return "pong"


async def main() -> None:
    await broker.startup()
    task = await ping.kiq()
    print((await task.wait_result(timeout=5)).return_value)
    await broker.shutdown()
    await client.aclose()  # the middleware leaves a client it was given open


if __name__ == "__main__":
    asyncio.run(main())
