"""Retries by taskiq's retry middlewares, before and after the deduplication one.

A retry re-sends the same task_id from inside the worker. It must keep the lock
(it is the same task, not a duplicate of itself) while every other send of the
same call is rejected, at any moment between the first attempt and the last.
When the last attempt ends, successful or not, the lock is gone for good. The
same holds when ``taskiq scheduler`` sends the retry later, from a schedule source.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from taskiq import AsyncTaskiqTask

from tests.e2e.app import MAX_ATTEMPTS
from tests.e2e.conftest import App, Launch

RETRY_SETUPS = ["smart-first", "smart-last", "simple-first", "simple-last"]


async def _drive(app: App, handle: AsyncTaskiqTask[Any], tag: str, failures: int) -> None:
    """Let each attempt of ``tag`` run to its end, sending duplicates all along."""
    flaky = app.tasks.flaky

    async def rejected() -> None:
        await app.assert_duplicate(flaky, handle.task_id, tag=tag, failures=failures)

    for attempt in range(1, MAX_ATTEMPTS + 1):
        await app.wait_started(tag, attempt)
        await rejected()  # while the attempt runs
        await app.open_gate(tag)
        if attempt == MAX_ATTEMPTS:
            break

        async def next_attempt_started(attempt: int = attempt) -> bool:
            # Between two attempts: the failed one ends, the retry is queued,
            # then taken by a worker. A duplicate is rejected throughout.
            await rejected()
            return len(await app.started(tag)) > attempt

        await app.wait_until(next_attempt_started, f"attempt {attempt + 1} of {tag!r}")


@pytest.mark.parametrize("retry", RETRY_SETUPS)
async def test_retried_task_holds_its_lock_until_the_last_attempt(
    launch: Launch, broker_kind: str, retry: str
) -> None:
    app = await launch(broker=broker_kind, retry=retry)
    flaky = app.tasks.flaky
    # "twice" fails twice, then succeeds; "always" fails until retries run out.
    twice = await flaky.kiq(tag="twice", failures=MAX_ATTEMPTS - 1)
    always = await flaky.kiq(tag="always", failures=99)
    await app.assert_duplicate(flaky, twice.task_id, tag="twice", failures=MAX_ATTEMPTS - 1)
    await app.assert_duplicate(flaky, always.task_id, tag="always", failures=99)

    app.start_worker()
    await asyncio.gather(
        _drive(app, twice, "twice", MAX_ATTEMPTS - 1),
        _drive(app, always, "always", 99),
    )

    succeeded = await twice.wait_result(timeout=20)
    assert succeeded.return_value == f"twice succeeded on run {MAX_ATTEMPTS}"
    exhausted = await always.wait_result(timeout=20)
    assert exhausted.is_err
    assert await app.runs("twice") == MAX_ATTEMPTS
    assert await app.runs("always") == MAX_ATTEMPTS
    assert {run["task_id"] for run in await app.started("twice")} == {twice.task_id}

    # Both locks are gone, and no heartbeat of an earlier attempt brings one back.
    assert await app.locks() == {}
    assert app.config.heartbeat_interval is not None
    await app.assert_no_locks_for(2 * app.config.heartbeat_interval)
    again = await flaky.kiq(tag="twice", failures=0)
    await app.open_gate("twice")
    assert not (await again.wait_result(timeout=20)).is_err


async def test_retry_sent_later_by_the_scheduler_keeps_the_lock_between_attempts(
    launch: Launch,
) -> None:
    # SmartRetryMiddleware(schedule_source=...) is how retries get a real delay on
    # brokers that ignore the "delay" label (the Redis ones, NATS): the worker puts
    # the retry in the schedule source, and `taskiq scheduler` sends it when due.
    app = await launch(broker="redis-list", retry="smart-source-first")
    flaky = app.tasks.flaky
    handle = await flaky.kiq(tag="f", failures=1)
    app.start_worker()
    app.start_scheduler("--update-interval", "1")
    await app.wait_started("f")
    await app.open_gate("f")  # the first attempt fails; its retry is due in 1 s

    async def retry_started() -> bool:
        await app.assert_duplicate(flaky, handle.task_id, tag="f", failures=1)
        return len(await app.started("f")) >= 2

    await app.wait_until(retry_started, "the retry to start")
    await app.open_gate("f")
    assert (await handle.wait_result(timeout=20)).return_value == "f succeeded on run 2"
    assert await app.locks() == {}
