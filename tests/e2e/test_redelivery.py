"""Copies of a message that the broker delivers again: runs of one lock never overlap.

At-least-once brokers deliver a message again while its first run still goes
on (a Redis stream reclaims a message idle past ``idle_timeout``, NATS one
unacknowledged after ``ack_wait``) or after it succeeded but before the broker
heard so (RabbitMQ, when the worker dies between the two). Such a copy waits
until the run of its lock ends; a copy of a run that succeeded then ends
without running its body, and so does a copy of a run whose success the lock
remembers (``deduplication_success_ttl``). A failed run's retry carries the
call on, never waiting on the attempt it continues. ``deduplication_exclusive
=False`` lets a copy run at once, as before.

Each task counts its bodies that run at the same time as another of its tag
(``overlapping``); every check is made by real ``taskiq worker`` processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from tests.e2e.conftest import App, Launch, Process, is_alive

#: ``idle_timeout`` of the reclaiming stream broker (ms) and ``ack_wait`` of NATS (s).
IDLE_TIMEOUT_MS = 1500
ACK_WAIT = 2.0
#: How long a test watches for a copy that must not start, once the copy exists.
WATCH = 3.0
RETRY_SETUPS = ["smart-first", "smart-last", "simple-first", "simple-last"]


#: The brokers that deliver a running task's message again.
REDELIVERING = ["redis-stream", "nats"]


def _redelivering(broker: str) -> dict[str, Any]:
    """The ``launch`` options of a broker that delivers a running task's message again."""
    if broker == "redis-stream":
        return {"broker": broker, "idle_timeout": IDLE_TIMEOUT_MS}
    return {"broker": broker, "ack_wait": ACK_WAIT}


@pytest.fixture(params=REDELIVERING)
def broker(request: pytest.FixtureRequest) -> str:
    """Each broker that delivers a running task's message again."""
    return str(request.param)


async def overlapping(app: App, tag: str) -> int:
    """How many bodies of ``tag`` started while another body of ``tag`` ran."""
    return await app.counter("overlapping", tag)


async def redelivered(app: App) -> bool:
    """Whether the broker has delivered a message of the test a second time."""
    if app.config.broker == "redis-stream":
        pending = await app.redis.xpending_range(
            f"{app.config.prefix}:stream", app.config.name, min="-", max="+", count=100
        )
        return any(int(entry["times_delivered"]) >= 2 for entry in pending)
    import nats  # noqa: PLC0415 (only for NATS)

    client = await nats.connect(app.config.nats_url)
    try:
        info = await client.jetstream().consumer_info(app.config.name, app.config.name)
    finally:
        await client.close()
    return (info.num_redelivered or 0) > 0


async def wait_redelivered(app: App, tags: list[str]) -> None:
    """Wait until the broker delivers a running message again; no copy of ``tags`` may start.

    A Redis stream's worker claims idle messages only after a read that found
    new ones: the test sends small tasks all along, as a busy queue would.
    """
    pokes = 0

    async def copy_delivered() -> bool:
        nonlocal pokes
        for tag in tags:
            assert await app.runs(tag) == 1, f"a copy of {tag!r} started while the first runs"
        if app.config.broker == "redis-stream":
            pokes += 1
            await app.tasks.count.kiq(n=pokes)
        await asyncio.sleep(0.2)
        return await redelivered(app)

    await app.wait_until(copy_delivered, "the broker to deliver the running task again")


async def watch_no_second_start(app: App, tags: list[str], seconds: float = WATCH) -> None:
    """Check, for ``seconds``, that each of ``tags`` has run once and never overlapped."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for tag in tags:
            assert await overlapping(app, tag) == 0, f"a copy of {tag!r} ran beside the first"
            assert await app.runs(tag) == 1, f"a copy of {tag!r} started while the first runs"
        await asyncio.sleep(0.05)


async def stop(app: App, worker: Process) -> None:
    """Stop ``worker`` with SIGTERM: it ends what it runs (copies that wait too), then exits.

    A worker of taskiq-redis's stream broker may never finish its own shutdown
    (its listener does not stop; seen with taskiq-redis 1.2 and taskiq 0.13,
    with no task of ours left running): once every delivery of the stream has
    been acknowledged, such a worker is killed instead.
    """
    os.kill(worker.pid, signal.SIGTERM)
    try:
        status = await asyncio.to_thread(worker.wait, 20)
    except subprocess.TimeoutExpired:
        assert app.config.broker == "redis-stream", worker.log()
        assert await queue_is_empty(app), worker.log()
        os.killpg(worker.pid, signal.SIGKILL)
        await asyncio.to_thread(worker.wait, 20)
        return
    assert status == 0, worker.log()
    assert worker.children() == []


async def queue_is_empty(app: App) -> bool:
    """Whether the test's broker holds no message that a worker has yet to acknowledge."""
    if app.config.broker == "redis-stream":
        summary = await app.redis.xpending(f"{app.config.prefix}:stream", app.config.name)
        return int(summary["pending"]) == 0
    if app.config.broker == "rabbitmq":
        import aio_pika  # noqa: PLC0415 (only for RabbitMQ)

        connection = await aio_pika.connect(app.config.amqp_url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(app.config.name, passive=True)
            return (queue.declaration_result.message_count or 0) == 0
    import nats  # noqa: PLC0415 (only for NATS)

    client = await nats.connect(app.config.nats_url)
    try:
        info = await client.jetstream().consumer_info(app.config.name, app.config.name)
    finally:
        await client.close()
    return bool(info.num_ack_pending == 0 and info.num_pending == 0)


# A copy of a run that is still going


@pytest.mark.slow
async def test_copy_of_a_running_task_waits_for_it_and_is_skipped_after_its_success(
    launch: Launch, broker: str
) -> None:
    app = await launch(**_redelivering(broker))
    handle = await app.tasks.hold.kiq(tag="r")
    worker = app.start_worker()
    [first] = await app.wait_started("r")
    key = await app.lock_of(handle.task_id)
    assert key is not None

    await wait_redelivered(app, ["r"])
    await watch_no_second_start(app, ["r"])
    # While the copy waits, the call is still the first run's: refused.
    await app.assert_duplicate(app.tasks.hold, handle.task_id, tag="r")
    assert (await app.holders()).get(key) == handle.task_id

    await app.open_gate("r")
    result = await handle.wait_result(timeout=20)
    assert result.return_value == {"tag": "r", "run": 1, "pid": first["pid"]}
    await stop(app, worker)  # every copy has ended: run or skipped

    assert await app.runs("r") == 1, "a copy of a run that succeeded ran its body"
    assert await overlapping(app, "r") == 0
    assert await queue_is_empty(app)
    result = await handle.wait_result(timeout=5)
    assert result.return_value["run"] == 1, "a skipped copy overwrote the result"
    # A success that copies waited for is kept for them a moment (two looks and 1 s).
    await app.wait_no_locks("the success kept for the copies that waited to expire")


@pytest.mark.slow
async def test_exclusive_false_lets_a_copy_run_beside_the_first_as_before(
    launch: Launch, broker: str
) -> None:
    app = await launch(**_redelivering(broker))
    exclusive = await app.tasks.hold.kiq(tag="exclusive")
    shared = (
        await app.tasks.hold.kicker().with_labels(deduplication_exclusive=False).kiq(tag="shared")
    )
    worker = app.start_worker()
    await app.wait_started("exclusive")
    await app.wait_started("shared")

    # The opted-out task's copy starts beside its first run; the other's waits.
    async def shared_copy_started() -> bool:
        assert await app.runs("exclusive") == 1, "a copy of 'exclusive' started beside the first"
        if app.config.broker == "redis-stream":
            await app.tasks.count.kiq(n=int(time.monotonic() * 1000))
        await asyncio.sleep(0.2)
        return await app.runs("shared") >= 2

    await app.wait_until(shared_copy_started, "the copy of 'shared' to start")
    assert await overlapping(app, "shared") >= 1
    await watch_no_second_start(app, ["exclusive"])

    await app.open_gate("exclusive")
    await app.open_gate("shared", runs=10)  # every copy of it that started
    assert (await exclusive.wait_result(timeout=20)).return_value["run"] == 1
    assert not (await shared.wait_result(timeout=20)).is_err
    await stop(app, worker)
    assert await app.runs("exclusive") == 1
    assert await overlapping(app, "exclusive") == 0


# A copy of a run that succeeded, its success remembered by the lock


async def test_copy_of_a_remembered_success_does_not_run_again_after_a_worker_dies(
    launch: Launch,
) -> None:
    # RabbitMQ: the worker dies after the task's success was saved, before the
    # ack; RabbitMQ hands the message to the other worker process.
    app = await launch(broker="rabbitmq")
    handle = await app.tasks.charge.kiq(order=1)
    worker = app.start_worker()

    async def saved() -> list[str]:
        return await app.report("saved", 1)

    [first] = [json.loads(item) for item in await app.wait_until(saved, "the charge's result")]
    result = await handle.wait_result(timeout=5)
    assert result.return_value == {"order": 1, "run": 1, "pid": first["pid"]}
    assert await app.redis.hget(app.config.key("charged"), "1") == "1"

    os.kill(first["pid"], signal.SIGKILL)

    async def dead() -> bool:
        return not is_alive(first["pid"])

    await app.wait_until(dead, "the worker process to die")

    async def delivered_again() -> bool:
        return len(await app.report("delivered", 1)) >= 2

    await app.wait_until(delivered_again, "RabbitMQ to deliver the message again")
    await app.open_gate("ack-1")  # were the copy to run and save, let it be acknowledged
    await stop(app, worker)

    assert await app.redis.hget(app.config.key("charged"), "1") == "1", (
        "the copy of a remembered success charged the order again"
    )
    assert await app.runs("order-1") == 1
    assert await queue_is_empty(app), "the copy was not acknowledged"
    result = await handle.wait_result(timeout=5)
    assert result.return_value == {"order": 1, "run": 1, "pid": first["pid"]}, (
        "the copy overwrote the result"
    )
    # The success is still remembered: the idempotency key refuses the call.
    await app.assert_duplicate(app.tasks.charge, handle.task_id, order=1)
    delivered = [json.loads(item) for item in await app.report("delivered", 1)]
    assert {d["task_id"] for d in delivered} == {handle.task_id}


# Retries: a failed attempt's retry carries the call on


@pytest.mark.slow
@pytest.mark.parametrize("retry", RETRY_SETUPS)
@pytest.mark.parametrize("broker", REDELIVERING)
async def test_copy_of_a_failed_attempt_never_overlaps_its_retry(
    launch: Launch, broker: str, retry: str
) -> None:
    app = await launch(**_redelivering(broker), retry=retry)
    flaky = app.tasks.flaky
    handle = await flaky.kiq(tag="f", failures=1)
    worker = app.start_worker()
    await app.wait_started("f")

    # The first attempt is delivered again while it runs; its copy waits.
    await wait_redelivered(app, ["f"])
    await watch_no_second_start(app, ["f"])
    await app.assert_duplicate(flaky, handle.task_id, tag="f", failures=1)

    # The first attempt fails: its retry runs (it never waits on the attempt
    # it continues), and the copy does not run beside it.
    await app.open_gate("f")
    await app.wait_started("f", runs=2)

    deadline = time.monotonic() + WATCH
    while time.monotonic() < deadline:
        assert await overlapping(app, "f") == 0, "two bodies of the call ran at once"
        assert await app.runs("f") == 2, "a copy of the failed attempt ran beside its retry"
        await asyncio.sleep(0.05)
    await app.assert_duplicate(flaky, handle.task_id, tag="f", failures=1)

    await app.open_gate("f")
    result = await handle.wait_result(timeout=20)
    assert result.return_value == "f succeeded on run 2"
    await stop(app, worker)
    assert await app.runs("f") == 2, "a copy of the call ran after its retry succeeded"
    assert await overlapping(app, "f") == 0
    assert {run["task_id"] for run in await app.started("f")} == {handle.task_id}
    # A success that copies waited for is kept for them a moment (two looks and 1 s).
    await app.wait_no_locks("the success kept for the copies that waited to expire")


# A call queued under "started" while the last one runs


@pytest.mark.parametrize("broker", ["redis-list", "rabbitmq"])
async def test_call_accepted_under_started_waits_for_the_running_one(
    launch: Launch, broker: str
) -> None:
    app = await launch(broker=broker)
    started = app.tasks.hold_by_policy["started"]
    first = await started.kiq(tag="s")
    worker = app.start_worker()
    await app.wait_started("s")
    # "started" lets the next call in once the first runs; it is queued, and
    # waits for the running one instead of running beside it.
    second = await started.kiq(tag="s")
    await watch_no_second_start(app, ["s"])

    await app.open_gate("s")
    assert (await first.wait_result(timeout=20)).return_value["run"] == 1
    await app.wait_started("s", runs=2)
    await app.open_gate("s")
    assert (await second.wait_result(timeout=20)).return_value["run"] == 2
    await stop(app, worker)
    assert await overlapping(app, "s") == 0
    # A success that copies waited for is kept for them a moment (two looks and 1 s).
    await app.wait_no_locks("the success kept for the copies that waited to expire")
