"""The middleware: the life of a deduplicated task, hook by hook.

Send (``pre_send``): fingerprint the call, take its lock for a short grace TTL,
refuse the send with a ``DuplicateTaskError`` if another task holds it.
Sent (``post_send``): the broker has the message; give the lock its full TTL.
Run (``pre_execute``), end (``on_error``, ``post_execute``): do what the row of
the lock's policy says (`_policies.py`): re-assert the lock and keep it alive,
or release it, or leave it to its TTL.

The mechanics live next door: `_labels.py` reads the labels and `_options.py`
the options, `_fingerprint.py` and `_formats.py` make the key and the value,
`_lock.py` and `_pipeline.py` talk to Redis, `_heartbeat.py` refreshes locks,
`_execution.py` follows a run and `_loops.py` keeps a state per event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import TaskiqMessage, TaskiqMiddleware, TaskiqResult

from taskiq_deduplication import _keys as keys
from taskiq_deduplication import _labels as labels
from taskiq_deduplication import _options as options
from taskiq_deduplication import _refusals
from taskiq_deduplication import _tracing as tracing
from taskiq_deduplication._client import client_from_url
from taskiq_deduplication._execution import Execution, Executions, NotRun, Resent
from taskiq_deduplication._formats import (
    NO_OWNER,
    SUCCEEDED_MARK,
    RecordedLock,
    drop_lock_labels,
    fence_key,
    holder_task_id,
    merge_key,
    new_run_token,
    new_token,
    read_lock_labels,
    run_key,
    write_lock_labels,
)
from taskiq_deduplication._heartbeat import Beat
from taskiq_deduplication._lock import REDIS_ERRORS, Acquired, Claimed, Lock, Reasserted
from taskiq_deduplication._loops import LoopState, LoopStates
from taskiq_deduplication._metrics import Metrics, process_metrics
from taskiq_deduplication._policies import FINISHED, POLICIES, RetrySend, Step
from taskiq_deduplication.events import EventSink, LockEventKind, Subscriber
from taskiq_deduplication.exceptions import (
    DuplicateTaskError,
    InvalidSettingError,
    StartupError,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from pydantic import RedisDsn
    from redis.asyncio import Redis
    from taskiq import BrokerMessage
    from taskiq.abc.broker import AsyncBroker

    from taskiq_deduplication._lock import LockStore

    RedisClient = Redis | RedisCluster

__all__ = ["RedisDeduplicationMiddleware"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long the lock of a send in flight lives before the broker accepts it.
GRACE_TTL: Final = 10


class _FailedOpen(enum.Enum):
    FAILED_OPEN = enum.auto()


_VERBS: Final = {Step.REASSERT: "re-assert", Step.REMEMBER: "release", Step.RELEASE: "release"}
# What claim.lua does at the start of a run, for each policy's step.
_CLAIM_STEPS: Final = {Step.REASSERT: "reassert", Step.RELEASE: "release"}

#: What an acquire gives when Redis failed and ``fail_open`` lets the send go.
_FAILED_OPEN: Final = _FailedOpen.FAILED_OPEN
#: Seconds the re-assert at a run's start and the step at its end may wait to
#: share a round trip with other runs' (only while other runs go on and their
#: calls come this often). Measured on a worker draining 1 ms tasks: 0.5 ms
#: shares too few round trips, 2 ms no more than 1 ms.
_RUN_LINGER: Final = 0.001
# What a run that could not claim its lock at its start does.
_NOT_BEGUN: Final = (
    "it runs with the arguments it was sent with, not knowing whether another run of its "
    "key goes on"
)
#: Seconds a run slot beside the lock ("started", "expired") lives unrefreshed,
#: unless ``running_ttl`` says: how long a crashed run holds up the next one.
_SLOT_LEASE: Final = 10
#: Longest wait, in seconds, between two looks of a run that waits for another
#: run of its key (a quarter of the heartbeat interval when that is shorter).
_MAX_POLL: Final = 5.0
#: More than two looks' time that a run's success is kept for the copies that
#: waited for it, when the task does not remember its success.
_WAITED_MARGIN_MS: Final = 1000
#: Most sends remembered between their pre_send and post_send (one whose
#: broker failed never gets a post_send; the oldest is forgotten first).
_MAX_SENDS_IN_FLIGHT: Final = 4096


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
        key_prefix: str = "taskiq:deduplication",
        startup_retries: int = 3,
        startup_retry_delay: float = 1.0,
        heartbeat: bool = True,
        heartbeat_interval: float | None = None,
        fail_open: bool = False,
        running_ttl: int | None = None,
        default_until: str = "finished",
        default_success_ttl: int = 0,
        client: Redis | RedisCluster | None = None,
        metrics: bool = True,
        default_exclusive: bool = True,
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
            default_until: How long a call counts as a duplicate, unless the
                ``deduplication_until`` label says: ``"finished"`` (while its
                task is queued or running), ``"started"`` (while it is queued)
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

        Raises:
            ValueError: An option is missing, of the wrong type or out of range.
        """
        super().__init__()
        self._url = options.check_connection(redis_url, client)
        self._client = client
        self.default_deduplication = options.check_bool(
            "default_deduplication", default_deduplication
        )
        self.default_ttl = options.check_int(
            "default_ttl", default_ttl, minimum=1, maximum=labels.MAX_TTL
        )
        self.key_prefix = options.check_prefix(key_prefix)
        self.startup_retries = options.check_int("startup_retries", startup_retries, minimum=1)
        self.startup_retry_delay = options.check_seconds("startup_retry_delay", startup_retry_delay)
        self.heartbeat = options.check_bool("heartbeat", heartbeat)
        self.heartbeat_interval = options.check_interval(heartbeat_interval, self.default_ttl)
        self.fail_open = options.check_bool("fail_open", fail_open)
        self.running_ttl = options.check_running_ttl(
            running_ttl, self.heartbeat, self.heartbeat_interval
        )
        policy = options.check_until(default_until)
        self.default_until = policy.name
        self.default_success_ttl = options.check_success_ttl(default_success_ttl)
        self.default_exclusive = options.check_bool("default_exclusive", default_exclusive)
        self._defaults = labels.Defaults(
            enabled=self.default_deduplication,
            ttl=self.default_ttl,
            policy=policy,
            success_ttl=self.default_success_ttl,
            heartbeat=self.heartbeat,
            exclusive=self.default_exclusive,
        )
        self.metrics = options.check_bool("metrics", metrics)
        self._events = EventSink()
        self._metrics: Metrics | None = None
        self._states = LoopStates(self._new_client, self._events, lambda: self._metrics)
        self._executions = Executions(f"taskiq_deduplication_execution_{id(self):x}")
        # The lock value of a retry's send that keeps its lock as it is: the
        # post_send of that very kiq (same context) must not extend it.
        self._kept: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"taskiq_deduplication_kept_{id(self):x}", default=None
        )
        # Owner tokens of this process's sends between pre_send and post_send,
        # and whether a run in this process has ended their lock meanwhile (an
        # in-memory broker that runs the task inside kiq): post_send then has
        # nothing to extend. Only this send's own run can have put its token
        # in Redis since, so the extension, owner-checked, would be a no-op or
        # would undo the end (a success TTL stretched back to the full TTL).
        self._sends: dict[str, bool] = {}
        # Whether each task (by name) takes a TaskLock, so that its sends draw a fence.
        self._fenced: dict[str, bool] = {}
        # Tasks whose runs cannot be exclusive here (said once each).
        self._not_exclusive: set[str] = set()

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
            TypeError: ``subscriber`` is not callable.
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

    # For the annotation of `locks` only; locks.py is imported when `locks` is used.
    if TYPE_CHECKING:
        from taskiq_deduplication.locks import Locks  # noqa: PLC0415 (see above)

    @property
    def locks(self) -> Locks:
        """The locks of this middleware, for tools: [Locks][taskiq_deduplication.Locks].

        Bound to its ``key_prefix`` and to the client of the event loop it is
        used in (the middleware's own, made on first use as a send would), and
        able to compute the key a call takes
        ([key_for][taskiq_deduplication.Locks.key_for]) with the middleware's
        options, as ``kiq`` does.
        """
        from taskiq_deduplication.locks import Locks  # noqa: PLC0415 (loaded when used)

        async def client() -> RedisClient:
            return (self._states.get() or await self._states.current()).client

        return Locks(client, prefix=self.key_prefix, key_of=self._send_key)

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
        if current is None:
            _watch_kick(broker, self._unsent)
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
        if broker is not None:
            tasks = broker.get_all_tasks()
            labels.check_task_labels(
                ((name, task.labels) for name, task in tasks.items()), self._defaults
            )
        self._observe(broker)
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
            ValueError: A deduplication label has an invalid value.
            TypeError: The arguments cannot be fingerprinted.
            redis.exceptions.RedisError: Redis failed and ``fail_open`` is off (a
                cluster client that reaches no node raises
                ``redis.exceptions.RedisClusterException`` instead).
        """
        send = labels.read_send_options(message.labels, self._defaults)
        if send is None:
            drop_lock_labels(message.labels)
            self._outcome(LockEventKind.OFF, message, None, None)
            return message
        running = self._executions.current(message.task_id)
        earlier = running.holds if running is not None else self._lock_of(message)
        policy = send.policy
        if earlier is not None and policy.retry is RetrySend.KEEP:
            return await self._keep(message, earlier, running, send)
        key = (
            earlier.key if earlier is not None else keys.lock_key_of(self.key_prefix, message, send)
        )
        digest = keys.arguments_digest_of(message, send)
        lock = Lock(key, new_token(digest), message.task_id, send.ttl * 1000)
        grace_ms = min(GRACE_TTL, send.ttl) * 1000
        acquired: Acquired | None = None
        if send.merge is None and not self._wants_fence(message.task_name):
            holder = await self._acquire(lock, grace_ms, earlier, message)
        else:
            reply = await self._acquire_with(lock, grace_ms, earlier, message, send)
            holder = reply if reply is _FAILED_OPEN else reply.holder
            acquired = None if reply is _FAILED_OPEN else reply
        if holder is _FAILED_OPEN:
            return self._without_lock(message, running, key, send)
        if holder is not None:
            holder_id = holder_task_id(holder)
            if earlier is not None and policy.retry is RetrySend.TAKE_IF_FREE:
                logger.info(
                    "Retry of task %s (%s) sent without a lock: task %s, queued "
                    "meanwhile, holds lock %r",
                    message.task_name,
                    message.task_id,
                    holder_id,
                    key,
                )
                self._outcome(LockEventKind.OFF, message, key, holder_id)
                return self._without_lock(message, running, key, send)
            raise self._refusal(message, key, holder, digest=digest, send=send, acquired=acquired)
        if earlier is not None:
            logger.debug(
                "Retry of task %s (%s) took over lock %r", message.task_name, message.task_id, key
            )
        if running is not None:
            running.resent = Resent.WITH_THE_LOCK
            running.stop_heartbeat()
            await self._hand_run_over(running, lock, message)
        self._record(message, key, lock.token, send, acquired.fence if acquired else None)
        if self._events.active:  # inline: the one point every accepted send passes
            self._outcome(LockEventKind.LOCKED, message, key, message.task_id)
        self._in_flight(lock.token)
        return message

    def _in_flight(self, token: str) -> None:
        """Note a send between its pre_send and post_send (see ``_sends``)."""
        if len(self._sends) >= _MAX_SENDS_IN_FLIGHT:  # shared by every loop and thread
            self._sends.pop(next(iter(self._sends), ""), None)
        self._sends[token] = False

    def _unsent(self, message: BrokerMessage, error: Exception) -> None:
        """Release at once the lock of a send of this process that the broker refused.

        taskiq calls no hook then (``kiq`` raises ``SendTaskError``); the
        broker's ``kick`` tells us instead. Only a send still between its
        pre_send and post_send counts (a requeue from inside a run carries
        its run's lock, not a send's). Owner-checked and queued in order, so
        the caller's own retry finds the lock free. A send that ends without
        telling (the process dies, the kiq is cancelled) leaves its lock to
        the grace TTL.
        """
        recorded = read_lock_labels(message.labels, message.task_id)
        if recorded is None or self._sends.get(recorded.token) is not False:
            return
        del self._sends[recorded.token]
        state = self._states.get()
        if state is None:
            return
        lock = Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)
        merged_key = merge_key(self.key_prefix, lock.key) if recorded.merge is not None else None
        logger.info(
            "Lock %r of task %s (%s) released: the broker refused the send (%s)",
            lock.key,
            message.task_name,
            message.task_id,
            type(error).__name__,
        )
        state.locks.release_unsent(lock, merged_key)

    async def _reopen_merge(self, message: TaskiqMessage, lock: Lock) -> None:
        """Let later calls merge into a retry that keeps its lock as it is ("expired").

        Its attempt's run claimed the merged arguments; a call that comes while
        the retry waits in the queue merges into it, as under the other policies.
        """
        merged_key = merge_key(self.key_prefix, lock.key)
        if merged_key is None:
            return
        state = self._states.get() or await self._states.current()
        arguments = self._serialise_arguments(message)
        try:
            await state.locks.reopen_merge(lock, merged_key, arguments, message.task_name)
        except REDIS_ERRORS as exc:
            logger.warning(
                "Retry of task %s (%s) sent without taking merges: %s: %s",
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )

    async def _keep(
        self,
        message: TaskiqMessage,
        earlier: Lock,
        running: Execution | None,
        send: labels.SendOptions,
    ) -> TaskiqMessage:
        """Send a retry with the lock of the attempt it continues, as that lock is.

        No Redis call, unless the task merges its calls: then one, so that
        calls merge into the retry while it waits in the queue.
        """
        if send.merge is not None:
            await self._reopen_merge(message, earlier)
        self._kept.set(earlier.value)  # this kiq's post_send leaves its TTL alone
        if running is not None:
            running.resent = Resent.WITH_THE_LOCK
            running.stop_heartbeat()
            await self._hand_run_over(running, earlier, message)
        fence = running.fence if running is not None else self._recorded_fence(message)
        self._record(message, earlier.key, earlier.token, send, fence)
        self._outcome(LockEventKind.LOCKED, message, earlier.key, message.task_id)
        return message

    async def post_send(self, message: TaskiqMessage) -> None:
        """Give the lock its full TTL, now that the broker accepted the message.

        The extension is queued, not awaited: it travels with the next batch of
        lock commands and never adds a round trip to ``kiq``. It is owner-checked,
        so it cannot revive a lock that a fast worker already released.
        """
        recorded = read_lock_labels(message.labels, message.task_id)
        if recorded is None:
            return
        if recorded.token == NO_OWNER:
            return  # sent without a lock: nothing to extend
        lock = Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)
        merges = recorded.merge is not None
        if self._sends.pop(lock.token, False):
            return  # its run ended the lock already
        extends = lock.ttl_ms > GRACE_TTL * 1000  # else the grace TTL is its TTL
        if self._kept.get() == lock.value:  # a retry that left its lock as it was
            self._kept.set(None)
            extends = False
        if not (extends or merges):
            return
        state = self._states.get() or await self._states.current()
        merged_key = merge_key(self.key_prefix, lock.key) if merges else None
        if merged_key is not None:
            # Calls merge into its message from now on: a broker accepted it.
            await state.locks.accepted_detached(lock, merged_key, lock.ttl_ms if extends else 0)
        else:
            await state.locks.extend_detached(lock)

    # Run

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Begin the run of a locked task: do what its policy says at the start.

        ``"finished"`` re-asserts the lock and lets the heartbeat keep it alive,
        ``"started"`` releases it, ``"expired"`` leaves it to its TTL.
        """
        recorded = read_lock_labels(message.labels, message.task_id)
        if recorded is None:
            return message
        # A policy this version does not know (a newer sender) holds the lock
        # the longest way: until the task finishes.
        policy = POLICIES.get(recorded.until, FINISHED)
        lock = Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)
        state = self._states.get() or await self._states.current()
        execution = Execution(
            lock,
            self._lease(message, lock) if policy.heartbeat else lock,
            policy,
            recorded.success_ttl if policy.remembers_success else 0,
            message.task_name,
            state,
            *Executions.counts(message),
        )
        execution.fence = recorded.fence
        # Sent without a lock: it owns none, unless its run takes it as its run slot.
        execution.owned = recorded.token != NO_OWNER
        self._executions.begin(execution)
        run = self._run_slot(execution, recorded, state) if recorded.exclusive else None
        if run is not None or recorded.merge is not None or recorded.fence is not None:
            await self._claim(execution, recorded, message, run)
        elif policy.at_start is Step.REASSERT:
            await self._reassert(execution, message)
        else:
            await self._apply(policy.at_start, execution, message)
        if execution.skipped:
            message.args = NotRun(message.args)
            return message
        if self.heartbeat and (execution.run is not None or (policy.heartbeat and execution.owned)):
            lease = execution.run or execution.lease
            execution.beat = Beat(lease, message.task_name, self._interval(execution, lease))
            state.heartbeat.add(execution.beat)
        return message

    async def on_error(
        self,
        message: TaskiqMessage,
        result: TaskiqResult[Any],  # noqa: ARG002 (the hook's signature)
        exception: BaseException,  # noqa: ARG002
    ) -> None:
        """Stop the heartbeat: the task itself is over. The lock goes in ``post_execute``."""
        execution = self._executions.current(message.task_id)
        if execution is not None:
            execution.stop_heartbeat()

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """End the run: do what its policy says on success, on failure, or when passed on.

        A run whose lock a retry took over leaves it to the retry. A run that
        passed itself on to a later delivery without a send through this
        middleware (``Context.requeue``, a retry left to a schedule source)
        keeps its lock for it as the policy says. Otherwise a success and a
        failure each get the step of their own: ``"finished"`` releases the
        lock (or keeps it for the success TTL after a success).
        """
        execution = self._executions.current(message.task_id)
        if execution is None:
            return
        self._executions.end(execution)
        if execution.skipped or execution.resent is Resent.WITH_THE_LOCK:
            return
        policy = execution.policy
        passed_on = execution.passed_on(message, result)
        succeeded = not passed_on and execution.resent is None and not result.is_err
        run = execution.run
        if run is not None and run.key == execution.lock.key:
            await self._finish(execution, message, passed_on=passed_on, succeeded=succeeded)
            return
        if execution.owned:
            if passed_on:
                step = policy.passed_on
            elif succeeded:
                step = policy.on_success
            else:
                step = policy.on_failure
            await self._apply(step, execution, message)
        if run is not None:
            await self._finish(execution, message, passed_on=passed_on, succeeded=succeeded)

    # The mechanics

    async def _apply(self, step: Step, execution: Execution, message: TaskiqMessage) -> None:
        """Do ``step`` to the run's lock in Redis; errors are logged, never raised."""
        lock = execution.lock
        locks = execution.state.locks
        if step is Step.NOTHING:
            return
        if step is Step.EXTEND:
            await locks.extend_detached(lock)
            return
        # The send's own post_send may still be to come (a worker in the sending
        # process): from the moment the end is on its way, it must not extend
        # the lock, or a success TTL would be stretched back to the full TTL.
        ending = step is not Step.REASSERT and lock.token in self._sends
        if ending:
            self._sends[lock.token] = True
        linger = _linger(execution)
        try:
            if step is Step.REASSERT:
                await locks.reassert([lock], linger=linger)
            elif step is Step.REMEMBER and execution.success_ttl:
                await locks.extend(lock, execution.success_ttl * 1000, linger=linger)
            elif await locks.release(lock, linger=linger):
                self._events.emit(
                    LockEventKind.RELEASED, message.task_name, message.task_id, lock.key, None
                )
        except REDIS_ERRORS as exc:
            if ending and lock.token in self._sends:  # the end failed: extend after all
                self._sends[lock.token] = False
            logger.warning(
                "Could not %s lock %r of task %s (%s): %s: %s; it expires in %ds",
                "keep" if step is Step.REMEMBER and execution.success_ttl else _VERBS[step],
                lock.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
                execution.lease.ttl_ms // 1000,
            )

    async def _acquire(
        self, lock: Lock, grace_ms: int, earlier: Lock | None, message: TaskiqMessage
    ) -> str | _FailedOpen | None:
        """Take ``lock`` for the grace TTL: ``None`` once taken, else the holder's value.

        A Redis error raises, or with ``fail_open`` is logged and gives
        ``_FAILED_OPEN``. An acquire that may still land in Redis after the
        call gave up (a timeout, a cancelled caller) is undone.
        """
        state = self._states.get() or await self._states.current()
        return await self._guarded(
            state,
            lock,
            message,
            state.locks.acquire(
                lock, grace_ms, replaces=earlier.value if earlier is not None else ""
            ),
        )

    async def _guarded(
        self, state: LoopState, lock: Lock, message: TaskiqMessage, acquire: Awaitable[_T]
    ) -> _T | _FailedOpen:
        """Await ``acquire``: a Redis error raises, or with ``fail_open`` gives ``_FAILED_OPEN``.

        An acquire that may still land in Redis after the call gave up (a
        timeout, a cancelled caller) is undone.
        """
        try:
            return await acquire
        except REDIS_ERRORS as exc:
            if isinstance(exc, (RedisTimeoutError, asyncio.TimeoutError)):
                state.locks.release_detached(lock)
            if not self.fail_open:
                raise
            logger.warning(
                "Could not take deduplication lock %r for task %s (%s): %s: %s; "
                "sending it without a lock (fail_open)",
                lock.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )
            self._outcome(LockEventKind.FAIL_OPEN, message, lock.key, None, error=exc)
            return _FAILED_OPEN
        except asyncio.CancelledError:
            state.locks.release_detached(lock)
            raise

    async def _reassert(self, execution: Execution, message: TaskiqMessage) -> None:
        """Re-assert the lock of a run that begins, on its lease; say what was found."""
        lock = execution.lock
        try:
            (reply,) = await execution.state.locks.reassert(
                [execution.lease], linger=_linger(execution)
            )
        except REDIS_ERRORS as exc:
            logger.warning(
                "Could not re-assert lock %r of task %s (%s): %s: %s",
                lock.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )
            return
        self._started(execution, message, reply)

    def _started(self, execution: Execution, message: TaskiqMessage, reply: int | str) -> None:
        """Say what a run found of its lock as it began: taken back, or held by another."""
        key = execution.lock.key
        if reply == Reasserted.TAKEN_BACK:
            logger.warning(
                "Lock %r of task %s (%s) had expired while the task was queued; taken back",
                key,
                message.task_name,
                message.task_id,
            )
            self._events.emit(
                LockEventKind.TAKEN_BACK, message.task_name, message.task_id, key, message.task_id
            )
        elif isinstance(reply, str):
            holder = holder_task_id(reply)
            logger.warning(
                "Task %s (%s) runs although task %s now holds its lock %r",
                message.task_name,
                message.task_id,
                holder,
                key,
            )
            self._events.emit(LockEventKind.LOST, message.task_name, message.task_id, key, holder)
            execution.owned = False

    def _outcome(
        self,
        kind: LockEventKind,
        message: TaskiqMessage,
        key: str | None,
        holder: str | None,
        error: BaseException | None = None,
    ) -> None:
        """Tell subscribers (and the send span) what became of ``message``'s send."""
        if self._events.active:  # checked first: every send comes this way
            self._events.emit(
                kind, message.task_name, message.task_id, key, holder, error=error, message=message
            )

    def _observe(self, broker: AsyncBroker | None) -> None:
        """Record metrics and annotate send spans from now on, where they are available."""
        if self.metrics and self._metrics is None:
            self._metrics = process_metrics()
            if self._metrics is not None:
                self._events.subscribe(self._metrics.record)
        if tracing.is_traced(broker):
            self._events.trace_sends(tracing.annotate_send)

    # Merged calls, debounce, fences and the arguments' digest

    def _refusal(  # noqa: PLR0913 (what the refusal says, each named)
        self,
        message: TaskiqMessage,
        key: str,
        holder: str,
        *,
        digest: str | None,
        send: labels.SendOptions,
        acquired: Acquired | None,
    ) -> DuplicateTaskError:
        """The error for a call refused (or merged) because ``holder`` holds its lock."""
        holder_id = holder_task_id(holder)
        same = keys.same_arguments(holder, digest, send)
        merged = acquired is not None and acquired.merged
        # A holder that merges calls says whether a broker has accepted it yet.
        pending = acquired is not None and acquired.pending
        state = ", whose send the broker has not accepted yet" if pending else ""
        if merged:
            logger.info(
                "Task %s (%s) not sent: its arguments replaced those of task %s, "
                "queued with lock %r",
                message.task_name,
                message.task_id,
                holder_id,
                key,
            )
            self._outcome(LockEventKind.MERGED, message, key, holder_id)
        else:
            from taskiq_deduplication.calls import joining  # noqa: PLC0415 (a cycle)

            # A caller that joins the holder asked for this: a join is its own
            # outcome, no warning, whatever its other arguments (with key
            # fields, that they differ is the point).
            marker = joining.get()
            joined = holder_id is not None and marker == []
            if marker == []:
                marker.append(True)
            handled = _refusals.HANDLED.get()  # a caller that logs the refusal itself
            if joined:
                logger.log(
                    logging.DEBUG if handled else logging.INFO,
                    "Task %s (%s) joined task %s%s, which holds lock %r%s",
                    message.task_name,
                    message.task_id,
                    holder_id,
                    state,
                    key,
                    " (its own arguments differ)" if same is False else "",
                )
                self._outcome(LockEventKind.JOINED, message, key, holder_id)
            else:
                logger.log(
                    logging.DEBUG if handled else logging.WARNING,
                    "Task %s (%s) not sent: a duplicate of task %s%s, which holds lock %r%s",
                    message.task_name,
                    message.task_id,
                    holder_id,
                    state,
                    key,
                    " with other arguments" if same is False else "",
                )
                self._outcome(LockEventKind.DUPLICATE, message, key, holder_id)
        return DuplicateTaskError(
            message.task_name,
            key,
            holder_id,
            merged=merged,
            same_arguments=same,
        )

    async def _acquire_with(
        self,
        lock: Lock,
        grace_ms: int,
        earlier: Lock | None,
        message: TaskiqMessage,
        send: labels.SendOptions,
    ) -> Acquired | _FailedOpen:
        """`_acquire` for a task that merges its calls or takes a fence."""
        state = self._states.get() or await self._states.current()
        merging = send.merge is not None and merge_key(self.key_prefix, lock.key) is not None
        if isinstance(state.client, RedisCluster) and "{" not in self.key_prefix:
            msg = (
                f"task {message.task_name!r} merges its calls or takes a fence: on Redis "
                "Cluster that needs a key_prefix with a hash tag, such as '{dedup}', so "
                "that its lock and the keys beside it share a slot"
            )
            raise InvalidSettingError(msg)
        return await self._guarded(
            state,
            lock,
            message,
            state.locks.acquire_with(
                lock,
                grace_ms,
                replaces=earlier.value if earlier is not None else "",
                merge_key=merge_key(self.key_prefix, lock.key) if merging else None,
                arguments=self._serialise_arguments(message) if merging else b"",
                fence_key=(
                    fence_key(self.key_prefix) if self._wants_fence(message.task_name) else None
                ),
                task_name=message.task_name if merging else "",
            ),
        )

    async def _claim(
        self,
        execution: Execution,
        recorded: RecordedLock,
        message: TaskiqMessage,
        run: Lock | None,
    ) -> None:
        """Begin a run that is exclusive, merges calls or has a fence, in one script.

        An exclusive run first waits, polling, while another run of its key
        goes on; a debounce waits out its quiet period. The claim replaces the
        policy's step at the start (one round trip, as that step is); each
        wait adds one per look.
        """
        lease = execution.lease
        step = _CLAIM_STEPS.get(execution.policy.at_start, "nothing")
        merging = recorded.merge is not None
        keys = {
            "merge_key": merge_key(self.key_prefix, lease.key) if merging else None,
            "fence_key": fence_key(self.key_prefix) if recorded.fence is not None else None,
        }
        locks = execution.state.locks
        waited = False
        failing: _Failing | None = None
        while True:
            try:
                claimed: Claimed = await locks.claim(
                    lease,
                    step=step,
                    debounce=recorded.merge or (0, 0),
                    run=run,
                    linger=_linger(execution),
                    **keys,
                )
            except REDIS_ERRORS as exc:
                if failing is None:
                    failing = self._failing(execution, recorded, message, run, exc)
                delay = failing.delay(self._poll(execution, run))
                if delay is None:
                    failing.gives_up(execution, message)
                    return
                await asyncio.sleep(delay)
                continue
            # Redis answered: a later outage is measured from its own start, or a
            # copy that waited through one short outage would run at the next.
            failing = None
            if claimed.skipped_for is not None:
                self._skip(execution, message, claimed.skipped_for)
                return
            if not claimed.wait_ms:
                break
            if claimed.waiting_for is None:  # a debounce: the lock was kept for one lease
                await asyncio.sleep(min(claimed.wait_ms, lease.ttl_ms // 3) / 1000)
                continue
            if not waited:
                waited = True
                self._waits(execution, message, claimed.waiting_for)
            await asyncio.sleep(min(self._poll(execution, run), claimed.wait_ms / 1000))
        self._begun(execution, recorded, message, run, claimed)

    def _begun(
        self,
        execution: Execution,
        recorded: RecordedLock,
        message: TaskiqMessage,
        run: Lock | None,
        claimed: Claimed,
    ) -> None:
        """Take in what the claim found as the run begins: its slot, fence, lock, arguments."""
        lease = execution.lease
        execution.run = run
        if claimed.fence is not None:
            execution.fence = claimed.fence
        if recorded.token == NO_OWNER:
            # Sent without a lock: it owns none (unless the run slot is its lock).
            execution.owned = run is not None and run.key == lease.key
        elif run is not None and run.key == lease.key and isinstance(claimed.outcome, str):
            self._took_over(execution, message, claimed.outcome)
        else:
            self._started(execution, message, claimed.outcome)
        if claimed.arguments is not None:
            latest = self.broker.formatter.loads(base64.b64decode(claimed.arguments))
            message.args, message.kwargs = latest.args, latest.kwargs

    def _failing(
        self,
        execution: Execution,
        recorded: RecordedLock,
        message: TaskiqMessage,
        run: Lock | None,
        exc: BaseException,
    ) -> _Failing:
        """Say that a run could not claim its lock as it begins, because Redis failed.

        An exclusive run then waits for Redis, for at most its run slot's lease:
        another run of its key may go on, and past that lease it would have
        lapsed in the same outage (unless that run still reaches Redis: a
        worker cut off from it, the one case a fence tells). With ``fail_open``,
        and for a run that is not exclusive, it runs at once.
        """
        waits = 0.0 if run is None or self.fail_open else run.ttl_ms / 1000
        if (
            recorded.merge is None
            and recorded.fence is None
            and (execution.policy.at_start is Step.REASSERT)
        ):
            text = "Could not re-assert lock %r of task %s (%s)"
            args: tuple[object, ...] = (execution.lock.key, message.task_name, message.task_id)
        else:
            text = "Could not begin the run of task %s (%s) with lock %r"
            args = (message.task_name, message.task_id, execution.lock.key)
        if waits:
            text += ": %s: %s; it waits for Redis, at most %ds, before it runs"
            logger.warning(text, *args, type(exc).__name__, exc, waits)
        else:
            text += ": %s: %s; " + _NOT_BEGUN
            logger.warning(text, *args, type(exc).__name__, exc)
        return _Failing(asyncio.get_running_loop().time() + waits, waited=bool(waits))

    def _run_slot(
        self, execution: Execution, recorded: RecordedLock, state: LoopState
    ) -> Lock | None:
        """The run slot an exclusive run is to hold, under a new run token.

        A ``"finished"`` lock is its own run slot; the other policies keep one
        beside the lock (on a cluster that needs the prefix's hash tag: without
        one, their runs are not exclusive, which is said once per task).
        """
        lease = execution.lease
        token = new_run_token(recorded.token)
        if execution.policy.at_start is Step.REASSERT:
            return Lock(lease.key, token, lease.task_id, lease.ttl_ms)
        key = run_key(self.key_prefix, lease.key)
        if key is None or (isinstance(state.client, RedisCluster) and "{" not in self.key_prefix):
            if execution.task_name not in self._not_exclusive:
                self._not_exclusive.add(execution.task_name)
                logger.warning(
                    "Runs of task %s are not exclusive: under deduplication_until=%r its "
                    "run slot lives beside its lock, which on Redis Cluster needs a "
                    "key_prefix with a hash tag, such as '{dedup}'",
                    execution.task_name,
                    execution.policy.name,
                )
            return None
        # The slot outlives no crashed run by more than a short lease, which the
        # heartbeat keeps (without the heartbeat it must last the whole run).
        # The lease is the run's, not the call's: a short TTL ("expired" windows
        # of a few seconds) would leave the heartbeat too little room to ride
        # out a Redis outage of a second or two, and let another run in.
        ttl_ms = lease.ttl_ms
        if self.heartbeat:
            ttl_ms = (self.running_ttl or _SLOT_LEASE) * 1000
        return Lock(key, token, lease.task_id, ttl_ms)

    def _poll(self, execution: Execution, run: Lock | None) -> float:
        """Seconds between two looks of a run that waits for another run of its key."""
        return min(self._interval(execution, run) / 4, _MAX_POLL)

    def _waits(self, execution: Execution, message: TaskiqMessage, slot: str) -> None:
        holder = holder_task_id(slot)
        logger.info(
            "Task %s (%s) waits to run: %s goes on under its lock %r",
            message.task_name,
            message.task_id,
            "another run of this task" if holder == message.task_id else f"task {holder}",
            execution.lock.key,
        )
        self._events.emit(
            LockEventKind.WAITING, message.task_name, message.task_id, execution.lock.key, holder
        )

    def _skip(self, execution: Execution, message: TaskiqMessage, slot: str) -> None:
        """End a delivery that must not run: its run succeeded, or a retry carries it on."""
        execution.skipped = True
        logger.info(
            "Task %s (%s) not run: the broker delivered it again, and %s (lock %r)",
            message.task_name,
            message.task_id,
            "its run succeeded"
            if slot.startswith(SUCCEEDED_MARK)
            else "a retry of it took its lock over",
            execution.lock.key,
        )
        self._events.emit(
            LockEventKind.SKIPPED,
            message.task_name,
            message.task_id,
            execution.lock.key,
            holder_task_id(slot),
        )

    def _took_over(self, execution: Execution, message: TaskiqMessage, holder: str) -> None:
        """Say that an exclusive run took its lock from a send that was queued meanwhile."""
        logger.warning(
            "Lock %r of task %s (%s) had expired while the task was queued and task %s "
            "took it; this run takes it back, and that task's run will wait for it",
            execution.lock.key,
            message.task_name,
            message.task_id,
            holder_task_id(holder),
        )
        self._events.emit(
            LockEventKind.TAKEN_BACK,
            message.task_name,
            message.task_id,
            execution.lock.key,
            message.task_id,
        )

    async def _finish(
        self, execution: Execution, message: TaskiqMessage, *, passed_on: bool, succeeded: bool
    ) -> None:
        """End an exclusive run's hold on its run slot; errors are logged, never raised."""
        run = execution.run
        assert run is not None  # noqa: S101 (the callers check)
        locks = execution.state.locks
        linger = _linger(execution)
        try:
            if passed_on and run.key == execution.lock.key:
                # The requeued message finds its own lock, for its full TTL.
                await locks.hand_over(run, execution.lock, linger=linger)
            else:
                # Only a success remembered (success TTL) keeps the lock; a failure
                # and a success without one release it (a "finished" lock is its slot).
                remembered = execution.success_ttl * 1000 if succeeded else 0
                waited = int(2 * self._poll(execution, run) * 1000) + _WAITED_MARGIN_MS
                how = "succeeded" if succeeded else "failed"
                ended = await locks.finish(run, how, remembered, waited_ms=waited, linger=linger)
                if ended and not remembered and run.key == execution.lock.key:
                    self._events.emit(
                        LockEventKind.RELEASED, message.task_name, message.task_id, run.key, None
                    )
        except REDIS_ERRORS as exc:
            if run.key != execution.lock.key:
                what = "free the run slot"
            elif passed_on:
                what = "hand on"
            else:
                what = "keep" if succeeded and execution.success_ttl else "release"
            logger.warning(
                "Could not %s %r of task %s (%s): %s: %s; it expires in %ds",
                what if run.key != execution.lock.key else what + " lock",
                run.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
                run.ttl_ms // 1000,
            )

    async def _hand_run_over(self, running: Execution, to: Lock, message: TaskiqMessage) -> None:
        """Hand a run slot beside the lock to the retry that carries the run on.

        (A ``"finished"`` lock is its own run slot: the retry's send took it over.)
        """
        run = running.run
        if run is None or run.key == running.lock.key:
            return
        try:
            await running.state.locks.hand_over(run, Lock(run.key, to.token, to.task_id, to.ttl_ms))
        except REDIS_ERRORS as exc:
            logger.warning(
                "Could not hand the run of task %s (%s) in %r to its retry: %s: %s; "
                "the retry may wait for it until it expires in %ds",
                message.task_name,
                message.task_id,
                run.key,
                type(exc).__name__,
                exc,
                run.ttl_ms // 1000,
            )
        running.run = None

    def _serialise_arguments(self, message: TaskiqMessage) -> bytes:
        """The call's arguments as the broker sends them (its formatter and serializer)."""
        call = TaskiqMessage(
            task_id="", task_name="", labels={}, args=message.args, kwargs=message.kwargs
        )
        # base64: any serializer's bytes survive a client that decodes replies.
        return base64.b64encode(self.broker.formatter.dumps(call).message)

    def _wants_fence(self, task_name: str) -> bool:
        """Whether the task takes a `TaskLock`, looked up once per task name."""
        wants = self._fenced.get(task_name)
        if wants is None:
            from taskiq_deduplication.calls import takes_task_lock  # noqa: PLC0415 (a cycle)

            broker = getattr(self, "broker", None)
            task = broker.find_task(task_name) if broker is not None else None
            wants = task is not None and takes_task_lock(task.original_func)
            self._fenced[task_name] = wants
        return wants

    @staticmethod
    def _recorded_fence(message: TaskiqMessage) -> int | None:
        recorded = read_lock_labels(message.labels, message.task_id)
        return None if recorded is None else recorded.fence

    # The run's lock, as a task sees it (TaskLock)

    def _run_of(self, task_id: str) -> Execution | None:
        return self._executions.of_run(task_id)

    def _without_lock(
        self,
        message: TaskiqMessage,
        running: Execution | None,
        key: str,
        send: labels.SendOptions,
    ) -> TaskiqMessage:
        """Let ``message`` go out without a lock (fail-open, or a retry that found none).

        An exclusive task still records its key, under no owner token: its run
        takes the run slot of that key as any other run does.
        """
        if running is not None:
            # The retry holds no lock, so the run ends its own as a failure does.
            running.resent = Resent.WITHOUT_A_LOCK
        if send.exclusive:
            self._record(message, key, NO_OWNER, send)
        else:
            drop_lock_labels(message.labels)
        return message

    def _record(
        self,
        message: TaskiqMessage,
        key: str,
        token: str,
        send: labels.SendOptions,
        fence: int | None = None,
    ) -> None:
        merge = send.merge if merge_key(self.key_prefix, key) is not None else None
        recorded = RecordedLock(
            key,
            token,
            send.ttl,
            send.policy.name,
            send.success_ttl,
            fence,
            merge,
            exclusive=send.exclusive,
        )
        write_lock_labels(message.labels, recorded, message.task_id)

    def _send_key(self, message: TaskiqMessage) -> str | None:
        """The key a first send of ``message`` takes, or ``None`` if it is not deduplicated.

        What ``pre_send`` computes, for ``taskiq dedup key``; raises as it does
        on a bad label or arguments that cannot be fingerprinted.
        """
        send = labels.read_send_options(message.labels, self._defaults)
        return None if send is None else keys.lock_key_of(self.key_prefix, message, send)

    @staticmethod
    def _lock_of(message: TaskiqMessage) -> Lock | None:
        recorded = read_lock_labels(message.labels, message.task_id)
        if recorded is None:
            return None
        return Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)

    def _lease(self, message: TaskiqMessage, lock: Lock) -> Lock:
        """The lock as its running task keeps it: on the running lease, if there is one."""
        seconds = labels.read_running_ttl(message.labels, default=self.running_ttl)
        if seconds is None or seconds * 1000 >= lock.ttl_ms or not self.heartbeat:
            return lock
        return Lock(lock.key, lock.token, lock.task_id, seconds * 1000)

    def _interval(self, execution: Execution, lease: Lock | None = None) -> float:
        """Seconds between two refreshes of ``lease`` (by default the run's lease)."""
        ttl = (lease or execution.lease).ttl_ms / 1000
        interval = self.heartbeat_interval or max(ttl / 3, 1.0)
        # A refresh less often than half the TTL would let the lock lapse.
        return min(interval, ttl / 2)

    async def _lock_store(self) -> LockStore:
        """The lock store of the running event loop: the scheduler takes its tick locks there."""
        state = self._states.get() or await self._states.current()
        return state.locks

    def _new_client(self) -> tuple[RedisClient, bool]:
        """The client for a new event loop's state, and whether it is the middleware's own.

        A client built from ``redis_url`` belongs to one loop (its connections
        do), so each loop gets its own, closed with the loop's state.
        """
        if self._client is not None:
            return self._client, False
        assert self._url is not None  # noqa: S101 (checked in __init__)
        return client_from_url(self._url), True


def _linger(execution: Execution) -> float:
    """How long a call of ``execution``'s may wait to share a round trip with other runs'.

    A run alone in its event loop (a worker's only task, a sequential in-place
    run) has no one to wait for. Other runs are those the loop's heartbeat
    keeps alive; this run's own beat is not among them at its start (not added
    yet) nor at its end (stopped first).
    """
    return _RUN_LINGER if len(execution.state.heartbeat) else 0.0


def _watch_kick(broker: AsyncBroker, refused: Callable[[BrokerMessage, Exception], None]) -> None:
    """Tell ``refused`` of every message ``broker.kick`` fails to send, then raise as it did.

    taskiq's ``kiq`` turns that failure into ``SendTaskError`` and calls no
    middleware hook: this wrapper of the broker's own ``kick`` (on the
    instance, as taskiq calls it) is the one place that sees it.
    """
    kick = broker.kick

    async def watched_kick(message: BrokerMessage) -> None:
        try:
            await kick(message)
        except Exception as exc:
            refused(message, exc)
            raise

    broker.kick = watched_kick  # type: ignore[method-assign]


@dataclass(slots=True)
class _Failing:
    """A run whose claim failed on a Redis error: until when it tries again."""

    until: float
    waited: bool

    def delay(self, poll: float) -> float | None:
        """Seconds to wait before the next try, or ``None`` to run without the claim."""
        left = self.until - asyncio.get_running_loop().time()
        return None if left <= 0 else min(poll, left)

    def gives_up(self, execution: Execution, message: TaskiqMessage) -> None:
        """Say that the run goes on without its claim, after waiting for Redis."""
        if self.waited:
            text = "Task %s (%s) runs without its lock %r: Redis did not answer for a lease; "
            text += _NOT_BEGUN
            logger.warning(
                text,
                message.task_name,
                message.task_id,
                execution.lock.key,
            )
