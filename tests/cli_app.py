"""A small application for ``taskiq dedup key``: a broker and tasks with deduplication labels.

It reads ``DEDUP_CLI_REDIS_URL`` (or ``REDIS_URL``) and ``DEDUP_CLI_PREFIX`` when
imported, as an app reads its settings, so the command and the test that kicks
its tasks share one Redis and one key prefix. Its tasks wait for ``finish`` so
that their locks stay held.
"""

from __future__ import annotations

import asyncio
import os

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(
        redis_url=os.environ.get("DEDUP_CLI_REDIS_URL")
        or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        key_prefix=os.environ.get("DEDUP_CLI_PREFIX", "cli-app"),
        # Its tasks run while the commands release their locks: no running
        # lease, so that the heartbeat (every 100 s, not every 10) does not
        # take a released lock back before the test looks.
        running_ttl=0,
    )
)
finish = asyncio.Event()


@broker.task(task_name="reports.monthly")
async def monthly_report(month: str, *, pages: int = 1) -> None:
    await finish.wait()


@broker.task(task_name="users.sync", deduplication_key_fields=["user_id"], deduplication_ttl=60)
async def sync_user(user_id: int, reason: str = "") -> None:
    await finish.wait()


@broker.task(task_name="nightly", deduplication_key="nightly-run")
async def nightly() -> None:
    await finish.wait()


@broker.task(task_name="ping", deduplication=False)
async def ping() -> None:
    await finish.wait()


@broker.task  # named as taskiq names it: tests.cli_app:build_report
async def build_report(user_id: int) -> None:
    await finish.wait()


# One function's name for two tasks, as two modules of an app can have it.
@broker.task(task_name="shop.exports:export")
async def export() -> None:
    await finish.wait()


@broker.task(task_name="shop:export")
async def export_all() -> None:
    await finish.wait()


not_a_broker = "just a string"
