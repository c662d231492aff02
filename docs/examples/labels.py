"""The four labels, set on the task and at the call site."""

import asyncio
import os
import uuid
from collections.abc import Awaitable

from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"demo-{uuid.uuid4().hex[:8]}"),
)


# --8<-- [start:task-level]
@broker.task(deduplication_ttl=60)  # locks of this task live 60 s
async def import_feed(feed_url: str) -> None:
    print(f"importing {feed_url}")
    await asyncio.sleep(0.2)


@broker.task(deduplication_key="nightly-cleanup")  # one lock for all calls
async def nightly_cleanup(older_than_days: int) -> None:
    print(f"deleting what is older than {older_than_days} days")
    await asyncio.sleep(0.2)


@broker.task(deduplication_key_fields=["user_id"])  # only user_id decides
async def send_welcome_email(user_id: int, locale: str) -> None:
    print(f"welcoming user {user_id} in {locale}")
    await asyncio.sleep(0.2)


@broker.task(deduplication=False)  # never deduplicated
async def record_page_view(path: str) -> None:
    print(f"counting a view of {path}")
    await asyncio.sleep(0.2)


# --8<-- [end:task-level]


async def is_sent(send: Awaitable[object]) -> bool:
    """Await a kiq() and say whether the middleware let it through."""
    try:
        await send
    except DuplicateTaskError:
        return False
    return True


async def main() -> None:
    await broker.startup()

    await import_feed.kiq(feed_url="https://example.com/feed")
    again = import_feed.kiq(feed_url="https://example.com/feed")
    print("same feed again:", await is_sent(again))

    await nightly_cleanup.kiq(older_than_days=30)
    print("cleanup with other arguments:", await is_sent(nightly_cleanup.kiq(7)))

    await send_welcome_email.kiq(user_id=1, locale="en")
    other_locale = send_welcome_email.kiq(user_id=1, locale="de")
    print("same user, other locale:", await is_sent(other_locale))

    await record_page_view.kiq(path="/")
    print("page view again:", await is_sent(record_page_view.kiq(path="/")))

    # --8<-- [start:call-level]
    # Labels given at the call site win over the task's own, for this call only.
    slow_feed = import_feed.kicker().with_labels(deduplication_ttl=600)
    await slow_feed.kiq(feed_url="https://slow.example/feed")

    counted_once = record_page_view.kicker().with_labels(deduplication=True)
    await counted_once.kiq(path="/pricing")
    # --8<-- [end:call-level]

    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
