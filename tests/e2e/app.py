"""The application the end-to-end tests run: a broker, its tasks, a scheduler.

The same code runs in every process of a test: the test itself (the client),
``taskiq worker tests.e2e.app:worker_broker``, ``taskiq scheduler
tests.e2e.app:scheduler`` and the client processes of ``tests.e2e.client``.
Each builds its broker from one :class:`Config`, which the test hands to the
other processes as JSON in the ``DEDUP_E2E_CONFIG`` environment variable, so
they all agree on the broker, its queue names and the key prefix.

Every task reports what it does to Redis, under the test's prefix: how often it
ran, which process ran it, when it started. Tasks that must stay running until
the test says so wait on a *gate*, a Redis list that the test pushes one token
to per run it lets finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis.asyncio
from taskiq import (
    AsyncBroker,
    AsyncTaskiqDecoratedTask,
    Context,
    ScheduleSource,
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqDepends,
    TaskiqEvents,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqResult,
    TaskiqScheduler,
    TaskiqState,
)
from taskiq.schedule_sources import LabelScheduleSource
from taskiq_redis import (
    ListQueueBroker,
    ListRedisScheduleSource,
    RedisAsyncResultBackend,
    RedisStreamBroker,
)

from taskiq_deduplication import (
    DeduplicatedScheduleSource,
    DeduplicationScheduler,
    RedisDeduplicationMiddleware,
    TaskLock,
)
from tests.e2e.ledger import DSN, Writer

CONFIG_ENV = "DEDUP_E2E_CONFIG"

BROKERS = ("redis-list", "redis-stream", "rabbitmq", "nats")
RETRIES = ("", "smart-first", "smart-last", "simple-first", "simple-last", "smart-source-first")
"""Retry setups: which retry middleware, and whether deduplication comes first.

``smart-source`` is ``SmartRetryMiddleware`` with a schedule source: the worker
puts the retry in the source, and ``taskiq scheduler`` sends it when it is due.
"""
SCHEDULES = ("", "random-id", "fixed-id")
TICKS = ("", "interval", "cron", "one-off")
"""How ``e2e.ticked`` is scheduled (tests/e2e/test_ticks.py), if at all."""
SCHEDULERS = ("taskiq", "dedup", "wrapped")
"""What ``taskiq scheduler tests.e2e.app:scheduler`` runs: ``TaskiqScheduler``, a
``DeduplicationScheduler``, or a ``TaskiqScheduler`` on ``DeduplicatedScheduleSource``."""
#: The interval of ``e2e.ticked`` with ``ticks="interval"``, in seconds.
TICK_INTERVAL = 2
#: The tag of ``e2e.ticked``'s runs and of its counter.
TICKED = "ticked"

#: How long a gated task waits for its token before it gives up (and fails).
GATE_TIMEOUT = 45
#: How long the scheduled task runs.
SCHEDULED_RUN_SECONDS = 3.0
#: The task_id of every send of the "fixed-id" schedule.
FIXED_TASK_ID = "e2e-scheduled-fixed-id"
#: Retry middlewares retry a task this many times in total (attempts, not retries).
MAX_ATTEMPTS = 3
#: The ``deduplication_ttl`` label of the short-TTL tasks; the default TTL is longer.
SHORT_TTL = 3
#: The ``deduplication_key`` label of ``hold_explicit_key``.
EXPLICIT_KEY = "e2e-explicit"
#: ``deduplication_success_ttl`` of the "remembered" tasks.
SUCCESS_TTL = 3
#: ``deduplication_ttl`` of the "expired" tasks: their throttle window.
EXPIRED_TTL = 4
#: ``deduplication_success_ttl`` of ``charge``: long enough to outlive any test.
CHARGE_SUCCESS_TTL = 60
#: The name of the task whose delivery :class:`AckWindow` records and whose ack it holds.
CHARGE_TASK = "e2e.charge"
#: The tasks of tests/e2e/test_runs_once.py: quick, keyed on ``order``; the first
#: with the middleware's defaults, the second remembering its success.
ONCE_TASK = "e2e.once.pay"
ONCE_REMEMBERED_TASK = "e2e.once.pay_remembered"
#: Where :class:`CopyMaker` kills the worker process of an ``e2e.once`` task, once
#: per order: after every middleware's ``post_execute`` (before the result is
#: saved), or in ``post_save`` (after the result is saved, before the ack).
CRASH_POINTS = ("", "post_execute", "post_save")
#: The labels of each lock policy's tasks, by a name of the test's own:
#: "remembered" is "finished" with a success TTL.
POLICY_LABELS: dict[str, dict[str, Any]] = {
    "finished": {},
    "remembered": {"deduplication_success_ttl": SUCCESS_TTL},
    "started": {"deduplication_until": "started"},
    "expired": {"deduplication_until": "expired", "deduplication_ttl": EXPIRED_TTL},
}


@dataclass(frozen=True)
class Config:
    """Everything the processes of one test must agree on."""

    broker: str
    redis_url: str
    prefix: str
    """Prefix of every Redis key of the test: locks, queues, results, reports."""
    name: str
    """Name of the test's queue, exchange, stream and subject on RabbitMQ and NATS."""
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    nats_url: str = "nats://127.0.0.1:4222"
    default_ttl: int = 30
    heartbeat_interval: float | None = 0.5
    running_ttl: int | None = None
    retry: str = ""
    schedule: str = ""
    scheduled_policies: str = "finished"
    """The policies (of :data:`POLICY_LABELS`), comma-separated, with a scheduled task each."""
    scheduled_run_seconds: float = SCHEDULED_RUN_SECONDS
    idle_timeout: int | None = None
    """``idle_timeout`` of the Redis stream broker, in ms: an unacknowledged message
    idle this long is claimed again by the next worker that reads the stream."""
    ack_wait: float | None = None
    """``ack_wait`` of the NATS consumer, in seconds: an unacknowledged message is
    delivered again this long after its delivery."""
    ticks: str = ""
    """How ``e2e.ticked`` is scheduled: one of :data:`TICKS`."""
    one_off_at: float = 0.0
    """With ``ticks="one-off"``: the time of the one-off, in seconds since the epoch."""
    scheduler_kind: str = "taskiq"
    """What ``taskiq scheduler`` runs: one of :data:`SCHEDULERS`."""
    crash_at: str = ""
    """Where :class:`CopyMaker` kills the worker process that runs an ``e2e.once``
    task, once per order: one of :data:`CRASH_POINTS` ("" registers no CopyMaker)."""
    later_middleware: bool = False
    """Whether :class:`LaterMiddleware` is registered after the deduplication middleware."""
    ledger: str = ""
    """The PostgreSQL schema of the test's ledger (``tests/e2e/ledger.py``), where the
    limited tasks write their runs; "" for none (they do not run then)."""
    pg_dsn: str = DSN

    def __post_init__(self) -> None:
        """Refuse a setup the app does not know."""
        if self.broker not in BROKERS:
            msg = f"unknown broker {self.broker!r}, expected one of {BROKERS}"
            raise ValueError(msg)
        if self.retry not in RETRIES:
            msg = f"unknown retry setup {self.retry!r}, expected one of {RETRIES}"
            raise ValueError(msg)
        if self.schedule not in SCHEDULES:
            msg = f"unknown schedule {self.schedule!r}, expected one of {SCHEDULES}"
            raise ValueError(msg)
        if self.crash_at not in CRASH_POINTS:
            msg = f"unknown crash point {self.crash_at!r}, expected one of {CRASH_POINTS}"
            raise ValueError(msg)
        if self.ticks not in TICKS or self.scheduler_kind not in SCHEDULERS:
            msg = f"unknown ticks {self.ticks!r} or scheduler {self.scheduler_kind!r}"
            raise ValueError(msg)
        for policy in self.scheduled_policies.split(","):
            if policy not in POLICY_LABELS:
                msg = f"unknown policy {policy!r}, expected one of {tuple(POLICY_LABELS)}"
                raise ValueError(msg)

    @property
    def lock_prefix(self) -> str:
        """The ``key_prefix`` of the deduplication middleware."""
        return f"{self.prefix}:lock"

    def key(self, *parts: object) -> str:
        """A Redis key of this test's reports, e.g. ``key("runs", "a")``."""
        return ":".join([self.prefix, "data", *map(str, parts)])

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """Serialise for :data:`CONFIG_ENV`."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> Config:
        """The configuration the test handed to this process."""
        return cls(**json.loads(os.environ[CONFIG_ENV]))


class Reports:
    """This process's connection to Redis for the tasks' reports, made on first use."""

    def __init__(self, config: Config) -> None:
        """Remember where to connect; nothing connects yet."""
        self.config = config
        self._client: redis.asyncio.Redis | None = None

    @property
    def redis(self) -> redis.asyncio.Redis:
        """The client, created in the running event loop."""
        if self._client is None:
            # Each task waiting at its gate holds a connection, for longer than
            # redis-py's default socket timeout (5 s); its default pool would
            # refuse the 101st connection instead of waiting for one.
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                self.config.redis_url,
                decode_responses=True,
                max_connections=2000,
                timeout=None,
                socket_timeout=GATE_TIMEOUT + 10,
            )
            self._client = redis.asyncio.Redis.from_pool(pool)
        return self._client

    async def started(self, kind: str, tag: str, context: Context) -> int:
        """Count a run of ``tag`` and say who runs it; return the run's number."""
        run = int(await self.redis.incr(self.config.key("runs", tag)))
        report = {
            "task": kind,
            "run": run,
            "pid": os.getpid(),
            "task_id": context.message.task_id,
            "at": time.time(),
        }
        await self.redis.rpush(self.config.key("started", tag), json.dumps(report))
        return run

    async def enter(self, tag: str) -> None:
        """Note that a body of ``tag`` runs; count an overlap if another one already does."""
        if int(await self.redis.incr(self.config.key("live", tag))) > 1:
            await self.redis.incr(self.config.key("overlapping", tag))

    async def leave(self, tag: str) -> None:
        """Note that a body of ``tag`` has ended (whatever its outcome)."""
        await self.redis.decr(self.config.key("live", tag))

    async def gated_run(self, kind: str, tag: str, context: Context) -> int:
        """A body of ``tag``: counted while it runs, until its gate opens; the run's number."""
        await self.enter(tag)
        try:
            run = await self.started(kind, tag, context)
            await self.pass_gate(tag)
        finally:
            await self.leave(tag)
        return run

    async def pass_gate(self, tag: str) -> None:
        """Wait for the test to let this run of ``tag`` finish."""
        token = await self.redis.blpop([self.config.key("gate", tag)], timeout=GATE_TIMEOUT)
        if token is None:
            msg = f"the gate of {tag!r} was not opened within {GATE_TIMEOUT}s"
            raise TimeoutError(msg)


@dataclass(frozen=True)
class Tasks:
    """The tasks of the app, as registered on one broker."""

    hold: AsyncTaskiqDecoratedTask[..., Any]
    """Runs until its gate opens. Deduplicated with the middleware's defaults.
    Its runs and their overlaps are counted (``live``, ``overlapping``)."""
    hold_short_ttl: AsyncTaskiqDecoratedTask[..., Any]
    """``hold`` with ``deduplication_ttl=SHORT_TTL`` (3 s) on the decorator."""
    hold_opt_out: AsyncTaskiqDecoratedTask[..., Any]
    """``hold`` with ``deduplication=False`` on the decorator."""
    hold_key_fields: AsyncTaskiqDecoratedTask[..., Any]
    """``hold`` with ``deduplication_key_fields=["user_id"]`` on the decorator."""
    hold_explicit_key: AsyncTaskiqDecoratedTask[..., Any]
    """``hold`` with ``deduplication_key="e2e-explicit"`` on the decorator."""
    flaky: AsyncTaskiqDecoratedTask[..., Any]
    """Fails its first ``failures`` runs, each once its gate opens; retried."""
    count: AsyncTaskiqDecoratedTask[..., Any]
    """Counts its run under its argument and returns at once."""
    hold_by_policy: dict[str, AsyncTaskiqDecoratedTask[..., Any]]
    """``hold`` with each policy's labels (:data:`POLICY_LABELS`) on the decorator."""
    flaky_by_policy: dict[str, AsyncTaskiqDecoratedTask[..., Any]]
    """``flaky`` with each policy's labels on the decorator."""
    charge: AsyncTaskiqDecoratedTask[..., Any]
    """Charges ``order`` once (counts it) and returns at once; keyed on ``order``
    with ``deduplication_success_ttl=CHARGE_SUCCESS_TTL``: an idempotency key.
    :class:`AckWindow` holds its ack until the test lets it go."""
    scheduled: dict[str, AsyncTaskiqDecoratedTask[..., Any]]
    """Scheduled every second, runs three seconds, one per scheduled policy; none
    without a schedule."""


def register_tasks(broker: AsyncBroker, config: Config) -> Tasks:
    """Register the app's tasks on ``broker``."""
    reports = Reports(config)
    _register_ticked(broker, config, reports)

    async def hold(
        tag: str,
        user_id: int = 0,  # a key field of the key-field tasks
        locale: str = "",
        context: Context = TaskiqDepends(),
    ) -> dict[str, Any]:
        run = await reports.gated_run("hold", tag, context)
        return {"tag": tag, "run": run, "pid": os.getpid()}

    async def flaky(tag: str, failures: int, context: Context = TaskiqDepends()) -> str:
        run = await reports.gated_run("flaky", tag, context)
        if run <= failures:
            msg = f"run {run} of {tag!r} fails on purpose"
            raise RuntimeError(msg)
        return f"{tag} succeeded on run {run}"

    async def count(n: int) -> int:
        await reports.redis.hincrby(config.key("count"), str(n), 1)
        return n

    async def charge(order: int, context: Context = TaskiqDepends()) -> dict[str, Any]:
        run = await reports.started("charge", f"order-{order}", context)
        await reports.redis.hincrby(config.key("charged"), str(order), 1)
        return {"order": order, "run": run, "pid": os.getpid()}

    retry_labels = {"retry_on_error": True, "max_retries": MAX_ATTEMPTS}
    policies = {name: labels for name, labels in POLICY_LABELS.items() if labels}
    hold_task = broker.task("e2e.hold")(hold)
    flaky_task = broker.task("e2e.flaky", **retry_labels)(flaky)
    return Tasks(
        hold=hold_task,
        hold_short_ttl=broker.task("e2e.hold_short_ttl", deduplication_ttl=SHORT_TTL)(hold),
        hold_opt_out=broker.task("e2e.hold_opt_out", deduplication=False)(hold),
        hold_key_fields=broker.task("e2e.hold_key_fields", deduplication_key_fields=["user_id"])(
            hold
        ),
        hold_explicit_key=broker.task("e2e.hold_explicit_key", deduplication_key=EXPLICIT_KEY)(
            hold
        ),
        flaky=flaky_task,
        count=broker.task("e2e.count")(count),
        hold_by_policy={"finished": hold_task}
        | {
            name: broker.task(f"e2e.hold.{name}", **labels)(hold)
            for name, labels in policies.items()
        },
        flaky_by_policy={"finished": flaky_task}
        | {
            name: broker.task(f"e2e.flaky.{name}", **retry_labels, **labels)(flaky)
            for name, labels in policies.items()
        },
        charge=broker.task(
            CHARGE_TASK,
            deduplication_key_fields=["order"],
            deduplication_success_ttl=CHARGE_SUCCESS_TTL,
        )(charge),
        scheduled=_register_scheduled(broker, config, reports),
    )


def _register_ticked(broker: AsyncBroker, config: Config, reports: Reports) -> None:
    """``e2e.ticked``, a quick task on the schedule ``config.ticks`` names, if any.

    Its schedule names no ``schedule_id``: ``LabelScheduleSource`` draws a new
    one in every scheduler process. Its runs are counted under :data:`TICKED`.
    """
    if not config.ticks:
        return
    schedule: dict[str, Any] = {"kwargs": {"what": "report"}}
    if config.ticks == "interval":
        schedule["interval"] = TICK_INTERVAL
    elif config.ticks == "cron":
        schedule["cron"] = "* * * * *"
    else:
        schedule["time"] = datetime.fromtimestamp(config.one_off_at, tz=timezone.utc)

    async def ticked(what: str, context: Context = TaskiqDepends()) -> None:
        await reports.started(what, TICKED, context)

    # No lock of its own: the tick locks are all that keeps a tick from going out twice.
    broker.task("e2e.ticked", schedule=[schedule], deduplication=False)(ticked)


def scheduled_name(policy: str) -> str:
    """The tag of the scheduled task of ``policy``, and the name of its counters."""
    return "scheduled" if policy == "finished" else f"scheduled-{policy}"


def _scheduled(config: Config, reports: Reports, name: str) -> Callable[..., Awaitable[None]]:
    """A scheduled task that counts its runs under ``name``, and the overlaps of two runs."""

    async def scheduled(context: Context = TaskiqDepends()) -> None:
        r = reports.redis
        running = int(await r.incr(config.key("running", name)))
        try:
            if running > 1:
                await r.incr(config.key("overlaps", name))
            await reports.started("scheduled", name, context)
            await asyncio.sleep(config.scheduled_run_seconds)
        finally:
            await r.decr(config.key("running", name))
        await r.incr(config.key("finished", name))

    return scheduled


def _register_scheduled(
    broker: AsyncBroker, config: Config, reports: Reports
) -> dict[str, AsyncTaskiqDecoratedTask[..., Any]]:
    if not config.schedule:
        return {}
    tasks = {}
    for policy in config.scheduled_policies.split(","):
        scheduled = _scheduled(config, reports, scheduled_name(policy))
        schedule: dict[str, Any] = {"interval": 1, "schedule_id": f"every-second-{policy}"}
        if config.schedule == "fixed-id":
            schedule["task_id"] = FIXED_TASK_ID
        task_name = "e2e.scheduled" if policy == "finished" else f"e2e.scheduled.{policy}"
        labels = POLICY_LABELS[policy]
        tasks[policy] = broker.task(task_name, schedule=[schedule], **labels)(scheduled)
    return tasks


class TaskIdLabelScheduleSource(LabelScheduleSource):
    """``LabelScheduleSource`` that also honours a ``task_id`` in a schedule label.

    taskiq 0.13's ``LabelScheduleSource`` drops the ``task_id`` key of a schedule,
    although ``ScheduledTask`` and the scheduler support one; this puts it back.
    """

    async def startup(self) -> None:
        """Collect the schedules, then give each the ``task_id`` its label names."""
        await super().startup()
        for task in self.broker.get_all_tasks().values():
            for schedule in task.labels.get("schedule", []):
                scheduled = self.schedules.get(schedule.get("schedule_id", ""))
                if scheduled is not None and "task_id" in schedule:
                    scheduled.task_id = schedule["task_id"]


class AckWindow(TaskiqMiddleware):
    """Opens the window between a success and its acknowledgement, for ``charge``.

    It records every delivery of ``charge`` (first in the chain, so it sees a
    delivery whatever the middlewares after it do with it), and holds each
    ``charge`` whose result is saved (``post_save``: after every middleware's
    ``post_execute``, before taskiq acknowledges the message) until the test
    pushes a token to its ``ack-gate``: a worker killed there has run the task
    to its success, and the broker has not heard of it.
    """

    def __init__(self, config: Config) -> None:
        """Report to the test's Redis."""
        super().__init__()
        self.reports = Reports(config)
        self.config = config

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Record a delivery of ``charge``."""
        if message.task_name == CHARGE_TASK:
            order = message.kwargs.get("order")
            report = json.dumps({"task_id": message.task_id, "pid": os.getpid()})
            await self.reports.redis.rpush(self.config.key("delivered", order), report)
        return message

    async def post_save(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Say that the result of ``charge`` is saved, then wait for the test's token."""
        if message.task_name != CHARGE_TASK:
            return
        order = message.kwargs.get("order")
        report = json.dumps({"task_id": message.task_id, "pid": os.getpid()})
        await self.reports.redis.rpush(self.config.key("saved", order), report)
        await self.reports.pass_gate(f"ack-{order}")


def once_tag(message: TaskiqMessage) -> str | None:
    """The tag of an ``e2e.once`` task's message (``once-ORDER``); ``None`` for other tasks."""
    if message.task_name not in {ONCE_TASK, ONCE_REMEMBERED_TASK}:
        return None
    return f"once-{message.kwargs.get('order')}"


class CopyMaker(TaskiqMiddleware):
    """Makes the broker deliver an ``e2e.once`` message again: its worker dies once.

    Registered before the deduplication middleware (``config.crash_at`` set), so
    it sees every delivery first (``pre_execute``, reported to ``delivered``),
    and every run's end last (``post_execute`` is called in reverse order:
    reported to ``ended``). Once per tag, the process that runs the task ends
    with ``os._exit(1)`` where ``config.crash_at`` says: after every
    middleware's ``post_execute`` and before the result is saved, or after the
    result is saved (``post_save``) and before the message is acknowledged.
    The key ``crashed:TAG`` says which process died, running which task_id.
    """

    def __init__(self, config: Config) -> None:
        """Report to the test's Redis."""
        super().__init__()
        self.reports = Reports(config)
        self.config = config

    def _report(self, message: TaskiqMessage, **extra: Any) -> str:
        return json.dumps({"task_id": message.task_id, "pid": os.getpid(), **extra})

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Record a delivery of an ``e2e.once`` task."""
        tag = once_tag(message)
        if tag is not None:
            await self.reports.redis.rpush(self.config.key("delivered", tag), self._report(message))
        return message

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Record the end of a run; die here once if ``crash_at`` is ``post_execute``."""
        tag = once_tag(message)
        if tag is None:
            return
        error = type(result.error).__name__ if result.error is not None else None
        report = self._report(message, is_err=result.is_err, error=error)
        await self.reports.redis.rpush(self.config.key("ended", tag), report)
        if self.config.crash_at == "post_execute":
            await self._crash_once(message, tag)

    async def post_save(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Die here once if ``crash_at`` is ``post_save``: the result is saved, not acked."""
        tag = once_tag(message)
        if tag is not None and self.config.crash_at == "post_save":
            await self._crash_once(message, tag)

    async def _crash_once(self, message: TaskiqMessage, tag: str) -> None:
        if await self.reports.redis.set(
            self.config.key("crashed", tag), self._report(message), nx=True
        ):
            os._exit(1)


class LaterMiddleware(TaskiqMiddleware):
    """A middleware registered after deduplication, as a logger or Sentry would be.

    For the ``e2e.once`` tasks: its ``pre_execute`` reads the message's
    arguments (``list(message.args)``, ``dict(message.kwargs)``) and reports
    them to ``later-seen:TAG``, or what reading them raised to
    ``later-errors:TAG`` (and raises it on); its ``on_error`` counts each call
    in the hash ``on-error:TAG``, by task_id, and reports it to
    ``on-error-calls:TAG``.
    """

    def __init__(self, config: Config) -> None:
        """Report to the test's Redis."""
        super().__init__()
        self.reports = Reports(config)
        self.config = config

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Read the arguments, as a logger would."""
        tag = once_tag(message)
        if tag is None:
            return message
        try:
            args, kwargs = list(message.args), dict(message.kwargs)
        except BaseException as exc:
            error = {"task_id": message.task_id, "error": repr(exc), "type": type(exc).__name__}
            await self.reports.redis.rpush(self.config.key("later-errors", tag), json.dumps(error))
            raise
        report = {"task_id": message.task_id, "args": args, "kwargs": kwargs}
        await self.reports.redis.rpush(
            self.config.key("later-seen", tag), json.dumps(report, default=repr)
        )
        return message

    async def on_error(
        self, message: TaskiqMessage, result: TaskiqResult[Any], exception: BaseException
    ) -> None:
        """Count the call, by task_id."""
        tag = once_tag(message)
        if tag is None:
            return
        await self.reports.redis.hincrby(self.config.key("on-error", tag), message.task_id, 1)
        report = {"task_id": message.task_id, "error": repr(exception), "pid": os.getpid()}
        await self.reports.redis.rpush(self.config.key("on-error-calls", tag), json.dumps(report))


def register_once_tasks(broker: AsyncBroker, config: Config) -> None:
    """Register the ``e2e.once`` tasks on ``broker`` (find them by name).

    Each counts its run under ``once-ORDER`` and returns at once: ``pay`` with
    the middleware's defaults (its lock keyed on the call's fingerprint), and
    ``pay_remembered`` with ``deduplication_success_ttl=CHARGE_SUCCESS_TTL``.
    """
    reports = Reports(config)

    async def pay(order: int, context: Context = TaskiqDepends()) -> dict[str, Any]:
        run = await reports.started("pay", f"once-{order}", context)
        return {"order": order, "run": run, "pid": os.getpid()}

    broker.task(ONCE_TASK)(pay)
    broker.task(ONCE_REMEMBERED_TASK, deduplication_success_ttl=CHARGE_SUCCESS_TTL)(pay)


def build_broker(config: Config) -> tuple[AsyncBroker, Tasks]:
    """The broker of ``config`` with its middlewares, result backend and tasks."""
    broker = _make_broker(config).with_result_backend(
        RedisAsyncResultBackend(
            config.redis_url, prefix_str=f"{config.prefix}:result", result_ex_time=300
        )
    )
    dedup = RedisDeduplicationMiddleware(
        redis_url=config.redis_url,
        default_ttl=config.default_ttl,
        key_prefix=config.lock_prefix,
        heartbeat_interval=config.heartbeat_interval,
        running_ttl=config.running_ttl,
        startup_retries=1,
    )
    middlewares: list[TaskiqMiddleware] = [dedup]
    if config.retry:
        kind, position = config.retry.rsplit("-", 1)
        retry: TaskiqMiddleware
        if kind == "smart":
            retry = SmartRetryMiddleware(default_retry_count=MAX_ATTEMPTS, default_delay=0.2)
        elif kind == "smart-source":
            retry = SmartRetryMiddleware(
                default_retry_count=MAX_ATTEMPTS,
                default_delay=1,
                schedule_source=_retry_source(config),
            )
        else:
            retry = SimpleRetryMiddleware(default_retry_count=MAX_ATTEMPTS)
        middlewares = [dedup, retry] if position == "first" else [retry, dedup]
    first: list[TaskiqMiddleware] = [AckWindow(config)]
    if config.crash_at:
        first.append(CopyMaker(config))
    if config.ledger:
        first.append(LimitDeliveries(config))
    later: list[TaskiqMiddleware] = [LaterMiddleware(config)] if config.later_middleware else []
    broker.with_middlewares(*first, *middlewares, *later)
    register_callsite_tasks(broker, config)
    register_once_tasks(broker, config)
    register_limited_tasks(broker, config)
    return broker, register_tasks(broker, config)


def _retry_source(config: Config) -> ListRedisScheduleSource:
    return ListRedisScheduleSource(config.redis_url, prefix=f"{config.prefix}:schedule")


def _make_broker(config: Config) -> AsyncBroker:
    if config.broker == "redis-list":
        # No read timeout: an idle worker's BRPOP must not die (and lose the
        # message it pops as it dies) every 5 s; worker_broker wakes the loop so
        # that a worker still stops at the first SIGTERM (docs/deploying.md).
        return ListQueueBroker(
            config.redis_url, queue_name=f"{config.prefix}:queue", socket_timeout=None
        )
    if config.broker == "redis-stream":
        return RedisStreamBroker(
            config.redis_url,
            queue_name=f"{config.prefix}:stream",
            consumer_group_name=config.name,
            xread_block=500,
            idle_timeout=600_000 if config.idle_timeout is None else config.idle_timeout,
        )
    if config.broker == "rabbitmq":
        from taskiq_aio_pika import AioPikaBroker  # noqa: PLC0415 (only where it runs)
        from taskiq_aio_pika.exchange import Exchange  # noqa: PLC0415
        from taskiq_aio_pika.queue import Queue, QueueType  # noqa: PLC0415

        return AioPikaBroker(
            config.amqp_url,
            exchange=Exchange(name=config.name),
            task_queues=[Queue(name=config.name, type=QueueType.CLASSIC)],
            dead_letter_queue=Queue(name=f"{config.name}.dead", type=QueueType.CLASSIC),
            # SmartRetryMiddleware sends retries with a "delay" label.
            delay_queue=Queue(name=f"{config.name}.delay", type=QueueType.CLASSIC),
        )
    from nats.js.api import ConsumerConfig  # noqa: PLC0415
    from taskiq_nats import PullBasedJetStreamBroker  # noqa: PLC0415

    consumer = None
    if config.ack_wait is not None:
        consumer = ConsumerConfig(durable_name=config.name, ack_wait=config.ack_wait)
    return PullBasedJetStreamBroker(
        config.nats_url,
        subject=config.name,
        stream_name=config.name,
        durable=config.name,
        pull_consume_timeout=0.5,
        consumer_config=consumer,
    )


async def _wake_every_second() -> None:
    while True:  # noqa: ASYNC110 (waking the loop up is the point, there is no event)
        await asyncio.sleep(1)


def worker_broker() -> AsyncBroker:
    """The broker for ``taskiq worker``, configured from the environment."""
    config = Config.from_env()
    broker, _ = build_broker(config)

    @broker.on_event(TaskiqEvents.WORKER_STARTUP)
    async def stop_at_the_first_signal(state: TaskiqState) -> None:
        # An idle worker sees SIGTERM only when its event loop wakes up.
        state.waker = asyncio.create_task(_wake_every_second())
        if config.ledger:  # the limited tasks' ledger: when this loop was late
            state.stalls = asyncio.create_task(Writer(config.pg_dsn, config.ledger).watch_stalls())

    return broker


def scheduler() -> TaskiqScheduler:
    """The scheduler for ``taskiq scheduler``, configured from the environment."""
    config = Config.from_env()
    broker, _ = build_broker(config)
    sources: list[ScheduleSource] = [TaskIdLabelScheduleSource(broker)]
    if config.retry.startswith("smart-source"):
        sources.append(_retry_source(config))
    if config.scheduler_kind == "dedup":
        return DeduplicationScheduler(broker, sources)
    if config.scheduler_kind == "wrapped":
        (dedup,) = [m for m in broker.middlewares if isinstance(m, RedisDeduplicationMiddleware)]
        return TaskiqScheduler(broker, [DeduplicatedScheduleSource(s, dedup) for s in sources])
    return TaskiqScheduler(broker, sources)


# The call-site tasks (tests/e2e/test_callsite.py): join, merge, debounce, fence.
# Each fails its first attempt when called with fail_first=True, so that a
# retry middleware retries it.

#: The debounce of ``e2e.cs.reindex``: quiet period and maximum wait, in seconds.
DEBOUNCE_QUIET = 1.0
DEBOUNCE_MAX = 3.0


def register_callsite_tasks(broker: AsyncBroker, config: Config) -> None:
    """Register the call-site tasks on ``broker`` (find them by name)."""
    reports = Reports(config)
    retry_labels = {"retry_on_error": True, "max_retries": MAX_ATTEMPTS}

    def fail(context: Context, fail_first: bool) -> None:
        if fail_first and int(context.message.labels.get("_retries", 0)) == 0:
            msg = "the first attempt fails on purpose"
            raise RuntimeError(msg)

    async def report(
        user_id: int, tag: str, fail_first: bool = False, context: Context = TaskiqDepends()
    ) -> dict[str, Any]:
        run = await reports.started("report", tag, context)
        await reports.pass_gate(tag)
        fail(context, fail_first)
        return {"user_id": user_id, "tag": tag, "run": run}

    async def sync(
        user_id: int, version: int, fail_first: bool = False, context: Context = TaskiqDepends()
    ) -> int:
        await reports.started("sync", f"user-{user_id}", context)
        await reports.redis.rpush(config.key("versions", user_id), version)
        fail(context, fail_first)
        return version

    async def reindex(
        doc_id: str, revision: int, fail_first: bool = False, context: Context = TaskiqDepends()
    ) -> int:
        await reports.started("reindex", doc_id, context)
        await reports.redis.rpush(config.key("revisions", doc_id), revision)
        fail(context, fail_first)
        return revision

    async def fenced(
        tag: str,
        fail_first: bool = False,
        context: Context = TaskiqDepends(),
        lock: TaskLock = TaskiqDepends(),
    ) -> None:
        # Read before it says it started: the test takes the lock over once it has.
        before = await lock.held()
        run = await reports.started("fenced", tag, context)
        seen = {"run": run, "fence": lock.fence, "before": before}
        await reports.pass_gate(tag)
        seen["after"] = await lock.held()
        await reports.redis.rpush(config.key("fences", tag), json.dumps(seen))
        fail(context, fail_first)

    broker.task("e2e.cs.report", deduplication_key_fields=["user_id"], **retry_labels)(report)
    broker.task(
        "e2e.cs.sync",
        deduplication_key_fields=["user_id"],
        deduplication_merge="latest",
        **retry_labels,
    )(sync)
    broker.task(
        "e2e.cs.reindex",
        deduplication_key_fields=["doc_id"],
        deduplication_debounce=DEBOUNCE_QUIET,
        deduplication_debounce_max=DEBOUNCE_MAX,
        **retry_labels,
    )(reindex)
    # Its runs may overlap: the fence is what tells a run that overlaps another.
    broker.task(
        "e2e.cs.fenced",
        deduplication_key_fields=["tag"],
        deduplication_exclusive=False,
        **retry_labels,
    )(fenced)


# The limited tasks (tests/e2e/test_limits.py): keyed flow control. Each writes
# its runs to the test's ledger in PostgreSQL, stamping its start as its body
# begins and its end as it ends, under the name of the limit it counts against.

#: ``limit_concurrency`` of the keyed limit: one limit per value of ``key``.
KEYED_LIMIT = 2
#: ``limit_rate`` and ``limit_burst`` of the rate that two tasks share.
SHARED_RATE, SHARED_RATE_PER_S, SHARED_BURST = "5/s", 5, 2
#: The limited tasks: name -> (their labels, the ledger's name of their limit).
#: The keyed tasks share one limit per ``key`` (``limit_key``), one deduplicated,
#: one not; so do the rated ones, one rate for both.
LIMITED_TASKS: dict[str, tuple[dict[str, Any], str]] = {
    "e2e.limit.keyed": (
        {
            "limit_concurrency": KEYED_LIMIT,
            "limit_key": "e2e-keyed",
            "limit_key_fields": ["key"],
            "retry_on_error": True,
            "max_retries": MAX_ATTEMPTS,
        },
        "keyed:{key}",
    ),
    "e2e.limit.keyed_open": (
        {
            "limit_concurrency": KEYED_LIMIT,
            "limit_key": "e2e-keyed",
            "limit_key_fields": ["key"],
            "retry_on_error": True,
            "max_retries": MAX_ATTEMPTS,
            "deduplication": False,
        },
        "keyed:{key}",
    ),
    "e2e.limit.one": ({"limit_concurrency": 1, "deduplication": False}, "one"),
    "e2e.limit.rate_a": (
        {"limit_rate": SHARED_RATE, "limit_burst": SHARED_BURST, "limit_key": "e2e-rate"},
        "rate",
    ),
    "e2e.limit.rate_b": (
        {
            "limit_rate": SHARED_RATE,
            "limit_burst": SHARED_BURST,
            "limit_key": "e2e-rate",
            "deduplication": False,
        },
        "rate",
    ),
    "e2e.limit.unlimited": ({"deduplication": False}, ""),
}
LIMITED_PREFIX = "e2e.limit."


class LimitDeliveries(TaskiqMiddleware):
    """Counts every delivery of a limited task, first in the chain (``deliveries`` hash).

    A delivery that its limit sends back to the broker ends without its body,
    and so without a row in the ledger: this counts those too.
    """

    def __init__(self, config: Config) -> None:
        """Count in the test's Redis."""
        super().__init__()
        self.reports = Reports(config)
        self.config = config

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Count the delivery under its task's name."""
        if message.task_name.startswith(LIMITED_PREFIX):
            await self.reports.redis.hincrby(self.config.key("deliveries"), message.task_name, 1)
        return message


def register_limited_tasks(broker: AsyncBroker, config: Config) -> None:
    """Register the tasks of :data:`LIMITED_TASKS` on ``broker`` (find them by name).

    Each call's ``n`` is unique in its test (the deduplicated ones lock each
    call apart); it runs ``ms`` milliseconds, first waiting at its ``gate``
    if it names one, and fails its first ``failures`` attempts.
    """
    if not config.ledger:
        return
    reports = Reports(config)
    writer = Writer(config.pg_dsn, config.ledger)

    def limited(name: str, limit: str) -> Callable[..., Awaitable[int]]:
        async def run(
            n: int,
            key: str = "",
            ms: int = 0,
            failures: int = 0,
            gate: str = "",
            context: Context = TaskiqDepends(),
        ) -> int:
            started = time.time()  # first: the body begins now
            attempt = int(context.message.labels.get("_retries", 0))
            row = await writer.start(
                task=name,
                task_id=context.message.task_id,
                limit_name=limit.format(key=key),
                n=n,
                attempt=attempt,
                started=started,
            )
            if gate:
                await reports.pass_gate(gate)
            await asyncio.sleep(ms / 1000)
            failing = attempt < failures
            await writer.end(row, time.time(), "failed" if failing else "ok")
            if failing:
                msg = f"attempt {attempt} of call {n} fails on purpose"
                raise RuntimeError(msg)
            return n

        return run

    for name, (labels, limit) in LIMITED_TASKS.items():
        broker.task(name, **labels)(limited(name, limit))
