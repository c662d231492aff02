"""Tightening the time limits of the client built from ``redis_url``."""

import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# --8<-- [start:timeouts]
# The query replaces the 5-second defaults: give up on a reply after 0.5 s, on
# connecting after 1 s, and on waiting for a free connection after 2 s.
url = f"{REDIS_URL}?socket_timeout=0.5&socket_connect_timeout=1&timeout=2"

broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(url, key_prefix=f"myapp-{uuid.uuid4().hex[:8]}"),
)
# --8<-- [end:timeouts]


@broker.task
async def ping() -> str:
    return "pong"


async def main() -> None:
    await broker.startup()
    task = await ping.kiq()
    print((await task.wait_result(timeout=5)).return_value)
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
