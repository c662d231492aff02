"""An application whose broker is a module-level ListQueueBroker, run by a worker."""

import asyncio
import os

from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

broker = (
    ListQueueBroker(REDIS_URL, queue_name="shop", socket_timeout=None)
    .with_result_backend(RedisAsyncResultBackend(REDIS_URL, result_ex_time=60))
    .with_middlewares(
        RedisDeduplicationMiddleware(redis_url=REDIS_URL, key_prefix="shop", default_ttl=60),
    )
)


@broker.task
async def ship_order(order_id: int) -> str:
    await asyncio.sleep(0.5)  # talking to the carrier
    return f"order {order_id} shipped"
