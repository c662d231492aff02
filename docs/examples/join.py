"""A request handler that joins the report already being built instead of failing."""

import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware, kiq_or_join

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"join-{uuid.uuid4().hex[:8]}"),
)


# --8<-- [start:join]
@broker.task(deduplication_key_fields=["user_id"], deduplication_ttl=60)
async def build_report(user_id: int) -> str:
    await asyncio.sleep(0.5)  # an expensive report
    return f"the report of user {user_id}"


async def handle_request(user_id: int, who: str) -> str:
    # A new task, or the one that is already building this user's report.
    handle = await kiq_or_join(build_report, user_id=user_id)
    how = "joined" if handle.joined else "sent"
    result = await handle.wait_result(timeout=30)
    return f"{who} ({how}): {result.return_value}"


# --8<-- [end:join]


async def main() -> None:
    await broker.startup()
    answers = await asyncio.gather(
        handle_request(42, "alice"),
        handle_request(42, "bob"),
        handle_request(42, "carol"),
    )
    print("\n".join(answers))
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
