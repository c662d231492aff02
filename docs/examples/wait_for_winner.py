"""A rejected caller waits for the task that holds the lock, and gets its result."""

import asyncio
import logging
import os
import uuid

from taskiq import AsyncTaskiqTask
from taskiq.api import run_receiver_task
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
RUN = uuid.uuid4().hex[:8]

# --8<-- [start:broker]
# The result backend is in Redis, so every process sees every task's result.
result_backend: RedisAsyncResultBackend[int] = RedisAsyncResultBackend(
    REDIS_URL, result_ex_time=600
)
broker = (
    # socket_timeout=None keeps an idle worker alive with redis-py 8 (see Getting started).
    ListQueueBroker(REDIS_URL, queue_name=f"winner-{RUN}", socket_timeout=None)
    .with_result_backend(result_backend)
    .with_middlewares(RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"wait-{RUN}"))
)
# --8<-- [end:broker]


@broker.task
async def count_active_users(region: str) -> int:
    await asyncio.sleep(0.5)  # an expensive query
    return 1234 if region == "eu" else 0


# --8<-- [start:wait]
async def active_users(region: str) -> int:
    try:
        task: AsyncTaskiqTask[int] = await count_active_users.kiq(region=region)
    except DuplicateTaskError as err:
        if err.holder_task_id is None:
            raise  # the holder is not a task of ours: nothing to wait for
        # Someone already asked: wait for their answer instead of asking again.
        task = AsyncTaskiqTask(err.holder_task_id, result_backend)
    result = await task.wait_result(timeout=30)
    return result.return_value


# --8<-- [end:wait]


async def main() -> None:
    # The receiver complains when it is stopped, as it is below; that is expected.
    logging.getLogger("taskiq.receiver").setLevel(logging.ERROR)
    await broker.startup()
    worker = asyncio.create_task(run_receiver_task(broker))
    try:
        # Three requests at once; one query runs and all three get its answer.
        answers = await asyncio.gather(*(active_users("eu") for _ in range(3)))
        print(answers)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
