"""A taskiq application with deduplication: a Redis queue, a worker, two sends.

In a real deployment the worker is its own process (``taskiq worker``); here it
runs inside the script so that the whole round trip fits in one file.
"""

import asyncio
import logging
import os
import uuid

from taskiq.api import run_receiver_task
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
RUN = uuid.uuid4().hex[:8]  # the demo's queue and keys are new on every run

# --8<-- [start:broker]
broker = (
    ListQueueBroker(REDIS_URL, queue_name=f"welcome-{RUN}")
    .with_result_backend(RedisAsyncResultBackend(REDIS_URL, result_ex_time=60))
    .with_middlewares(
        RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"welcome-{RUN}"),
    )
)


@broker.task
async def send_welcome_email(user_id: int) -> str:
    await asyncio.sleep(0.3)  # talking to the mail server
    return f"welcome email sent to user {user_id}"


# --8<-- [end:broker]


# --8<-- [start:send]
async def sign_up(user_id: int) -> None:
    try:
        task = await send_welcome_email.kiq(user_id=user_id)
    except DuplicateTaskError:
        print(f"user {user_id}: a welcome email is already on its way")
        return
    result = await task.wait_result(timeout=10)
    print(result.return_value)


# --8<-- [end:send]


async def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    # The receiver complains when it is stopped, as it is below; that is expected.
    logging.getLogger("taskiq.receiver").setLevel(logging.ERROR)
    await broker.startup()
    worker = asyncio.create_task(run_receiver_task(broker))
    try:
        # A double click: the same sign-up twice, at the same time.
        await asyncio.gather(sign_up(user_id=42), sign_up(user_id=42))
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
