"""Limits: per-tenant concurrency, one API's rate shared by two tasks, one at a time per user."""

import asyncio
import os
import time
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"demo-{uuid.uuid4().hex[:8]}"),
)
running: dict[str, int] = {}
most: dict[str, int] = {}
starts: list[float] = []


async def work(name: str, seconds: float, *_what: object) -> None:
    """Count the runs of ``name`` that go on at once, for the example to print."""
    running[name] = running.get(name, 0) + 1
    most[name] = max(most.get(name, 0), running[name])
    await asyncio.sleep(seconds)
    running[name] -= 1


# --8<-- [start:task]
@broker.task(limit_concurrency=2, deduplication=False)  # at most 2 runs at once
async def resize_image(path: str) -> None:
    await work("resize_image", 0.05, path)


# --8<-- [end:task]


# --8<-- [start:per-tenant]
@broker.task(limit_concurrency=3, limit_key_fields=["tenant_id"], deduplication=False)
async def export_report(tenant_id: int, report: str) -> None:
    await work(f"tenant {tenant_id}", 0.05, report)


# --8<-- [end:per-tenant]


# --8<-- [start:shared-rate]
@broker.task(limit_key="vendor-api", limit_rate="10/s", limit_burst=5, deduplication=False)
async def fetch_invoice(invoice_id: int) -> None:
    starts.append(time.monotonic())
    await work("vendor-api", 0, invoice_id)


@broker.task(limit_key="vendor-api", limit_rate="10/s", limit_burst=5, deduplication=False)
async def push_payment(payment_id: int) -> None:
    starts.append(time.monotonic())
    await work("vendor-api", 0, payment_id)


# --8<-- [end:shared-rate]


# --8<-- [start:one-at-a-time]
@broker.task(limit_concurrency=1, limit_key_fields=["user_id"], deduplication=False)
async def sync_profile(user_id: int, changes: dict[str, str]) -> None:
    await work(f"user {user_id}", 0.02, changes)


# --8<-- [end:one-at-a-time]


async def main() -> None:
    await broker.startup()

    await asyncio.gather(*[resize_image.kiq(f"img{i}.png") for i in range(6)])
    for tenant in (1, 2):
        await asyncio.gather(*[export_report.kiq(tenant, f"r{i}") for i in range(5)])
    await asyncio.gather(
        *[fetch_invoice.kiq(i) for i in range(10)], *[push_payment.kiq(i) for i in range(10)]
    )
    await asyncio.gather(*[sync_profile.kiq(7, {"name": f"v{i}"}) for i in range(4)])
    await broker.wait_all()

    print("resize_image at once, at most:", most["resize_image"])
    print("tenant 1 at once, at most:", most["tenant 1"], "tenant 2:", most["tenant 2"])
    print("user 7 at once, at most:", most["user 7"])
    first = min(starts)
    # A burst of 5, then one every 0.1 s: 14 starts before the second is over.
    in_first_second = sum(1 for s in starts if s - first < 0.95)  # noqa: PLR2004
    print("vendor-api starts:", len(starts), "of which in the first second:", in_first_second)
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
