"""Lock policies: what counts as a duplicate while a task is queued, runs and after it ends.

Each test runs real sends through a real Redis; the broker that holds its
messages until the test delivers them lets a task wait "in the queue".
"""

from __future__ import annotations

import asyncio
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

from taskiq_deduplication import DeduplicationError, DuplicateTaskError
from tests._brokers import BrokerFactory, HoldingBroker, KeptSchedules, queued_job
from tests._locks import lock_keys, lock_value, scripts_run
from tests._middlewares import MiddlewareFactory, dedup_middleware, each_retry_order, running_beats
from tests._topologies import all_topologies
from tests.benchmarks.harness import Traffic

# The labels of each policy under test, and the table of docs/usage.md: whether
# a second identical call is refused while the first is queued, while it runs,
# after it finished successfully, and after it failed (for good).
POLICIES: dict[str, dict[str, Any]] = {
    "finished": {},
    "finished+success_ttl": {"deduplication_success_ttl": 60},
    "started": {"deduplication_until": "started"},
    "expired": {"deduplication_until": "expired"},
}
REFUSED = {
    #                        queued running success failure
    "finished": (True, True, False, False),
    "finished+success_ttl": (True, True, True, False),
    "started": (True, False, False, False),
    "expired": (True, True, True, True),
}
ROWS = ("queued", "running", "success", "failure")


async def _refused(call: Any) -> bool:
    try:
        await call()
    except DuplicateTaskError:
        return True
    return False


@all_topologies()
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("policy", POLICIES)
async def test_what_counts_as_a_duplicate(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, policy: str, row: str
) -> None:
    seen: list[bool] = []

    @broker.task(task_name=None, **POLICIES[policy])
    async def job(n: int) -> str:
        if row == "running" and not seen:
            seen.append(await _refused(lambda: job.kiq(n=n)))
        if row == "failure":
            msg = "the task fails"
            raise RuntimeError(msg)
        return "done"

    first = await job.kiq(n=1)
    if row == "queued":
        seen.append(await _refused(lambda: job.kiq(n=1)))
    else:
        await broker.deliver()
        if row != "running":
            broker.queued.clear()
            seen.append(await _refused(lambda: job.kiq(n=1)))
    assert seen == [REFUSED[policy][ROWS.index(row)]]
    if policy == "finished+success_ttl" and row == "success":
        # The lock still names the finished task: its result can be read.
        (key,) = await lock_keys(redis_client, broker_prefix(broker))
        assert (await lock_value(redis_client, key)).endswith(" " + first.task_id)
        assert (await first.wait_result(timeout=5)).return_value == "done"


def broker_prefix(broker: Any) -> str:
    return str(dedup_middleware(broker).key_prefix)


@pytest.mark.parametrize("policy", POLICIES)
async def test_every_policy_lets_a_call_through_after_the_ttl(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str, policy: str
) -> None:
    labels = {**POLICIES[policy], "deduplication_ttl": 1}
    if "deduplication_success_ttl" in labels:
        labels["deduplication_success_ttl"] = 1
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task(task_name=None, **labels)
    async def job(n: int) -> None: ...

    await job.kiq(n=1)
    await broker.deliver()
    await dedup_middleware(broker).shutdown()  # sends what is queued
    for key in await lock_keys(redis_client, prefix):
        assert 0 < await redis_client.pttl(key) <= 1000
    await asyncio.sleep(1.1)
    await job.kiq(n=1)  # accepted


@pytest.mark.parametrize(
    ("policy", "exclusive", "scripts"),
    [
        # acquire + extend after the send, then at run time:
        ("finished", True, 4),  # take the lock as the run slot at start, free it at the end
        ("finished", False, 4),  # re-assert at start, release at the end
        ("finished+success_ttl", True, 4),  # take at start, keep as succeeded at the end
        ("finished+success_ttl", False, 4),  # re-assert at start, keep at the end
        ("started", True, 4),  # release and take the run slot at start, free it at the end
        ("started", False, 3),  # release at start
        ("expired", True, 4),  # take the run slot at start, free it at the end
        ("expired", False, 2),  # nothing
    ],
)
async def test_round_trips_of_each_policy(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    policy: str,
    exclusive: bool,
    scripts: int,
) -> None:
    broker = await make_broker()

    @broker.task(task_name=None, deduplication_exclusive=exclusive, **POLICIES[policy])
    async def job(n: int, fail: bool = False) -> None:
        if fail:
            msg = "the task fails"
            raise RuntimeError(msg)

    async def scripts_for(n: int, *, fail: bool) -> int:
        await redis_client.config_resetstat()
        await (await job.kiq(n=n, fail=fail)).wait_result(timeout=5)
        await broker.wait_all()
        await dedup_middleware(broker).shutdown()  # sends what is queued
        return await scripts_run(redis_client)

    assert await scripts_for(1, fail=False) == scripts
    assert await scripts_for(2, fail=True) == scripts  # a failure costs what a success does
    assert running_beats(dedup_middleware(broker)) == []


@pytest.mark.parametrize(
    ("policy", "exclusive", "scripts"),
    [
        # acquire, then the run inside kiq(), then the send's extension, unless
        # the run already replaced or ended the send's lock:
        ("finished", True, 3),  # the acquire wrote the run's value; the run set its lease
        ("finished", False, 3),  # the release ended it
        ("finished+success_ttl", True, 3),
        ("finished+success_ttl", False, 3),  # kept for the success TTL, not stretched
        ("started", True, 3),  # the claim released it
        ("started", False, 2),  # released at start
        ("expired", True, 4),  # the lock is still the send's: it gets its full TTL
        ("expired", False, 2),  # nothing at the start, the lock's TTL said at the send
    ],
)
async def test_a_run_inside_kiq_leaves_out_the_extension_it_made_pointless(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    policy: str,
    exclusive: bool,
    scripts: int,
) -> None:
    """An in-process broker runs the task inside ``kiq``, before the send's post_send."""
    broker = await make_broker(await_inplace=True)

    @broker.task(task_name=None, deduplication_exclusive=exclusive, **POLICIES[policy])
    async def job(n: int) -> None: ...

    await redis_client.config_resetstat()
    await job.kiq(n=1)
    await dedup_middleware(broker).shutdown()  # sends what is queued
    assert await scripts_run(redis_client) == scripts


class _RoundTripsAtTheEnd(TaskiqMiddleware):
    """Put first: the round trips made by the time the deduplication middleware ended a run."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic
        self.at_end: int | None = None

    def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        self.at_end = self.traffic.round_trips


@pytest.mark.parametrize("policy", ["started", "expired"])
async def test_an_exclusive_run_beside_its_lock_waits_for_no_round_trip_more(
    make_broker: BrokerFactory,
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    policy: str,
) -> None:
    """The run slot's end goes without a round trip of its own, and still frees the slot."""
    round_trips: dict[bool, int | None] = {}
    for n, exclusive in enumerate((False, True)):
        traffic = Traffic()
        end = _RoundTripsAtTheEnd(traffic)
        # taskiq calls post_execute in the reverse order: this one after ours.
        broker = await make_broker(middlewares=[end, make_middleware()])

        @broker.task(task_name=None, deduplication_exclusive=exclusive, **POLICIES[policy])
        async def job(n: int) -> None: ...

        traffic.install()
        try:
            await (await job.kiq(n=n)).wait_result(timeout=5)
            await broker.wait_all()
        finally:
            traffic.uninstall()
        round_trips[exclusive] = end.at_end
        await dedup_middleware(broker).shutdown()  # sends what is queued
    # The kiq's round trip, and the start's: under "started" the claim takes
    # the place of the release; under "expired", where nothing ran at the
    # start, the claim that takes the slot is the one round trip a run must
    # wait for. Neither waits at the end.
    assert round_trips == ({False: 2, True: 2} if policy == "started" else {False: 1, True: 2})
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}#run:*")] == []


async def test_started_releases_at_start_with_no_heartbeat_when_runs_may_overlap(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    during: list[Any] = []

    @broker.task(
        deduplication_until="started", deduplication_key="refresh", deduplication_exclusive=False
    )
    async def refresh() -> None:
        during.append(await lock_keys(redis_client, prefix))
        during.append(len(running_beats(dedup_middleware(broker))))
        second = await refresh.kiq()  # accepted while the first runs, and queued
        during.append(second.task_id)

    first = await refresh.kiq()
    await broker.deliver_one()
    assert during[:2] == [[], 0]
    # The copy queued while the first ran holds the lock now; it runs once.
    (key,) = await lock_keys(redis_client, prefix)
    assert (await lock_value(redis_client, key)).endswith(" " + during[2])
    assert during[2] != first.task_id


async def test_expired_leaves_the_lock_to_its_ttl_however_the_run_ends(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_until="expired", deduplication_ttl=30)
    async def digest(user_id: int) -> None:
        if user_id == 2:
            msg = "the task fails"
            raise RuntimeError(msg)

    for user_id in (1, 2):
        sent = await digest.kiq(user_id=user_id)
        await broker.deliver()
        assert running_beats(dedup_middleware(broker)) == []
    await dedup_middleware(broker).shutdown()
    keys = await lock_keys(redis_client, prefix)
    assert len(keys) == 2
    for key in keys:
        assert 25_000 < await redis_client.pttl(key) <= 30_000
    holders = {(await lock_value(redis_client, key)).split(" ")[1] for key in keys}
    assert sent.task_id in holders  # the failed run's lock is there too


@each_retry_order
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_retry_is_never_its_own_duplicate_nor_lost(
    retry_and_dedup: list[TaskiqMiddleware],
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    policy: str,
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, middlewares=retry_and_dedup)
    dedup = dedup_middleware(broker)
    attempts: list[str] = []
    refused_between: list[str | None] = []

    @broker.task(task_name=None, retry_on_error=True, deduplication_ttl=30, **POLICIES[policy])
    async def flaky(user_id: int, context: Context = TaskiqDepends()) -> str:
        attempts.append(context.message.task_id)
        if len(attempts) < 3:
            msg = "not yet"
            raise RuntimeError(msg)
        return "done"

    first = await flaky.kiq(user_id=7)
    expected_lock = await lock_keys(redis_client, prefix)
    value = await lock_value(redis_client, expected_lock[0])
    while broker.queued:
        await broker.deliver_one()
        # Between attempts, the retry waits in the queue: a new call is refused
        # while it holds the lock (every policy counts a queued copy).
        if broker.queued:
            try:
                await flaky.kiq(user_id=7)
            except DuplicateTaskError as err:
                refused_between.append(err.holder_task_id)
    assert attempts == [first.task_id] * 3
    assert refused_between == [first.task_id] * 2
    assert (await first.wait_result(timeout=5)).return_value == "done"
    assert running_beats(dedup) == []
    await dedup.shutdown()
    keys = await lock_keys(redis_client, prefix)
    if policy == "expired":
        # The retries kept the first send's lock as it was: same owner, and the
        # window was never extended past the first send's TTL.
        assert keys == expected_lock
        assert await lock_value(redis_client, keys[0]) == value
        assert 0 < await redis_client.pttl(keys[0]) <= 30_000
    elif policy == "finished+success_ttl":
        assert len(keys) == 1
        assert 50_000 < await redis_client.pttl(keys[0]) <= 60_000
    else:
        assert keys == []


@pytest.mark.parametrize("policy", POLICIES)
async def test_exhausted_retries_end_the_lock_as_a_failure(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str, policy: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, retries=3)
    attempts = 0

    @broker.task(task_name=None, retry_on_error=True, **POLICIES[policy])
    async def hopeless() -> None:
        nonlocal attempts
        attempts += 1
        msg = "never works"
        raise RuntimeError(msg)

    await hopeless.kiq()
    await broker.deliver()
    assert attempts == 3
    refused = await _refused(hopeless.kiq)
    assert refused is (policy == "expired")  # a failure frees every other policy's lock


async def test_a_started_retry_goes_out_without_a_lock_behind_a_copy_queued_meanwhile(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, retries=2)
    runs: list[str] = []

    @broker.task(task_name=None, retry_on_error=True, deduplication_until="started")
    async def refresh(shard: int, context: Context = TaskiqDepends()) -> None:
        runs.append(context.message.task_id)
        if len(runs) == 1:
            await refresh.kiq(shard=shard)  # accepted while the first runs
            msg = "the first run fails"
            raise RuntimeError(msg)

    first = await refresh.kiq(shard=1)
    await broker.deliver()
    # The retry was not refused: both the copy and the retry ran.
    assert len(runs) == 3
    assert runs.count(first.task_id) == 2
    assert await lock_keys(redis_client, prefix) == []


@pytest.mark.parametrize("policy", ["started", "expired"])
async def test_a_requeue_under_each_policy(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str, policy: str
) -> None:
    runs = 0

    @broker.task(task_name=None, deduplication_ttl=30, **POLICIES[policy])
    async def job(context: Context = TaskiqDepends()) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            await context.requeue()

    await job.kiq()
    await broker.deliver_one()  # requeues
    assert len(broker.queued) == 1
    await dedup_middleware(broker).shutdown()
    # The requeued copy waits in the queue holding the lock, as a new one would.
    (key,) = await lock_keys(redis_client, prefix)
    assert 25_000 < await redis_client.pttl(key) <= 30_000
    assert await _refused(job.kiq)
    await broker.deliver()
    assert runs == 2
    assert (await lock_keys(redis_client, prefix) == []) is (policy == "started")


@pytest.mark.parametrize("policy", ["started", "expired"])
async def test_a_retry_left_to_a_schedule_source_under_each_policy(
    make_middleware: MiddlewareFactory,
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    policy: str,
) -> None:
    source = KeptSchedules()
    retry = SmartRetryMiddleware(
        default_retry_count=3, default_delay=30, use_jitter=False, schedule_source=source
    )
    broker = await make_broker(
        broker_class=HoldingBroker, middlewares=[make_middleware(default_ttl=60), retry]
    )
    attempts = 0

    @broker.task(task_name=None, retry_on_error=True, **POLICIES[policy])
    async def flaky(n: int) -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            msg = "first attempt fails"
            raise RuntimeError(msg)
        return "done"

    first = await flaky.kiq(n=1)
    (key,) = await lock_keys(redis_client, prefix)
    value = await lock_value(redis_client, key)
    await broker.deliver()  # attempt 1 fails; the retry waits in the schedule source
    (scheduled,) = source.schedules
    await dedup_middleware(broker).shutdown()
    assert await lock_value(redis_client, key) == value  # held for the retry to come
    await TaskiqScheduler(broker, [source]).on_ready(source, scheduled)
    assert len(broker.queued) == 1  # the retry was not refused as its own duplicate
    assert await _refused(lambda: flaky.kiq(n=1))
    await broker.deliver()
    assert attempts == 2
    assert (await first.wait_result(timeout=5)).return_value == "done"
    await dedup_middleware(broker).shutdown()
    if policy == "expired":
        assert await lock_value(redis_client, key) == value  # the window, untouched
        assert await redis_client.pttl(key) <= 60_000
    else:
        assert await lock_keys(redis_client, prefix) == []


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({"deduplication_until": "later"}, "deduplication_until"),
        ({"deduplication_until": ""}, "deduplication_until"),
        ({"deduplication_until": 5}, "deduplication_until"),
        ({"deduplication_success_ttl": -1}, "deduplication_success_ttl"),
        ({"deduplication_success_ttl": "a day"}, "deduplication_success_ttl"),
        ({"deduplication_success_ttl": 1.5}, "deduplication_success_ttl"),
        ({"deduplication_success_ttl": True}, "deduplication_success_ttl"),
        (
            {"deduplication_until": "started", "deduplication_success_ttl": 60},
            "deduplication_success_ttl",
        ),
        (
            {"deduplication_until": "expired", "deduplication_success_ttl": "60"},
            "deduplication_success_ttl",
        ),
        (
            {"deduplication_until": "started", "deduplication_running_ttl": 5},
            "deduplication_running_ttl",
        ),
    ],
)
async def test_bad_policy_labels_are_refused_at_kiq_with_nothing_locked_or_sent(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    labels: dict[str, Any],
    named: str,
) -> None:
    broker, job = await queued_job(make_broker)

    for given in (labels, {k: str(v) for k, v in labels.items()}):  # as the scheduler sends
        with pytest.raises(ValueError, match=named) as caught:
            await job.kicker().with_labels(**given).kiq()
        assert isinstance(caught.value, DeduplicationError)
    assert broker.queued == []
    assert await lock_keys(redis_client, prefix) == []


@pytest.mark.parametrize(
    ("labels", "policy"),
    [
        ({"deduplication_until": "Started"}, "started"),
        ({"deduplication_until": " expired "}, "expired"),
        ({"deduplication_until": "finished", "deduplication_success_ttl": "0"}, "finished"),
        ({"deduplication_until": "started", "deduplication_success_ttl": 0}, "started"),
    ],
)
async def test_policy_labels_in_their_string_forms(
    make_broker: BrokerFactory, labels: dict[str, Any], policy: str
) -> None:
    broker, job = await queued_job(make_broker)

    await job.kicker().with_labels(**labels).kiq()
    (message,) = broker.queued
    assert message.labels.get("_deduplication_lock_until", "finished") == policy


async def test_middleware_defaults_set_the_policy_and_the_success_ttl(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(
        broker_class=HoldingBroker, default_until="started", default_success_ttl=60
    )

    @broker.task
    async def refresh() -> None: ...

    @broker.task(deduplication_until="finished")
    async def charge() -> None: ...

    await refresh.kiq()
    await charge.kiq()
    await broker.deliver()
    await dedup_middleware(broker).shutdown()
    # refresh released at start (the success TTL means nothing to it); charge
    # stays for the default success TTL.
    (key,) = await lock_keys(redis_client, prefix)
    assert 50_000 < await redis_client.pttl(key) <= 60_000
    await refresh.kiq()
    assert await _refused(charge.kiq)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"default_until": "later"}, "default_until"),
        ({"default_until": None}, "default_until"),
        ({"default_success_ttl": -1}, "default_success_ttl"),
        ({"default_success_ttl": 1.5}, "default_success_ttl"),
        ({"default_success_ttl": True}, "default_success_ttl"),
    ],
)
def test_bad_policy_options_are_refused_at_construction(
    make_middleware: MiddlewareFactory, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        make_middleware(**options)
