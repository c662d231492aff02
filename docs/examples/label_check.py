"""A typo on a decorator fails the broker's startup, not every kiq in production."""

import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
middleware = RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"myapp-{uuid.uuid4().hex[:8]}")
broker = InMemoryBroker().with_middlewares(middleware)


# --8<-- [start:tasks]
@broker.task(deduplication_key_fields="order_id")  # a name, where a list belongs
async def charge(order_id: str) -> None: ...


@broker.task(deduplication_tll=60)  # a typo
async def digest(user_id: int) -> None: ...


# --8<-- [end:tasks]


async def main() -> None:
    try:
        await middleware.startup()  # what broker.startup() runs, in every process
    except ValueError as err:
        print(f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    asyncio.run(main())
