"""Schedules under deduplication: each tick sent once, a refused tick one line of log.

taskiq's scheduler is one process: run two for availability and every tick goes
out twice; restart one within a minute and that minute's cron ticks go out
again. The task's own lock does not help: a quick task has released it long
before the other replica sends. So each tick also takes a *tick lock* of its
own, one Redis key per tick under the middleware's ``key_prefix``, apart from
the task's lock and its policy: the replica that takes it sends the tick, the
others skip it (`scheduler/ticks.py` says how a tick is named and how long its lock
lives).

taskiq's scheduler also sends each due schedule in an asyncio task of its own
and never looks at how it ended, so a ``DuplicateTaskError`` from that send (a
tick that comes while the run of an earlier one is still queued or running)
would surface as asyncio's "Task exception was never retrieved" and a
traceback. Here it is one INFO line.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from taskiq import ScheduleSource, TaskiqScheduler
from taskiq.exceptions import ScheduledTaskCancelledError

from taskiq_deduplication.exceptions import DuplicateTaskError
from taskiq_deduplication.middleware import RedisDeduplicationMiddleware, loop_states
from taskiq_deduplication.model.formats import holder_task_id, new_token
from taskiq_deduplication.observe import refusals
from taskiq_deduplication.scheduler.ticks import CronPaths, Tick, is_one_off, tick_of
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.lock_store import Lock

if TYPE_CHECKING:
    from collections.abc import Callable

    from taskiq import AsyncBroker, ScheduledTask


__all__ = ["DeduplicatedScheduleSource", "DeduplicationScheduler"]

#: The name the docs give it (docs/usage.md), the folder's: every tick is logged here.
logger = logging.getLogger("taskiq_deduplication.scheduler")

# Whether a DeduplicationScheduler sends this tick: it handles a refusal itself.
_IN_SCHEDULER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "taskiq_deduplication_in_scheduler", default=False
)
#: How many schedules a source remembers its last tick lock of, and cron minutes seen.
_REMEMBERED = 10_000


@dataclass(slots=True)
class _Send:
    """The tick lock a send took, and whether the tick went out."""

    lock: Lock | None
    sent: bool = False
    """Set before the source's ``post_send``: a tick that went out keeps its lock."""


# This send's tick lock, for its scheduler to let go if the send fails.
_TAKEN: contextvars.ContextVar[_Send | None] = contextvars.ContextVar(
    "taskiq_deduplication_tick", default=None
)


def replica() -> str:
    """This scheduler process, as the logs and the tick locks name it: ``<host>/<pid>``."""
    return f"{socket.gethostname()}/{os.getpid()}"


class DeduplicatedScheduleSource(ScheduleSource):
    """A schedule source whose ticks go out once, however many schedulers read it.

    Wrap each source of a stock ``TaskiqScheduler`` in it (a
    [DeduplicationScheduler][taskiq_deduplication.DeduplicationScheduler] does
    this by itself). Before a tick is sent, it takes the tick's own lock in
    Redis, under the middleware's ``key_prefix``: one round trip. A tick that
    another scheduler process (a replica, or this one before a restart) has
    sent already is cancelled with taskiq's ``ScheduledTaskCancelledError``;
    a tick that the task's own lock refuses is one INFO line, not a traceback.
    Everything else (the schedules, adding and deleting them) is the wrapped
    source's.

    What "once" means for each kind of schedule: a cron schedule, once per cron
    minute; an interval schedule, sends at least the interval less half a
    second apart (not a whole interval, across replicas whose clocks differ);
    a one-off, once while its tick lock lives (a day).

    If Redis cannot be reached, the middleware's ``fail_open`` decides: the
    tick is sent without its tick lock (a WARNING), or it is skipped (an ERROR).

    It is made for taskiq's scheduler loop, which sends each tick in an asyncio
    task of its own: how that task ends (a refusal, a failed send) is handled
    when it ends. Before Python 3.12, ``taskiq scheduler --send-timeout`` sends
    in a task nested in that one, and a refusal by the task's own lock still
    ends the outer task with a ``DuplicateTaskError`` that asyncio reports:
    use a ``DeduplicationScheduler`` there.

    Example:
        ```python
        dedup = RedisDeduplicationMiddleware(redis_url=REDIS_URL)
        broker = ListQueueBroker(REDIS_URL).with_middlewares(dedup)
        scheduler = TaskiqScheduler(
            broker, sources=[DeduplicatedScheduleSource(LabelScheduleSource(broker), dedup)]
        )
        ```

    Args:
        source: The schedule source to wrap.
        middleware: The deduplication middleware of the scheduler's broker: its
            Redis, ``key_prefix`` and ``fail_open`` are the tick locks'.
    """

    def __init__(self, source: ScheduleSource, middleware: RedisDeduplicationMiddleware) -> None:
        """Wrap ``source``; see the class."""
        self.source = source
        self.middleware = middleware
        # Sources' post_send of one-offs refused by their task's lock, under way.
        self._consuming: set[asyncio.Task[None]] = set()
        # Interval tick key -> (value of the lock this source took, loop time of that tick).
        self._own: dict[str, tuple[str, float]] = {}
        # Which sends of schedules that also have an interval are their cron's.
        self._cron_paths = CronPaths(_REMEMBERED)
        # Schedules said to be sent without a tick lock (said once each).
        self._unlocked: set[tuple[str, str]] = set()

    async def startup(self) -> None:
        """Start the wrapped source."""
        await self.source.startup()

    async def shutdown(self) -> None:
        """Stop the wrapped source."""
        await self.source.shutdown()

    async def get_schedules(self) -> list[ScheduledTask]:
        """The wrapped source's schedules."""
        return await self.source.get_schedules()

    async def add_schedule(self, schedule: ScheduledTask) -> None:
        """Add ``schedule`` to the wrapped source."""
        await self.source.add_schedule(schedule)

    async def delete_schedule(self, schedule_id: str) -> None:
        """Delete schedule ``schedule_id`` from the wrapped source."""
        await self.source.delete_schedule(schedule_id)

    async def pre_send(self, task: ScheduledTask) -> None:
        """Let the wrapped source see the tick, then take the tick's lock.

        Raises:
            ScheduledTaskCancelledError: The wrapped source cancelled the tick,
                another scheduler process sent it already, or Redis could not
                be reached and ``fail_open`` is off.
        """
        started = asyncio.get_running_loop().time()
        now = datetime.now(timezone.utc)  # as near as can be to when taskiq's loop found it due
        await _maybe_await(self.source.pre_send(task))
        tick_lock = await self._take(task, started, now)
        send = _Send(tick_lock)
        _TAKEN.set(send)
        if _IN_SCHEDULER.get():
            return
        # Sent by taskiq's scheduler, in an asyncio task of its own that nobody
        # awaits: how the send ends is told when that task ends. The context is
        # the send's own, so the flag is for this send only.
        refusals.HANDLED.set(True)
        current = asyncio.current_task()
        if current is not None:
            current.add_done_callback(self._ended(task, send))

    async def post_send(self, task: ScheduledTask) -> None:
        """Let the wrapped source see that the tick was sent.

        The tick went out: it keeps its tick lock even if the wrapped source's
        ``post_send`` fails (a restart or another replica must not send it again).
        """
        send = _TAKEN.get()
        if send is not None:
            send.sent = True
        await _maybe_await(self.source.post_send(task))

    def _tick(self, task: ScheduledTask, now: datetime) -> Tick:
        """The tick of ``task`` due at ``now``, named by the path of taskiq's loop that sent it.

        Raises:
            TypeError: The schedule cannot be fingerprinted.
        """
        prefix = self.middleware.key_prefix
        if task.cron is None or task.interval is None:
            return tick_of(prefix, task, now)
        # Both a cron and an interval: the path this process's taskiq loop sent
        # it on, replayed (see CronPaths for the rule).
        return tick_of(prefix, task, now, by_cron=self._cron_paths.by_cron(task, now))

    def _remember(self, key: str, value: str, started: float) -> None:
        """Remember the interval tick lock this source took (a bounded map, oldest out)."""
        self._own.pop(key, None)
        if len(self._own) >= _REMEMBERED:
            del self._own[next(iter(self._own))]
        self._own[key] = (value, started)

    async def _take(self, task: ScheduledTask, started: float, now: datetime) -> Lock | None:
        """Take the lock of ``task``'s tick due at ``now``; ``None`` when sent without one."""
        name, schedule = task.task_name, task.schedule_id
        try:
            tick = self._tick(task, now)
        except TypeError:
            said = (name, schedule)
            if said not in self._unlocked:
                if len(self._unlocked) >= _REMEMBERED:
                    self._unlocked.clear()
                self._unlocked.add(said)
                logger.warning(
                    "Scheduled task %s (schedule %s) sent without a tick lock: cannot "
                    "fingerprint its arguments or labels (values taskiq cannot serialise), "
                    "so every scheduler process sends each of its ticks",
                    name,
                    schedule,
                )
            return None
        tick_lock = Lock(tick.key, new_token(), replica(), tick.ttl_ms)
        # This source's own lock of the schedule's previous interval tick is
        # taken over: its TTL counts from when it reached Redis, which may have
        # been late, and is there to hold back the other replicas only.
        replaces = ""
        own = self._own.get(tick.key)
        if (
            own is not None
            and tick.takes_over_after is not None
            and started - own[1] >= tick.takes_over_after
        ):
            replaces = own[0]
        states = loop_states(self.middleware)
        locks = (states.get() or await states.current()).locks
        # Sent without it (fail_open), a tick lock that lands late only holds
        # back the other replicas; the late lock of a skipped tick is undone.
        acquired = await locks.acquire(
            tick_lock, tick.ttl_ms, replaces=replaces, undo_late=not self.middleware.fail_open
        )
        if isinstance(acquired, RedisFailed):
            self._unreachable(task, tick, acquired.error)
            return None
        holder = acquired.holder
        if holder is not None:
            logger.info(
                "Tick (%s) of scheduled task %s (schedule %s): not sent here, replica %s sent it",
                tick.when,
                name,
                schedule,
                holder_task_id(holder),
            )
            if is_one_off(task):  # its tick is over: no restart sends it again
                await self._consume(task)
            raise ScheduledTaskCancelledError
        if tick.takes_over_after is not None:
            self._remember(tick.key, tick_lock.value, started)
        logger.info(
            "Tick (%s) of scheduled task %s (schedule %s): sending from replica %s",
            tick.when,
            name,
            schedule,
            tick_lock.task_id,
        )
        return tick_lock

    def _unreachable(self, task: ScheduledTask, tick: Tick, exc: BaseException) -> None:
        """Redis failed: send the tick without its lock (``fail_open``), or skip it.

        Raises:
            ScheduledTaskCancelledError: ``fail_open`` is off.
        """
        sent = self.middleware.fail_open
        logger.log(
            logging.WARNING if sent else logging.ERROR,
            "Could not take tick lock %r of scheduled task %s (schedule %s): %s: %s; %s",
            tick.key,
            task.task_name,
            task.schedule_id,
            type(exc).__name__,
            exc,
            f"sending the tick ({tick.when}) without it (fail_open)"
            if sent
            else f"tick ({tick.when}) skipped",
        )
        if not sent:
            raise ScheduledTaskCancelledError

    async def _consume(self, task: ScheduledTask) -> None:
        """Tell the wrapped source that one-off ``task`` is over, though not sent here."""
        try:
            await _maybe_await(self.source.post_send(task))
        except Exception as exc:  # noqa: BLE001 (the tick is cancelled all the same)
            logger.warning(
                "Scheduled task %s (schedule %s): its source failed to drop the one-off "
                "(%s: %s); a restart finds its tick lock taken for a day",
                task.task_name,
                task.schedule_id,
                type(exc).__name__,
                exc,
            )

    def _ended(self, task: ScheduledTask, send: _Send) -> Callable[[asyncio.Task[Any]], None]:
        """What to do when the asyncio task that sends ``task``'s tick ends."""

        def ended(done: asyncio.Task[Any]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            if isinstance(error, DuplicateTaskError):
                _refused(task, error)
                if is_one_off(task):
                    consuming = done.get_loop().create_task(self.post_send(task))
                    self._consuming.add(consuming)
                    consuming.add_done_callback(self._consuming.discard)
            elif error is not None:
                if send.lock is not None and not send.sent:
                    _let_go(self.middleware, send.lock)
                # What asyncio would say when the task is collected.
                never = "Task exception was never retrieved"
                done.get_loop().call_exception_handler(
                    {"message": never, "exception": error, "future": done}
                )

        return ended


class DeduplicationScheduler(TaskiqScheduler):
    """A ``TaskiqScheduler`` that sends each tick once and skips a duplicate quietly.

    Each tick takes a tick lock in Redis first (see
    [DeduplicatedScheduleSource][taskiq_deduplication.DeduplicatedScheduleSource]),
    so that any number of scheduler processes on the same sources, and a
    scheduler restarted, send it once (an interval schedule: sends at least the
    interval less half a second apart). A tick refused by
    [RedisDeduplicationMiddleware][taskiq_deduplication.RedisDeduplicationMiddleware]
    (its task is still queued or running) is logged as one INFO line that names
    the task, its schedule and the task holding the lock, and the scheduler goes
    on; every other error of a send is left as taskiq leaves it. Use it where
    you use ``TaskiqScheduler``:

    Example:
        ```python
        scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])
        ```

    Args:
        broker: The broker, with a ``RedisDeduplicationMiddleware``.
        sources: The schedule sources.
        tick_locks: Whether each tick takes a tick lock (``False``: every
            scheduler process sends every tick it finds due, as taskiq's does).
    """

    def __init__(
        self, broker: AsyncBroker, sources: list[ScheduleSource], *, tick_locks: bool = True
    ) -> None:
        """Schedule ``sources`` on ``broker``; see the class."""
        super().__init__(broker, sources)
        self.tick_locks = tick_locks
        self._deduplicated: dict[int, tuple[ScheduleSource, ScheduleSource]] = {}

    async def startup(self) -> None:
        """Start the broker (and its middleware); say so if ticks cannot be locked."""
        await super().startup()
        if self.tick_locks and self._middleware() is None:
            logger.warning(
                "The broker has no RedisDeduplicationMiddleware: every scheduler "
                "process sends every tick it finds due"
            )

    async def on_ready(self, source: ScheduleSource, task: ScheduledTask) -> None:
        """Send the task of a due schedule, once per tick; a duplicate is logged and skipped.

        Args:
            source: The schedule source of the schedule.
            task: The schedule that is due.
        """
        handled = refusals.HANDLED.set(True)
        inside = _IN_SCHEDULER.set(True)
        taken = _TAKEN.set(None)
        try:
            await super().on_ready(self._with_tick_locks(source), task)
        except DuplicateTaskError as refused:
            _refused(task, refused)
            if is_one_off(task):  # its tick is over: no restart sends it again
                await _maybe_await(source.post_send(task))
        except Exception:
            send = _TAKEN.get()
            middleware = self._middleware()
            if (
                send is not None
                and send.lock is not None
                and not send.sent
                and middleware is not None
            ):
                _let_go(middleware, send.lock)
            raise
        finally:
            _TAKEN.reset(taken)
            _IN_SCHEDULER.reset(inside)
            refusals.HANDLED.reset(handled)

    def _with_tick_locks(self, source: ScheduleSource) -> ScheduleSource:
        """``source``, wrapped so that its ticks take tick locks (once per source)."""
        if not self.tick_locks or isinstance(source, DeduplicatedScheduleSource):
            return source
        known = self._deduplicated.get(id(source))
        if known is not None and known[0] is source:
            return known[1]
        middleware = self._middleware()
        wrapped = source if middleware is None else DeduplicatedScheduleSource(source, middleware)
        self._deduplicated[id(source)] = (source, wrapped)
        return wrapped

    def _middleware(self) -> RedisDeduplicationMiddleware | None:
        return next(
            (m for m in self.broker.middlewares if isinstance(m, RedisDeduplicationMiddleware)),
            None,
        )


def _refused(task: ScheduledTask, refused: DuplicateTaskError) -> None:
    logger.info(
        "Scheduled task %s not sent (schedule %s): task %s still holds its lock %r",
        task.task_name,
        task.schedule_id,
        refused.holder_task_id,
        refused.key,
    )


def _let_go(middleware: RedisDeduplicationMiddleware, tick_lock: Lock) -> None:
    """Release the tick lock of a send that failed: a restart, or another replica, may send it."""
    state = loop_states(middleware).get()
    if state is not None:
        state.locks.release_detached(tick_lock)
        logger.info(
            "Tick lock %r released: its send failed, another replica or a restart may send it",
            tick_lock.key,
        )


async def _maybe_await(result: object) -> None:
    if inspect.isawaitable(result):
        await result
