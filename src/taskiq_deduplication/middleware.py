"""The middleware: its options, and the taskiq hooks that a deduplicated task passes.

Each hook hands its work to the folder it belongs to: `send/` takes the lock of
a send and gives it its full TTL once the broker has the message; `run/` does
what the lock's policy says at a run's start and end, and keeps running locks
alive. Below them, `model/` makes keys and values from the options and labels,
`store/` talks to Redis and `observe/` tells subscribers, metrics and spans
(`docs/how-it-works.md` maps them all).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any

from taskiq import TaskiqMessage, TaskiqMiddleware, TaskiqResult

from taskiq_deduplication.exceptions import InvalidSettingError, StartupError
from taskiq_deduplication.locks import Locks
from taskiq_deduplication.model import settings
from taskiq_deduplication.model.formats import DEFAULT_PREFIX, DEFAULT_UNTIL, MERGED_INTO_LABEL
from taskiq_deduplication.model.limits import read_limit
from taskiq_deduplication.observe import tracing
from taskiq_deduplication.observe.events import EventSink, Subscriber
from taskiq_deduplication.observe.metrics import Metrics, process_metrics
from taskiq_deduplication.run.copies import watch_deliveries
from taskiq_deduplication.run.execution import Executions, follow_runs
from taskiq_deduplication.run.limits import DEFAULT_WAITING, Limits, follow_limits
from taskiq_deduplication.run.loops import LoopStates
from taskiq_deduplication.run.runs import Runs
from taskiq_deduplication.send.pending import PendingSends
from taskiq_deduplication.send.sends import Sends
from taskiq_deduplication.store.client import check_connection, client_from_url

if TYPE_CHECKING:
    from collections.abc import Callable

    from pydantic import RedisDsn
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from taskiq import BrokerMessage
    from taskiq.abc.broker import AsyncBroker

    RedisClient = Redis | RedisCluster

__all__ = ["RedisDeduplicationMiddleware"]  # and, for the library's own parts, `loop_states`

logger = logging.getLogger(__name__)


class RedisDeduplicationMiddleware(TaskiqMiddleware):
    """Stops a taskiq application from queueing or running the same task twice.

    Every ``kiq()`` takes a Redis lock keyed on the task's fingerprint (its name
    and arguments, or an explicit key); an identical ``kiq()`` while the lock is
    held raises [DuplicateTaskError][taskiq_deduplication.DuplicateTaskError]. How
    long the lock is held is the task's policy: by default until the task
    finishes (a heartbeat keeps the lock alive while it runs), or until it
    starts, or until the TTL expires, whatever happens to the run.

    Example:
        ```python
        broker = ListQueueBroker("redis://localhost:6379").with_middlewares(
            RedisDeduplicationMiddleware(redis_url="redis://localhost:6379"),
        )
        ```
    """

    def __init__(  # noqa: PLR0913 (the options of the spec, each with its default)
        self,
        redis_url: str | RedisDsn | None = None,
        *,
        default_deduplication: bool = True,
        default_ttl: int = 300,
        key_prefix: str = DEFAULT_PREFIX,
        startup_retries: int = 3,
        startup_retry_delay: float = 1.0,
        heartbeat: bool = True,
        heartbeat_interval: float | None = None,
        fail_open: bool = False,
        running_ttl: int | None = None,
        default_until: str = DEFAULT_UNTIL,
        default_success_ttl: int = 0,
        client: Redis | RedisCluster | None = None,
        metrics: bool = True,
        default_exclusive: bool = True,
        record_task_name: bool = True,
        redelivery_window: int = settings.DEFAULT_REDELIVERY_WINDOW,
        limit_waiting: int = DEFAULT_WAITING,
    ) -> None:
        """Configure the middleware; nothing connects until the broker starts.

        Args:
            redis_url: Redis URL, as for ``Redis.from_url``: a string or a pydantic
                ``RedisDsn``. The client built from it has connect and socket
                timeouts of 5 seconds unless the URL's query sets them.
            default_deduplication: Whether tasks are deduplicated unless their
                ``deduplication`` label says otherwise.
            default_ttl: Lock TTL in seconds, unless the ``deduplication_ttl``
                label sets one.
            key_prefix: Prefix of every lock key: ``"taskiq:deduplication"`` unless set.
            startup_retries: Connection attempts when the broker starts.
            startup_retry_delay: Seconds before the second attempt, doubled
                before each one after it.
            heartbeat: Whether to refresh the lock while the task runs.
            heartbeat_interval: Seconds between refreshes; by default a third of
                the task's TTL, at least 1 second (and at most half the TTL).
            fail_open: Whether a Redis error while taking the lock lets the task
                go out without one (logged) instead of failing the send.
            running_ttl: A shorter TTL, in seconds, for the lock while its task
                runs (a running lease): the heartbeat keeps it on this lease,
                so a worker that dies mid-task frees the lock within it, while
                a queued task keeps its full TTL. ``None`` (the default): 30
                seconds (three ``heartbeat_interval`` if that is longer), or
                none without the heartbeat; 0 keeps the full TTL throughout.
                The ``deduplication_running_ttl`` label sets it per task; it
                needs the heartbeat.
            default_until: How long a call counts as a duplicate, unless the
                ``deduplication_until`` label says: ``"finished"`` (the default:
                while its task is queued or running), ``"started"`` (while it is queued)
                or ``"expired"`` (for the TTL from the send, however the run
                ends).
            default_success_ttl: Seconds a lock of the ``"finished"`` policy
                stays after a successful run, still naming that task as holder,
                unless the ``deduplication_success_ttl`` label says; 0 releases
                it at once.
            client: A ready ``redis.asyncio`` client (``Redis`` or ``RedisCluster``)
                to use instead of ``redis_url``. The middleware does not close it.
            metrics: Whether to record the Prometheus metrics (see
                [Events and metrics](observability.md)) when ``prometheus_client``
                is installed; they are recorded from the broker's startup on.
            default_exclusive: Whether the runs of one lock key never overlap,
                unless the ``deduplication_exclusive`` label says otherwise: a run
                that begins while another run of its key goes on (a copy the
                broker delivered again, a call queued under ``"started"``) waits
                for it to end or for its lease to lapse; a copy of a run that
                succeeded does not run its body again.
            record_task_name: Whether each lock records its task's name (the
                default), so that `taskiq dedup list`, ``show`` and the locks
                page can say whose it is. Every lock records when it was taken,
                its policy and whether a broker accepted its send; the name
                costs its length in every lock's value (and in the message's
                owner label): a lock of a 30-character name takes 216 bytes
                instead of 184 on Redis 7 (see [Performance](performance.md)).
                ``False`` leaves it out.
            redelivery_window: Seconds a call whose run succeeded is remembered,
                so that a copy of its message that the broker delivers again
                (a lost acknowledgement, a reclaim, ``ack_wait``) does not run:
                one hour by default, longer than each broker's own redelivery
                horizon. A new call with the same arguments is not refused by
                it (that is ``deduplication_success_ttl``). It costs one small
                key per successful run of an exclusive task, for the window
                (see [Performance](performance.md)); 0 remembers nothing.
            limit_waiting: How many runs of one limit (``limit_concurrency``,
                ``limit_rate``) may wait for it in one worker process at once.
                A run that would wait beyond them goes back to the broker (its
                message sent again, not a retry), so that a limit with a long
                backlog never takes the worker's slots from its other tasks
                (see [Limits](limits.md)).

        Raises:
            ValueError: An option is missing, of the wrong type or out of range.
        """
        super().__init__()
        self._url = check_connection(redis_url, client)
        self._client = client
        self.default_deduplication = settings.check_bool(
            "default_deduplication", default_deduplication
        )
        self.default_ttl = settings.check_ttl("default_ttl", default_ttl)
        self.key_prefix = settings.check_prefix(key_prefix)
        self.startup_retries = settings.check_int("startup_retries", startup_retries, minimum=1)
        self.startup_retry_delay = settings.check_seconds(
            "startup_retry_delay", startup_retry_delay
        )
        self.heartbeat = settings.check_bool("heartbeat", heartbeat)
        self.heartbeat_interval = settings.check_interval(heartbeat_interval, self.default_ttl)
        self.fail_open = settings.check_bool("fail_open", fail_open)
        self.running_ttl = settings.check_running_ttl(
            running_ttl, self.heartbeat, self.heartbeat_interval
        )
        self.running_lease = settings.default_lease(
            self.running_ttl, self.heartbeat, self.heartbeat_interval
        )
        self.redelivery_window = settings.check_int(
            "redelivery_window", redelivery_window, minimum=0, maximum=10 * 365 * 86400
        )
        policy = settings.check_until(default_until)
        self.default_until = policy.name
        self.default_success_ttl = settings.check_success_ttl(default_success_ttl)
        self.default_exclusive = settings.check_bool("default_exclusive", default_exclusive)
        self.record_task_name = settings.check_bool("record_task_name", record_task_name)
        self.limit_waiting = settings.check_int("limit_waiting", limit_waiting, minimum=1)
        self._defaults = settings.Defaults(
            enabled=self.default_deduplication,
            ttl=self.default_ttl,
            policy=policy,
            success_ttl=self.default_success_ttl,
            heartbeat=self.heartbeat,
            exclusive=self.default_exclusive,
        )
        self.metrics = settings.check_bool("metrics", metrics)
        # Whether the registered tasks' labels were checked (at startup, or at the first kiq).
        self._tasks_checked = False
        self._events = EventSink()
        self._metrics: Metrics | None = None
        self._states = LoopStates(self._new_client, self._events, lambda: self._metrics)
        self._executions = Executions(f"taskiq_deduplication_execution_{id(self):x}")
        follow_runs(self, self._executions)
        pending = PendingSends()
        self._limits = Limits(
            self.key_prefix,
            self.running_lease,
            self.limit_waiting,
            self._events,
            _metrics_of(weakref.ref(self)),
        )
        follow_limits(self, self._limits)
        self._runs = Runs(self, self._states, self._events, self._executions, pending, self._limits)
        self._sends = Sends(
            self,
            defaults=self._defaults,
            states=self._states,
            events=self._events,
            runs=self._runs,
            executions=self._executions,
            pending=pending,
        )

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber`` with every [LockEvent][taskiq_deduplication.LockEvent] from now on.

        It is called in the hook or heartbeat tick that made the event, in every
        event loop that uses the middleware; an exception it raises is logged
        and never reaches ``kiq`` or the task.

        Args:
            subscriber: A callable taking one ``LockEvent``.

        Returns:
            A function that ends the subscription.

        Raises:
            InvalidArgumentError: ``subscriber`` is not callable (a ``TypeError``).
        """
        return self._events.subscribe(subscriber)

    @property
    def subscribers(self) -> tuple[Subscriber, ...]:
        """Who ``subscribe()`` subscribed and is still subscribed, in order.

        The middleware's own Prometheus recorder is not among them: another
        middleware that takes these subscribers over records its own metrics.
        """
        own = self._metrics.record if self._metrics is not None else None
        return tuple(s for s in self._events.subscribers if s != own)

    @property
    def redis_url(self) -> str | None:
        """The Redis URL the middleware connects to; ``None`` if it was given a ``client``."""
        return self._url

    @property
    def locks(self) -> Locks:
        """The locks of this middleware, for tools: [Locks][taskiq_deduplication.Locks].

        Bound to its ``key_prefix`` and to the client of the event loop it is
        used in (the middleware's own, made on first use as a send would), and
        able to compute the key a call takes
        ([key_for][taskiq_deduplication.Locks.key_for]) with the middleware's
        options, as ``kiq`` does.
        """

        async def client() -> RedisClient:
            return (self._states.get() or await self._states.current()).client

        return Locks(client, prefix=self.key_prefix, key_of=self._send_key)

    # Startup and shutdown

    def set_broker(self, broker: AsyncBroker) -> None:
        """Register on ``broker``; taskiq calls this from ``with_middlewares``.

        Raises:
            InvalidSettingError: The middleware is registered on another broker
                already (a ``ValueError``).
                Shutting either broker down would stop the locks of the other's
                running tasks; give each broker a middleware of its own (with the
                same ``redis_url`` and ``key_prefix`` they share their locks).
        """
        current = getattr(self, "broker", None)
        if current is not None and current is not broker:
            msg = (
                f"this RedisDeduplicationMiddleware is registered on "
                f"{type(current).__name__} already; give each broker a middleware of "
                "its own (middlewares with the same redis_url and key_prefix share locks)"
            )
            raise InvalidSettingError(msg)
        if current is None:
            _watch_kick(broker, self._sends.refused)
            watch_deliveries(broker)
        super().set_broker(broker)

    async def startup(self) -> None:
        """Check every registered task's labels, then connect to Redis with retries.

        Raises:
            ValueError: A registered task has a bad or unknown deduplication
                label; the message lists each one, task by task, and nothing
                connects.
            ConnectionError: Redis did not answer a ``PING`` in any attempt;
                the last error is chained.
        """
        broker = getattr(self, "broker", None)
        self._check_tasks()
        self._observe(broker)
        state = await self._states.current()
        for attempt in range(self.startup_retries):
            failed = await state.locks.check()
            if failed is None:
                return
            last_error = failed.error
            if attempt + 1 < self.startup_retries:
                delay = self.startup_retry_delay * 2**attempt
                logger.warning(
                    "Redis is not reachable for deduplication (attempt %d of %d: %s); "
                    "retrying in %.1fs",
                    attempt + 1,
                    self.startup_retries,
                    last_error,
                    delay,
                )
                await asyncio.sleep(delay)
        msg = (
            f"could not connect to Redis for deduplication after "
            f"{self.startup_retries} attempt(s): {last_error}"
        )
        raise StartupError(msg) from last_error

    async def shutdown(self) -> None:
        """Send what is still queued (lock extensions), stop the heartbeat, disconnect.

        This closes what the middleware uses in the running event loop; other
        loops' (``asyncio.run`` in a sync task, threads) close with their loops.
        """
        await self._states.close_current()

    # Send

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        """Take the task's lock before the message goes to the broker.

        A retry of a run (from inside it, or later from a schedule source with
        the run's lock labels) is never its own duplicate: it carries the lock
        on as its policy says.

        Raises:
            DuplicateTaskError: Another send holds the lock.
            ValueError: A deduplication label has an invalid value, or is
                unknown (a typo); on a broker that was not started, a
                registered task's labels are checked at the first send.
            UnfingerprintableError: The arguments cannot be fingerprinted (a
                ``TypeError``).
            redis.exceptions.RedisError: Redis failed and ``fail_open`` is off (a
                cluster client that reaches no node raises
                ``redis.exceptions.RedisClusterException`` instead).
        """
        if not self._tasks_checked:
            self._check_tasks()  # a broker used without startup(): check at the first kiq
        return await self._sends.pre_send(message)

    async def post_send(self, message: TaskiqMessage) -> None:
        """Give the lock its full TTL, now that the broker accepted the message.

        The extension is queued, not awaited: it travels with the next batch of
        lock commands and never adds a round trip to ``kiq``. It is owner-checked,
        so it cannot revive a lock that a fast worker already released.
        """
        await self._sends.post_send(message)

    # Run

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Begin the run of a locked task: do what its policy says at the start.

        ``"finished"`` re-asserts the lock and lets the heartbeat keep it alive,
        ``"started"`` releases it, ``"expired"`` leaves it to its TTL.
        """
        return await self._runs.pre_execute(message)

    async def on_error(
        self,
        message: TaskiqMessage,
        result: TaskiqResult[Any],  # noqa: ARG002 (the hook's signature)
        exception: BaseException,  # noqa: ARG002
    ) -> None:
        """Stop the heartbeat: the task itself is over. The lock goes in ``post_execute``."""
        self._runs.on_error(message)

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """End the run: do what its policy says on success, on failure, or when passed on.

        A run whose lock a retry took over leaves it to the retry. A run that
        passed itself on to a later delivery without a send through this
        middleware (``Context.requeue``, a retry left to a schedule source)
        keeps its lock for it as the policy says. Otherwise a success and a
        failure each get the step of their own: ``"finished"`` releases the
        lock (or keeps it for the success TTL after a success).
        """
        await self._runs.post_execute(message, result)

    # The parts

    def _check_tasks(self) -> None:
        """Check every registered task's labels once, as its sends will (see `startup`)."""
        broker = getattr(self, "broker", None)
        if broker is not None:
            tasks = broker.get_all_tasks()
            settings.check_task_labels(
                ((name, task.labels) for name, task in tasks.items()),
                self._defaults,
                (read_limit,),
            )
        self._tasks_checked = True

    def _observe(self, broker: AsyncBroker | None) -> None:
        """Record metrics and annotate send spans from now on, where they are available."""
        if self.metrics and self._metrics is None:
            self._metrics = process_metrics()
            if self._metrics is not None:
                self._events.subscribe(self._metrics.record)
        if tracing.is_traced(broker):
            self._events.trace_sends(tracing.annotate_send)

    def _send_key(self, message: TaskiqMessage) -> str | None:
        """The key a first send of ``message`` takes (`Sends.key_of`), for the lock API."""
        return self._sends.key_of(message)

    def _new_client(self) -> tuple[RedisClient, bool]:
        """The client for a new event loop's state, and whether it is the middleware's own.

        A client built from ``redis_url`` belongs to one loop (its connections
        do), so each loop gets its own, closed with the loop's state.
        """
        if self._client is not None:
            return self._client, False
        assert self._url is not None  # noqa: S101 (checked in __init__)
        return client_from_url(self._url), True


def _metrics_of(
    middleware: weakref.ReferenceType[RedisDeduplicationMiddleware],
) -> Callable[[], Metrics | None]:
    """The metrics ``middleware`` records, read when asked, without keeping it alive.

    The limits are followed by middleware in a weak map (`follow_limits`):
    a getter that held the middleware would keep it, and its broker, for ever.
    """

    def metrics() -> Metrics | None:
        current = middleware()
        return None if current is None else current._metrics  # noqa: SLF001 (its own)

    return metrics


def loop_states(middleware: RedisDeduplicationMiddleware) -> LoopStates:
    """The Redis client, lock store and heartbeat of each event loop that uses ``middleware``.

    The one internal handle to a middleware's per-loop state, for the parts
    that take locks beside its hooks (the scheduler's tick locks, the locks
    page's client) and for the tests. Not part of the public API.
    """
    return middleware._states  # noqa: SLF001 (this module's own attribute, handed out here only)


def _watch_kick(broker: AsyncBroker, refused: Callable[[BrokerMessage, Exception], None]) -> None:
    """Tell ``refused`` of every message ``broker.kick`` fails to send, then raise as it did.

    A call merged into its queued holder is not sent at all: the holder's
    message runs with its arguments.

    taskiq's ``kiq`` turns that failure into ``SendTaskError`` and calls no
    middleware hook: this wrapper of the broker's own ``kick`` (on the
    instance, as taskiq calls it) is the one place that sees it.
    """
    kick = broker.kick

    async def watched_kick(message: BrokerMessage) -> None:
        if MERGED_INTO_LABEL in message.labels:
            return  # merged into its queued holder: the holder's message carries it
        try:
            await kick(message)
        except Exception as exc:
            refused(message, exc)
            raise

    broker.kick = watched_kick  # type: ignore[method-assign]
