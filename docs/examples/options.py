"""Every option of the middleware, set to a value other than its default."""

import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# --8<-- [start:options]
middleware = RedisDeduplicationMiddleware(
    redis_url=REDIS_URL,
    default_deduplication=True,  # every task is deduplicated unless it opts out
    default_ttl=60,  # locks live 60 s unless a heartbeat keeps them alive
    key_prefix=f"myapp-{uuid.uuid4().hex[:8]}",  # the start of every lock key
    startup_retries=5,  # PING Redis up to 5 times when the broker starts
    startup_retry_delay=0.5,  # wait 0.5 s, 1 s, 2 s, 4 s between those attempts
    heartbeat=True,  # refresh the lock while the task runs
    heartbeat_interval=15,  # every 15 s (by default, a third of the TTL)
    fail_open=False,  # if Redis fails while taking the lock, kiq() raises
)
broker = InMemoryBroker().with_middlewares(middleware)
# --8<-- [end:options]


@broker.task
async def ping() -> str:
    return "pong"


async def main() -> None:
    await broker.startup()
    task = await ping.kiq()
    result = await task.wait_result(timeout=5)
    print(result.return_value)
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
