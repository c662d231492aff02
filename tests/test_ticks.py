"""Tick locks: every replica names a tick the same way, its lock expires by itself, one round trip.

The real ``taskiq scheduler`` processes are in tests/e2e/test_ticks.py; here the
sources' hooks are called in process, each "replica" a middleware of its own
on the same Redis and prefix, as two scheduler processes would have.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis.asyncio
from taskiq import InMemoryBroker, ScheduledTask, TaskiqScheduler
from taskiq.cli.scheduler import run as scheduler_run
from taskiq.exceptions import ScheduledTaskCancelledError, SendTaskError
from taskiq.schedule_sources import LabelScheduleSource

from taskiq_deduplication import (
    DeduplicatedScheduleSource,
    DeduplicationScheduler,
    DuplicateTaskError,
    RedisDeduplicationMiddleware,
)
from taskiq_deduplication.scheduler.schedulers import replica
from taskiq_deduplication.scheduler.ticks import (
    INTERVAL_MARGIN_MS,
    ONE_OFF_TTL_MS,
    CronPaths,
    tick_of,
)
from tests._brokers import BrokerFactory, KeptSchedules, RefusingBroker
from tests._locks import wait_until
from tests._middlewares import MiddlewareFactory, dedup_middleware
from tests._server import Server
from tests._tasks import Gate, held_report

NOW = datetime(2026, 12, 2, 6, 0, 10, tzinfo=timezone.utc)


def schedule(**fields: Any) -> ScheduledTask:
    """A schedule of ``report(day="mon")``, with ``fields`` (cron, interval, time...)."""
    fields.setdefault("kwargs", {"day": "mon"})
    return ScheduledTask(task_name="report", labels=fields.pop("labels", {}), args=[], **fields)


# Which tick it is


def test_a_tick_is_named_by_what_its_schedule_is_not_by_its_schedule_id(prefix: str) -> None:
    cron = tick_of(prefix, schedule(cron="0 6 * * *", schedule_id="a"), NOW)

    assert cron.key.startswith(f"{prefix}#tick:")
    # LabelScheduleSource draws a new schedule_id in every process.
    assert tick_of(prefix, schedule(cron="0 6 * * *", schedule_id="b"), NOW) == cron
    # taskiq's scheduler writes the schedule_id into the labels as it sends a tick.
    sent = schedule(
        cron="0 6 * * *", labels={"schedule_id": "c", "types_of_exceptions": [KeyError]}
    )
    assert tick_of(prefix, sent, NOW) == cron
    assert tick_of(prefix, schedule(cron="0 6 * * *"), NOW + timedelta(seconds=49)).key == cron.key
    others = [
        schedule(cron="0 6 * * *", kwargs={"day": "tue"}),
        schedule(cron="0 6 * * *", labels={"priority": 1}),
        schedule(cron="0 6 * * *", task_id="fixed"),
        schedule(cron="0 */6 * * *"),
        schedule(cron="0 6 * * *", cron_offset="Europe/Paris"),
        schedule(interval=60),
    ]
    assert len({cron.key, *(tick_of(prefix, other, NOW).key for other in others)}) == 7
    # The next minute is another tick of the same schedule.
    assert tick_of(prefix, schedule(cron="0 6 * * *"), NOW + timedelta(seconds=50)).key != cron.key


def test_a_cron_tick_is_a_minute_of_the_schedules_own_time(prefix: str) -> None:
    shifted = schedule(cron="* * * * *", cron_offset=timedelta(seconds=30))
    # 06:00:10 UTC is 06:00:40 in the schedule's time: its minute ends 20 s later.
    tick = tick_of(prefix, shifted, NOW)
    assert tick.when == "cron minute 2026-12-02 06:00"
    assert tick_of(prefix, shifted, NOW + timedelta(seconds=19)).key == tick.key
    assert tick_of(prefix, shifted, NOW + timedelta(seconds=20)).key != tick.key
    paris = tick_of(prefix, schedule(cron="0 7 * * *", cron_offset="Europe/Paris"), NOW)
    assert paris.when == "cron minute 2026-12-02 07:00"


def test_each_kind_of_tick_lives_as_long_as_it_says(prefix: str) -> None:
    # A cron tick: to the end of the next minute.
    assert tick_of(prefix, schedule(cron="* * * * *"), NOW).ttl_ms == 110_000
    # An interval: the interval less half a second, however it is written.
    every = tick_of(prefix, schedule(interval=2), NOW)
    assert every.ttl_ms == 2000 - INTERVAL_MARGIN_MS
    assert every.when == "interval 2s"
    assert tick_of(prefix, schedule(interval=timedelta(seconds=2)), NOW) == every
    assert tick_of(prefix, schedule(interval=1), NOW).ttl_ms == 500
    # A one-off: a day, named with its time.
    once = tick_of(prefix, schedule(time=NOW.replace(tzinfo=None)), NOW)
    assert once.ttl_ms == ONE_OFF_TTL_MS
    assert tick_of(prefix, schedule(time=NOW), NOW + timedelta(hours=5)) == once
    assert tick_of(prefix, schedule(time=NOW + timedelta(seconds=1)), NOW).key != once.key


# Replicas on one Redis


async def replicas(
    make_middleware: MiddlewareFactory, **options: Any
) -> list[DeduplicatedScheduleSource]:
    """Two "scheduler processes": a source each, with a middleware of its own."""
    sources = []
    for _ in range(2):
        broker = InMemoryBroker()
        middleware = make_middleware(**options)
        broker.with_middlewares(middleware)
        await middleware.startup()
        sources.append(DeduplicatedScheduleSource(LabelScheduleSource(broker), middleware))
    return sources


async def shut(sources: list[DeduplicatedScheduleSource]) -> None:
    for source in sources:
        await source.middleware.shutdown()


@pytest.mark.parametrize(
    ("fields", "lifetime_ms"),
    [
        ({"cron": "* * * * *"}, 120_000),
        ({"interval": 3}, 3000 - INTERVAL_MARGIN_MS),
        ({"time": NOW}, ONE_OFF_TTL_MS),
    ],
    ids=["cron", "interval", "one-off"],
)
async def test_one_replica_takes_a_tick_in_one_round_trip_and_its_lock_expires_by_itself(
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    fields: dict[str, Any],
    lifetime_ms: int,
) -> None:
    first, second = await replicas(make_middleware)
    tick = schedule(schedule_id="daily", **fields)
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")
    try:
        await redis_client.config_resetstat()
        await first.pre_send(tick)
        with pytest.raises(ScheduledTaskCancelledError):
            await second.pre_send(tick.model_copy(update={"schedule_id": "other"}))
        stats = await redis_client.info("commandstats")
        (key,) = [key async for key in redis_client.scan_iter(match=f"{prefix}#tick:*")]
        pttl = await redis_client.pttl(key)
    finally:
        await shut([first, second])

    # One script call per replica, and nothing else.
    calls = {name: stat["calls"] for name, stat in stats.items()}
    assert calls["cmdstat_evalsha"] == 2
    # What else ran was the scripts' own commands, and the test's.
    assert set(calls) <= {
        "cmdstat_evalsha",
        "cmdstat_get",
        "cmdstat_set",
        "cmdstat_config|resetstat",
    }
    assert 0 < pttl <= lifetime_ms
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["INFO", "INFO"], said
    assert said[0][1].endswith(
        f"of scheduled task report (schedule daily): sending from replica {replica()}"
    )
    assert said[1][1].endswith(
        f"of scheduled task report (schedule other): not sent here, replica {replica()} sent it"
    )


async def reporting(make_broker: BrokerFactory) -> tuple[InMemoryBroker, list[str]]:
    """A started broker with the task ``report(day)``, and the days it ran for."""
    broker = await make_broker()
    runs: list[str] = []

    @broker.task(task_name="report")
    async def report(day: str) -> None:
        runs.append(day)

    return broker, runs


async def test_an_interval_tick_goes_out_again_once_its_lock_expired(
    make_middleware: MiddlewareFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    first, second = await replicas(make_middleware)
    tick = schedule(interval=1)
    try:
        await first.pre_send(tick)
        with pytest.raises(ScheduledTaskCancelledError):
            await second.pre_send(tick)
        (key,) = [key async for key in redis_client.scan_iter(match=f"{prefix}#tick:*")]
        while await redis_client.exists(key):  # noqa: ASYNC110 (Redis expires it; no event to wait on)
            await asyncio.sleep(0.02)
        await second.pre_send(tick)
        assert await redis_client.get(key) is not None
    finally:
        await shut([first, second])


# Redis out of reach


@pytest.mark.parametrize("fail_open", [True, False])
async def test_a_scheduler_without_redis_follows_fail_open(
    make_middleware: MiddlewareFactory,
    server: Server,
    caplog: pytest.LogCaptureFixture,
    fail_open: bool,
) -> None:
    (source, other) = await replicas(make_middleware, redis_url=server.url, fail_open=fail_open)
    server.stop()
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")
    try:
        if fail_open:
            await source.pre_send(schedule(interval=5))
        else:
            with pytest.raises(ScheduledTaskCancelledError):
                await source.pre_send(schedule(interval=5))
    finally:
        await shut([source, other])

    said = [r for r in caplog.records if r.name == "taskiq_deduplication.scheduler"]
    assert [r.levelname for r in said] == ["WARNING" if fail_open else "ERROR"]
    ending = "sending the tick (interval 5s) without it (fail_open)" if fail_open else "skipped"
    assert said[0].getMessage().endswith(ending), said[0].getMessage()
    assert "mon" not in said[0].getMessage()  # never the task's arguments


# Refusals by the task's own lock


async def test_taskiqs_own_scheduler_logs_a_tick_refused_by_the_tasks_lock_in_one_line(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await make_broker()
    report, gate = held_report(broker)

    source = DeduplicatedScheduleSource(LabelScheduleSource(broker), dedup_middleware(broker))
    scheduler = TaskiqScheduler(broker, sources=[source])
    first = await report.kiq(day="mon")
    caplog.set_level(logging.INFO)

    # As taskiq's scheduler loop sends a tick: in a task of its own that nobody awaits.
    send = asyncio.create_task(scheduler.on_ready(source, schedule(interval=5, schedule_id="s")))
    await asyncio.wait([send])
    del send
    gc.collect()
    await asyncio.sleep(0)
    gate.finish.set()

    said = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if r.name != "taskiq.receiver.receiver"
    ]
    assert [level for _, level, _ in said] == ["INFO", "INFO"], said
    assert said[0][2].endswith(f"sending from replica {replica()}")
    assert said[1][0] == "taskiq_deduplication.scheduler"
    assert f"not sent (schedule s): task {first.task_id} still holds its lock" in said[1][2]


async def _one_off_report(
    broker: InMemoryBroker,
) -> tuple[Any, Gate, LabelScheduleSource, ScheduledTask]:
    """``held_report`` with a one-off schedule for now, read from its labels.

    Returns:
        The task, its gate, the started source of its labels, and the one-off.
    """
    report, gate = held_report(broker, schedule=[{"time": NOW, "kwargs": {"day": "mon"}}])
    source = LabelScheduleSource(broker)
    await source.startup()
    (once,) = await source.get_schedules()
    return report, gate, source, once


async def test_a_one_off_refused_by_its_tasks_lock_is_over_and_stays_over(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await make_broker()
    report, gate, source, once = await _one_off_report(broker)
    scheduler = DeduplicationScheduler(broker, sources=[source])
    await report.kiq(day="mon")
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")

    await scheduler.on_ready(source, once)
    # Gone from its source, as if it had been sent: nothing sends it again here.
    assert await source.get_schedules() == []
    # A restarted scheduler finds it in its labels again, and its tick lock taken.
    restarted = LabelScheduleSource(broker)
    await restarted.startup()
    (again,) = await restarted.get_schedules()
    await scheduler.on_ready(restarted, again)
    gate.finish.set()

    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(said) == 3, said
    assert "sending from replica" in said[0]
    assert "still holds its lock" in said[1]
    assert f"not sent here, replica {replica()} sent it" in said[2]


async def test_deduplication_scheduler_without_tick_locks_sends_every_tick(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, runs = await reporting(make_broker)

    tick = schedule(interval=60)
    for tick_locks in (True, True, False):
        scheduler = DeduplicationScheduler(
            broker, sources=[LabelScheduleSource(broker)], tick_locks=tick_locks
        )
        await scheduler.on_ready(scheduler.sources[0], tick)
        await broker.wait_all()
    assert runs == ["mon", "mon"]
    assert len([key async for key in redis_client.scan_iter(match=f"{prefix}#tick:*")]) == 1


async def test_deduplication_scheduler_without_the_middleware_warns_and_sends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = InMemoryBroker()
    scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")
    await scheduler.startup()
    try:
        runs: list[str] = []

        @broker.task(task_name="report")
        async def report(day: str) -> None:
            runs.append(day)

        await scheduler.on_ready(scheduler.sources[0], schedule(interval=60))
        await broker.wait_all()
    finally:
        await scheduler.shutdown()
    assert runs == ["mon"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert not any(isinstance(m, RedisDeduplicationMiddleware) for m in broker.middlewares)


# A send that fails


@pytest.mark.parametrize("scheduler_class", [DeduplicationScheduler, TaskiqScheduler])
async def test_a_tick_whose_send_fails_lets_its_tick_lock_go(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    scheduler_class: type[TaskiqScheduler],
) -> None:
    broker = await make_broker(broker_class=RefusingBroker)

    @broker.task(task_name="report")
    async def report(day: str) -> None:
        pass

    source = DeduplicatedScheduleSource(LabelScheduleSource(broker), dedup_middleware(broker))
    scheduler = scheduler_class(broker, sources=[source])
    caplog.set_level(logging.INFO)

    send = asyncio.create_task(scheduler.on_ready(source, schedule(cron="* * * * *")))
    await asyncio.wait([send])
    assert isinstance(send.exception(), SendTaskError)
    del send

    async def released() -> bool:
        return not [key async for key in redis_client.scan_iter(match=f"{prefix}#tick:*")]

    await wait_until(released)
    said = [r.getMessage() for r in caplog.records if r.name == "taskiq_deduplication.scheduler"]
    assert said[-1].startswith("Tick lock"), said
    assert said[-1].endswith("released: its send failed, another replica or a restart may send it")
    if scheduler_class is TaskiqScheduler:
        # Said at once, as asyncio would say it when the task is collected.
        never = [
            r
            for r in caplog.records
            if r.getMessage().startswith("Task exception was never retrieved")
        ]
        assert len(never) == 1


async def test_a_schedule_that_cannot_be_fingerprinted_is_sent_without_a_tick_lock(
    make_middleware: MiddlewareFactory, caplog: pytest.LogCaptureFixture
) -> None:
    (source, other) = await replicas(make_middleware)
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")
    try:
        unlocked = schedule(interval=5, kwargs={"day": object()}, schedule_id="odd")
        await source.pre_send(unlocked)
        await source.pre_send(unlocked)
    finally:
        await shut([source, other])
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(said) == 1, said  # once per schedule, not at every tick
    assert said[0][0] == "WARNING"
    assert said[0][1].startswith("Scheduled task report (schedule ")
    assert "sent without a tick lock: cannot fingerprint" in said[0][1]
    assert "deduplication_key" not in said[0][1]  # a label for tasks, not for ticks


def test_a_cron_offset_that_is_no_time_zone_counts_as_utc(prefix: str) -> None:
    tick = tick_of(prefix, schedule(cron="* * * * *", cron_offset="Nowhere/Atlantis"), NOW)
    assert tick.when == "cron minute 2026-12-02 06:00"


async def test_the_wrapper_is_its_source_for_all_but_the_ticks(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    kept = KeptSchedules()
    source = DeduplicatedScheduleSource(kept, dedup_middleware(broker))
    once = schedule(time=NOW, schedule_id="once")
    await source.startup()
    await source.add_schedule(once)
    assert await source.get_schedules() == [once]
    with pytest.raises(NotImplementedError):  # as KeptSchedules does
        await source.delete_schedule("once")
    await source.post_send(once)
    await source.shutdown()
    assert kept.schedules == [once]


async def test_taskiqs_own_scheduler_ends_a_one_off_refused_by_its_tasks_lock(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker()
    report, gate, labels, once = await _one_off_report(broker)
    source = DeduplicatedScheduleSource(labels, dedup_middleware(broker))
    scheduler = TaskiqScheduler(broker, sources=[source])
    await report.kiq(day="mon")
    try:
        send = asyncio.create_task(scheduler.on_ready(source, once))
        await asyncio.wait([send])
        assert isinstance(send.exception(), DuplicateTaskError)

        async def over() -> bool:
            return await labels.get_schedules() == []

        await wait_until(over)
    finally:
        gate.finish.set()


# A lone scheduler and its own tick locks


class SlowFirstPreSend(LabelScheduleSource):
    """A source whose first ``pre_send`` is slow (a remote source, a loaded event loop)."""

    calls = 0

    async def pre_send(self, task: ScheduledTask) -> None:
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(0.8)


async def test_a_lone_scheduler_sends_the_next_interval_tick_after_a_late_tick_lock(
    make_broker: BrokerFactory,
) -> None:
    broker, runs = await reporting(make_broker)

    source = SlowFirstPreSend(broker)
    scheduler = DeduplicationScheduler(broker, sources=[source])
    tick = schedule(interval=1)
    loop = asyncio.get_running_loop()
    due = loop.time()
    await scheduler.on_ready(source, tick)  # its tick lock reaches Redis 0.8 s late
    await asyncio.sleep(max(0.0, due + 1.0 - loop.time()))  # the loop's next tick
    await scheduler.on_ready(source, tick)
    await broker.wait_all()
    # One scheduler, two ticks due 1 s apart: both sent, as taskiq sends them.
    assert runs == ["mon", "mon"]


async def test_alike_interval_schedules_in_one_pass_of_the_loop_stay_one_schedule(
    make_middleware: MiddlewareFactory,
) -> None:
    source, other = await replicas(make_middleware)
    try:
        await source.pre_send(schedule(interval=60, schedule_id="a"))
        # Its own lock of a moment ago is not taken over: that is no next tick.
        with pytest.raises(ScheduledTaskCancelledError):
            await source.pre_send(schedule(interval=60, schedule_id="b"))
        with pytest.raises(ScheduledTaskCancelledError):
            await other.pre_send(schedule(interval=60, schedule_id="c"))
    finally:
        await shut([source, other])


async def test_replicas_send_an_interval_schedule_at_least_the_interval_less_half_a_second_apart(
    make_middleware: MiddlewareFactory,
) -> None:
    first, second = await replicas(make_middleware)
    tick = schedule(interval=2)
    loop = asyncio.get_running_loop()
    try:
        sent_at = loop.time()
        await first.pre_send(tick)
        # The other replica's ticks, whatever its clock, find it sent until the
        # lock expires: the interval less half a second after it reached Redis
        # (not a whole interval).
        for _ in range(100):  # 5 s at most
            try:
                await second.pre_send(tick)
            except ScheduledTaskCancelledError:  # noqa: PERF203 (a poll, not a hot loop)
                await asyncio.sleep(0.05)
            else:
                break
        else:
            pytest.fail("the tick lock never expired")
        assert loop.time() - sent_at >= (2000 - INTERVAL_MARGIN_MS) / 1000
    finally:
        await shut([first, second])


# A schedule with both a cron and an interval


async def test_a_schedule_with_a_cron_and_an_interval_sends_each_interval_tick(
    make_broker: BrokerFactory,
) -> None:
    broker, runs = await reporting(make_broker)

    source = LabelScheduleSource(broker)
    scheduler = DeduplicationScheduler(broker, sources=[source])
    # taskiq's loop sends it every second (interval), and at midnight on Jan 1 (cron).
    tick = schedule(cron="0 0 1 1 *", interval=1)
    await scheduler.on_ready(source, tick)
    await asyncio.sleep(1.0)
    await scheduler.on_ready(source, tick)
    await broker.wait_all()
    assert runs == ["mon", "mon"]


async def test_a_tick_of_a_schedule_with_a_cron_and_an_interval_is_named_by_its_path(
    make_middleware: MiddlewareFactory, caplog: pytest.LogCaptureFixture
) -> None:
    if datetime.now(timezone.utc).second >= 55:  # all four in one minute
        await asyncio.sleep(6)
    first, second = await replicas(make_middleware)
    both = schedule(cron="* * * * *", interval=60)
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")
    try:
        # taskiq's loop: the cron's tick first in the minute, then the interval's.
        await first.pre_send(both)
        await first.pre_send(both)
        with pytest.raises(ScheduledTaskCancelledError):
            await second.pre_send(both)
        with pytest.raises(ScheduledTaskCancelledError):
            await second.pre_send(both)
    finally:
        await shut([first, second])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert said[0].startswith("Tick (cron minute ")
    assert said[0].endswith("sending from replica " + replica())
    assert said[1].startswith("Tick (interval 60s)")
    assert said[1].endswith("sending from replica " + replica())
    assert said[2].startswith("Tick (cron minute ")
    assert "not sent here" in said[2]
    assert said[3].startswith("Tick (interval 60s)")
    assert "not sent here" in said[3]


async def within_a_minute(seconds: float) -> None:
    """Return once the next ``seconds`` fall in one minute (at once, or early in the next)."""
    now = datetime.now(timezone.utc)
    if now.second + now.microsecond / 1e6 + seconds >= 59:
        await asyncio.sleep(61 - now.second - now.microsecond / 1e6)


def started_late(
    source: DeduplicatedScheduleSource, both: ScheduledTask, cron_at: datetime
) -> None:
    """What ``source``'s taskiq loop sent of ``both`` when it started, in the minute before.

    Its first pass sent the cron's tick (at ``cron_at``), its second the
    interval's (due, never sent): from then on its cron goes out at that second
    of each minute, as taskiq's loop counts a minute from its last cron send.
    """
    source._tick(both, cron_at)
    source._tick(both, cron_at + timedelta(seconds=1))


async def outcome(source: DeduplicatedScheduleSource, both: ScheduledTask) -> str:
    try:
        await source.pre_send(both)
    except ScheduledTaskCancelledError:
        return "cancelled"
    return "sent"


async def test_replicas_name_a_tick_by_its_path_when_one_sends_its_interval_before_its_cron(
    make_middleware: MiddlewareFactory, caplog: pytest.LogCaptureFixture
) -> None:
    on_time, late = await replicas(make_middleware)
    both = schedule(cron="* * * * *", interval=60)
    await within_a_minute(3)
    caplog.set_level(logging.INFO, logger="taskiq_deduplication")
    try:
        sent = [await outcome(on_time, both)]  # its loop: the cron's tick of this minute
        # late's loop sends its cron a second later in each minute than on_time's.
        started_late(late, both, datetime.now(timezone.utc) + timedelta(seconds=1, minutes=-1))
        sent.append(await outcome(late, both))  # its loop: the interval's tick, come round
        await asyncio.sleep(1)
        sent.append(await outcome(late, both))  # its loop: this minute's cron's tick
    finally:
        await shut([on_time, late])
    said = [r.getMessage() for r in caplog.records]
    # The interval's tick is one, whichever replica sends it first in the
    # minute; the minute's cron tick is another, sent once.
    assert sent == ["sent", "sent", "cancelled"], said
    assert said[0].startswith("Tick (cron minute ")
    assert said[1].startswith("Tick (interval 60s)")
    assert said[2].startswith("Tick (cron minute ")
    assert said[2].endswith(f"not sent here, replica {replica()} sent it")


async def test_a_scheduler_whose_cron_goes_out_late_in_the_minute_sends_every_tick(
    make_middleware: MiddlewareFactory,
) -> None:
    late, idle = await replicas(make_middleware)
    both = schedule(cron="* * * * *", interval=3)
    await within_a_minute(5)
    # Its loop started 57 s ago: its cron goes out 3 s from now, in this minute.
    started_late(late, both, datetime.now(timezone.utc) + timedelta(seconds=3, minutes=-1))
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        sent = [await outcome(late, both)]  # the interval's tick
        await asyncio.sleep(max(0.0, start + 3 - loop.time()))
        # The cron's tick; the interval, due too, waits for the loop's next pass.
        sent.append(await outcome(late, both))
        await asyncio.sleep(max(0.0, start + 4 - loop.time()))
        sent.append(await outcome(late, both))  # the interval's tick, a pass later
    finally:
        await shut([late, idle])
    # As taskiq's own loop sends them: the cron's tick never holds back the interval's.
    assert sent == ["sent", "sent", "sent"]


@pytest.mark.parametrize("skip_first_run", [False, True], ids=["start", "skip-first-run"])
async def test_the_path_of_a_send_is_the_one_taskiqs_own_loop_takes(skip_first_run: bool) -> None:
    scheduler = TaskiqScheduler(InMemoryBroker(), sources=[])
    for start_second, interval in itertools.product(range(0, 58, 7), [3, 10, 90]):
        both = schedule(cron="* * * * *", interval=interval, schedule_id="both")
        start = NOW.replace(second=start_second)
        taskiq = scheduler_run.SchedulerLoop(scheduler, event_loop=asyncio.get_running_loop())
        if skip_first_run:  # what the loop does before its first pass
            taskiq.cron_tasks_last_run["both"] = start.replace(second=0)
        paths = CronPaths(100)
        for second in range(180):  # one pass a second, as taskiq's loop makes them
            now = start + timedelta(seconds=second, milliseconds=3)
            cron_before = taskiq.cron_tasks_last_run.get("both")
            if not taskiq._is_schedule_ready_to_send(both, now):
                continue
            by_cron = taskiq.cron_tasks_last_run.get("both") is not cron_before
            # A few milliseconds later, in the send; the first send after
            # --skip-first-run is taken for the cron's tick (the next one tells).
            named = paths.by_cron(both, now + timedelta(milliseconds=5))
            if not (skip_first_run and second == 0):
                assert named == by_cron, (start_second, interval, now.time())


# A tick that went out, a one-off that is over


class FailingPostSend(LabelScheduleSource):
    """A source whose post_send fails (RedisScheduleSource deleting a one-off in a Redis hiccup)."""

    def post_send(self, task: ScheduledTask) -> None:
        msg = "source unreachable"
        raise ConnectionError(msg)


@pytest.mark.parametrize("scheduler_class", [DeduplicationScheduler, TaskiqScheduler])
async def test_a_tick_that_was_sent_keeps_its_tick_lock_when_post_send_fails(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    scheduler_class: type[TaskiqScheduler],
) -> None:
    broker, runs = await reporting(make_broker)

    labels = FailingPostSend(broker)
    source: Any = labels
    if scheduler_class is TaskiqScheduler:
        source = DeduplicatedScheduleSource(labels, dedup_middleware(broker))
    scheduler = scheduler_class(broker, sources=[source])
    send = asyncio.create_task(scheduler.on_ready(source, schedule(time=NOW)))
    await asyncio.wait([send])
    assert isinstance(send.exception(), ConnectionError)
    del send
    await broker.wait_all()
    await asyncio.sleep(0.2)  # a detached release, if any, goes out
    assert runs == ["mon"]
    # The one-off is still in its source (its delete failed): a restart, or
    # another replica, finds its tick lock and does not send it again.
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}#tick:*")] != []


@pytest.mark.parametrize("scheduler_class", [DeduplicationScheduler, TaskiqScheduler])
async def test_a_one_off_cancelled_by_an_alike_ones_tick_lock_is_over_too(
    make_broker: BrokerFactory, scheduler_class: type[TaskiqScheduler]
) -> None:
    broker = await make_broker()
    once = {"time": NOW, "kwargs": {"day": "mon"}}

    @broker.task(task_name="report", schedule=[dict(once), dict(once)])
    async def report(day: str) -> None:
        pass

    labels = LabelScheduleSource(broker)
    await labels.startup()
    first, second = await labels.get_schedules()
    source: Any = labels
    if scheduler_class is TaskiqScheduler:
        source = DeduplicatedScheduleSource(labels, dedup_middleware(broker))
    scheduler = scheduler_class(broker, sources=[source])
    await scheduler.on_ready(source, first)
    await scheduler.on_ready(source, second)  # cancelled: "replica ... sent it"
    await broker.wait_all()
    # Gone from its source, as if sent: a restart a day later does not send it.
    assert await labels.get_schedules() == []


# taskiq scheduler --send-timeout


async def test_a_refused_tick_under_send_timeout_is_as_documented(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await make_broker()
    report, gate = held_report(broker)

    send_with_timeout = getattr(scheduler_run, "send_with_timeout", None)
    if send_with_timeout is None:
        pytest.skip("taskiq before 0.13 has no --send-timeout")
    source = DeduplicatedScheduleSource(LabelScheduleSource(broker), dedup_middleware(broker))
    scheduler = TaskiqScheduler(broker, sources=[source])
    await report.kiq(day="mon")  # the task's own lock is held: the tick is refused
    caplog.set_level(logging.INFO)
    # As taskiq's loop sends it with `taskiq scheduler --send-timeout 5`.
    send = asyncio.create_task(send_with_timeout(scheduler, source, schedule(interval=5), 5))
    await asyncio.wait([send])
    del send
    gc.collect()
    await asyncio.sleep(0)
    gate.finish.set()
    refused = [r for r in caplog.records if "still holds its lock" in r.getMessage()]
    never = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [r.levelname for r in refused] == ["INFO"]
    if sys.version_info >= (3, 12):
        assert never == []
    else:
        # Documented (docs/recipes.md): before 3.12 asyncio.wait_for sends in a
        # task of its own, and the refusal also ends taskiq's outer task.
        assert len(never) == 1


async def test_a_tick_sent_without_its_lock_after_a_timeout_lets_a_late_lock_stand(
    make_middleware: MiddlewareFactory, server: Server
) -> None:
    url = f"{server.url}?socket_timeout=0.3"
    (source, other) = await replicas(make_middleware, redis_url=url, fail_open=True)
    tick = schedule(interval=60)
    try:
        await source.pre_send(schedule(interval=60, kwargs={}))  # connected
        server.pause()
        try:
            await source.pre_send(tick)  # timed out: sent without its lock (fail_open)
        finally:
            server.resume()
        await asyncio.sleep(0.3)  # the lock lands; an undo, if any, goes out
        # This replica sent the tick: the lock that landed late holds the other one back.
        with pytest.raises(ScheduledTaskCancelledError):
            await other.pre_send(tick)
    finally:
        await shut([source, other])
