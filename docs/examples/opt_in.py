"""Opt-in mode: nothing is deduplicated unless the task asks for it."""

import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

# --8<-- [start:opt-in]
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(
        redis_url=REDIS_URL,
        key_prefix=f"myapp-{uuid.uuid4().hex[:8]}",
        default_deduplication=False,  # tasks run as usual unless they opt in
    ),
)


@broker.task  # not deduplicated: every kiq() is sent
async def log_event(name: str) -> None:
    print(f"event {name}")


@broker.task(deduplication=True)  # opted in: one at a time per set of arguments
async def resize_image(image_id: int) -> None:
    print(f"resizing image {image_id}")
    await asyncio.sleep(0.2)


# --8<-- [end:opt-in]


async def main() -> None:
    await broker.startup()
    await log_event.kiq(name="signup")
    await log_event.kiq(name="signup")  # sent again: log_event did not opt in
    await resize_image.kiq(image_id=5)
    try:
        await resize_image.kiq(image_id=5)
    except DuplicateTaskError:
        print("image 5 is already being resized")
    # --8<-- [start:call-site]
    digest = log_event.kicker().with_labels(deduplication=True)
    await digest.kiq(name="daily-digest")
    # --8<-- [end:call-site]
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
