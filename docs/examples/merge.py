"""A profile sync whose latest call wins while an older one is still queued."""

import asyncio
import logging
import os
import uuid

from taskiq.api import run_receiver_task
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
RUN = uuid.uuid4().hex[:8]
broker = ListQueueBroker(
    REDIS_URL, queue_name=f"merge-{RUN}", socket_timeout=None
).with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"merge-{RUN}"),
)


# --8<-- [start:merge]
@broker.task(
    deduplication_key_fields=["user_id"],
    deduplication_merge="latest",
    deduplication_until="started",  # one running, one queued with the latest data
)
async def sync_profile(user_id: int, fields: list[str]) -> None:
    print(f"syncing user {user_id}: {', '.join(fields)}")
    synced.set()


async def profile_changed(user_id: int, fields: list[str]) -> None:
    # Sent, or merged into a sync still queued: either way it runs with these
    # fields, and kiq() returns its handle. A sync that runs already refuses it.
    await sync_profile.kiq(user_id=user_id, fields=fields)


# --8<-- [end:merge]
synced = asyncio.Event()


async def main() -> None:
    await broker.startup()
    # Three changes while no worker runs: one sync is queued, with the last fields.
    await profile_changed(7, ["name"])
    await profile_changed(7, ["name", "email"])
    await profile_changed(7, ["name", "email", "avatar"])
    print("three changes sent")
    # The receiver complains when it is stopped, as it is below; that is expected.
    logging.getLogger("taskiq.receiver").setLevel(logging.ERROR)
    worker = asyncio.create_task(run_receiver_task(broker))  # a worker, in this process
    try:
        await asyncio.wait_for(synced.wait(), 10)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
