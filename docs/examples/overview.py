import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

redis_url = os.environ.get("REDIS_URL", "redis://localhost:6379")
prefix = f"demo-{uuid.uuid4().hex[:8]}"  # a fresh namespace for each run
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(redis_url, key_prefix=prefix),
)


@broker.task
async def rebuild_report(account_id: int) -> None:
    print(f"rebuilding the report of account {account_id}")
    await asyncio.sleep(0.5)  # slow work: a second request arrives meanwhile


async def main() -> None:
    await broker.startup()
    await rebuild_report.kiq(account_id=7)  # takes the lock, then runs
    try:
        await rebuild_report.kiq(account_id=7)  # the same call, while it runs
    except DuplicateTaskError as err:
        print(f"not sent: {err}")
    await rebuild_report.kiq(account_id=8)  # other arguments: another lock
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
