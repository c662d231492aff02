"""Exclusive runs: runs of one lock key never overlap, and a succeeded run is not run again.

A broker that delivers at least once hands a worker a copy of a message while
its first run goes on (a Streams reclaim, a NATS ``ack_wait``) or after it
succeeded (a RabbitMQ redelivery after a lost connection). Here the holding
broker delivers the very same message twice, as those brokers do, through
taskiq's real receiver; the end-to-end suite does it with the real brokers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio
from taskiq import (
    BrokerMessage,
    InMemoryBroker,
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqMessage,
    TaskiqMiddleware,
)
from taskiq.exceptions import SendTaskError

from taskiq_deduplication import DuplicateTaskError, LockEventKind
from taskiq_deduplication.model.formats import holder_task_id
from taskiq_deduplication.store.lock_store import Lock, LockStore
from tests._brokers import BrokerFactory, HoldingBroker, merged_into, queued_job, retry_middleware
from tests._locks import answered, lock_keys, lock_value, ready, scripts_run, without_done
from tests._middlewares import MiddlewareFactory, dedup_middleware, running_beats
from tests._topologies import all_topologies
from tests.benchmarks.harness import Traffic


class Runs:
    """When each body began and ended, by the order they began in."""

    def __init__(self) -> None:
        self.spans: list[list[float]] = []

    def begin(self) -> int:
        self.spans.append([time.monotonic(), float("inf")])
        return len(self.spans) - 1

    def end(self, index: int) -> None:
        self.spans[index][1] = time.monotonic()

    async def until(self, release: asyncio.Event) -> None:
        """A body that goes on until ``release`` is set."""
        index = self.begin()
        await release.wait()
        self.end(index)

    def overlaps(self) -> int:
        """How many pairs of bodies ran at the same time."""
        spans = sorted(self.spans)
        return sum(
            1 for i, (_, end) in enumerate(spans) for begin, _ in spans[i + 1 :] if begin < end
        )


def events_of(broker: InMemoryBroker) -> list[Any]:
    """The lock events of the deduplication middleware on ``broker``, from now on."""
    seen: list[Any] = []
    dedup_middleware(broker).subscribe(seen.append)
    return seen


async def deliver_copy(broker: HoldingBroker, message: Any) -> None:
    """Deliver ``message`` once more, as a broker that redelivers it does."""
    await broker.receiver.callback(message=message.message)


async def released(release: asyncio.Event, *deliveries: asyncio.Task[None]) -> None:
    """Let the held bodies end (``release``), and wait for the deliveries to be over."""
    release.set()
    await asyncio.wait_for(asyncio.gather(*deliveries), timeout=10)


async def run_then_redeliver(broker: HoldingBroker, task: Any) -> Any:
    """Send ``task(1)`` and run it; then, as if the worker died before the ack, run it again."""
    sent = await task.kiq(1)
    (message,) = broker.queued
    await broker.deliver()
    await deliver_copy(broker, message)
    return sent


@all_topologies()
async def test_a_copy_delivered_while_its_run_goes_on_waits_and_is_not_run_after_a_success(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=3)
    events = events_of(broker)
    runs = Runs()
    release = asyncio.Event()

    @broker.task
    async def charge(order: int) -> str:
        await runs.until(release)
        return f"charged {order}"

    sent = await charge.kiq(7)
    (message,) = broker.queued
    first = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.3)
    copy = asyncio.create_task(deliver_copy(broker, message))
    await asyncio.sleep(1.0)
    assert len(runs.spans) == 1  # the copy waits
    assert [e.kind for e in events if e.task_id == sent.task_id][-1] is LockEventKind.WAITING
    with pytest.raises(DuplicateTaskError):
        await charge.kiq(7)  # still one call, and still held
    await released(release, first, copy)
    assert len(runs.spans) == 1
    skipped = [e for e in events if e.kind is LockEventKind.SKIPPED]
    assert [(e.task_id, e.holder_task_id) for e in skipped] == [(sent.task_id, sent.task_id)]
    result = await broker.result_backend.get_result(sent.task_id)
    assert result.return_value == "charged 7"  # the copy did not overwrite it
    assert running_beats(dedup_middleware(broker)) == []
    # The success is kept only as long as the copies that waited need to see it.
    (key,) = await lock_keys(redis_client, prefix)
    assert 0 < await redis_client.pttl(key) <= 3000
    await asyncio.sleep(await redis_client.pttl(key) / 1000 + 0.1)
    assert await lock_keys(redis_client, prefix) == []
    await charge.kiq(7)  # a new call is accepted


async def test_a_run_alone_leaves_nothing_when_it_succeeds(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, job = await queued_job(make_broker)

    await job.kiq()
    await broker.deliver()
    assert without_done(await redis_client.keys(f"{prefix}*")) == []
    await job.kiq()  # accepted at once


async def test_a_copy_of_a_run_whose_success_is_remembered_does_not_run_again(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    retry = SimpleRetryMiddleware(default_retry_count=3)
    broker = await make_broker(broker_class=HoldingBroker)
    broker.add_middlewares(retry)
    events = events_of(broker)
    bodies: list[int] = []

    @broker.task(deduplication_success_ttl=60, retry_on_error=True)
    async def charge(order: int) -> str:
        bodies.append(order)
        return "charged"

    sent = await run_then_redeliver(broker, charge)
    assert bodies == [1]
    assert broker.queued == []  # not retried
    assert [e.kind for e in events if e.kind is LockEventKind.SKIPPED] == [LockEventKind.SKIPPED]
    result = await broker.result_backend.get_result(sent.task_id)
    assert result.return_value == "charged"
    (key,) = await lock_keys(redis_client, prefix)
    assert holder_task_id(await lock_value(redis_client, key)) == sent.task_id
    with pytest.raises(DuplicateTaskError) as refused:
        await charge.kiq(1)  # the idempotency key still holds, naming the task
    assert refused.value.holder_task_id == sent.task_id


async def test_a_success_is_remembered_even_if_its_lock_vanished_during_the_run(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    # A Redis restart (it keeps nothing on disk) empties the keyspace while the
    # run goes on; the copy the broker delivers after the run's success must
    # still find that it succeeded. (The soak saw such copies run again.)
    broker = await make_broker(broker_class=HoldingBroker)
    bodies: list[int] = []

    @broker.task(deduplication_success_ttl=60)
    async def charge(order: int) -> str:
        bodies.append(order)
        for key in await redis_client.keys(f"{prefix}*"):
            await redis_client.delete(key)
        return "charged"

    sent = await run_then_redeliver(broker, charge)
    assert bodies == [1]
    result = await broker.result_backend.get_result(sent.task_id)
    assert result.return_value == "charged"
    (key,) = await lock_keys(redis_client, prefix)
    assert 55_000 < await redis_client.pttl(key) <= 60_000
    with pytest.raises(DuplicateTaskError) as refused:
        await charge.kiq(1)  # the idempotency key holds again
    assert refused.value.holder_task_id == sent.task_id


async def test_a_copy_of_a_run_that_failed_runs_after_it_and_never_beside_it(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=3)
    runs = Runs()
    release = asyncio.Event()

    @broker.task
    async def job() -> None:
        index = runs.begin()
        first = index == 0
        await release.wait()
        runs.end(index)
        if first:
            msg = "the first run fails"
            raise RuntimeError(msg)

    await job.kiq()
    (message,) = broker.queued
    first = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.3)
    copy = asyncio.create_task(deliver_copy(broker, message))
    await asyncio.sleep(0.8)
    assert len(runs.spans) == 1
    await released(release, first, copy)
    assert len(runs.spans) == 2
    assert runs.overlaps() == 0
    assert await lock_keys(redis_client, prefix) == []


async def test_a_copy_whose_run_lost_its_worker_runs_once_the_lease_lapses(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=30, running_ttl=3)
    bodies: list[float] = []

    @broker.task
    async def job() -> None:
        bodies.append(time.monotonic())

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    # A run of this very message began on a worker that then died: its slot
    # lapses with its lease.
    await redis_client.set(key, f"~deadrun001 {sent.task_id}", px=1500)
    began = time.monotonic()
    await asyncio.wait_for(broker.deliver(), timeout=10)
    assert len(bodies) == 1
    assert bodies[0] - began >= 1.4  # not before the dead run's lease lapsed
    assert await lock_keys(redis_client, prefix) == []


@pytest.mark.parametrize("exclusive", [True, False])
async def test_a_call_queued_under_started_runs_after_the_run_that_goes_on(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str, exclusive: bool
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=3)
    runs = Runs()
    release = asyncio.Event()

    @broker.task(
        deduplication_until="started",
        deduplication_key="refresh",
        deduplication_exclusive=exclusive,
    )
    async def refresh() -> None:
        await runs.until(release)

    await refresh.kiq()
    first = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.3)
    await refresh.kiq()  # accepted: the first one started
    second = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.8)
    assert len(runs.spans) == (1 if exclusive else 2)
    if exclusive:
        with pytest.raises(DuplicateTaskError):
            await refresh.kiq()  # the second still counts as queued while it waits
    await released(release, first, second)
    assert len(runs.spans) == 2
    assert runs.overlaps() == (0 if exclusive else 1)
    assert without_done(await redis_client.keys(f"{prefix}*")) == []


async def test_a_call_accepted_after_an_expired_window_waits_for_the_last_run(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    runs = Runs()
    release = asyncio.Event()

    @broker.task(deduplication_until="expired", deduplication_ttl=1, deduplication_key="digest")
    async def digest() -> None:
        await runs.until(release)

    await digest.kiq()
    first = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(1.2)  # the window is over while the run goes on
    await digest.kiq()
    second = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.8)
    assert len(runs.spans) == 1
    await released(release, first, second)
    assert len(runs.spans) == 2
    assert runs.overlaps() == 0
    await asyncio.sleep(1.1)
    assert without_done(await redis_client.keys(f"{prefix}*")) == []


@pytest.mark.parametrize("policy", ["finished", "started", "expired"])
@pytest.mark.parametrize("retry_class", [SimpleRetryMiddleware, SmartRetryMiddleware])
@pytest.mark.parametrize("dedup_first", [True, False])
async def test_a_retry_never_waits_for_the_attempt_it_continues(
    make_middleware: MiddlewareFactory,
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    policy: str,
    retry_class: type[TaskiqMiddleware],
    dedup_first: bool,
) -> None:
    dedup = make_middleware()
    retry = retry_middleware(retry_class)
    middlewares = [dedup, retry] if dedup_first else [retry, dedup]
    broker = await make_broker(middlewares=middlewares, await_inplace=True)
    runs = Runs()

    @broker.task(deduplication_until=policy, retry_on_error=True, max_retries=3)
    async def flaky() -> None:
        index = runs.begin()
        await asyncio.sleep(0.05)
        runs.end(index)
        if len(runs.spans) < 3:
            msg = "not yet"
            raise RuntimeError(msg)

    await asyncio.wait_for(flaky.kiq(), timeout=15)  # in place: a deadlock would hang here
    await asyncio.wait_for(broker.wait_all(), timeout=15)
    assert len(runs.spans) == 3
    assert runs.overlaps() == 0
    await dedup.shutdown()
    if policy != "expired":
        assert without_done(await redis_client.keys(f"{prefix}*")) == []


async def test_a_copy_of_an_attempt_that_a_retry_carries_on_is_not_run(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, retries=3)
    events = events_of(broker)
    bodies: list[str] = []

    @broker.task(retry_on_error=True)
    async def flaky() -> None:
        bodies.append("ran")
        if len(bodies) == 1:
            msg = "the first attempt fails"
            raise RuntimeError(msg)

    await flaky.kiq()
    (attempt,) = broker.queued
    await broker.deliver_one()  # fails, and its retry is queued
    assert len(broker.queued) == 1
    await deliver_copy(broker, attempt)  # the failed attempt, delivered again
    assert bodies == ["ran"]
    assert [e.kind for e in events][-1] is LockEventKind.SKIPPED
    await broker.deliver()  # the retry
    assert bodies == ["ran", "ran"]
    assert without_done(await redis_client.keys(f"{prefix}*")) == []


@all_topologies(hash_tag=True)
async def test_one_running_and_one_queued_with_the_latest_arguments(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=5)
    ran: list[int] = []
    runs = Runs()
    release = asyncio.Event()

    @broker.task(
        deduplication_until="started", deduplication_key="sync", deduplication_merge="latest"
    )
    async def sync(version: int) -> None:
        index = runs.begin()
        ran.append(version)
        if index == 0:
            await release.wait()
        runs.end(index)

    await sync.kiq(1)
    first = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.3)
    await sync.kiq(2)  # queued behind the run that goes on
    second = asyncio.create_task(broker.deliver_one())
    await asyncio.sleep(0.5)
    for version in (3, 4, 5):
        await merged_into(lambda: sync.kiq(version))  # noqa: B023 (into the copy that waits)
    await released(release, first, second)
    assert ran == [1, 5]
    assert runs.overlaps() == 0
    assert without_done(await redis_client.keys(f"{prefix}*")) == []


@pytest.mark.parametrize("value", ["maybe", 2, "[]"])
async def test_a_bad_exclusive_label_is_refused_by_name(
    make_broker: BrokerFactory, value: str | int
) -> None:
    broker, job = await queued_job(make_broker)

    with pytest.raises(ValueError, match="deduplication_exclusive"):
        await job.kicker().with_labels(deduplication_exclusive=value).kiq()
    assert broker.queued == []


def test_a_bad_default_exclusive_is_refused_by_name(make_middleware: MiddlewareFactory) -> None:
    with pytest.raises(ValueError, match="default_exclusive"):
        make_middleware(default_exclusive="yes")


@pytest.mark.parametrize("policy", ["started", "expired"])
async def test_a_run_slot_beside_the_lock_lives_on_its_own_short_lease(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str, policy: str
) -> None:
    # A worker that dies while running holds the next run of its key up for
    # the slot's lease (10 s by default, running_ttl here), not the lock's TTL.
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=60, running_ttl=4)
    seen: list[int] = []

    @broker.task(deduplication_until=policy)
    async def job() -> None:
        (slot,) = [key async for key in redis_client.scan_iter(match=f"{prefix}#run:*")]
        seen.append(await redis_client.pttl(slot))

    await job.kiq()
    await broker.deliver()
    assert len(seen) == 1
    assert 0 < seen[0] <= 4000


async def test_a_retry_sent_without_a_lock_still_never_runs_beside_its_key(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    # Under "started" a retry whose lock a call queued meanwhile holds goes out
    # without a lock (it is never refused, never lost); its run still takes the
    # run slot of its key, so it and that call's run take turns.
    broker = await make_broker(broker_class=HoldingBroker, retries=3, default_ttl=5)
    runs = Runs()

    @broker.task(deduplication_until="started", deduplication_key="sync", retry_on_error=True)
    async def sync(n: int) -> None:
        index = runs.begin()
        if index == 0:
            await sync.kiq(2)  # accepted: the first one started
            runs.end(index)
            msg = "the first attempt fails"
            raise RuntimeError(msg)
        await asyncio.sleep(0.5)
        runs.end(index)

    await sync.kiq(1)
    await broker.deliver_one()  # fails; call 2 and the retry of call 1 are queued
    assert len(broker.queued) == 2
    await asyncio.wait_for(asyncio.gather(broker.deliver_one(), broker.deliver_one()), 10)
    assert len(runs.spans) == 3
    assert runs.overlaps() == 0
    assert without_done(await redis_client.keys(f"{prefix}*")) == []


class RefusingRetries(HoldingBroker):
    """Keeps the first send of each task_id and refuses a second (a retry): the broker is down."""

    async def kick(self, message: BrokerMessage) -> None:
        if message.task_id in {queued.task_id for queued in self.sent}:
            msg = "the broker is down"
            raise ConnectionError(msg)
        self.sent.append(message)
        await super().kick(message)

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.sent: list[BrokerMessage] = []


@pytest.mark.parametrize("until", ["finished", "started"])
async def test_a_copy_of_an_attempt_whose_retry_the_broker_refused_runs(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str, until: str
) -> None:
    """Review of issue 30: the refused retry had been handed the run, so the copy was skipped."""
    broker = await make_broker(broker_class=RefusingRetries, retries=3)
    bodies: list[str] = []

    @broker.task(retry_on_error=True, deduplication_until=until)
    async def flaky() -> None:
        bodies.append("ran")
        if len(bodies) == 1:
            msg = "the first attempt fails"
            raise RuntimeError(msg)

    await flaky.kiq()
    (attempt,) = broker.queued
    # The attempt fails, and the broker refuses its retry: taskiq's retry
    # middleware raises from on_error, so this delivery is never acknowledged.
    with pytest.raises(SendTaskError):
        await broker.deliver_one()
    assert broker.queued == []
    await deliver_copy(broker, attempt)  # so the broker delivers the attempt again
    assert bodies == ["ran", "ran"]  # the call is not lost
    assert await lock_keys(redis_client, prefix) == []
    assert without_done(await redis_client.keys(f"{prefix}*")) == []


async def test_a_run_inside_its_own_kiq_holds_its_run_slot_while_its_body_runs(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    """An in-process broker runs the task inside ``kiq``, before the send's post_send."""
    broker = await make_broker(await_inplace=True)
    seen: list[tuple[str, bool]] = []

    @broker.task(task_name=None)
    async def job(n: int) -> int:
        (key,) = await lock_keys(redis_client, prefix)
        value = await lock_value(redis_client, key)
        refused = False
        try:
            await job.kiq(n=n)
        except DuplicateTaskError:
            refused = True
        seen.append((value, refused))
        return n

    await job.kiq(n=1)
    ((value, refused),) = seen
    assert value.startswith("~")  # the run token holds the slot
    assert refused  # an identical call during the run is a duplicate
    assert await lock_keys(redis_client, prefix) == []  # released at the end


async def test_a_run_inside_its_own_kiq_begins_on_the_lock_its_send_took_for_it(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    """The send's acquire writes the run's value: the run begins without waiting for a claim.

    The value is marked in flight, on the grace TTL, until the run sets its
    lease on the way: a life cycle waits for 2 round trips (the acquire, the
    finish), not 3 (issue 32).
    """
    broker = await make_broker(await_inplace=True, running_ttl=20)
    seen: list[tuple[str, int]] = []

    @broker.task(task_name=None, deduplication_ttl=60)
    async def job(n: int) -> int:
        if n == 1:  # the run that looks (its own reads are round trips too)
            await asyncio.sleep(0.05)  # the lease, set on the way, has landed
            (key,) = await lock_keys(redis_client, prefix)
            seen.append((await lock_value(redis_client, key), await redis_client.pttl(key)))
        return n

    await job.kiq(n=1)
    ((value, ttl_ms),) = seen
    assert value.startswith("~")
    assert not value.endswith("!")  # the run goes on: its send is no longer in flight
    assert 10_000 < ttl_ms <= 20_000  # the run's lease: not the grace TTL, nor the full TTL
    traffic = Traffic()
    traffic.install()
    try:
        await job.kiq(n=2)
    finally:
        traffic.uninstall()
    await dedup_middleware(broker).shutdown()  # sends what is queued
    # Waited for: the acquire and the finish; the lease went along with the finish.
    assert (traffic.round_trips, traffic.commands) == (2, 3)
    assert await lock_keys(redis_client, prefix) == []


async def test_a_duplicate_of_a_call_whose_run_is_about_to_begin_in_its_kiq_hears_it_is_unsent(
    make_broker: BrokerFactory, make_middleware: MiddlewareFactory
) -> None:
    """While the send that took the lock for its run is in flight, a refusal says so."""
    middlewares = [make_middleware(), _SlowSend(0.3)]
    broker = await make_broker(await_inplace=True, middlewares=middlewares)

    @broker.task(task_name=None, deduplication_ttl=60)
    async def job(n: int) -> None: ...

    async def duplicate() -> DuplicateTaskError:
        await asyncio.sleep(0.1)  # the first send holds the lock, its kick not begun
        with pytest.raises(DuplicateTaskError) as refused:
            await job.kiq(n=1)
        return refused.value

    _, refusal = await asyncio.gather(job.kiq(n=1), duplicate())
    assert refusal.holder_sent is False


class _SlowStart(TaskiqMiddleware):
    """Before ours: a run that begins ``delay`` seconds after its send took its lock."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        await asyncio.sleep(self.delay)
        return message


async def test_a_run_inside_its_own_kiq_that_begins_late_claims_its_lock(
    make_broker: BrokerFactory,
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    """Past half the grace TTL its send took the lock for, the lock may have lapsed: the run claims.

    The claim finds the run's own value (its send wrote it) and the run begins.
    """
    broker = await make_broker(await_inplace=True, middlewares=[_SlowStart(0.6), make_middleware()])
    ran: list[int] = []

    @broker.task(task_name=None, deduplication_ttl=1)  # a grace TTL of 1 s: half of it is 0.5 s
    async def job(n: int) -> None:
        ran.append(n)

    await redis_client.config_resetstat()
    await job.kiq(n=1)
    await dedup_middleware(broker).shutdown()
    assert ran == [1]
    assert await scripts_run(redis_client) == 3  # acquire, claim (it waited for it), finish
    assert await lock_keys(redis_client, prefix) == []


class _RefusingStart(TaskiqMiddleware):
    """Before ours: a run that never begins (its hook raises inside the broker's kick)."""

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        msg = "no run today"
        raise RuntimeError(msg)


async def test_a_lock_taken_for_a_run_that_never_began_goes_with_the_failed_kiq(
    make_broker: BrokerFactory,
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    """The kiq fails: the lock its send took, under the run's value, is released at once."""
    middlewares = [_RefusingStart(), make_middleware()]
    broker = await make_broker(await_inplace=True, middlewares=middlewares)

    @broker.task(task_name=None, deduplication_ttl=60)
    async def job(n: int) -> None: ...

    with pytest.raises(SendTaskError):
        await job.kiq(n=1)
    await dedup_middleware(broker).shutdown()  # sends the queued release
    assert await lock_keys(redis_client, prefix) == []


async def test_a_lock_taken_for_a_run_that_never_began_lives_its_lease(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    """The broker's receiver dropped the message (one it cannot parse): the grace TTL frees it.

    Nothing waits in a queue, so the lock does not get the full TTL of a queued message.
    """
    broker = await make_broker(await_inplace=True, running_ttl=20)

    async def dropped(*_args: object, **_kwargs: object) -> None:
        pass

    broker.receiver.callback = dropped  # type: ignore[method-assign]

    @broker.task(task_name=None, deduplication_ttl=600)
    async def job(n: int) -> None: ...

    await redis_client.config_resetstat()
    await job.kiq(n=1)
    await dedup_middleware(broker).shutdown()  # sends what is queued
    assert await scripts_run(redis_client) == 1  # no extension: the lock is the run's
    (key,) = await lock_keys(redis_client, prefix)
    assert (await lock_value(redis_client, key)).startswith("~")
    assert 0 < await redis_client.pttl(key) <= 10_000
    with pytest.raises(DuplicateTaskError):  # still a duplicate while it lives
        await job.kiq(n=1)


async def test_an_in_place_broker_with_a_kick_of_its_own_takes_the_lock_as_a_send(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    """A subclass whose ``kick`` may not run the task at once: its queued lock is a send's."""
    broker = await make_broker(broker_class=HoldingBroker, await_inplace=True, running_ttl=20)

    @broker.task(task_name=None, deduplication_ttl=600)
    async def job(n: int) -> int:
        return n

    await job.kiq(n=1)
    await dedup_middleware(broker).shutdown()  # sends the extension
    (key,) = await lock_keys(redis_client, prefix)
    assert not (await lock_value(redis_client, key)).startswith("~")
    assert await redis_client.pttl(key) > 500_000  # the full TTL of a queued message
    await broker.deliver()
    assert await lock_keys(redis_client, prefix) == []


class _FailingSend(TaskiqMiddleware):
    """After ours: a send that a later middleware refuses before the broker gets it."""

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        msg = "refused by a later middleware"
        raise RuntimeError(msg)


@pytest.mark.parametrize(
    ("heartbeat", "later"),
    [(True, "refuses"), (False, "refuses"), (False, "is cancelled")],
)
async def test_a_send_that_fails_after_taking_the_lock_for_its_run_leaves_the_grace_ttl(
    make_broker: BrokerFactory,
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    heartbeat: bool,
    later: str,
) -> None:
    """Design rule 4 holds for a lock taken for the run inside kiq() (found in review).

    No kick, so neither post_send nor the refusal runs: the lock is left to its
    TTL, which is the grace TTL, not the run's lease nor (without the
    heartbeat) the full TTL; it says its send was never accepted.
    """
    after = _FailingSend() if later == "refuses" else _SlowSend(5)
    broker = await make_broker(
        await_inplace=True, middlewares=[make_middleware(heartbeat=heartbeat), after]
    )

    @broker.task(task_name=None, deduplication_ttl=600)
    async def job(n: int) -> None: ...

    with pytest.raises(RuntimeError if later == "refuses" else asyncio.TimeoutError):
        await asyncio.wait_for(job.kiq(n=1), 0.5)
    await dedup_middleware(broker).shutdown()
    (key,) = await lock_keys(redis_client, prefix)
    assert (await lock_value(redis_client, key)).endswith("!")  # in flight, never accepted
    assert 0 < await redis_client.pttl(key) <= 10_000


class _SlowSend(TaskiqMiddleware):
    """After ours: a send that takes ``delay`` seconds before the broker gets it."""

    def __init__(self, delay: float = 1.2) -> None:
        super().__init__()
        self.delay = delay

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        await asyncio.sleep(self.delay)
        return message


async def test_runs_inside_their_own_kiq_do_not_overlap_when_a_slow_send_outlived_its_lock(
    make_broker: BrokerFactory, make_middleware: MiddlewareFactory
) -> None:
    """A's lock lapses while A is still being sent; B takes it, then both run inside kiq().

    The claim at each run's start is what keeps them apart: B's waits for A's
    run, though B's own send took its lock moments before (found in review).
    """
    # A send that takes longer than the lock's grace TTL.
    broker = await make_broker(await_inplace=True, middlewares=[make_middleware(), _SlowSend()])
    runs = Runs()

    @broker.task(task_name=None, deduplication_ttl=1)
    async def job(x: int) -> None:
        index = runs.begin()
        await asyncio.sleep(1.5)
        runs.end(index)

    async def second() -> None:
        await asyncio.sleep(1.1)  # A's lock (its grace TTL, 1 s) has lapsed
        await job.kiq(1)

    await asyncio.gather(job.kiq(1), second())
    assert len(runs.spans) == 2
    assert runs.overlaps() == 0


async def test_a_claim_finds_the_run_value_its_send_took_and_begins_under_any_token(
    redis_url: str, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    """A run whose send took the lock for it begins on that value, whatever run token it holds.

    The run that began late, or whose process forgot which run token its send
    drew (more sends in flight than it remembers), claims: the value is its
    task's, marked in flight, which only such a send writes. Another task's
    run waits for it.
    """
    client = redis.asyncio.Redis.from_url(redis_url)
    store = LockStore(client)
    await ready(store)
    try:
        lock = Lock(f"{prefix}:inplace", "tok", "task-1", 600_000)
        taken = answered(await store.acquire(lock, 10_000, record="f", for_run=True))
        assert taken.holder is None
        assert taken.run_token is not None
        assert (await lock_value(redis_client, lock.key)).endswith(" task-1!")
        sent = Lock(lock.key, taken.token or "", "task-1", 30_000)
        other = Lock(lock.key, "oth/1/f", "task-2", 30_000)
        elsewhere = Lock(lock.key, "~x/1/f", "task-2", 30_000)
        waits = answered(await store.claim(other, step="reassert", run=elsewhere))
        assert waits.wait_ms > 0  # another task's run waits for it
        run = Lock(lock.key, "~fresh/1/f", "task-1", 30_000)
        begun = answered(await store.claim(sent, step="reassert", run=run))
        assert (begun.wait_ms, begun.skipped_for) == (0, None)
        assert await lock_value(redis_client, lock.key) == run.value  # no "!" after it
        assert 20_000 < await redis_client.pttl(lock.key) <= 30_000  # the run's lease
    finally:
        await store.close()
        await client.aclose()


@pytest.mark.parametrize("policy", ["finished", "started", "expired"])
async def test_a_claim_sent_again_finds_its_own_run_and_begins(
    redis_url: str, redis_client: redis.asyncio.Redis, prefix: str, policy: str
) -> None:
    """A batch sent again after a lost connection runs its claim twice (found in review).

    The second run used to find the run's own token, mark it as waited for
    (`` +``) and answer "wait": the run then waited for itself, or its success
    was kept for the copies that never were.
    """
    client = redis.asyncio.Redis.from_url(redis_url)
    store = LockStore(client)
    await ready(store)
    try:
        lock = Lock(f"{prefix}:again", "tok/1/f", "task-1", 30_000)
        assert answered(await store.acquire(lock, 30_000)).holder is None
        beside = policy != "finished"
        run = Lock(f"{prefix}#run:again" if beside else lock.key, "~ok/1/f", "task-1", 30_000)
        step = {"finished": "reassert", "started": "release", "expired": "nothing"}[policy]
        for _ in range(2):
            claimed = answered(await store.claim(lock, step=step, run=run))
            assert claimed.wait_ms == 0
            assert claimed.skipped_for is None
        assert await redis_client.get(run.key) == run.value  # no " +" after it
    finally:
        await store.close()
        await client.aclose()


class _Gate(TaskiqMiddleware):
    """Before ours: runs wait until the test opens the gate (a middleware that holds them back)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        await self.open.wait()
        return message


async def test_a_queued_run_held_back_past_its_lease_keeps_its_call_locked(
    make_broker: BrokerFactory,
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    """Until its run begins, the lock its send took for it lives the full TTL of a queued call.

    A guard from issue 32: a version that took the lock for the run at the
    send, and gave it the run's lease of 2 s in its post_send, let the same
    call be queued again while the first was held back, and the run began on a
    lock that had lapsed.
    """
    gate = _Gate()
    broker = await make_broker(middlewares=[gate, make_middleware(running_ttl=2)])
    ran: list[int] = []
    during: list[bool] = []

    @broker.task(task_name=None, deduplication_ttl=60)
    async def job(n: int) -> None:
        ran.append(n)
        try:
            await job.kiq(n=n)
        except DuplicateTaskError:
            during.append(True)
        else:
            during.append(False)

    await job.kiq(n=1)
    await asyncio.sleep(2.5)  # past the run's lease
    with pytest.raises(DuplicateTaskError):
        await job.kiq(n=1)
    (key,) = await lock_keys(redis_client, prefix)
    assert await redis_client.pttl(key) > 50_000  # the full TTL, not the lease
    gate.open.set()
    await asyncio.wait_for(broker.wait_all(), 5)
    await dedup_middleware(broker).shutdown()
    assert ran == [1]
    assert during == [True]  # the run, begun late, holds its lock (it claimed it)
    assert await lock_keys(redis_client, prefix) == []


async def test_a_queued_run_without_the_heartbeat_holds_its_lock_for_the_ttl_from_its_start(
    make_broker: BrokerFactory, make_middleware: MiddlewareFactory
) -> None:
    """With no heartbeat to set its lease, the run gives its lock the TTL as it begins.

    A guard from issue 32: in a version that set the run's TTL in the send's
    post_send, the TTL of a run that began 0.6 s late lapsed 0.6 s before the
    end of a body that fits in it.
    """
    broker = await make_broker(middlewares=[_SlowStart(0.6), make_middleware(heartbeat=False)])
    outcome: list[str] = []

    @broker.task(task_name=None, deduplication_ttl=4)
    async def job(n: int) -> None:
        if outcome:
            return
        await asyncio.sleep(3.6)  # 4.2 s after the send, 3.6 s into a TTL of 4
        try:
            await job.kiq(n=n)
        except DuplicateTaskError:
            outcome.append("refused")
        else:
            outcome.append("accepted")

    await job.kiq(n=1)
    await asyncio.wait_for(broker.wait_all(), 10)
    await dedup_middleware(broker).shutdown()
    assert outcome == ["refused"]
