"""Client processes of the end-to-end tests: ``python -m tests.e2e.client ROLE ...``.

They build the application from ``DEDUP_E2E_CONFIG`` like every other process
and report what they saw to Redis, where the test reads it:

``winner TAG``
    Send ``hold(tag=TAG)``, push its task_id to the ``winner`` report, wait for
    its result and push that to ``winner-result``.
``send-and-exit TAG``
    Send ``hold(tag=TAG)``, push its task_id to ``sent`` and end, as a short
    script does that never calls ``broker.shutdown()``.
``storm INDEX SENDS same|distinct``
    Push INDEX to ``ready``, wait for a token in ``go:INDEX``, then fire SENDS
    concurrent sends at once: all ``hold(tag="storm")``, or each
    ``count(n=...)`` with an ``n`` no other send uses. Push what the sends got
    to ``storm``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import redis
import redis.asyncio
from taskiq import AsyncTaskiqTask

from taskiq_deduplication import DuplicateTaskError
from tests.e2e.app import Config, build_broker

STORM_TAG = "storm"
#: How long a client waits for the test before it gives up.
CLIENT_WAIT = 60


async def winner(config: Config, reports: redis.asyncio.Redis, tag: str) -> None:
    """Send the task that the test's own callers will then find running."""
    broker, tasks = build_broker(config)
    await broker.startup()
    try:
        handle = await tasks.hold.kiq(tag=tag)
        await reports.rpush(config.key("winner"), handle.task_id)
        result = await handle.wait_result(timeout=CLIENT_WAIT)
        await reports.rpush(config.key("winner-result"), json.dumps(result.return_value))
    finally:
        await broker.shutdown()


async def send_and_exit(config: Config, tag: str) -> str:
    """Send a task and return at once, leaving the broker as it is."""
    broker, tasks = build_broker(config)
    await broker.startup()
    handle = await tasks.hold.kiq(tag=tag)
    return handle.task_id


async def storm(
    config: Config, reports: redis.asyncio.Redis, index: int, sends: int, mode: str
) -> None:
    """Fire ``sends`` concurrent sends, all at the moment the test says go."""
    broker, tasks = build_broker(config)
    await broker.startup()
    try:
        await reports.rpush(config.key("ready"), index)
        if await reports.blpop([config.key("go", index)], timeout=CLIENT_WAIT) is None:
            msg = f"storm client {index} was never told to go"
            raise TimeoutError(msg)
        if mode == "same":
            sending = [tasks.hold.kiq(tag=STORM_TAG) for _ in range(sends)]
        else:
            sending = [tasks.count.kiq(n=index * sends + i) for i in range(sends)]
        outcomes = await asyncio.gather(*sending, return_exceptions=True)
    finally:
        await broker.shutdown()
    report: dict[str, list[Any]] = {"accepted": [], "holders": [], "errors": []}
    for outcome in outcomes:
        if isinstance(outcome, AsyncTaskiqTask):
            report["accepted"].append(outcome.task_id)
        elif isinstance(outcome, DuplicateTaskError):
            report["holders"].append(outcome.holder_task_id)
        else:
            report["errors"].append(repr(outcome))
    await reports.rpush(config.key("storm"), json.dumps(report))


async def main(argv: list[str]) -> None:
    """Run the role that ``argv`` names."""
    config = Config.from_env()
    reports = redis.asyncio.Redis.from_url(config.redis_url, decode_responses=True)
    try:
        role, *args = argv
        if role == "winner":
            (tag,) = args
            await winner(config, reports, tag)
        elif role == "storm":
            index, sends, mode = args
            await storm(config, reports, int(index), int(sends), mode)
        else:
            msg = f"unknown role {role!r}"
            raise SystemExit(msg)
    finally:
        await reports.aclose()


def send_and_exit_script(tag: str) -> None:
    """The whole script: ``asyncio.run()`` of a coroutine that sends, then the report."""
    config = Config.from_env()
    task_id = asyncio.run(send_and_exit(config, tag))
    # Reported after the event loop has ended, so that nothing else runs in it.
    with redis.Redis.from_url(config.redis_url) as reports:
        reports.rpush(config.key("sent"), task_id)


if __name__ == "__main__":
    if sys.argv[1] == "send-and-exit":
        send_and_exit_script(*sys.argv[2:])
    else:
        asyncio.run(main(sys.argv[1:]))
