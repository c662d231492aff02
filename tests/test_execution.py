"""Running: the lock while a task waits, runs, fails, retries and ends."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.asyncio
from taskiq import (
    Context,
    SmartRetryMiddleware,
    TaskiqDepends,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqResult,
    TaskiqScheduler,
)

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.model.formats import holder_task_id
from tests._brokers import BrokerFactory, HoldingBroker, KeptSchedules, queued_job
from tests._locks import lock_keys, lock_value, wait_until
from tests._middlewares import MiddlewareFactory, dedup_middleware, each_retry_order, running_beats
from tests._tasks import all_running, held_slow
from tests._topologies import all_topologies


@all_topologies()
async def test_lock_is_released_when_the_task_succeeds(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker()

    @broker.task
    async def job(n: int) -> int:
        return n

    handle = await job.kiq(n=1)
    assert (await handle.wait_result(timeout=5)).return_value == 1
    assert await lock_keys(redis_client, prefix) == []
    await job.kiq(n=1)  # accepted again


async def test_lock_is_released_once_when_the_task_fails(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker()

    @broker.task
    async def ok() -> None: ...

    @broker.task
    async def boom() -> None:
        msg = "task failed"
        raise RuntimeError(msg)

    async def calls_for(task: Any) -> dict[str, int]:
        await redis_client.config_resetstat()
        await (await task.kiq()).wait_result(timeout=5)
        await broker.wait_all()
        stats = await redis_client.info("commandstats")
        return {
            name: stats.get(f"cmdstat_{name}", {}).get("calls", 0)
            for name in ("evalsha", "del", "pexpire", "set")
        }

    success, failure = await calls_for(ok), await calls_for(boom)
    # A failed task costs what a successful one does, but for the success that
    # the run's own finish script remembers for copies of its message.
    assert failure == {**success, "set": success["set"] - 1}
    assert failure["del"] == 1
    assert await lock_keys(redis_client, prefix) == []


@all_topologies()
async def test_a_task_waiting_in_the_queue_keeps_its_lock(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, job = await queued_job(make_broker)

    await job.kiq()
    with pytest.raises(DuplicateTaskError):
        await job.kiq()
    await broker.deliver()
    assert await lock_keys(redis_client, prefix) == []


async def test_a_lock_that_expired_in_the_queue_is_taken_back_at_execution(
    broker: HoldingBroker,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str | None] = []

    @broker.task
    async def job() -> None:
        (key,) = await lock_keys(redis_client, prefix)
        seen.append(await lock_value(redis_client, key))

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    value = await lock_value(redis_client, key)
    await redis_client.delete(key)  # as if its TTL ran out while it was queued
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await broker.deliver()
    # Held again by the same task while it ran, under its run's token.
    assert [holder_task_id(v) for v in seen if v] == [holder_task_id(value)]
    assert seen[0] is not None
    assert seen[0].startswith("~")
    assert sent.task_id in caplog.text
    assert "taken back" in caplog.text
    assert await lock_keys(redis_client, prefix) == []


async def test_a_lock_taken_by_another_send_meanwhile_is_left_to_it_when_runs_may_overlap(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = await make_broker(
        broker_class=HoldingBroker, heartbeat_interval=1, default_exclusive=False
    )

    @broker.task
    async def job() -> None: ...

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    await redis_client.set(key, "othertoken other-task-id", px=30_000)
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await broker.deliver()
    assert "other-task-id" in caplog.text
    assert sent.task_id in caplog.text
    assert await redis_client.get(key) == "othertoken other-task-id"  # not released by us


@all_topologies()
async def test_heartbeat_keeps_the_lock_of_a_task_that_outlives_its_ttl(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(default_ttl=2)
    slow, gate = held_slow(broker)
    running, finish = gate.started, gate.finish

    handle = await slow.kiq()
    await running.wait()
    await asyncio.sleep(3.0)  # one and a half TTLs
    with pytest.raises(DuplicateTaskError):
        await slow.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    assert 0 < await redis_client.pttl(key) <= 2000
    finish.set()
    await handle.wait_result(timeout=5)
    assert await lock_keys(redis_client, prefix) == []


async def test_without_heartbeat_the_lock_expires_mid_run(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(default_ttl=1, heartbeat=False)
    slow, gate = held_slow(broker)
    running, finish = gate.started, gate.finish

    await slow.kiq()
    await running.wait()

    async def lock_gone() -> bool:
        return await lock_keys(redis_client, prefix) == []

    await wait_until(lock_gone)
    second = await slow.kiq()  # the documented hazard of heartbeat=False
    finish.set()
    await second.wait_result(timeout=5)


async def test_heartbeat_interval_defaults_to_a_third_of_the_ttl(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(default_ttl=30)
    middleware = dedup_middleware(broker)
    beats: list[float] = []
    release = asyncio.Event()

    @broker.task
    async def job() -> None:
        beats.extend(beat.interval for beat in running_beats(middleware))
        await release.wait()

    @broker.task(deduplication_ttl=2)
    async def short() -> None:
        beats.extend(beat.interval for beat in running_beats(middleware))

    handle = await job.kiq()
    await asyncio.sleep(0.2)
    release.set()
    await handle.wait_result(timeout=5)
    await (await short.kiq()).wait_result(timeout=5)
    # 30 s / 3; for 2 s the 1 s floor applies, which is also half the TTL.
    assert beats == [10.0, 1.0]


async def test_heartbeat_interval_option_is_used_but_never_exceeds_half_the_ttl(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(default_ttl=60, heartbeat_interval=20)
    middleware = dedup_middleware(broker)
    beats: list[float] = []

    @broker.task
    async def job() -> None:
        beats.extend(beat.interval for beat in running_beats(middleware))

    await (await job.kiq()).wait_result(timeout=5)
    await (await job.kicker().with_labels(deduplication_ttl=10).kiq()).wait_result(timeout=5)
    assert beats == [20.0, 5.0]


async def test_heartbeat_ends_with_the_task_and_revives_nothing(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(default_ttl=2)
    middleware = dedup_middleware(broker)

    @broker.task
    async def quick() -> None:
        await asyncio.sleep(1.2)  # past the first refresh at 1 s

    await (await quick.kiq()).wait_result(timeout=5)
    assert running_beats(middleware) == []
    await asyncio.sleep(1.5)  # past the next refresh it would have sent
    assert await lock_keys(redis_client, prefix) == []


class RaisesAfterTheTask(TaskiqMiddleware):
    """Another middleware whose post_execute fails, so later hooks never run."""

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        msg = "post_execute failed"
        raise RuntimeError(msg)


async def test_heartbeat_stops_even_when_another_middleware_skips_our_post_execute(
    make_middleware: MiddlewareFactory,
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    dedup = make_middleware(default_ttl=2)
    broker = await make_broker(middlewares=[dedup, RaisesAfterTheTask()])

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    with pytest.raises(RuntimeError, match="post_execute failed"):
        await broker.wait_all()
    await asyncio.sleep(0)  # the done callbacks of the ended asyncio task run
    assert len(running_beats(dedup)) == 0
    # The lock was never released, and nothing refreshes it: it expires on its TTL.
    (key,) = await lock_keys(redis_client, prefix)
    assert 0 < await redis_client.pttl(key) <= 2000

    async def lock_gone() -> bool:
        return await lock_keys(redis_client, prefix) == []

    await wait_until(lock_gone, timeout=4)


async def test_one_heartbeat_batch_refreshes_many_running_tasks(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(default_ttl=3)
    _, finish = await all_running(broker, 200)
    await redis_client.config_resetstat()
    await asyncio.sleep(2.2)  # two refresh intervals of 1 s
    stats = await redis_client.info("commandstats")
    finish.set()
    await broker.wait_all()
    refreshes = stats["cmdstat_pexpire"]["calls"]
    scripts = stats["cmdstat_evalsha"]["calls"]
    assert refreshes >= 200  # every lock refreshed at least once
    assert scripts <= 6  # in a handful of multi-key calls, not one per task
    assert await lock_keys(redis_client, prefix) == []


@all_topologies()
@each_retry_order
async def test_a_retry_is_not_a_duplicate_of_itself(
    retry_and_dedup: list[TaskiqMiddleware],
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    broker = await make_broker(middlewares=retry_and_dedup)
    dedup = dedup_middleware(broker)
    attempts: list[str] = []
    rejected: list[str | None] = []
    holders: list[str] = []

    @broker.task(retry_on_error=True)
    async def flaky(user_id: int, context: Context = TaskiqDepends()) -> str:
        attempts.append(context.message.task_id)
        (key,) = await lock_keys(redis_client, prefix)
        # Its holder's task_id, whatever mark follows it in the value.
        holders.append(holder_task_id(await lock_value(redis_client, key)) or "")
        try:
            await flaky.kiq(user_id=user_id)  # a duplicate sent in between
        except DuplicateTaskError as err:
            rejected.append(err.holder_task_id)
        if len(attempts) < 3:
            msg = "not yet"
            raise RuntimeError(msg)
        return "done"

    first = await flaky.kiq(user_id=7)
    for _ in range(100):
        await broker.wait_all()
        if not broker._running_tasks:
            break
    assert attempts == [first.task_id] * 3
    assert rejected == [first.task_id] * 3
    assert holders == [first.task_id] * 3
    assert (await first.wait_result(timeout=5)).return_value == "done"
    assert await lock_keys(redis_client, prefix) == []
    assert len(running_beats(dedup)) == 0


@all_topologies()
async def test_exhausted_retries_release_the_lock(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(retries=3)
    attempts = 0

    @broker.task(retry_on_error=True)
    async def hopeless() -> None:
        nonlocal attempts
        attempts += 1
        msg = "never works"
        raise RuntimeError(msg)

    await hopeless.kiq()
    for _ in range(100):
        await broker.wait_all()
        if not broker._running_tasks:
            break
    assert attempts == 3
    assert await lock_keys(redis_client, prefix) == []
    await hopeless.kiq()


async def test_reusing_a_task_id_from_outside_its_run_is_an_ordinary_duplicate(
    make_middleware: MiddlewareFactory, make_broker: BrokerFactory
) -> None:
    _, job = await queued_job(make_broker)

    await job.kicker().with_task_id("fixed").kiq()
    with pytest.raises(DuplicateTaskError) as caught:
        await job.kicker().with_task_id("fixed").kiq()
    assert caught.value.holder_task_id == "fixed"


async def test_reusing_a_running_task_id_from_another_asyncio_task_is_a_duplicate(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker()
    running = asyncio.Event()
    finish = asyncio.Event()

    @broker.task
    async def job() -> None:
        running.set()
        await finish.wait()

    await job.kicker().with_task_id("fixed").kiq()
    await running.wait()
    with pytest.raises(DuplicateTaskError):
        await job.kicker().with_task_id("fixed").kiq()
    finish.set()


async def test_requeue_keeps_the_lock_until_the_last_delivery(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    runs = 0

    @broker.task
    async def job(context: Context = TaskiqDepends()) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            await context.requeue()

    await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    message = broker.queued.pop(0)
    await broker.receiver.callback(message=message.message)  # first delivery requeues
    assert len(broker.queued) == 1
    await dedup_middleware(broker).shutdown()  # sends the queued extension
    assert 200_000 < await redis_client.pttl(key) <= 300_000  # still held, at full TTL
    with pytest.raises(DuplicateTaskError):
        await job.kiq()
    await broker.deliver()
    assert runs == 2
    assert await lock_keys(redis_client, prefix) == []


async def test_worker_side_ignores_malformed_lock_labels(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task
    async def job() -> str:
        return "ran"

    handle = await job.kicker().with_labels(deduplication=False).kiq()
    broker.queued[0].message = broker.queued[0].message.replace(
        b'"labels":{',
        b'"labels":{"_deduplication_lock_key":"k","_deduplication_lock_owner":"t x",'
        b'"_deduplication_lock_ttl":"abc",',
    )
    await broker.deliver()
    assert (await handle.wait_result(timeout=5)).return_value == "ran"


async def test_inplace_broker_runs_hooks_inside_kiq(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(await_inplace=True)
    inner: list[str] = []

    @broker.task
    async def child(n: int) -> None:
        inner.append(f"child {n}")

    @broker.task
    async def parent() -> None:
        await child.kiq(n=1)
        await child.kiq(n=1)  # the first one ran in place and released its lock
        inner.append("parent")

    await parent.kiq()
    assert inner == ["child 1", "child 1", "parent"]
    await dedup_middleware(broker).shutdown()
    assert await lock_keys(redis_client, prefix) == []
    await parent.kiq()  # the parent's lock went too, and the late extension revived nothing


async def test_a_retry_left_to_a_schedule_source_keeps_the_lock_between_attempts(
    make_middleware: MiddlewareFactory,
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    source = KeptSchedules()
    retry = SmartRetryMiddleware(
        default_retry_count=3, default_delay=30, use_jitter=False, schedule_source=source
    )
    broker = await make_broker(
        broker_class=HoldingBroker, middlewares=[make_middleware(default_ttl=60), retry]
    )
    attempts = 0

    @broker.task(retry_on_error=True)
    async def flaky(n: int) -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            msg = "first attempt fails"
            raise RuntimeError(msg)
        return "done"

    first = await flaky.kiq(n=1)
    await broker.deliver()  # attempt 1 fails; the retry waits in the schedule source
    (scheduled,) = source.schedules
    await dedup_middleware(broker).shutdown()  # sends the extension queued at its end
    (key,) = await lock_keys(redis_client, prefix)
    assert 50_000 < await redis_client.pttl(key) <= 60_000  # kept, at full TTL
    with pytest.raises(DuplicateTaskError) as caught:
        await flaky.kiq(n=1)
    assert caught.value.holder_task_id == first.task_id

    # The scheduler fires the retry, with the task_id and labels of attempt 1.
    await TaskiqScheduler(broker, [source]).on_ready(source, scheduled)
    assert len(broker.queued) == 1
    with pytest.raises(DuplicateTaskError):
        await flaky.kiq(n=1)  # still refused while the retry is queued
    await broker.deliver()
    assert attempts == 2
    assert (await first.wait_result(timeout=5)).return_value == "done"
    assert await lock_keys(redis_client, prefix) == []


async def test_lock_labels_copied_onto_another_task_do_not_carry_its_lock(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task
    async def child(n: int) -> None: ...

    @broker.task
    async def parent(context: Context = TaskiqDepends()) -> None:
        # Some middlewares build the next message from the parent's labels.
        await child.kicker().with_labels(**context.message.labels).kiq(n=1)

    parent_handle = await parent.kiq()
    (parent_key,) = await lock_keys(redis_client, prefix)
    parent_lock = await lock_value(redis_client, parent_key)
    message = broker.queued.pop(0)
    await broker.receiver.callback(message=message.message)
    (queued_child,) = broker.queued
    (child_key,) = await lock_keys(redis_client, prefix)  # the parent's was released
    assert child_key != parent_key
    child_lock = await lock_value(redis_client, child_key)
    assert child_lock.endswith(queued_child.task_id)
    assert not child_lock.endswith(parent_handle.task_id)
    assert parent_lock.endswith(parent_handle.task_id)


# A running lease (running_ttl): the full TTL while queued, a short one while running.


async def test_a_running_lease_holds_the_lock_while_the_task_runs_and_no_longer_queued(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=300, running_ttl=2)
    left_while_running: list[int] = []

    @broker.task
    async def job() -> None:
        (key,) = await lock_keys(redis_client, prefix)
        left_while_running.append(await redis_client.pttl(key))
        await asyncio.sleep(2.6)  # past the lease: only the heartbeat keeps the lock
        left_while_running.append(await redis_client.pttl(key))

    handle = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)

    async def queued_with_its_full_ttl() -> bool:
        return await redis_client.pttl(key) > 290_000

    await wait_until(queued_with_its_full_ttl)
    running = asyncio.create_task(broker.deliver())
    await asyncio.sleep(2.3)
    with pytest.raises(DuplicateTaskError) as refused:
        await job.kiq()
    assert refused.value.holder_task_id == handle.task_id
    await running
    assert len(left_while_running) == 2
    assert all(0 < left <= 2000 for left in left_while_running), left_while_running
    assert await lock_keys(redis_client, prefix) == []


async def test_the_running_ttl_label_sets_the_lease_per_task_and_never_lengthens_a_lock(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(default_ttl=300)
    left: dict[str, int] = {}

    async def remember(name: str) -> None:
        (key,) = await lock_keys(redis_client, prefix)
        left[name] = await redis_client.pttl(key)

    @broker.task(deduplication_running_ttl=3)
    async def leased() -> None:
        await remember("leased")

    @broker.task(deduplication_running_ttl=60, deduplication_ttl=5)
    async def short() -> None:
        await remember("short")  # a lease longer than the TTL: the TTL stays

    await (await leased.kiq()).wait_result(timeout=5)
    await (await short.kiq()).wait_result(timeout=5)
    assert 0 < left["leased"] <= 3000
    assert 0 < left["short"] <= 5000
    assert await lock_keys(redis_client, prefix) == []


async def test_a_running_ttl_label_without_the_heartbeat_is_refused_at_kiq(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(heartbeat=False)

    @broker.task(deduplication_running_ttl=10)
    async def job() -> None: ...

    with pytest.raises(ValueError, match="deduplication_running_ttl"):
        await job.kiq()
    assert await lock_keys(redis_client, prefix) == []
