"""A report that takes longer to build than the interval between its ticks.

Run the scheduler with ``taskiq scheduler reports:scheduler`` in this folder, and
a worker with ``taskiq worker reports:broker``.
"""

import asyncio
import os

from taskiq import TaskiqEvents, TaskiqState
from taskiq.schedule_sources import LabelScheduleSource
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import DeduplicationScheduler, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# socket_timeout=None: an idle worker outlives redis-py 8's 5-second read limit.
broker = ListQueueBroker(REDIS_URL, queue_name="reports", socket_timeout=None).with_middlewares(
    RedisDeduplicationMiddleware(redis_url=REDIS_URL, key_prefix="reports:dedup"),
)


async def wake_every_second() -> None:
    while True:  # noqa: ASYNC110 (waking the loop up is the point, there is no event)
        await asyncio.sleep(1)


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def stop_at_the_first_signal(state: TaskiqState) -> None:
    # An idle worker sees SIGTERM only when its event loop wakes up (see Deploying).
    state.waker = asyncio.create_task(wake_every_second())


@broker.task(schedule=[{"interval": 1, "schedule_id": "sales-report"}])
async def build_sales_report() -> None:
    await asyncio.sleep(5)  # longer than the interval: the next ticks are duplicates


# In place of TaskiqScheduler: a refused tick is one INFO line, not a traceback.
scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])
