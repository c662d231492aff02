"""At the call site and inside the task: join, merge, debounce, same_arguments, TaskLock.

Real sends through a real Redis; the broker that holds its messages until the
test delivers them lets a task wait "in the queue".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest
import redis.asyncio
from redis.exceptions import RedisError
from taskiq import (
    BrokerMessage,
    Context,
    InMemoryBroker,
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqDepends,
    TaskiqMiddleware,
)
from taskiq.exceptions import SendTaskError
from taskiq.kicker import AsyncKicker

from taskiq_deduplication import (
    DuplicateTaskError,
    JoinedTask,
    NoLockError,
    RedisDeduplicationMiddleware,
    TaskLock,
    kiq_or_join,
)
from taskiq_deduplication.calls import takes_task_lock
from tests._brokers import BrokerFactory, HoldingBroker, merged_into, queued_job, retry_middleware
from tests._locks import lock_keys, lock_value, scripts_run, wait_until, without_done
from tests._middlewares import MiddlewareFactory, dedup_middleware, each_retry_order, running_beats
from tests._server import Server
from tests._topologies import all_topologies
from tests.test_redis_trouble import FAST


async def refusal(call: Any) -> DuplicateTaskError:
    with pytest.raises(DuplicateTaskError) as caught:
        await call()
    return caught.value


# Join


async def test_join_hands_back_the_winner_whose_result_both_callers_get(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis
) -> None:
    @broker.task(deduplication_key_fields=["user_id"])
    async def build_report(user_id: int, tag: str) -> str:
        return f"report {user_id} {tag}"

    first = await kiq_or_join(build_report, user_id=42, tag="first")
    await redis_client.config_resetstat()
    second = await kiq_or_join(
        build_report.kicker().with_labels(deduplication_ttl=60), user_id=42, tag="second"
    )
    assert await scripts_run(redis_client) == 1  # the refused acquire, nothing more
    assert isinstance(first, JoinedTask)
    assert (first.joined, second.joined) == (False, True)
    assert second.task_id == first.task_id
    assert second.duplicate is not None
    assert second.duplicate.same_arguments is False
    await broker.deliver()
    for handle in (first, second):
        assert (await handle.wait_result(timeout=5)).return_value == "report 42 first"


async def test_a_join_is_logged_as_a_join_whatever_its_other_arguments(
    broker: HoldingBroker, caplog: pytest.LogCaptureFixture
) -> None:
    @broker.task(deduplication_key_fields=["user_id"])
    async def build_report(user_id: int, tag: str = "") -> None: ...

    def said() -> list[tuple[int, str]]:
        return [(r.levelno, r.getMessage()) for r in caplog.records]

    sent = await build_report.kiq(user_id=1)
    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    for tag in ("", "other"):  # other non-key arguments are the point of key fields
        caplog.clear()
        assert (await kiq_or_join(build_report, user_id=1, tag=tag)).joined
        ((level, text),) = said()
        assert level == logging.INFO
        assert f"joined task {sent.task_id}" in text
        assert "not sent" not in text
        assert "other" not in text  # the arguments themselves are never logged
    caplog.clear()
    await refusal(lambda: build_report.kiq(user_id=1))  # a plain kiq is refused, at INFO
    assert [(level, "not sent" in text) for level, text in said()] == [(logging.INFO, True)]


async def test_join_of_a_holder_this_library_did_not_write_raises(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_key="shared")
    async def job() -> None: ...

    await redis_client.set(f"{prefix}:shared", "not-ours", px=30_000)
    caught = await refusal(lambda: kiq_or_join(job))
    assert caught.holder_task_id is None
    assert broker.queued == []


# same_arguments


async def test_same_arguments_says_whether_the_holder_was_called_alike(
    broker: HoldingBroker,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @broker.task(deduplication_key_fields=["user_id"])
    async def charge(user_id: int, amount: int) -> None: ...

    @broker.task
    async def plain(n: int) -> None: ...

    await charge.kiq(user_id=1, amount=10)
    await plain.kiq(n=1)
    (key, *_) = await lock_keys(redis_client, prefix)
    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    assert (await refusal(lambda: charge.kiq(user_id=1, amount=10))).same_arguments is True
    caplog.clear()
    other = await refusal(lambda: charge.kiq(user_id=1, amount=99999))
    assert other.same_arguments is False
    (said,) = [r for r in caplog.records if r.name == "taskiq_deduplication.refusals"]
    assert said.levelno == logging.INFO
    assert "other arguments" in said.getMessage()
    assert other.key in said.getMessage()
    assert "charge" in said.getMessage()
    assert "99999" not in caplog.text  # never the arguments
    assert (await refusal(lambda: plain.kiq(n=1))).same_arguments is True  # a fingerprint
    # A holder sent by a version without the digest: it cannot be told.
    for lock in await lock_keys(redis_client, prefix):
        value = await lock_value(redis_client, lock)
        if "." in value.split(" ")[0]:
            await redis_client.set(lock, "AAAAAAAAAAA " + value.split(" ")[1], keepttl=True)
    assert (await refusal(lambda: charge.kiq(user_id=1, amount=10))).same_arguments is None
    assert key


async def test_a_lock_value_stays_61_bytes_whatever_its_key(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task
    async def plain(n: int) -> None: ...

    @broker.task(deduplication_key_fields=["n"])
    async def fields(n: int, extra: str) -> None: ...

    @broker.task(deduplication_key="nightly")
    async def fenced(lock: TaskLock = TaskiqDepends()) -> None: ...

    await plain.kiq(n=1)
    await fields.kiq(n=1, extra="x")
    await fenced.kiq()
    keys = await lock_keys(redis_client, prefix)
    assert len(keys) == 3
    names = {plain.task_name, fields.task_name, fenced.task_name}
    for key in keys:
        value = await lock_value(redis_client, key)
        # 11 of owner token, 16 of record (time, policy), a space, 32 of task_id,
        # and "!" while the extension is on its way (docs/performance.md); and
        # the task's name after a "/", recorded by default.
        name = next(name for name in names if f"/{name} " in value)
        assert len(value) <= 61 + 1 + len(name)


# Merge


async def test_twenty_merges_into_one_queued_copy_run_once_with_the_last_arguments(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    ran: list[tuple[int, list[str]]] = []

    @broker.task(deduplication_key_fields=["user_id"], deduplication_merge="latest")
    async def sync_profile(user_id: int, fields: list[str]) -> str:
        ran.append((user_id, fields))
        return ",".join(fields)

    first = await kiq_or_join(sync_profile, user_id=7, fields=["f0"])
    handles = []
    for n in range(1, 20):
        await redis_client.config_resetstat()
        handles.append(await kiq_or_join(sync_profile, user_id=7, fields=[f"f{n}"]))
        assert await scripts_run(redis_client) == 1  # a merge is one round trip
    assert all(h.joined and h.task_id == first.task_id for h in handles)
    assert all(h.duplicate is not None and h.duplicate.merged for h in handles)
    # kiq() itself hands back the queued holder: a merged call is no refusal.
    assert await merged_into(lambda: sync_profile.kiq(user_id=7, fields=["f20"])) == first.task_id
    assert len(broker.queued) == 1
    await broker.deliver()
    assert ran == [(7, ["f20"])]
    assert (await handles[-1].wait_result(timeout=5)).return_value == "f20"
    assert without_done([key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")]) == []


async def test_once_the_holder_runs_a_call_is_handled_as_its_policy_says(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis
) -> None:
    during: list[Any] = []

    @broker.task(deduplication_key="sync", deduplication_merge="latest")
    async def finished_sync(n: int) -> None:
        if not during:
            during.append(await refusal(lambda: finished_sync.kiq(n=n + 1)))

    @broker.task(
        deduplication_key="sync-started",
        deduplication_merge="latest",
        deduplication_until="started",
    )
    async def started_sync(n: int) -> int:
        if n == 1:
            during.append(await started_sync.kiq(n=2))  # one running, one queued
            during.append(await merged_into(lambda: started_sync.kiq(n=3)))
        return n

    await finished_sync.kiq(n=1)
    await started_sync.kiq(n=1)
    await broker.deliver_one()
    refused = during[0]
    assert not refused.merged  # the holder runs: refused, not merged
    await broker.deliver_one()
    assert during[2] == during[1].task_id  # merged into it
    (queued,) = broker.queued
    await broker.deliver()
    assert (await during[1].wait_result(timeout=5)).return_value == 3
    assert queued


async def test_merged_arguments_go_through_the_brokers_serializer(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    seen: list[dict[str, Any]] = []

    @broker.task(deduplication_key="blob", deduplication_merge="latest")
    async def store(payload: dict[str, Any]) -> None:
        seen.append(payload)

    await store.kiq(payload={"a": 1})
    await merged_into(lambda: store.kiq(payload={"secret": "s3cr3t", "n": [1, 2]}))
    (merged_key,) = [key async for key in redis_client.scan_iter(match=f"{prefix}#merge:*")]
    assert await redis_client.pttl(merged_key) > 0  # it never outlives the lock for long
    await broker.deliver()
    assert seen == [{"secret": "s3cr3t", "n": [1, 2]}]


@each_retry_order
async def test_merges_under_retries_run_the_latest_arguments_and_free_the_lock(
    retry_and_dedup: list[TaskiqMiddleware],
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, middlewares=retry_and_dedup)
    dedup = dedup_middleware(broker)
    runs: list[tuple[str, int]] = []

    @broker.task(
        retry_on_error=True, deduplication_key_fields=["user_id"], deduplication_merge="latest"
    )
    async def sync(user_id: int, version: int, context: Context = TaskiqDepends()) -> int:
        runs.append((context.message.task_id, version))
        if len(runs) < 3:
            msg = "not yet"
            raise RuntimeError(msg)
        return version

    first = await sync.kiq(user_id=1, version=1)
    assert await merged_into(lambda: sync.kiq(user_id=1, version=2)) == first.task_id
    version = 2
    while broker.queued:
        await broker.deliver_one()
        if broker.queued:  # a retry waits in the queue: the latest call merges into it
            version += 1
            holder = await merged_into(lambda: sync.kiq(user_id=1, version=version))  # noqa: B023
            assert holder == first.task_id
    assert runs == [(first.task_id, 2), (first.task_id, 3), (first.task_id, 4)]
    assert (await first.wait_result(timeout=5)).return_value == 4
    await dedup.shutdown()
    assert without_done([key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")]) == []


@all_topologies(hash_tag=True)
async def test_a_requeued_merge_runs_with_the_arguments_it_ran_with(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    runs: list[int] = []

    @broker.task(deduplication_key="requeue", deduplication_merge="latest")
    async def job(version: int, context: Context = TaskiqDepends()) -> None:
        runs.append(version)
        if len(runs) == 1:
            await context.requeue()

    await job.kiq(version=1)
    await merged_into(lambda: job.kiq(version=2))
    await broker.deliver_one()  # runs version 2, requeues it
    assert not (await refusal(lambda: job.kiq(version=3))).merged  # claimed already
    await broker.deliver()
    assert runs == [2, 2]
    assert await lock_keys(redis_client, prefix) == []


# Debounce


async def test_a_debounced_burst_runs_once_after_the_quiet_period(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    loop = asyncio.get_running_loop()
    ran: list[tuple[int, float]] = []

    @broker.task(deduplication_key_fields=["doc_id"], deduplication_debounce=0.4)
    async def reindex(doc_id: str, revision: int) -> None:
        ran.append((revision, loop.time()))

    await reindex.kiq(doc_id="d", revision=0)
    await redis_client.config_resetstat()
    delivery = asyncio.create_task(broker.deliver_one())  # a worker takes it and waits
    last_call = 0.0
    for revision in range(1, 6):
        await asyncio.sleep(0.05)
        await merged_into(lambda: reindex.kiq(doc_id="d", revision=revision))  # noqa: B023
        last_call = loop.time()
    assert ran == []
    await asyncio.wait_for(delivery, 5)
    ((revision, started),) = ran
    assert revision == 5
    assert started > last_call
    # 5 merges; the worker: a claim when it took the message, one per wake-up
    # (here one, at the end of the quiet period), and the release.
    assert await scripts_run(redis_client) <= 5 + 1 + 3 + 1
    assert await lock_keys(redis_client, prefix) == []


async def test_a_steady_stream_runs_by_the_maximum_wait(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis
) -> None:
    ran: list[int] = []

    @broker.task(
        deduplication_key="stream", deduplication_debounce=0.3, deduplication_debounce_max=0.8
    )
    async def reindex(revision: int) -> None:
        ran.append(revision)

    await reindex.kiq(revision=0)
    delivery = asyncio.create_task(broker.deliver_one())
    revision = 0
    # A call every 0.1 s for three times the maximum wait: never quiet for 0.3 s.
    for _ in range(24):
        await asyncio.sleep(0.1)
        revision += 1
        with contextlib.suppress(DuplicateTaskError):
            await reindex.kiq(revision=revision)
    await asyncio.wait_for(delivery, 5)
    assert len(ran) == 1
    assert 0 < ran[0] < revision  # it ran during the stream, with a call of it
    await broker.deliver()  # calls after the start were queued afresh


async def test_a_debounced_retry_runs_at_once(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, retries=3)
    dedup = dedup_middleware(broker)
    runs: list[int] = []

    @broker.task(retry_on_error=True, deduplication_key="r", deduplication_debounce=0.3)
    async def job(n: int) -> None:
        runs.append(n)
        if len(runs) == 1:
            msg = "fails once"
            raise RuntimeError(msg)

    await job.kiq(n=1)
    await broker.deliver_one()  # waits out the quiet period, fails; the retry is queued
    # The queued retry takes the latest call, and runs as soon as it is taken:
    # its claim at the start is one round trip, with no wake-up.
    await merged_into(lambda: job.kiq(n=2))
    await redis_client.config_resetstat()
    await broker.deliver_one()
    assert runs == [1, 2]
    await dedup.shutdown()
    assert await scripts_run(redis_client) == 2  # the claim and the release
    assert await lock_keys(redis_client, prefix) == []


# TaskLock and fences


@all_topologies(hash_tag=True)
async def test_fences_increase_across_sends_expiry_and_takeover(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    seen: list[tuple[int, bool]] = []

    @broker.task(deduplication_key="nightly-import", deduplication_ttl=1)
    async def nightly_import(takeover: bool, lock: TaskLock = TaskiqDepends()) -> None:
        assert lock.locked
        assert lock.key == f"{prefix}:nightly-import"
        seen.append((lock.fence, await lock.held()))
        if takeover:
            # The lock expires under the run and another send takes it.
            await redis_client.delete(lock.key)
            await nightly_import.kiq(takeover=False)
            seen.append((lock.fence, await lock.held()))

    await nightly_import.kiq(takeover=False)
    await broker.deliver()
    await nightly_import.kiq(takeover=False)
    await asyncio.sleep(1.2)  # expires while queued; the run takes it back
    await broker.deliver()
    await nightly_import.kiq(takeover=True)
    await broker.deliver()
    fences = [fence for fence, _ in seen]
    assert [held for _, held in seen] == [True, True, True, False, True]
    assert fences[3] == fences[2]  # the same run keeps its fence...
    # ...and every new holder has a greater one: the taken-back run drew anew.
    assert fences[0] < fences[1] < fences[2] < fences[4]
    assert await redis_client.get(f"{prefix}#fence") == str(fences[4])


async def test_a_task_lock_costs_no_round_trip_and_held_costs_one(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis
) -> None:
    broker = await make_broker()
    counted: list[int] = []

    @broker.task(deduplication_key="fenced")
    async def fenced(lock: TaskLock = TaskiqDepends()) -> int:
        before = await scripts_run(redis_client)
        await lock.held()
        counted.append(await scripts_run(redis_client) - before)
        return lock.fence

    await redis_client.config_resetstat()
    await (await fenced.kiq()).wait_result(timeout=5)
    await broker.wait_all()
    await dedup_middleware(broker).shutdown()
    # acquire (with its fence) + extend + claim at the start + release, as any
    # task; and the one held().
    assert counted == [1]
    assert await scripts_run(redis_client) == 4 + 1


async def test_a_task_without_a_lock_gets_a_clear_answer(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)
    answers: list[Any] = []

    @broker.task(deduplication=False)
    async def free(lock: TaskLock = TaskiqDepends()) -> None:
        answers.extend([lock.locked, await lock.held()])
        for name in ("key", "fence"):
            with pytest.raises(NoLockError, match="without a deduplication lock"):
                getattr(lock, name)
        answers.append("checked")

    await free.kiq()
    await broker.deliver()
    assert answers == [False, False, "checked"]


async def test_a_fence_needs_a_sender_that_knows_the_task(
    make_broker: BrokerFactory, make_middleware: MiddlewareFactory
) -> None:
    sender = await make_broker(broker_class=HoldingBroker)
    worker = await make_broker(broker_class=HoldingBroker, middlewares=[make_middleware()])
    answers: list[Any] = []

    @worker.task("fenced", deduplication_key="f")
    async def fenced(lock: TaskLock = TaskiqDepends()) -> None:
        answers.append(await lock.held())
        with pytest.raises(NoLockError, match="no fence"):
            _ = lock.fence

    # The sender has no such task registered: it sends by name.
    await AsyncKicker("fenced", sender, {"deduplication_key": "f"}).kiq()
    (message,) = sender.queued
    await worker.receiver.callback(message=message.message)
    assert answers == [True]


@each_retry_order
@pytest.mark.parametrize("until", ["finished", "expired"])
async def test_fences_under_retries(
    retry_and_dedup: list[TaskiqMiddleware],
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    until: str,
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, middlewares=retry_and_dedup)
    dedup = dedup_middleware(broker)
    fences: list[tuple[int, bool]] = []

    @broker.task(retry_on_error=True, deduplication_key="import", deduplication_until=until)
    async def job(lock: TaskLock = TaskiqDepends()) -> None:
        fences.append((lock.fence, await lock.held()))
        if len(fences) < 3:
            msg = "not yet"
            raise RuntimeError(msg)

    await job.kiq()
    while broker.queued:
        await broker.deliver_one()
        if broker.queued:
            await refusal(job.kiq)
    assert [held for _, held in fences] == [True] * 3
    numbers = [fence for fence, _ in fences]
    if until == "expired":
        assert numbers == [numbers[0]] * 3  # the retries keep the first send's lock
    else:
        assert numbers == sorted(set(numbers))  # each retry took the lock over anew
    assert running_beats(dedup) == []
    await dedup.shutdown()
    assert (await lock_keys(redis_client, prefix) == []) is (until == "finished")


def test_a_task_lock_parameter_is_found_however_it_is_written() -> None:
    async def annotated(lock: TaskLock = TaskiqDepends()) -> None: ...

    async def by_dependency(lock: Any = TaskiqDepends(TaskLock)) -> None: ...

    async def stringly(lock: TaskLock) -> None: ...

    stringly.__annotations__["lock"] = "taskiq_deduplication.TaskLock"

    async def without(n: int, context: Context = TaskiqDepends()) -> None: ...

    assert takes_task_lock(annotated)
    assert takes_task_lock(by_dependency)
    assert takes_task_lock(stringly)
    assert not takes_task_lock(without)


# Labels


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({"deduplication_merge": "first"}, "deduplication_merge"),
        ({"deduplication_merge": 1}, "deduplication_merge"),
        ({"deduplication_debounce": 0}, "deduplication_debounce"),
        ({"deduplication_debounce": "soon"}, "deduplication_debounce"),
        ({"deduplication_debounce": True}, "deduplication_debounce"),
        ({"deduplication_debounce_max": 5}, "deduplication_debounce_max"),
        (
            {"deduplication_debounce": 5, "deduplication_debounce_max": 2},
            "deduplication_debounce_max",
        ),
        ({"deduplication_debounce": 5, "deduplication_merge": "off"}, "deduplication_debounce"),
    ],
)
async def test_bad_merge_and_debounce_labels_are_refused_at_kiq(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    labels: dict[str, Any],
    named: str,
) -> None:
    broker, job = await queued_job(make_broker)

    for given in (labels, {k: str(v) for k, v in labels.items()}):  # as the scheduler sends
        with pytest.raises(ValueError, match=named):
            await job.kicker().with_labels(**given).kiq()
    assert broker.queued == []
    assert await lock_keys(redis_client, prefix) == []


async def test_the_new_labels_are_known_to_the_startup_check(
    make_middleware: MiddlewareFactory,
) -> None:
    middleware = make_middleware()
    broker = InMemoryBroker().with_middlewares(middleware)

    @broker.task(deduplication_merge="latest", deduplication_debounce="1.5")
    async def fine() -> None: ...

    # The middleware's own startup: taskiq 0.12's InMemoryBroker.startup runs
    # no middleware's.
    await middleware.startup()
    await middleware.shutdown()

    @broker.task(deduplication_debounce_maximum=3)
    async def typo() -> None: ...

    with pytest.raises(ValueError, match="did you mean 'deduplication_debounce_max'"):
        await middleware.startup()


# When Redis fails, or another send holds the lock at the start


async def test_redis_down_merge_and_fence_tasks_fail_or_fail_open(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    brokers = []
    for fail_open in (False, True):
        broker = HoldingBroker().with_middlewares(
            RedisDeduplicationMiddleware(redis_url=server.url + FAST, fail_open=fail_open)
        )
        await broker.startup()
        brokers.append(broker)

        @broker.task(deduplication_key="m", deduplication_merge="latest")
        async def merged(n: int) -> None: ...

        @broker.task(deduplication_key="f")
        async def fenced(lock: TaskLock = TaskiqDepends()) -> bool:
            return lock.locked

    server.stop()
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    strict, lenient = brokers
    for name in ("merged", "fenced"):
        task = strict.find_task(f"tests.test_callsite:{name}")
        assert task is not None
        with pytest.raises(RedisError):
            await task.kiq(n=1) if name == "merged" else await task.kiq()
    fenced_task = lenient.find_task("tests.test_callsite:fenced")
    assert fenced_task is not None
    handle = await fenced_task.kiq()  # fail-open: sent without a lock
    await lenient.deliver()
    assert (await handle.wait_result(timeout=5)).return_value is False
    assert "sending it without a lock (fail_open)" in caplog.text
    for broker in brokers:
        await broker.shutdown()


@pytest.mark.slow
async def test_a_run_whose_claim_fails_runs_with_the_arguments_it_was_sent_with(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(redis_url=server.url + FAST, default_ttl=30)
    )
    await broker.startup()
    ran: list[int] = []

    @broker.task(deduplication_key="m", deduplication_merge="latest")
    async def merged(n: int) -> None:
        ran.append(n)

    await merged.kiq(n=1)
    await merged_into(lambda: merged.kiq(n=2))
    server.stop()
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await broker.deliver()
    assert ran == [1]
    assert "Could not begin the run of task" in caplog.text
    await broker.shutdown()


async def test_a_merged_run_whose_lock_another_send_holds_runs_as_sent_with_a_warning(
    broker: HoldingBroker,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[tuple[int, bool]] = []

    @broker.task(deduplication_key="m", deduplication_merge="latest", deduplication_exclusive=False)
    async def merged(n: int, lock: TaskLock = TaskiqDepends()) -> None:
        ran.append((n, await lock.held()))

    await merged.kiq(n=1)
    await merged_into(lambda: merged.kiq(n=2))
    await redis_client.set(f"{prefix}:m", "other " + "0" * 32, keepttl=True)
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await broker.deliver()
    # The other holder's merged arguments are left for it: this run has its own.
    assert ran == [(1, False)]
    assert "runs although task " + "0" * 32 in caplog.text
    assert await redis_client.exists(f"{prefix}#merge:m") == 1


class GatedBroker(InMemoryBroker):
    """A broker whose send waits until the test opens the gate, then fails or goes through."""

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.gate = asyncio.Event()
        self.refuse = True
        self.queued: list[BrokerMessage] = []

    async def kick(self, message: BrokerMessage) -> None:
        await self.gate.wait()
        if self.refuse:
            msg = "broker connection lost"
            raise ConnectionError(msg)
        self.queued.append(message)


@pytest.mark.parametrize("accepted", [False, True], ids=["refused", "accepted"])
async def test_a_call_merges_only_into_a_message_a_broker_accepted(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    accepted: bool,
) -> None:
    broker = await make_broker(broker_class=GatedBroker)
    ran: list[str] = []

    @broker.task(deduplication_key_fields=["user"], deduplication_merge="latest")
    async def sync_profile(user: int, name: str) -> None:
        ran.append(name)

    first = asyncio.create_task(sync_profile.kiq(user=1, name="old"))
    await wait_until(lambda: has_lock(redis_client, prefix))
    # The first send is on its way to the broker: nothing to merge into yet.
    during = await refusal(lambda: sync_profile.kiq(user=1, name="during"))
    assert not during.merged
    assert during.holder_task_id is not None
    broker.refuse = not accepted
    broker.gate.set()
    if accepted:
        sent = await first
        # Once the broker has the message, calls merge into it.
        holder = await merged_into(lambda: sync_profile.kiq(user=1, name="after"))
        assert holder == sent.task_id == during.holder_task_id
        (message,) = broker.queued
        await broker.receiver.callback(message=message.message)
        assert ran == ["after"]
    else:
        with pytest.raises(SendTaskError):
            await first
        assert (
            without_done([key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")])
            == []
        )
        # Its lock and its arguments went at once: the next call is sent, not joined.
        broker.refuse = False
        handle = await kiq_or_join(sync_profile, user=1, name="retry")
        assert not handle.joined
        (message,) = broker.queued
        await broker.receiver.callback(message=message.message)
        assert ran == ["retry"]


async def has_lock(client: redis.asyncio.Redis, prefix: str) -> bool:
    return bool(await lock_keys(client, prefix))


async def test_tasks_sharing_a_key_never_merge_into_each_other(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    ran: list[tuple[str, int]] = []

    @broker.task(deduplication_key="nightly", deduplication_merge="latest")
    async def export(n: int) -> None:
        ran.append(("export", n))

    @broker.task(deduplication_key="nightly", deduplication_merge="latest")
    async def purge(n: int) -> None:
        ran.append(("purge", n))

    sent = await export.kiq(1)
    caught = await refusal(lambda: purge.kiq(666))
    assert not caught.merged  # refused as a duplicate: its arguments are not export's
    assert caught.holder_task_id == sent.task_id
    assert await merged_into(lambda: export.kiq(2)) == sent.task_id  # its own task merges
    await broker.deliver()
    assert ran == [("export", 2)]
    assert without_done([key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")]) == []


@pytest.mark.parametrize("retry_class", [SimpleRetryMiddleware, SmartRetryMiddleware])
async def test_a_call_merges_into_a_queued_retry_under_expired(
    make_middleware: MiddlewareFactory,
    make_broker: BrokerFactory,
    retry_class: type[TaskiqMiddleware],
) -> None:
    broker = await make_broker(
        broker_class=HoldingBroker, middlewares=[retry_middleware(retry_class), make_middleware()]
    )
    runs: list[int] = []

    @broker.task(
        retry_on_error=True,
        deduplication_key_fields=["user_id"],
        deduplication_merge="latest",
        deduplication_until="expired",
    )
    async def sync(user_id: int, version: int) -> None:
        runs.append(version)
        if len(runs) < 2:
            msg = "not yet"
            raise RuntimeError(msg)

    first = await sync.kiq(user_id=1, version=1)
    await broker.deliver_one()  # fails; its retry keeps the lock and waits in the queue
    assert len(broker.queued) == 1
    # As under "finished": a call merges into the queued retry.
    assert await merged_into(lambda: sync.kiq(user_id=1, version=2)) == first.task_id
    await broker.deliver()
    assert runs == [1, 2]
