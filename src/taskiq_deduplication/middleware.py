"""The middleware: the life of a deduplicated task, hook by hook.

Send (``pre_send``): fingerprint the call, take its lock for a short grace TTL,
refuse the send with a ``DuplicateTaskError`` if another task holds it.
Sent (``post_send``): the broker has the message; give the lock its full TTL.
Run (``pre_execute``): re-assert the lock and let the heartbeat keep it alive.
End (``on_error``, ``post_execute``): stop the heartbeat, release the lock.

The mechanics live next door: `labels.py` reads the labels, `fingerprint.py`
makes the key, `lock.py` and `pipeline.py` talk to Redis, and `heartbeat.py`
refreshes locks.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import pydantic
import pydantic_core
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import TaskiqMessage, TaskiqMiddleware, TaskiqResult
from taskiq.exceptions import NoResultError

from taskiq_deduplication import labels
from taskiq_deduplication.exceptions import DuplicateTaskError
from taskiq_deduplication.fingerprint import call_fingerprint, fields_fingerprint
from taskiq_deduplication.heartbeat import Beat
from taskiq_deduplication.labels import MAX_TTL
from taskiq_deduplication.lock import (
    REDIS_ERRORS,
    Lock,
    Reasserted,
    holder_task_id,
    new_token,
)
from taskiq_deduplication.loops import LoopState, LoopStates

if TYPE_CHECKING:
    from pydantic import RedisDsn
    from taskiq.abc.broker import AsyncBroker

    RedisClient = Redis | RedisCluster

__all__ = ["RedisDeduplicationMiddleware"]

logger = logging.getLogger(__name__)

#: How long the lock of a send in flight lives before the broker accepts it.
GRACE_TTL: Final = 10
#: Bounds on every Redis call of a client built from ``redis_url`` (seconds);
#: a URL query such as ``?socket_timeout=1`` overrides them.
_DEFAULT_TIMEOUTS: Final = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0, "timeout": 5.0}
# taskiq's own labels, counted up on the running message by Context.requeue()
# and by the retry middlewares when they send the next attempt.
_REQUEUE_LABEL: Final = "X-Taskiq-requeue"
_RETRIES_LABEL: Final = "_retries"


class _Resent(enum.Enum):
    """What became of a retry that a run sent of itself, through this middleware."""

    WITH_THE_LOCK = enum.auto()
    """The retry took the lock over: this run must not touch it any more."""
    WITHOUT_A_LOCK = enum.auto()
    """The retry went out without one (``fail_open``): this run releases its own."""


@dataclass(eq=False, slots=True)
class _Execution:
    """One run of a locked task in this process."""

    lock: Lock
    """The lock as the send took it, with the TTL of a queued task."""
    lease: Lock
    """The same lock with the TTL it keeps while the task runs."""
    task_name: str
    state: LoopState
    """The event loop's state the run began in: its heartbeat keeps the lease."""
    requeues: object
    """taskiq's requeue count when the run began."""
    retries: object
    """The retry middlewares' attempt count when the run began."""
    beat: Beat | None = None
    owned: bool = True
    ended: bool = False
    resent: _Resent | None = None
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    """The asyncio task the run began in."""
    context: Any = field(default=None, repr=False)
    """The token that restores the execution context variable."""
    on_task_done: Any = field(default=None, repr=False)


class RedisDeduplicationMiddleware(TaskiqMiddleware):
    """Stops a taskiq application from queueing or running the same task twice.

    Every ``kiq()`` takes a Redis lock keyed on the task's fingerprint (its name
    and arguments, or an explicit key); an identical ``kiq()`` while the lock is
    held raises [DuplicateTaskError][taskiq_deduplication.DuplicateTaskError]. A heartbeat
    keeps the lock alive while the task runs, and the lock is released when the
    task ends.

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
        key_prefix: str = "taskiq:deduplication",
        startup_retries: int = 3,
        startup_retry_delay: float = 1.0,
        heartbeat: bool = True,
        heartbeat_interval: float | None = None,
        fail_open: bool = False,
        running_ttl: int | None = None,
        client: Redis | RedisCluster | None = None,
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
            key_prefix: Prefix of every lock key.
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
                so a worker that crashes frees the lock within it, while a
                queued task keeps its full TTL. ``None`` (the default) keeps the
                full TTL throughout. The ``deduplication_running_ttl`` label
                sets it per task; it needs the heartbeat.
            client: A ready ``redis.asyncio`` client (``Redis`` or ``RedisCluster``)
                to use instead of ``redis_url``. The middleware does not close it.

        Raises:
            ValueError: An option is missing, of the wrong type or out of range.
        """
        super().__init__()
        self._url = _check_connection(redis_url, client)
        self._client = client
        self.default_deduplication = _check_bool("default_deduplication", default_deduplication)
        self.default_ttl = _check_int("default_ttl", default_ttl, minimum=1, maximum=MAX_TTL)
        self.key_prefix = _check_prefix(key_prefix)
        self.startup_retries = _check_int("startup_retries", startup_retries, minimum=1)
        self.startup_retry_delay = _check_seconds("startup_retry_delay", startup_retry_delay)
        self.heartbeat = _check_bool("heartbeat", heartbeat)
        self.heartbeat_interval = _check_interval(heartbeat_interval, self.default_ttl)
        self.fail_open = _check_bool("fail_open", fail_open)
        self.running_ttl = _check_running_ttl(running_ttl, self.heartbeat, self.heartbeat_interval)
        self._states = LoopStates(self._new_client)
        # The run of a locked task in the current asyncio task: its hooks, and a
        # retry that re-sends it from inside the run, find it here.
        self._execution: contextvars.ContextVar[_Execution | None] = contextvars.ContextVar(
            f"taskiq_deduplication_execution_{id(self):x}", default=None
        )

    # Startup and shutdown

    def set_broker(self, broker: AsyncBroker) -> None:
        """Register on ``broker``; taskiq calls this from ``with_middlewares``.

        Raises:
            ValueError: The middleware is registered on another broker already.
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
            raise ValueError(msg)
        super().set_broker(broker)

    async def startup(self) -> None:
        """Connect to Redis, retrying with exponential backoff.

        Raises:
            ConnectionError: Redis did not answer a ``PING`` in any attempt;
                the last error is chained.
        """
        state = await self._states.current()
        for attempt in range(self.startup_retries):
            try:
                await state.client.ping()
                await state.locks.load_scripts()
            except REDIS_ERRORS as exc:  # noqa: PERF203 (one try per attempt is the point)
                last_error = exc
                if attempt + 1 < self.startup_retries:
                    delay = self.startup_retry_delay * 2**attempt
                    logger.warning(
                        "Redis is not reachable for deduplication (attempt %d of %d: %s); "
                        "retrying in %.1fs",
                        attempt + 1,
                        self.startup_retries,
                        exc,
                        delay,
                    )
                    await asyncio.sleep(delay)
            else:
                return
        msg = (
            f"could not connect to Redis for deduplication after "
            f"{self.startup_retries} attempt(s): {last_error}"
        )
        raise ConnectionError(msg) from last_error

    async def shutdown(self) -> None:
        """Send what is still queued (lock extensions), stop the heartbeat, disconnect.

        This closes what the middleware uses in the running event loop; other
        loops' (``asyncio.run`` in a sync task, threads) close with their loops.
        """
        await self._states.close_current()

    # Send

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        """Take the task's lock before the message goes to the broker.

        Raises:
            DuplicateTaskError: Another send holds the lock.
            ValueError: A deduplication label has an invalid value.
            TypeError: The arguments cannot be fingerprinted.
            redis.exceptions.RedisError: Redis failed and ``fail_open`` is off (a
                cluster client that reaches no node raises
                ``redis.exceptions.RedisClusterException`` instead).
        """
        options = labels.read_send_options(
            message.labels,
            default_enabled=self.default_deduplication,
            default_ttl=self.default_ttl,
            heartbeat=self.heartbeat,
        )
        if options is None:
            labels.drop_lock_labels(message.labels)
            return message
        running = self._current_run(message.task_id)
        # A retry re-sends an earlier attempt: from inside its run, or later (from a
        # schedule source) with the attempt's lock labels copied onto the message.
        earlier = running.lock if running is not None else self._lock_of(message)
        key = earlier.key if earlier is not None else self._lock_key(message, options)
        lock = Lock(key, new_token(), message.task_id, options.ttl * 1000)
        grace_ms = min(GRACE_TTL, options.ttl) * 1000
        state = self._states.get() or await self._states.current()
        try:
            holder = await state.locks.acquire(
                lock, grace_ms, replaces=earlier.value if earlier is not None else ""
            )
        except REDIS_ERRORS as exc:
            if isinstance(exc, (RedisTimeoutError, asyncio.TimeoutError)):
                # The acquire was written and may still run when Redis wakes up:
                # undo it, so a send that failed leaves no lock behind.
                state.locks.release_detached(lock)
            if not self.fail_open:
                raise
            logger.warning(
                "Could not take deduplication lock %r for task %s (%s): %s: %s; "
                "sending it without a lock (fail_open)",
                key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )
            if running is not None:
                # The retry holds no lock, so nobody else will release this one.
                running.resent = _Resent.WITHOUT_A_LOCK
            labels.drop_lock_labels(message.labels)
            return message
        except asyncio.CancelledError:
            # The acquire may still land after the caller gave up: undo it.
            state.locks.release_detached(lock)
            raise
        if holder is not None:
            holder_id = holder_task_id(holder)
            logger.warning(
                "Task %s (%s) not sent: a duplicate of task %s, which holds lock %r",
                message.task_name,
                message.task_id,
                holder_id,
                key,
            )
            raise DuplicateTaskError(message.task_name, key, holder_id)
        if earlier is not None:
            logger.debug(
                "Retry of task %s (%s) took over lock %r", message.task_name, message.task_id, key
            )
        if running is not None:
            running.resent = _Resent.WITH_THE_LOCK
            self._stop_heartbeat(running)
        labels.write_lock_labels(message.labels, key, lock.value, options.ttl)
        return message

    async def post_send(self, message: TaskiqMessage) -> None:
        """Give the lock its full TTL, now that the broker accepted the message.

        The extension is queued, not awaited: it travels with the next batch of
        lock commands and never adds a round trip to ``kiq``. It is owner-checked,
        so it cannot revive a lock that a fast worker already released.
        """
        lock = self._lock_of(message)
        if lock is not None and lock.ttl_ms > GRACE_TTL * 1000:
            state = self._states.get() or await self._states.current()
            await state.locks.extend_detached(lock)

    # Run

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Re-assert the lock at the start of the run and start its heartbeat."""
        lock = self._lock_of(message)
        if lock is None:
            return message
        state = self._states.get() or await self._states.current()
        execution = _Execution(
            lock,
            self._lease(message, lock),
            message.task_name,
            state,
            message.labels.get(_REQUEUE_LABEL),
            message.labels.get(_RETRIES_LABEL),
        )
        self._begin(execution)
        try:
            (reply,) = await state.locks.reassert([execution.lease])
        except REDIS_ERRORS as exc:
            logger.warning(
                "Could not re-assert lock %r of task %s (%s): %s: %s",
                lock.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )
        else:
            if reply == Reasserted.TAKEN_BACK:
                logger.warning(
                    "Lock %r of task %s (%s) had expired while the task was queued; taken back",
                    lock.key,
                    message.task_name,
                    message.task_id,
                )
            elif isinstance(reply, str):
                logger.warning(
                    "Task %s (%s) runs although task %s now holds its lock %r",
                    message.task_name,
                    message.task_id,
                    holder_task_id(reply),
                    lock.key,
                )
                execution.owned = False
        if self.heartbeat and execution.owned:
            execution.beat = Beat(execution.lease, message.task_name, self._interval(execution))
            state.heartbeat.add(execution.beat)
        return message

    async def on_error(
        self,
        message: TaskiqMessage,
        result: TaskiqResult[Any],  # noqa: ARG002 (the hook's signature)
        exception: BaseException,  # noqa: ARG002
    ) -> None:
        """Stop the heartbeat: the task itself is over. The lock goes in ``post_execute``."""
        execution = self._current_run(message.task_id)
        if execution is not None:
            self._stop_heartbeat(execution)

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Release the lock once the run has ended, successful or not.

        A run whose lock a retry took over leaves it to the retry. A run that
        passed itself on to a later delivery keeps its lock for it, at full TTL:
        one that requeued itself (``Context.requeue``), or whose retry was left
        to a schedule source (the retry middleware counted the attempt and
        dropped this run's result, but no send passed through here).
        """
        execution = self._current_run(message.task_id)
        if execution is None:
            return
        self._end(execution)
        if execution.resent is _Resent.WITH_THE_LOCK or not execution.owned:
            return
        lock = execution.lock
        locks = execution.state.locks
        # Both count up before they send, and the run ends with NoResultError
        # only once the send went through. A retry sent through this middleware
        # without a lock passed nothing on.
        passed_on = (
            execution.resent is None
            and isinstance(result.error, NoResultError)
            and (
                message.labels.get(_REQUEUE_LABEL) != execution.requeues
                or message.labels.get(_RETRIES_LABEL) != execution.retries
            )
        )
        if passed_on:
            await locks.extend_detached(lock)
            return
        try:
            await locks.release(lock)
        except REDIS_ERRORS as exc:
            logger.warning(
                "Could not release lock %r of task %s (%s): %s: %s; it expires in %ds",
                lock.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
                execution.lease.ttl_ms // 1000,
            )

    # The mechanics

    def _lock_key(self, message: TaskiqMessage, options: labels.SendOptions) -> str:
        if options.key is not None:
            return f"{self.key_prefix}:{options.key}"
        if options.key_fields is None:
            digest = call_fingerprint(message.task_name, message.args, message.kwargs)
            return f"{self.key_prefix}:{digest}"
        if message.args:
            logger.warning(
                "Task %s is called with positional arguments, which %s leaves out of "
                "its lock key: pass %s as keyword arguments",
                message.task_name,
                labels.KEY_FIELDS_LABEL,
                ", ".join(options.key_fields),
            )
        present = {
            name: message.kwargs[name] for name in options.key_fields if name in message.kwargs
        }
        for name in options.key_fields:
            if name not in present:
                logger.warning(
                    "Key field %r of task %s is missing from its keyword arguments; "
                    "left out of the lock key, so different calls may collide",
                    name,
                    message.task_name,
                )
        return f"{self.key_prefix}:{fields_fingerprint(message.task_name, present)}"

    def _current_run(self, task_id: str) -> _Execution | None:
        """The run of ``task_id`` that this asyncio task is in, if any.

        The hooks of a run, and a retry it sends of itself, find it here. A task
        started from inside a run (an in-memory broker delivering a retry) gets
        a copy of the context, and with it a run that is not its own.
        """
        execution = self._execution.get()
        if (
            execution is not None
            and execution.lock.task_id == task_id
            and not execution.ended
            and execution.task is asyncio.current_task()
        ):
            return execution
        return None

    def _lock_of(self, message: TaskiqMessage) -> Lock | None:
        recorded = labels.read_lock_labels(message.labels, message.task_id)
        if recorded is None:
            return None
        return Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)

    def _lease(self, message: TaskiqMessage, lock: Lock) -> Lock:
        """The lock as its running task keeps it: on the running lease, if there is one."""
        seconds = labels.read_running_ttl(message.labels, default=self.running_ttl)
        if seconds is None or seconds * 1000 >= lock.ttl_ms or not self.heartbeat:
            return lock
        return Lock(lock.key, lock.token, lock.task_id, seconds * 1000)

    def _interval(self, execution: _Execution) -> float:
        ttl = execution.lease.ttl_ms / 1000
        interval = self.heartbeat_interval or max(ttl / 3, 1.0)
        # A refresh less often than half the TTL would let the lock lapse.
        return min(interval, ttl / 2)

    def _begin(self, execution: _Execution) -> None:
        execution.context = self._execution.set(execution)
        # If a later hook of another middleware raises, post_execute never runs;
        # the end of the asyncio task still ends the heartbeat.
        execution.on_task_done = lambda _: self._stop_heartbeat(execution)
        execution.task = _current_task()
        execution.task.add_done_callback(execution.on_task_done)

    def _end(self, execution: _Execution) -> None:
        execution.ended = True
        self._stop_heartbeat(execution)
        if execution.task is not None:
            execution.task.remove_done_callback(execution.on_task_done)
        try:
            self._execution.reset(execution.context)
        except ValueError:  # ended in another context than it began in
            self._execution.set(None)

    @staticmethod
    def _stop_heartbeat(execution: _Execution) -> None:
        if execution.beat is not None:
            execution.state.heartbeat.discard(execution.beat)
        execution.beat = None

    def _new_client(self) -> tuple[RedisClient, bool]:
        """The client for a new event loop's state, and whether it is the middleware's own.

        A client built from ``redis_url`` belongs to one loop (its connections
        do), so each loop gets its own, closed with the loop's state.
        """
        if self._client is not None:
            return self._client, False
        assert self._url is not None  # noqa: S101 (checked in __init__)
        pool = BlockingConnectionPool.from_url(
            self._url,
            **_DEFAULT_TIMEOUTS,
            # One quick retry reconnects after a dropped connection; a hung
            # server is not retried, so a call never outlasts socket_timeout.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        return Redis.from_pool(pool), True


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:  # pragma: no cover (taskiq runs every hook inside a task)
        msg = "taskiq hooks run inside an asyncio task"
        raise RuntimeError(msg)
    return task


# Checking the options


# A RedisDsn, as every pydantic 2 spells it: from 2.10 on a subclass of AnyUrl;
# before, an Annotated alias of pydantic_core.Url, which isinstance() refuses.
_PYDANTIC_URLS: Final = (pydantic.AnyUrl, pydantic_core.Url, pydantic_core.MultiHostUrl)


def _check_connection(redis_url: str | RedisDsn | None, client: object) -> str | None:
    if (redis_url is None) == (client is None):
        msg = "pass exactly one of redis_url and client"
        raise ValueError(msg)
    if client is not None:
        if not isinstance(client, (Redis, RedisCluster)):
            msg = (
                f"client must be a redis.asyncio Redis or RedisCluster client, "
                f"not {type(client).__name__}"
            )
            raise ValueError(msg)
        return None
    url = str(redis_url) if isinstance(redis_url, _PYDANTIC_URLS) else redis_url
    if not isinstance(url, str) or not url:
        msg = f"redis_url must be a non-empty string or RedisDsn, not {redis_url!r}"
        raise ValueError(msg)
    try:
        parse_url(url)
    except ValueError as exc:
        msg = f"redis_url {url!r} is not a Redis URL: {exc}"
        raise ValueError(msg) from None
    return url


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        msg = f"{name} must be True or False, not {value!r}"
        raise ValueError(msg)
    return value


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name} must be a whole number of at least {minimum}, not {value!r}"
        raise ValueError(msg)
    if maximum is not None and value > maximum:
        msg = f"{name} must be at most {maximum}, not {value!r}"
        raise ValueError(msg)
    return value


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        msg = f"{name} must be a finite number of seconds of at least 0, not {value!r}"
        raise ValueError(msg)
    return float(value)


def _check_prefix(value: object) -> str:
    if not isinstance(value, str) or not value:
        msg = f"key_prefix must be a non-empty string, not {value!r}"
        raise ValueError(msg)
    return value


def _check_running_ttl(value: object, heartbeat: bool, interval: float | None) -> int | None:  # noqa: FBT001 (checked options, passed on)
    if value is None:
        return None
    seconds = _check_int("running_ttl", value, minimum=1, maximum=MAX_TTL)
    if not heartbeat:
        msg = "running_ttl needs the heartbeat: a lease nobody refreshes lapses mid-run"
        raise ValueError(msg)
    if interval is not None and interval >= seconds:
        msg = (
            f"heartbeat_interval ({interval}s) must be shorter than running_ttl "
            f"({seconds}s), or the lease expires between refreshes"
        )
        raise ValueError(msg)
    return seconds


def _check_interval(value: object, default_ttl: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        msg = f"heartbeat_interval must be a positive number of seconds or None, not {value!r}"
        raise ValueError(msg)
    if value >= default_ttl:
        msg = (
            f"heartbeat_interval ({value}s) must be shorter than default_ttl "
            f"({default_ttl}s), or the lock expires between refreshes"
        )
        raise ValueError(msg)
    return float(value)
