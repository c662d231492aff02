"""Keyed flow control (issue 34): the ``limit_*`` labels on real runs, on a real Redis.

Two brokers with a middleware each, in one event loop, stand for two workers:
each middleware keeps its own runs, waits and wake-ups, and they meet only in
Redis. The end-to-end tests with worker processes on the four brokers are in
``tests/e2e/test_limits.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio
from taskiq import InMemoryBroker, TaskiqDepends, TaskiqMessage

from taskiq_deduplication import DuplicateTaskError, LockEvent, LockEventKind, TaskLock
from taskiq_deduplication.middleware import loop_states
from taskiq_deduplication.model.limits import limit_keys, limit_name, read_limit
from taskiq_deduplication.observe.events import EventSink
from taskiq_deduplication.run.limits import Limits
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.lock_store import LockStore
from taskiq_deduplication.store.slots import Slot, Taken
from taskiq_deduplication.store.wakes import Wakes
from tests._brokers import HoldingBroker
from tests._locks import wait_until
from tests._server import free_port
from tests._topologies import all_topologies

if TYPE_CHECKING:
    from tests._brokers import BrokerFactory
    from tests._middlewares import MiddlewareFactory


class Ledger:
    """Who runs now, per limit, and the most that ever ran at once."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.starts: list[tuple[str, float]] = []

    async def run(self, key: str, seconds: float) -> None:
        self.running[key] = self.running.get(key, 0) + 1
        self.peak[key] = max(self.peak.get(key, 0), self.running[key])
        self.starts.append((key, time.monotonic()))
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running[key] -= 1


async def two_workers(make_broker: BrokerFactory, **options: Any) -> list[InMemoryBroker]:
    """Two brokers, each with a middleware of its own on the test's Redis and prefix."""
    return [await make_broker(**options), await make_broker(**options)]


async def results(handles: list[Any], timeout: float = 30.0) -> list[Any]:
    """The return values of ``handles``, each one's result awaited; a failure fails the test."""
    values = []
    for handle in handles:
        result = await handle.wait_result(timeout=timeout)
        assert not result.is_err, result.error
        values.append(result.return_value)
    return values


@all_topologies()
async def test_runs_of_a_limit_never_overlap_beyond_it_across_workers(
    make_broker: BrokerFactory,
) -> None:
    ledger = Ledger()
    handles = []
    for broker in await two_workers(make_broker, limit_waiting=50):

        @broker.task(task_name="limited", limit_concurrency=2, deduplication=False)
        async def limited(i: int) -> int:
            await ledger.run("limited", 0.02)
            return i

        handles += [await limited.kiq(i) for i in range(12)]
    assert sorted(await results(handles)) == sorted(list(range(12)) * 2)
    assert ledger.peak["limited"] == 2


async def test_a_limit_without_its_labels_has_no_effect(make_broker: BrokerFactory) -> None:
    # The control of the test above: without the label the same runs overlap,
    # so a peak of 2 there is the limit's doing.
    ledger = Ledger()
    broker = await make_broker()

    @broker.task(deduplication=False)
    async def free(i: int) -> int:
        await ledger.run("free", 0.05)
        return i

    await results([await free.kiq(i) for i in range(6)])
    assert ledger.peak["free"] > 2


async def test_a_rate_spaces_the_starts_of_its_runs(make_broker: BrokerFactory) -> None:
    ledger = Ledger()
    handles = []
    for broker in await two_workers(make_broker, limit_waiting=50):

        @broker.task(task_name="rated", limit_rate="5/s", limit_burst=2, deduplication=False)
        async def rated() -> None:
            await ledger.run("rated", 0)

        handles += [await rated.kiq() for _ in range(6)]
    await results(handles)
    starts = sorted(moment for _, moment in ledger.starts)
    assert len(starts) == 12
    # At most 5 + 2 - 1 starts in any second. A start comes at its place in
    # the rate or later (its event loop's lag): an interval's lag (200 ms)
    # would be needed to bring one more into a window; 20 ms of the clock's
    # read after Redis placed the start are allowed.
    for first in starts:
        assert sum(1 for s in starts if first <= s < first + 1.0 - 0.02) <= 6
    # And the rate holds them back: 12 starts at 5/s, 2 at once, take 2 s.
    assert starts[-1] - starts[0] >= 1.5


async def test_tasks_that_name_one_limit_key_share_it(make_broker: BrokerFactory) -> None:
    ledger = Ledger()
    broker = await make_broker(limit_waiting=50)

    @broker.task(limit_key="vendor-api", limit_concurrency=1, deduplication=False)
    async def fetch(i: int) -> None:
        await ledger.run("vendor-api", 0.02)

    @broker.task(limit_key="vendor-api", limit_concurrency=1, deduplication=False)
    async def push(i: int) -> None:
        await ledger.run("vendor-api", 0.02)

    handles = [await task.kiq(i) for i in range(5) for task in (fetch, push)]
    await results(handles)
    assert ledger.peak["vendor-api"] == 1


async def test_key_fields_make_one_limit_per_value(make_broker: BrokerFactory) -> None:
    ledger = Ledger()
    broker = await make_broker(limit_waiting=50)

    @broker.task(limit_concurrency=1, limit_key_fields=["tenant"], deduplication=False)
    async def report(tenant: str, i: int) -> None:
        await ledger.run(tenant, 0.05)
        await ledger.run("any", 0)

    handles = [
        await report.kiq(tenant=tenant, i=i) for i in range(4) for tenant in ("acme", "globex")
    ]
    await results(handles)
    assert ledger.peak["acme"] == 1
    assert ledger.peak["globex"] == 1
    # The tenants' limits are their own: their runs went side by side.
    starts = {key: [m for k, m in ledger.starts if k == key] for key in ("acme", "globex")}
    assert min(abs(a - g) for a in starts["acme"] for g in starts["globex"]) < 0.04


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({"limit_concurrency": 0}, "limit_concurrency"),
        ({"limit_concurrency": "two"}, "limit_concurrency"),
        ({"limit_rate": "5/d"}, "limit_rate"),
        ({"limit_rate": "five per second"}, "limit_rate"),
        ({"limit_rate": "0/s"}, "limit_rate"),
        ({"limit_rate": "5/s", "limit_burst": 0}, "limit_burst"),
        ({"limit_burst": 2}, "limit_burst"),
        ({"limit_key": "vendor"}, "limit_key"),
        ({"limit_concurrency": 1, "limit_key": ""}, "limit_key"),
        ({"limit_concurrency": 1, "limit_key_fields": "tenant"}, "limit_key_fields"),
        ({"limit_concurency": 1}, "limit_concurrency"),
        ({"limit_concurrency": 1, "limit_burst": 2}, "limit_burst"),
        ({"limit_rate": "1/30h"}, "limit_rate"),
        ({"limit_rate": "200000/s"}, "limit_rate"),
    ],
)
async def test_a_bad_limit_label_fails_the_kiq_and_the_startup_naming_it(
    make_broker: BrokerFactory, make_middleware: MiddlewareFactory, labels: Any, named: str
) -> None:
    broker = await make_broker()

    @broker.task(deduplication=False)
    async def job() -> None: ...

    with pytest.raises(ValueError, match=named):
        await job.kicker().with_labels(**labels).kiq()
    fresh = InMemoryBroker().with_middlewares(make_middleware())
    fresh.register_task(job.original_func, task_name="bad", **labels)
    with pytest.raises(ValueError, match=f"bad: .*{named}"):
        await fresh.startup()


async def test_a_failed_run_frees_its_slot(make_broker: BrokerFactory) -> None:
    broker = await make_broker(limit_waiting=50)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def flaky(fail: bool) -> str:
        await asyncio.sleep(0.01)
        if fail:
            raise RuntimeError("boom")
        return "ok"

    failing = await flaky.kiq(True)
    later = await flaky.kiq(False)
    assert (await failing.wait_result(timeout=10)).is_err
    assert (await later.wait_result(timeout=10)).return_value == "ok"


async def test_runs_past_the_waiting_bound_go_back_to_the_broker_and_all_run(
    make_broker: BrokerFactory,
) -> None:
    ledger = Ledger()
    broker = await make_broker(limit_waiting=1)
    events: list[LockEvent] = []
    broker.middlewares[0].subscribe(events.append)  # type: ignore[attr-defined]

    @broker.task(limit_concurrency=1, deduplication=False)
    async def slow(i: int) -> int:
        await ledger.run("slow", 0.03)
        return i

    handles = [await slow.kiq(i) for i in range(5)]
    assert sorted(await results(handles)) == list(range(5))
    assert ledger.peak["slow"] == 1
    requeued = [e for e in events if e.kind is LockEventKind.LIMITED and e.requeued]
    assert requeued, "no run went back to the broker"
    # Each call ran its body once: a delivery that went back ran nothing.
    assert len(ledger.starts) == 5


async def test_a_waiting_run_is_handed_the_slot_by_the_run_that_frees_it(
    make_broker: BrokerFactory,
) -> None:
    # A lease of 10 minutes: the refresh that would also find a slot handed
    # over comes only after 200 s. The waiter must be woken by the channel.
    broker = await make_broker(running_ttl=600, limit_waiting=50)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def one_at_a_time(i: int) -> int:
        await asyncio.sleep(0.01)
        return i

    handles = [await one_at_a_time.kiq(i) for i in range(4)]
    assert await asyncio.wait_for(results(handles), timeout=60) == [0, 1, 2, 3]


async def test_the_slot_of_a_run_whose_worker_died_lapses_within_its_lease(
    make_broker: BrokerFactory, prefix: str
) -> None:
    broker = await make_broker(running_ttl=2, limit_waiting=50)
    state = await loop_states(broker.middlewares[0]).current()  # type: ignore[arg-type]

    @broker.task(limit_concurrency=1, deduplication=False)
    async def after_death() -> float:
        return time.monotonic()

    # A worker that took the only slot and died: nobody refreshes it.
    dead = Slot(limit_keys(prefix, after_death.task_name), "dead-task", "~dead", 2000)
    assert isinstance(await state.locks.slots.take(dead, 1, None), Taken)

    sent = time.monotonic()
    started = (await results([await after_death.kiq()]))[0]
    assert started - sent >= 1.0


async def test_a_copy_of_a_running_message_takes_no_second_slot(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, limit_waiting=50)
    release = asyncio.Event()

    @broker.task(limit_concurrency=5)
    async def exclusive() -> None:
        await release.wait()

    await exclusive.kiq()
    message = broker.queued[0]
    first = asyncio.create_task(broker.receiver.callback(message=message.message))
    holders = limit_keys(prefix, exclusive.task_name).holders

    async def in_use() -> int:
        return int(await redis_client.zcard(holders))

    async def in_use_is(count: int) -> bool:
        return await in_use() == count

    await wait_until(lambda: in_use_is(1))
    copy = asyncio.create_task(broker.receiver.callback(message=message.message))
    await asyncio.sleep(0.3)  # the copy waits for its run, by the run slot of its lock
    assert await in_use() == 1
    release.set()
    await asyncio.wait_for(asyncio.gather(first, copy), timeout=20)
    assert await in_use() == 0


async def test_a_started_run_that_waits_for_its_limit_keeps_its_lock(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(limit_waiting=50)
    release = asyncio.Event()

    @broker.task(limit_concurrency=1, deduplication_until="started")
    async def guarded(i: int) -> int:
        await release.wait()
        return i

    running = await guarded.kiq(1)
    waiting = await guarded.kiq(2)
    await asyncio.sleep(0.3)  # the second run waits for the slot, still queued
    with pytest.raises(DuplicateTaskError):
        await guarded.kiq(2)
    release.set()
    assert await results([running, waiting]) == [1, 2]


async def test_a_run_that_waits_says_so_and_how_long(make_broker: BrokerFactory) -> None:
    broker = await make_broker(limit_waiting=50)
    events: list[LockEvent] = []
    broker.middlewares[0].subscribe(events.append)  # type: ignore[attr-defined]

    @broker.task(limit_concurrency=1, deduplication=False)
    async def paced() -> None:
        await asyncio.sleep(0.1)

    await results([await paced.kiq(), await paced.kiq()])
    limited = [e for e in events if e.kind is LockEventKind.LIMITED]
    waited = [e for e in events if e.kind is LockEventKind.WAITED]
    assert len(limited) == 1
    assert limited[0].requeued is False
    assert limited[0].key is not None
    assert limited[0].key.endswith("{" + paced.task_name + "}")
    assert len(waited) == 1
    assert waited[0].waited is not None
    assert waited[0].waited > 0.05


async def test_no_slot_is_left_behind_once_every_run_ended(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(limit_waiting=2)

    @broker.task(limit_concurrency=2, limit_key_fields=["n"], deduplication=False)
    async def many(n: int, i: int) -> None:
        await asyncio.sleep(0.005)

    await results([await many.kiq(n=i % 3, i=i) for i in range(30)])
    await asyncio.sleep(0.1)  # the last frees ride on no later call: they go at the turn's end
    keys = [k async for k in redis_client.scan_iter(match=f"{prefix}#limit:*")]
    assert keys
    for key in keys:
        if key.endswith(("}", ":tokens", ":waiting", ":leases")):
            assert await redis_client.exists(key) == 0, key


async def test_a_unique_limit_key_is_cleaned_away_after_its_lease(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(running_ttl=1)
    name = f"once-{uuid.uuid4().hex[:6]}"

    @broker.task(limit_key=name, limit_concurrency=1, deduplication=False)
    async def once() -> None: ...

    await results([await once.kiq()])
    meta = limit_keys(prefix, name).meta
    ttl = await redis_client.pttl(meta)
    assert 0 < ttl <= 3000


async def test_a_run_whose_slot_lapsed_is_fenced(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker()
    seen: list[bool] = []
    running, go_on = asyncio.Event(), asyncio.Event()

    @broker.task(limit_concurrency=1, deduplication=False)
    async def fenced(lock: TaskLock = TaskiqDepends()) -> None:
        seen.append(await lock.held())
        running.set()
        await go_on.wait()
        seen.append(await lock.held())

    handle = await fenced.kiq()
    await asyncio.wait_for(running.wait(), timeout=10)
    # Its worker was cut off past the lease: Redis holds its slot as lapsed.
    holders = limit_keys(prefix, fenced.task_name).holders
    await redis_client.zadd(holders, {handle.task_id: 1})
    go_on.set()
    await results([handle])
    assert seen == [True, False]


async def test_a_slot_handed_over_before_its_run_watches_is_not_lost(
    redis_client: redis.asyncio.Redis, redis_url: str, prefix: str
) -> None:
    # The take's reply says "wait"; before the run comes to watch, the slot is
    # handed to it on a channel this loop listens to already (another run of
    # the limit waits here). The hand-over must wait for it, not be dropped.
    client = redis.asyncio.Redis.from_url(redis_url)
    wakes = Wakes(client)
    channel = limit_keys(prefix, "early").holders
    try:
        loop = asyncio.get_running_loop()
        other, look_again = await wakes.watch(channel, "~other other-task", loop.time())
        assert look_again  # its take came before the subscription
        await redis_client.publish(channel, "~late late-task 1500")
        await wait_until(lambda: _heard(wakes))
        late, look_again = await wakes.watch(channel, "~late late-task", loop.time())
        assert not look_again  # its take came after the subscription
        assert await asyncio.wait_for(late, timeout=1) == 0.0015
        assert not other.done()
    finally:
        await wakes.close()
        await client.aclose()


async def _heard(wakes: Wakes) -> bool:
    return bool(wakes._early)


async def test_runs_that_wait_for_a_limit_start_in_the_order_they_came(
    make_broker: BrokerFactory,
) -> None:
    workers = await two_workers(make_broker, limit_waiting=50)
    release = asyncio.Event()
    order: list[int] = []
    tasks = []
    for broker in workers:

        @broker.task(task_name="in_order", limit_concurrency=1, deduplication=False)
        async def in_order(i: int) -> None:
            order.append(i)
            if i == 0:
                await release.wait()

        tasks.append(in_order)
    handles = [await tasks[0].kiq(0)]
    await wait_until(lambda: _started(order))
    for i in range(1, 9):  # the two workers in turn: one line across them
        handles.append(await tasks[i % 2].kiq(i))
        await asyncio.sleep(0.05)  # each has taken its place before the next comes
    release.set()
    await results(handles)
    assert order == list(range(9))


async def _started(order: list[int]) -> bool:
    return bool(order)


async def test_a_run_whose_slot_lapsed_under_it_is_told_by_its_refresh(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = await make_broker(running_ttl=3)  # a refresh every second
    running = asyncio.Event()

    @broker.task(limit_concurrency=1, deduplication=False)
    async def long_one() -> None:
        running.set()
        await asyncio.sleep(2.5)

    handle = await long_one.kiq()
    await asyncio.wait_for(running.wait(), timeout=10)
    # Redis lost the limit (a restart without persistence): the refresh finds no slot.
    await redis_client.delete(*limit_keys(prefix, long_one.task_name).all)
    with caplog.at_level(logging.WARNING):
        await results([handle])
    assert any("lost its slot" in r.getMessage() for r in caplog.records)


async def test_a_bad_limit_label_a_sender_did_not_check_runs_without_its_limit(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task(deduplication=False)
    async def job() -> str:
        return "ran"

    handle = await job.kiq()
    # A sender without this middleware: the label was never checked.
    broker.queued[0].labels["limit_concurrency"] = "none"
    message = broker.formatter.loads(broker.queued[0].message)
    message.labels["limit_concurrency"] = "none"
    broker.queued[0] = broker.formatter.dumps(message)
    with caplog.at_level(logging.WARNING):
        await broker.deliver()
    assert (await handle.wait_result(timeout=5)).return_value == "ran"
    assert any("runs without its limit" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("label", "spelt"),
    [("10/s", "10/s"), ("2/5s", "2/5s"), ("3/m", "3/m"), ("1/120s", "1/2m"), ("4/h", "4/h")],
)
def test_a_rate_says_itself_as_its_label_does(label: str, spelt: str) -> None:
    rule = read_limit({"limit_rate": label})
    assert rule is not None
    assert rule.rate is not None
    assert str(rule.rate) == spelt


def test_a_limit_per_key_field_is_named_by_a_digest_of_any_value() -> None:
    rule = read_limit({"limit_concurrency": 1, "limit_key_fields": ["owner"]})
    assert rule is not None

    def name(owner: object) -> str:
        message = TaskiqMessage(
            task_id="t", task_name="report", labels={}, args=[], kwargs={"owner": owner}
        )
        return rule.name_of(message)

    assert name(1.5).startswith("report:")
    assert name(1.5) == name(1.5)
    assert len({name(1), name(1.0), name(True), name("1")}) == 4
    assert "secret" not in name("secret")


async def test_key_fields_that_cannot_be_fingerprinted_run_without_their_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rule = read_limit({"limit_concurrency": 1, "limit_key_fields": ["owner"]})
    assert rule is not None
    limits = Limits("test", None, 2, EventSink())
    message = TaskiqMessage(
        task_id="t", task_name="report", labels={}, args=[], kwargs={"owner": object()}
    )
    with caplog.at_level(logging.WARNING):
        assert await limits.begin(rule, message, state=None) is None  # type: ignore[arg-type]
    assert any("cannot be fingerprinted" in r.getMessage() for r in caplog.records)


def test_only_a_limit_s_record_names_a_limit() -> None:
    keys = limit_keys("app", "vendor")
    assert limit_name("app", keys.meta) == "vendor"
    assert limit_name("app", keys.holders) is None
    assert limit_name("other", keys.meta) is None


async def test_a_channel_that_cannot_be_subscribed_leaves_its_waiters_to_look_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = redis.asyncio.Redis(port=free_port(), socket_connect_timeout=0.5)
    wakes = Wakes(client)
    try:
        with caplog.at_level(logging.WARNING):
            future, look_again = await wakes.watch("nowhere", "~run task", 0.0)
        assert look_again  # the refreshes wake it, and it looks once more now
        assert not future.done()
        assert any("Could not listen" in r.getMessage() for r in caplog.records)
        wakes.wake("nowhere", "~run task", 0.25)  # a refresh found its slot handed over
        assert future.result() == 0.25
    finally:
        wakes.forget("nowhere", "~run task")
        await wakes.close()
        await client.aclose()


async def test_the_slots_of_a_closed_store_answer_that_redis_failed(
    redis_url: str, prefix: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    store = LockStore(client)
    await store.close()
    slot = Slot(limit_keys(prefix, "closed"), "task", "~run", 1000)
    try:
        assert isinstance(await store.slots.take(slot, 1, None), RedisFailed)
        assert isinstance(await store.slots.keep([slot]), RedisFailed)
    finally:
        await client.aclose()
