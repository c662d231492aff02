"""Fail-open: when Redis fails while taking the lock, send the task anyway."""

import asyncio
import logging
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# --8<-- [start:fail-open]
# Cache warming may run twice now and then; failing to warm the cache may not.
# When Redis does not answer within 0.5 s, the task goes out without a lock,
# and a warning from taskiq_deduplication.middleware says so.
cache_broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(
        redis_url=f"{REDIS_URL}?socket_timeout=0.5",
        key_prefix=f"cache-{uuid.uuid4().hex[:8]}",
        fail_open=True,
    ),
)


@cache_broker.task
async def warm_cache(page: str) -> None:
    print(f"warming the cache of {page}")


# --8<-- [end:fail-open]


async def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    await cache_broker.startup()
    await warm_cache.kiq(page="/")
    await cache_broker.wait_all()
    await cache_broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
