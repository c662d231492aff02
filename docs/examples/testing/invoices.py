"""The application: a module-level broker, as most taskiq applications have one.

In production ``BROKER=redis`` picks a ListQueueBroker; the tests run the tasks
in their own process on InMemoryBroker, as taskiq's testing guide suggests.
"""

import asyncio
import os

from taskiq import AsyncBroker, InMemoryBroker
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

broker: AsyncBroker = (
    # socket_timeout=None: an idle worker outlives redis-py 8's 5-second read limit.
    ListQueueBroker(REDIS_URL, queue_name="invoices", socket_timeout=None)
    if os.environ.get("BROKER") == "redis"
    else InMemoryBroker()
)
broker.add_middlewares(RedisDeduplicationMiddleware(redis_url=REDIS_URL, key_prefix="invoices"))


@broker.task
async def send_invoice(invoice_id: int) -> str:
    await asyncio.sleep(0.2)  # talking to the mail server
    return f"invoice {invoice_id} sent"
