"""The application's tasks: the module that the worker and the senders import.

Start a worker from this directory with ``taskiq worker tasks:broker``, then send
it tasks with ``python send.py``.
"""

import asyncio
import os

from taskiq import TaskiqEvents, TaskiqState
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# --8<-- [start:broker]
broker = (
    ListQueueBroker(
        REDIS_URL,
        queue_name="welcome",
        # redis-py 8 gives up on a reply after 5 s, and an idle worker waits longer
        # than that for its next message: without this line it dies (see below).
        socket_timeout=None,
    )
    .with_result_backend(RedisAsyncResultBackend(REDIS_URL, result_ex_time=60))
    .with_middlewares(RedisDeduplicationMiddleware(REDIS_URL))
)


@broker.task
async def send_welcome_email(user_id: int) -> str:
    await asyncio.sleep(0.3)  # talking to the mail server
    return f"welcome email sent to user {user_id}"


# --8<-- [end:broker]


# --8<-- [start:wake]
async def wake_every_second() -> None:
    while True:  # noqa: ASYNC110 (waking the loop up is the point, there is no event)
        await asyncio.sleep(1)


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def stop_at_the_first_signal(state: TaskiqState) -> None:
    # An idle worker sees SIGTERM only when its event loop wakes up (see Deploying).
    state.waker = asyncio.create_task(wake_every_second())


# --8<-- [end:wake]
