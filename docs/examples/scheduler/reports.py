"""A report that takes longer to build than the interval between its ticks.

Run the scheduler with ``taskiq scheduler reports:scheduler`` in this folder, and
a worker with ``taskiq worker reports:broker``.
"""

import asyncio
import os

from taskiq.schedule_sources import LabelScheduleSource
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import DeduplicationScheduler, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

broker = ListQueueBroker(REDIS_URL, queue_name="reports").with_middlewares(
    RedisDeduplicationMiddleware(redis_url=REDIS_URL, key_prefix="reports:dedup"),
)


@broker.task(schedule=[{"interval": 1, "schedule_id": "sales-report"}])
async def build_sales_report() -> None:
    await asyncio.sleep(5)  # longer than the interval: the next ticks are duplicates


# In place of TaskiqScheduler: a refused tick is one INFO line, not a traceback.
scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])
