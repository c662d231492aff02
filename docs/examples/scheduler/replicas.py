"""A nightly report and a cache refresh, with as many schedulers as you like.

Start ``taskiq scheduler replicas:scheduler`` (or ``replicas:taskiq_scheduler``)
in this folder on two machines, or twice on one: each tick goes out once. The
worker is ``taskiq worker replicas:broker``.
"""

import os

from taskiq import TaskiqScheduler
from taskiq.schedule_sources import LabelScheduleSource
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import (
    DeduplicatedScheduleSource,
    DeduplicationScheduler,
    RedisDeduplicationMiddleware,
)

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

dedup = RedisDeduplicationMiddleware(redis_url=REDIS_URL, key_prefix="replicas:dedup")
# socket_timeout=None: an idle worker outlives redis-py 8's 5-second read limit.
broker = ListQueueBroker(REDIS_URL, queue_name="replicas", socket_timeout=None).with_middlewares(
    dedup
)


@broker.task(schedule=[{"cron": "0 6 * * *", "cron_offset": "Europe/Paris"}])
async def build_nightly_report() -> None:
    """Once a day at 06:00 in Paris: one run, however many schedulers tick."""


@broker.task(schedule=[{"interval": 30}])
async def refresh_prices() -> None:
    """Every 30 seconds: at most one run per 30 seconds across the schedulers."""


# Either a DeduplicationScheduler: every tick takes its tick lock, and a tick
# that the task's own lock refuses is one INFO line.
scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])

# Or taskiq's own scheduler, with each source wrapped.
taskiq_scheduler = TaskiqScheduler(
    broker, sources=[DeduplicatedScheduleSource(LabelScheduleSource(broker), dedup)]
)
