"""The application the soak runs: four brokers, their middlewares, tasks, a ledger.

The brokers are those of the e2e suite: taskiq-redis' list and stream brokers
(the stream one reclaims a message idle for :data:`IDLE_TIMEOUT_MS`), RabbitMQ
through taskiq-aio-pika and NATS JetStream through taskiq-nats (delivering a
message again when it is not acknowledged within :data:`ACK_WAIT`). One ``work``
task per lock policy (:data:`POLICIES`), some of whose calls outlast those two
timeouts, so that their message is delivered again while they run. One more,
"limited", has a limit (:data:`LIMIT` runs at once) that its calls on every
broker share.

The same code runs in the soak's own process, in its client process
(``python -m tests.soak.client``) and in every ``taskiq worker
tests.soak.app:<broker>_worker`` process. They agree on everything through one
:class:`SoakConfig`, handed to the other processes as JSON in :data:`CONFIG_ENV`.

Every run of the task writes its start and its end to PostgreSQL, the outside
observer: it sees what really ran, whatever Redis, the brokers or the
middleware believe. So do the results that taskiq stores (:class:`LedgerResults`,
the application's result backend), and what a middleware of the application's
own, registered after deduplication, sees of each delivery (:class:`Observer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import psycopg
import redis.asyncio
import redis.exceptions
from taskiq import (
    AckableMessage,
    AsyncBroker,
    AsyncResultBackend,
    AsyncTaskiqDecoratedTask,
    BrokerMessage,
    Context,
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqDepends,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqResult,
)
from taskiq.exceptions import ResultGetError
from taskiq_redis import ListQueueBroker, RedisStreamBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

CONFIG_ENV = "DEDUP_SOAK_CONFIG"
BROKERS = ("redis-list", "redis-stream", "rabbitmq", "nats")
#: The brokers that deliver a message again until a worker acknowledges it.
AT_LEAST_ONCE = frozenset({"redis-stream", "rabbitmq", "nats"})
#: Attempts of a failing task in all (taskiq's ``max_retries`` label counts attempts).
MAX_ATTEMPTS = 3
TASK_NAME = "soak.work"
CHAIN_NAME = "soak.chain"
POKE_NAME = "soak.poke"
#: The stream broker claims a message again once it is idle (unacknowledged) this long.
IDLE_TIMEOUT_MS = 2000
#: NATS delivers a message again when it is not acknowledged within this, in seconds.
ACK_WAIT = 3.0
#: The label the :class:`Observer` tags each delivery with, for the ledger.
DELIVERY_LABEL = "_soak_delivery"
#: ``deduplication_success_ttl`` of the "remembered" task.
SUCCESS_TTL = 5
#: ``deduplication_ttl`` of the "expired" task: its throttle window.
EXPIRED_TTL = 4
#: The debounce of the "debounce" task: quiet period and longest wait, in seconds.
DEBOUNCE_QUIET, DEBOUNCE_MAX = 0.3, 1.0
#: At most this many runs of the "limited" task at once, on all four brokers together.
LIMIT = 4
#: The ``work`` task of each lock policy, by a name of the soak's own, with its
#: labels. "merge" and "debounce" key on ``fp`` alone: their repeats vary ``ms``.
#: "limited" is "finished" with a limit of :data:`LIMIT` runs at once, one
#: limit (``limit_key``) for its calls on every broker.
POLICIES: dict[str, dict[str, Any]] = {
    "finished": {},
    "remembered": {"deduplication_success_ttl": SUCCESS_TTL},
    "started": {"deduplication_until": "started"},
    "expired": {"deduplication_until": "expired", "deduplication_ttl": EXPIRED_TTL},
    "merge": {
        "deduplication_until": "started",
        "deduplication_merge": "latest",
        "deduplication_key_fields": ["fp"],
    },
    "debounce": {
        "deduplication_debounce": DEBOUNCE_QUIET,
        "deduplication_debounce_max": DEBOUNCE_MAX,
        "deduplication_key_fields": ["fp"],
    },
    "limited": {"limit_concurrency": LIMIT, "limit_key": "soak-limited"},
}


def policy_of(fp: str) -> str:
    """The lock policy of a call, from its fingerprint ``<broker>:<policy>:<n>``.

    A chain call and the call it sends (``<broker>:chain:<n>``,
    ``<broker>:child:<n>``) and any other fingerprint are "finished".
    """
    parts = fp.split(":")
    return parts[1] if len(parts) == 3 and parts[1] in POLICIES else "finished"


def fingerprint(kind: str, policy: str, serial: int) -> str:
    """The fingerprint of a new call: its broker, its policy, a serial number."""
    return f"{kind}:{policy}:{serial}"


@dataclass(frozen=True)
class SoakConfig:
    """Everything the processes of one soak run must agree on."""

    run_id: str
    """Unique per run: the PostgreSQL schema, queue names and key prefix derive from it."""
    lock_redis_url: str
    """The middleware's Redis, through the soak's proxy (with its timeouts in the query)."""
    list_redis_url: str
    """The Redis of ``ListQueueBroker``, through a second proxy."""
    amqp_url: str
    """RabbitMQ, through a third proxy."""
    stream_redis_url: str
    """The Redis of ``RedisStreamBroker`` (the list broker's server), through a proxy of its own."""
    nats_url: str
    """NATS, through a proxy."""
    pg_dsn: str
    ttl: int
    """The middleware's ``default_ttl``."""
    fail_open: tuple[str, ...] = ("redis-list",)
    """The brokers whose middleware has ``fail_open=True``."""
    running_ttl: int | None = None
    """If set, sent as the ``deduplication_running_ttl`` label (a library that
    does not know the label ignores it)."""
    redelivery_window: int | None = None
    """If set, the middleware's ``redelivery_window`` option (where the library has it)."""

    @property
    def schema(self) -> str:
        """The PostgreSQL schema of the run's ledger."""
        return f"dedup_soak_{self.run_id}"

    @property
    def lock_prefix(self) -> str:
        """The middleware's ``key_prefix``."""
        return f"soak:{self.run_id}:lock"

    def queue(self, broker: str) -> str:
        """The queue (and exchange) name of ``broker``."""
        return f"dedup-soak-{self.run_id}-{broker}"

    def to_json(self) -> str:
        """Serialise for :data:`CONFIG_ENV`."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> SoakConfig:
        """The configuration the soak handed to this process."""
        raw = json.loads(os.environ[CONFIG_ENV])
        raw["fail_open"] = tuple(raw["fail_open"])
        return cls(**raw)


class Ledger:
    """This process's connection to the run's ledger, made on first use."""

    def __init__(self, config: SoakConfig) -> None:
        """Remember where to connect; nothing connects yet."""
        self.config = config
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock: asyncio.Lock | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.config.pg_dsn,
                autocommit=True,
                options=f"-c search_path={self.config.schema}",
            )
        return self._conn

    async def execute(self, sql: str, params: tuple[Any, ...]) -> Any:
        """Run one statement; return the first column of its first row, if any."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = await self._connection()
            cursor = await conn.execute(sql.encode(), params)
            row = await cursor.fetchone() if cursor.description else None
            return row[0] if row else None

    async def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """Insert many rows at once."""
        if not rows:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = await self._connection()
            async with conn.cursor() as cursor:
                await cursor.executemany(sql.encode(), rows)

    async def close(self) -> None:
        """Close the connection, if one was made."""
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


#: The client sets a fresh list here before each send; :class:`SendTimer` appends
#: the moment (monotonic) the deduplication middleware let the send through, so
#: the client can time the lock's part of ``kiq``. A list, not a float: the
#: context may be copied into another task on the way (``asyncio.wait_for``).
LOCK_TAKEN_AT: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "dedup_soak_lock_taken_at", default=None
)


class SendTimer(TaskiqMiddleware):
    """Notes when ``pre_send`` reaches it: placed after deduplication, that is when
    the lock was taken (or refused with fail-open)."""

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        """Note the time; change nothing."""
        taken = LOCK_TAKEN_AT.get()
        if taken is not None:
            taken.append(time.monotonic())
        return message


class Observer(TaskiqMiddleware):
    """A middleware of the application's own, after deduplication: what it sees of a skip.

    As many a logging or auditing middleware does, it reads the call's
    positional arguments before the run (``list(message.args)``) and hears of
    every error (``on_error``). A copy that deduplication leaves out must be
    invisible here: arguments that read, and no error. Every ``on_error`` call,
    and every read of the arguments that raised, goes to the ledger's ``hooks``
    table. Where the read raises, it goes on as if it had not (a real middleware
    would raise, and leave the message unacknowledged, to come back for ever),
    so that the rest of the soak sees the deduplication middleware's doing alone.

    It tags each delivery with a fresh :data:`DELIVERY_LABEL`, which the run
    writes to the ledger too: the report tells an error of a body that failed
    from an error in a delivery whose body never ran.
    """

    def __init__(self, kind: str, ledger: Ledger) -> None:
        """Record for broker ``kind`` in ``ledger``."""
        super().__init__()
        self.kind = kind
        self.ledger = ledger

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Tag the delivery; read the arguments, as a logging middleware would."""
        message.labels[DELIVERY_LABEL] = uuid.uuid4().hex
        try:
            list(message.args)
        except Exception as exc:  # noqa: BLE001 (what it raises is the finding)
            await self._record(message, "pre_execute", exc)
        return message

    async def on_error(
        self,
        message: TaskiqMessage,
        result: TaskiqResult[Any],
        exception: BaseException,
    ) -> None:
        """Write the error to the ledger, with the delivery it came in."""
        await self._record(message, "on_error", exception)

    async def _record(self, message: TaskiqMessage, hook: str, error: BaseException) -> None:
        with contextlib.suppress(Exception):  # the ledger must not change the run
            await self.ledger.execute(
                "INSERT INTO hooks (task_id, broker, pid, at, hook, delivery, error)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (
                    message.task_id,
                    self.kind,
                    os.getpid(),
                    time.time(),
                    hook,
                    message.labels.get(DELIVERY_LABEL),
                    f"{type(error).__name__}: {error}"[:300],
                ),
            )


class LedgerResults(AsyncResultBackend[Any]):
    """The application's result backend: every result stored is a row of the ledger's ``results``.

    PostgreSQL is never faulted, so a result missing at the end is one that no
    worker stored, not one that the backend lost. The last row of a task id is
    its result.
    """

    def __init__(self, kind: str, ledger: Ledger) -> None:
        """Store for broker ``kind`` in ``ledger``."""
        self.kind = kind
        self.ledger = ledger

    async def set_result(self, task_id: str, result: TaskiqResult[Any]) -> None:
        """Add the result as the task's latest."""
        error = None if result.error is None else type(result.error).__name__
        await self.ledger.execute(
            "INSERT INTO results (task_id, broker, pid, at, is_err, error, body)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (
                task_id,
                self.kind,
                os.getpid(),
                time.time(),
                result.is_err,
                error,
                result.model_dump_json(),
            ),
        )

    async def is_result_ready(self, task_id: str) -> bool:
        """Whether a result of ``task_id`` was stored."""
        return bool(
            await self.ledger.execute(
                "SELECT EXISTS (SELECT 1 FROM results WHERE task_id = %s)", (task_id,)
            )
        )

    async def get_result(self, task_id: str, with_logs: bool = False) -> TaskiqResult[Any]:
        """The latest result stored for ``task_id``."""
        del with_logs  # none are kept
        body = await self.ledger.execute(
            "SELECT body FROM results WHERE task_id = %s ORDER BY id DESC LIMIT 1", (task_id,)
        )
        if body is None:
            raise ResultGetError
        return TaskiqResult[Any].model_validate_json(body)


def library_redelivery_window() -> int | None:
    """The default ``redelivery_window`` of the middleware, where the library has the option."""
    parameter = inspect.signature(RedisDeduplicationMiddleware).parameters.get("redelivery_window")
    if parameter is None or not isinstance(parameter.default, int):
        return None
    return parameter.default


def _record_failed_sends(broker: AsyncBroker, kind: str, ledger: Ledger) -> None:
    """Write each send the broker refuses in a worker (a retry's) to the ledger.

    taskiq then raises from the retry middleware's ``on_error``: the message is
    not acknowledged, and the broker delivers it again later. The report needs
    to know that the retry was never queued.
    """
    kick = broker.kick

    async def kick_or_record(message: BrokerMessage) -> None:
        try:
            await kick(message)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
            with contextlib.suppress(Exception):  # the ledger must not hide the error
                await ledger.execute(
                    "INSERT INTO send_failures (task_id, broker, at, error)"
                    " VALUES (%s, %s, %s, %s)",
                    (message.task_id, kind, time.time(), error),
                )
            raise

    broker.kick = kick_or_record  # type: ignore[method-assign]


@dataclass(frozen=True)
class App:
    """One broker of the application, as seen by one process."""

    kind: str
    broker: AsyncBroker
    work: dict[str, AsyncTaskiqDecoratedTask[..., Any]]
    """The ``work`` task of each policy of :data:`POLICIES`."""
    chain: AsyncTaskiqDecoratedTask[..., Any]
    poke: AsyncTaskiqDecoratedTask[..., Any]
    """Does nothing, undeduplicated and unrecorded: wakes a stream worker up."""
    ledger: Ledger


def build(config: SoakConfig, kind: str, *, client: bool = False) -> App:
    """The broker ``kind`` with its middlewares and task."""
    broker = _make_broker(config, kind)
    extra: dict[str, Any] = {}
    if config.redelivery_window is not None and library_redelivery_window() is not None:
        extra["redelivery_window"] = config.redelivery_window
    dedup = RedisDeduplicationMiddleware(
        redis_url=config.lock_redis_url,
        default_ttl=config.ttl,
        key_prefix=config.lock_prefix,
        fail_open=kind in config.fail_open,
        startup_retries=5,
        startup_retry_delay=0.5,
        **extra,
    )
    # Both retry middlewares, each in both orders with deduplication.
    retry: TaskiqMiddleware
    if kind in {"redis-list", "rabbitmq"}:
        retry = SimpleRetryMiddleware(default_retry_count=MAX_ATTEMPTS)
    else:
        retry = SmartRetryMiddleware(default_retry_count=MAX_ATTEMPTS, default_delay=0.1)
    dedup_first = kind in {"redis-list", "nats"}
    middlewares: list[TaskiqMiddleware] = [dedup, retry] if dedup_first else [retry, dedup]
    if client:
        middlewares.append(SendTimer())
    ledger = Ledger(config)
    # Last of all, after deduplication whatever its place: it must not see a skip.
    middlewares.append(Observer(kind, ledger))
    broker.with_middlewares(*middlewares)
    broker.with_result_backend(LedgerResults(kind, ledger))
    if not client:
        _record_failed_sends(broker, kind, ledger)

    async def work(fp: str, ms: int, fails: int, context: Context = TaskiqDepends()) -> str:
        message = context.message
        attempt = int(message.labels.get("_retries", 0))
        started = time.time()
        run = await ledger.execute(
            "INSERT INTO runs (fp, task_id, broker, attempt, pid, started, delivery)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (
                fp,
                message.task_id,
                kind,
                attempt,
                os.getpid(),
                started,
                message.labels.get(DELIVERY_LABEL),
            ),
        )
        await asyncio.sleep(ms / 1000)
        failing = attempt < fails
        # The end is stamped before it is written: a slow write cannot make the
        # run look longer than it was.
        await ledger.execute(
            "UPDATE runs SET ended = %s, outcome = %s WHERE id = %s",
            (time.time(), "failed" if failing else "ok", run),
        )
        if failing:
            msg = f"attempt {attempt} fails on purpose"
            raise RuntimeError(msg)
        return fp

    labels: dict[str, Any] = {"retry_on_error": True, "max_retries": MAX_ATTEMPTS}
    if config.running_ttl is not None:
        labels["deduplication_running_ttl"] = config.running_ttl
    tasks = {
        policy: broker.task(
            TASK_NAME if policy == "finished" else f"{TASK_NAME}.{policy}",
            **labels,
            **policy_labels,
        )(work)
        for policy, policy_labels in POLICIES.items()
    }
    task = tasks["finished"]

    def chain(fp: str, child: str, ms: int, context: Context = TaskiqDepends()) -> str:
        # A sync task: taskiq runs it in its thread pool, and it enqueues a
        # follow-up the way sync code does, with asyncio.run(): a second event
        # loop in the worker process, beside the one that runs the async tasks.
        message = context.message
        with psycopg.connect(
            config.pg_dsn, autocommit=True, options=f"-c search_path={config.schema}"
        ) as conn:
            run = _one(
                conn,
                "INSERT INTO runs (fp, task_id, broker, attempt, pid, started, delivery)"
                " VALUES (%s, %s, %s, 0, %s, %s, %s) RETURNING id",
                (
                    fp,
                    message.task_id,
                    kind,
                    os.getpid(),
                    time.time(),
                    message.labels.get(DELIVERY_LABEL),
                ),
            )
            task_id = uuid.uuid4().hex
            wall, t0 = time.time(), time.monotonic()
            holder = error = None
            try:
                asyncio.run(task.kicker().with_task_id(task_id).kiq(fp=child, ms=ms, fails=0))
            except DuplicateTaskError as exc:
                outcome, holder = "duplicate", exc.holder_task_id
            except Exception as exc:  # noqa: BLE001 (every failure is an outcome to count)
                outcome, error = "error", f"{type(exc).__name__}: {exc}"[:300]
            else:
                outcome = "accepted"
            latency = time.monotonic() - t0
            conn.execute(
                b"INSERT INTO kiqs (fp, task_id, broker, started, ended, latency, lock_latency,"
                b" outcome, holder, error, source)"
                b" VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 'worker')",
                (
                    child,
                    task_id,
                    kind,
                    wall,
                    wall + latency,
                    latency,
                    latency,
                    outcome,
                    holder,
                    error,
                ),
            )
            conn.execute(
                b"UPDATE runs SET ended = %s, outcome = 'ok' WHERE id = %s", (time.time(), run)
            )
        return fp

    chained = broker.task(CHAIN_NAME)(chain)

    async def poke() -> None:
        # Nothing: a stream worker claims idle messages (those of a killed
        # worker) only after a read that found a new one.
        return None

    poked = broker.task(POKE_NAME, deduplication=False)(poke)
    return App(kind, broker, tasks, chained, poked, ledger)


def _one(conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...]) -> Any:
    row = conn.execute(sql.encode(), params).fetchone()
    assert row is not None
    return row[0]


class _AnyLoopListQueueBroker(ListQueueBroker):
    """``ListQueueBroker`` whose ``kick`` also works from a second event loop.

    taskiq-redis shares one connection pool between ``kick`` and ``listen``; a
    ``kick`` from another loop (the ``chain`` task's ``asyncio.run``) leaves a
    connection bound to that loop in the pool, and the listener that picks it
    up next dies with "attached to a different loop". Here a kick from any
    other loop uses a connection of its own, so what the soak sees from the
    second loop is the middleware's doing, not the broker's.
    """

    def __init__(self, url: str, **kwargs: Any) -> None:
        """Build the broker, remembering ``url`` for kicks from other loops."""
        super().__init__(url, **kwargs)
        self._url = url
        self._home: asyncio.AbstractEventLoop | None = None

    async def startup(self) -> None:
        """Remember the loop the broker lives in."""
        self._home = asyncio.get_running_loop()
        await super().startup()

    async def kick(self, message: BrokerMessage) -> None:
        """Push the message, from the broker's own pool only in its own loop."""
        if asyncio.get_running_loop() is self._home:
            await super().kick(message)
            return
        client = redis.asyncio.Redis.from_url(self._url)
        try:
            await client.lpush(message.labels.get("queue_name") or self.queue_name, message.message)
        finally:
            await client.aclose()


class _ReconnectingStreamBroker(RedisStreamBroker):
    """``RedisStreamBroker`` whose listener outlives a lost connection to its Redis.

    taskiq-redis' stream listener lets a ``ConnectionError`` end the worker
    process, which taskiq does not replace: a cut of the broker's Redis would
    leave the stream without a consumer, and the messages of killed workers
    unclaimed. Here the listener reads again after a pause, as a deployment's
    supervisor would restart it, so that the soak sees the middleware's doing.
    """

    async def listen(self) -> AsyncGenerator[AckableMessage, None]:
        """Listen, starting again whenever the connection to Redis is lost."""
        while True:
            try:
                async for message in super().listen():
                    yield message
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):  # noqa: PERF203 (read again)
                await asyncio.sleep(0.5)


def _make_broker(config: SoakConfig, kind: str) -> AsyncBroker:
    if kind == "redis-list":
        # BRPOP waits without a timeout: the default socket timeout would end
        # an idle worker's listener (taskiq-redis catches ConnectionError only).
        return _AnyLoopListQueueBroker(
            config.list_redis_url, queue_name=config.queue(kind), socket_timeout=None
        )
    if kind == "redis-stream":
        return _ReconnectingStreamBroker(
            config.stream_redis_url,
            queue_name=config.queue(kind),
            consumer_group_name=config.queue(kind),
            idle_timeout=IDLE_TIMEOUT_MS,
            xread_block=500,
        )
    if kind == "nats":
        from nats.js.api import ConsumerConfig  # noqa: PLC0415 (only where it runs)
        from taskiq_nats import PullBasedJetStreamBroker  # noqa: PLC0415

        name = config.queue(kind)
        return PullBasedJetStreamBroker(
            config.nats_url,
            subject=name,
            stream_name=name,
            durable=name,
            pull_consume_timeout=0.5,
            consumer_config=ConsumerConfig(durable_name=name, ack_wait=ACK_WAIT),
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
        )
    from taskiq_aio_pika import AioPikaBroker  # noqa: PLC0415 (only where it runs)
    from taskiq_aio_pika.exchange import Exchange  # noqa: PLC0415
    from taskiq_aio_pika.queue import Queue, QueueType  # noqa: PLC0415

    name = config.queue(kind)
    return AioPikaBroker(
        config.amqp_url,
        exchange=Exchange(name=name),
        task_queues=[Queue(name=name, type=QueueType.CLASSIC)],
        dead_letter_queue=Queue(name=f"{name}.dead", type=QueueType.CLASSIC),
        delay_queue=Queue(name=f"{name}.delay", type=QueueType.CLASSIC),
    )


def redis_list_worker() -> AsyncBroker:
    """The broker for ``taskiq worker tests.soak.app:redis_list_worker``."""
    return build(SoakConfig.from_env(), "redis-list").broker


def rabbitmq_worker() -> AsyncBroker:
    """The broker for ``taskiq worker tests.soak.app:rabbitmq_worker``."""
    return build(SoakConfig.from_env(), "rabbitmq").broker


def redis_stream_worker() -> AsyncBroker:
    """The broker for ``taskiq worker tests.soak.app:redis_stream_worker``."""
    return build(SoakConfig.from_env(), "redis-stream").broker


def nats_worker() -> AsyncBroker:
    """The broker for ``taskiq worker tests.soak.app:nats_worker``."""
    return build(SoakConfig.from_env(), "nats").broker
