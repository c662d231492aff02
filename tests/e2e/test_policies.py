"""Each lock policy end to end, with ``taskiq worker`` processes on every broker.

What a second identical call gets while the first one is in each state, as the
policies' table says ("remembered" is "finished" with a success TTL; plain
"finished" is the rest of the suite's)::

    the first call is ...   finished  remembered             started   expired
    queued                  refused   refused                refused   refused
    running                 refused   refused                accepted  refused
    finished successfully   accepted  refused (success TTL)  accepted  refused
    failed                  accepted  accepted               accepted  refused
    after its TTL           accepted  accepted               accepted  accepted

One test walks each policy's column on one worker, the policies side by side.
A worker with a single slot shows what "started" does with a copy that waits
in the queue while another runs, a retry among them. Then workers killed
mid-task, and ``taskiq scheduler`` ticks. Retries in both middleware orders are
in ``test_retries.py``, for every policy.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from taskiq import AsyncTaskiqTask

from tests.e2e.app import EXPIRED_TTL, SUCCESS_TTL, scheduled_name
from tests.e2e.conftest import App, Launch, Process, is_alive

#: A worker that runs one task at a time: what it does not run waits in the queue.
ONE_SLOT = ("--workers", "1", "--max-async-tasks", "1")
#: The ``deduplication_ttl`` of the "expired" task that a crash interrupts.
CRASH_TTL = 3


async def _ok(handle: AsyncTaskiqTask[Any]) -> Any:
    result = await handle.wait_result(timeout=20)
    assert not result.is_err, result.error
    return result.return_value


async def _failed(handle: AsyncTaskiqTask[Any]) -> None:
    result = await handle.wait_result(timeout=20)
    assert result.is_err


# The table, column by column


async def _remembered_success(app: App, first: AsyncTaskiqTask[Any], key: str) -> None:
    hold = app.tasks.hold_by_policy["remembered"]
    await app.wait_started("remembered")
    await app.assert_duplicate(hold, first.task_id, tag="remembered")  # running
    await app.open_gate("remembered")
    value = await _ok(first)

    # Finished successfully: refused for the success TTL, naming the finished
    # task, whose result the refused caller reads from the result backend.
    refused = await app.assert_duplicate(hold, first.task_id, tag="remembered")
    assert 0 < await app.redis.pttl(key) <= SUCCESS_TTL * 1000
    assert refused.holder_task_id is not None
    holder = AsyncTaskiqTask(refused.holder_task_id, app.broker.result_backend)
    assert (await holder.wait_result(timeout=5)).return_value == value

    await app.watch_expire(key, SUCCESS_TTL)  # nothing refreshes it
    again = await hold.kiq(tag="remembered")  # after the success TTL: accepted
    await app.open_gate("remembered")
    assert (await _ok(again))["run"] == 2


async def _remembered_failure(app: App) -> None:
    flaky = app.tasks.flaky_by_policy["remembered"]  # no retry middleware: one run
    failing = await flaky.kiq(tag="remembered-f", failures=1)
    await app.wait_started("remembered-f")
    await app.assert_duplicate(flaky, failing.task_id, tag="remembered-f", failures=1)
    await app.open_gate("remembered-f")
    await _failed(failing)
    # Failed: released at once, so a corrected call goes through.
    assert await app.lock_of(failing.task_id) is None
    corrected = await flaky.kiq(tag="remembered-f", failures=1)
    await app.open_gate("remembered-f")
    assert await _ok(corrected) == "remembered-f succeeded on run 2"


async def _started(app: App, first: AsyncTaskiqTask[Any], key: str) -> None:
    hold = app.tasks.hold_by_policy["started"]
    await app.wait_started("started")
    assert key not in await app.locks()  # released when the run started
    second = await hold.kiq(tag="started")  # running: accepted
    # The first run is let finish before the second may: a worker that takes
    # the second while the first runs makes it wait for the first (issue 19).
    await app.open_gate("started")
    await _ok(first)
    await app.wait_started("started", runs=2)
    await app.open_gate("started")
    await _ok(second)
    third = await hold.kiq(tag="started")  # finished: accepted
    await app.open_gate("started")
    assert (await _ok(third))["run"] == 3

    flaky = app.tasks.flaky_by_policy["started"]
    failing = await flaky.kiq(tag="started-f", failures=1)
    await app.open_gate("started-f")
    await _failed(failing)
    corrected = await flaky.kiq(tag="started-f", failures=1)  # failed: accepted
    await app.open_gate("started-f")
    await _ok(corrected)


async def _expired(app: App, first: AsyncTaskiqTask[Any]) -> None:
    await app.wait_started("expired")  # the one sent before the worker started
    await app.open_gate("expired")
    await _ok(first)

    # A window that begins now that a worker runs: one call succeeds, one fails.
    hold, flaky = app.tasks.hold_by_policy["expired"], app.tasks.flaky_by_policy["expired"]
    calls: list[tuple[Any, dict[str, Any]]] = [
        (hold, {"tag": "expired-s"}),
        (flaky, {"tag": "expired-f", "failures": 1}),
    ]
    handles = [await task.kiq(**kwargs) for task, kwargs in calls]
    values = {}
    for handle in handles:
        key = await app.lock_of(handle.task_id)
        assert key is not None
        assert 0 < await app.redis.pttl(key) <= EXPIRED_TTL * 1000
        values[key] = (await app.locks())[key]
    await app.wait_started("expired-s")
    await app.wait_started("expired-f")
    for (task, kwargs), handle in zip(calls, handles, strict=True):
        await app.assert_duplicate(task, handle.task_id, **kwargs)  # running
    await app.open_gate("expired-s")
    await app.open_gate("expired-f")
    await _ok(handles[0])
    await _failed(handles[1])
    # Finished, successfully or not: refused still, the lock exactly as the send
    # left it (neither released nor refreshed by the run) until its TTL.
    for (task, kwargs), handle in zip(calls, handles, strict=True):
        await app.assert_duplicate(task, handle.task_id, **kwargs)
    locks = await app.locks()
    assert {key: locks.get(key) for key in values} == values
    await asyncio.gather(*(app.watch_expire(key, EXPIRED_TTL) for key in values))
    again = [await task.kiq(**kwargs) for task, kwargs in calls]  # after the TTL: accepted
    await app.open_gate("expired-s")
    await app.open_gate("expired-f")
    for handle in again:
        await _ok(handle)


async def test_each_policy_refuses_exactly_what_its_table_says(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind)
    hold = app.tasks.hold_by_policy
    # Queued, before any worker runs: every policy refuses a second call.
    first = {}
    keys = {}
    for policy in ("remembered", "started", "expired"):
        first[policy] = await hold[policy].kiq(tag=policy)
        await app.assert_duplicate(hold[policy], first[policy].task_id, tag=policy)
        key = await app.lock_of(first[policy].task_id)
        assert key is not None
        keys[policy] = key

    app.start_worker()
    await asyncio.gather(
        _remembered_success(app, first["remembered"], keys["remembered"]),
        _remembered_failure(app),
        _started(app, first["started"], keys["started"]),
        _expired(app, first["expired"]),
    )


# "started": one queued copy at most


@pytest.mark.parametrize(
    ("broker", "retry"),
    # Each broker once, each retry setup once.
    [
        ("redis-list", "simple-first"),
        ("redis-stream", "smart-last"),
        ("rabbitmq", "smart-first"),
        ("nats", "simple-last"),
    ],
)
async def test_started_policy_keeps_one_queued_copy_and_never_refuses_a_retry(
    launch: Launch, broker: str, retry: str
) -> None:
    app = await launch(broker=broker, retry=retry)
    hold, flaky = app.tasks.hold_by_policy["started"], app.tasks.flaky_by_policy["started"]
    worker = app.start_worker(*ONE_SLOT)

    # A copy queued while the first attempt runs holds the lock: the attempt's
    # retry goes out without one, neither refused nor lost.
    first = await flaky.kiq(tag="f", failures=1)
    await app.wait_started("f")
    assert await app.locks() == {}
    copy = await flaky.kiq(tag="f", failures=1)  # running: accepted, and waits
    await app.assert_duplicate(flaky, copy.task_id, tag="f", failures=1)  # queued: refused
    await app.open_gate("f")  # the first attempt fails
    await app.wait_started("f", runs=2)
    await app.open_gate("f", runs=2)
    await _ok(copy)
    await _ok(first)
    runs = [run["task_id"] for run in await app.started("f")]
    assert sorted(runs) == sorted([first.task_id, first.task_id, copy.task_id])
    assert "sent without a lock" in worker.log()
    assert await app.locks() == {}

    # A retry that finds the lock free takes it, and holds it while it waits
    # (behind another task here); its run releases it.
    retried = await flaky.kiq(tag="r", failures=1)
    await app.wait_started("r")
    blocker = await hold.kiq(tag="blocker")
    await app.open_gate("r")  # the first attempt fails; its retry queues behind

    async def retry_holds_the_lock() -> bool:
        return await app.lock_of(retried.task_id) is not None

    await app.wait_until(retry_holds_the_lock, "the retry to take the lock")
    await app.wait_started("blocker")
    await app.assert_duplicate(flaky, retried.task_id, tag="r", failures=1)

    # Queued past its TTL, a copy's lock is gone: another copy is accepted.
    short = await hold.kicker().with_labels(deduplication_ttl=2).kiq(tag="t")
    key = await app.lock_of(short.task_id)
    assert key is not None
    await app.watch_expire(key, 2)
    longer = await hold.kiq(tag="t")

    # A retry with a delay (SmartRetryMiddleware on RabbitMQ) may queue behind these.
    await app.open_gate("blocker")
    await app.open_gate("t", runs=2)
    await app.wait_started("r", runs=2)
    assert await app.lock_of(retried.task_id) is None
    await app.open_gate("r")
    for handle in (blocker, short, longer):
        await _ok(handle)
    assert await _ok(retried) == "r succeeded on run 2"
    assert await app.locks() == {}


# Crashes


async def test_killed_worker_leaves_no_started_lock_and_the_expired_window_as_it_was(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind)
    started, expired = app.tasks.hold_by_policy["started"], app.tasks.hold_by_policy["expired"]
    running = await started.kiq(tag="ks")
    app.start_worker()
    [run_started] = await app.wait_started("ks")
    # Sent once a worker runs, so that the window is all ahead; a short one.
    window = await expired.kicker().with_labels(deduplication_ttl=CRASH_TTL).kiq(tag="ke")
    [run_expired] = await app.wait_started("ke")
    key = await app.lock_of(window.task_id)
    assert key is not None
    assert await app.lock_of(running.task_id) is None

    pids = {run_started["pid"], run_expired["pid"]}
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        return not any(is_alive(pid) for pid in pids)

    await app.wait_until(dead, "the worker processes to die")
    # "started" held no lock while running: the same call goes at once.
    again_started = await started.kiq(tag="ks")
    # "expired": the window is the send's, and ends on its TTL, refreshed by nobody.
    assert (await app.holders()).get(key) == window.task_id
    await app.assert_duplicate(expired, window.task_id, tag="ke")
    await app.watch_expire(key, CRASH_TTL)
    again_expired = await expired.kiq(tag="ke")

    # RabbitMQ redelivers the killed runs: a token each for them too.
    await app.open_gate("ks", runs=2)
    await app.open_gate("ke", runs=2)
    await _ok(again_started)
    await _ok(again_expired)


# taskiq scheduler


def _refusals(scheduler: Process, holder: str) -> int:
    """How many ticks the scheduler did not send because ``holder`` held the lock."""
    return sum(
        "not sent" in line and f"duplicate of task {holder}" in line
        for line in scheduler.log().splitlines()
    )


async def test_scheduled_started_task_queues_one_copy_while_it_runs(launch: Launch) -> None:
    app = await launch(broker="rabbitmq", schedule="random-id", scheduled_policies="started")
    name = scheduled_name("started")
    app.start_worker(*ONE_SLOT)
    scheduler = app.start_scheduler()
    [first] = await app.wait_started(name)

    async def queued_copy() -> str | None:
        holders = set((await app.holders()).values()) - {first["task_id"]}
        assert await app.counter("finished", name) == 0, "no tick was queued during run 1"
        return holders.pop() if holders else None

    # A tick while the first run runs is accepted, and waits in the queue...
    copy = await app.wait_until(queued_copy, "a tick to be queued while the first run runs")
    assert copy is not None

    # ...where it refuses the ticks after it.
    async def refused() -> bool:
        return _refusals(scheduler, copy) > 0

    await app.wait_until(refused, "a tick to be refused while the copy waits")
    second = (await app.wait_started(name, runs=2))[1]
    assert second["task_id"] == copy
    assert await app.counter("overlaps", name) == 0


async def test_scheduled_ticks_after_a_run_are_refused_for_its_window(launch: Launch) -> None:
    # "expired": the window is EXPIRED_TTL from the send; "remembered": SUCCESS_TTL
    # from the end of the run. Both outlive the one-second run.
    app = await launch(
        broker="nats",
        schedule="random-id",
        scheduled_policies="expired,remembered",
        scheduled_run_seconds=1,
    )
    app.start_worker()
    scheduler = app.start_scheduler()

    async def window(policy: str) -> None:
        name = scheduled_name(policy)
        [first] = await app.wait_started(name)

        async def finished() -> bool:
            return await app.counter("finished", name) >= 1

        await app.wait_until(finished, f"the first {policy} run to finish")
        before = _refusals(scheduler, first["task_id"])

        async def refused_after_the_run() -> bool:
            return _refusals(scheduler, first["task_id"]) > before

        await app.wait_until(refused_after_the_run, f"a tick refused after the {policy} run")
        second = (await app.wait_started(name, runs=2))[1]  # the window ended
        assert second["task_id"] != first["task_id"]
        assert await app.counter("overlaps", name) == 0

    await asyncio.gather(window("expired"), window("remembered"))
    assert scheduler.popen.poll() is None, "the scheduler stopped"
