"""Keyed flow control at a run's start: a slot of its limit, a place in its rate, or a wait.

A run of a task with a ``limit_concurrency`` or ``limit_rate`` takes a slot of
its limit (``model/limits.py`` names it) before its body: in the same batch as
its claim, so an uncontended limited run costs no round trip more. A run over
the limit waits in line in Redis, without a thread and without polling: the
script that frees a slot hands it to the first in line and says so on the
limit's channel (``store/wakes.py``); a lease refresh finds it too, if that
message was lost. The slot goes at the run's end, whatever the end, or with its
lease if its worker dies.

A worker lends a limit a bounded number of its slots to wait in
(``limit_waiting``): past that, a run goes back to the broker (the same message,
sent again, not a retry), so a key with a long backlog never starves the
worker's other tasks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from taskiq.exceptions import NoResultError

from taskiq_deduplication.model.formats import new_token
from taskiq_deduplication.model.limits import LimitRule, limit_keys, read_limit_leniently
from taskiq_deduplication.observe.events import LockEventKind
from taskiq_deduplication.run.copies import leave_out_body
from taskiq_deduplication.run.execution import Followed
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.slots import Slot, Taken, Taking, Waits
from taskiq_deduplication.store.wakes import Wakes

if TYPE_CHECKING:
    from collections.abc import Callable

    from taskiq import TaskiqMessage, TaskiqResult
    from taskiq.abc.broker import AsyncBroker

    from taskiq_deduplication.observe.events import EventSink
    from taskiq_deduplication.observe.metrics import Metrics
    from taskiq_deduplication.run.loops import LoopState

logger = logging.getLogger(__name__)

#: Seconds a slot (or a place in line) outlives its worker unrefreshed, unless
#: the middleware's running lease says otherwise.
DEFAULT_LEASE: Final = 30
#: How many runs of one limit may wait in one event loop, unless ``limit_waiting`` says.
DEFAULT_WAITING: Final = 2
#: Seconds a run of a limit that lends this loop no more slots to wait in
#: pauses for a place among them before it goes back to the broker.
_PAUSE: Final = 1.0
#: How long a run waits for Redis to answer its take before it tries again.
_RETRY_AFTER: Final = 1.0


@dataclass(eq=False, slots=True)
class LimitedRun:
    """One run's place in its limit, from its start to its end."""

    rule: LimitRule
    name: str
    slot: Slot
    task_name: str
    state: LoopState
    taking: Taking | None = None
    """The take sent with the run's claim, until it is read."""
    holds: bool = False
    """Whether the run holds its slot (or its start in the rate) now."""
    in_line: bool = False
    """Whether the run has a place in its limit's line in Redis now."""
    took_at: float = 0.0
    """The event loop's time when its last take was made."""
    stays: bool = False
    """Whether the run waits here whatever: the broker refused to take it back."""
    lost: bool = False
    """Whether a refresh found the slot gone (its lease lapsed): the run is fenced."""
    requeued: bool = False
    """Whether the run went back to the broker: its delivery ends without its body."""
    entered: bool = False
    """Whether the run is past its limit: it holds its slot, went back, or goes without."""
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    on_task_done: Any = field(default=None, repr=False)


class Room:
    """The limited runs of one event loop: their leases, their waits, their wake-ups."""

    def __init__(self, state: LoopState, metrics: Metrics | None = None) -> None:
        """Keep the limited runs of ``state``'s loop; nothing is sent yet."""
        self._state = state
        self._metrics = metrics
        self.wakes = Wakes(state.client)
        self.waiting: dict[str, int] = {}
        """Runs of each limit that wait in this loop (for a slot or their start)."""
        self._paused: dict[str, list[asyncio.Future[None]]] = {}
        """Runs of each limit that wait for a place among those, before they go back."""
        self._runs: set[LimitedRun] = set()
        self._keeper: asyncio.Task[None] | None = None

    def wait_more(self, name: str) -> None:
        """One more run of ``name`` waits in this loop."""
        self.waiting[name] = self.waiting.get(name, 0) + 1
        if self._metrics is not None:
            self._metrics.waiting(1)

    def wait_less(self, name: str) -> None:
        """One run of ``name`` waits no more: a run paused for a place may take it."""
        if self._metrics is not None:
            self._metrics.waiting(-1)
        left = self.waiting.get(name, 0) - 1
        if left > 0:
            self.waiting[name] = left
        else:
            self.waiting.pop(name, None)
        paused = self._paused.get(name)
        while paused:
            future = paused.pop(0)
            if not future.done():
                future.set_result(None)
                break

    async def make_room(self, name: str, most: int) -> bool:
        """Whether a run of ``name`` may wait here: fewer than ``most`` do, or one stops soon.

        At most ``most`` runs of a limit pause here for a place, each for at
        most `_PAUSE` seconds: a limit's backlog neither takes more of the
        loop's slots nor goes round the broker at its full speed.
        """
        if self.waiting.get(name, 0) < most:
            return True
        paused = self._paused.setdefault(name, [])
        if len(paused) >= most:
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        paused.append(future)
        try:
            await asyncio.wait_for(future, _PAUSE)
        except asyncio.TimeoutError:
            return False
        finally:
            if future in paused:
                paused.remove(future)
            if not paused:
                self._paused.pop(name, None)
        return self.waiting.get(name, 0) < most

    def hold(self, run: LimitedRun, *, holds: bool) -> None:
        """Note that ``run`` holds its slot now, or no longer."""
        if run.holds != holds and run.rule.concurrency and self._metrics is not None:
            self._metrics.slots(1 if holds else -1)
        run.holds = holds

    def add(self, run: LimitedRun) -> None:
        """Keep ``run``'s place alive until `discard`."""
        self._runs.add(run)
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    def discard(self, run: LimitedRun) -> None:
        """Stop keeping ``run``'s place (it was freed)."""
        self._runs.discard(run)

    async def close(self) -> None:
        """Stop the refreshes and the wake-ups."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await self.wakes.close()

    async def _keep(self) -> None:
        while self._runs:
            interval = min(run.slot.lease_ms for run in self._runs) / 3000
            await asyncio.sleep(interval)
            runs = [run for run in self._runs if run.taking is None]
            if not runs:
                continue
            kept = await self._state.locks.slots.keep([run.slot for run in runs])
            if isinstance(kept, RedisFailed):
                logger.warning(
                    "Could not refresh %d limit slot(s): %s: %s; trying again",
                    len(runs),
                    type(kept.error).__name__,
                    kept.error,
                )
                continue
            for run, found in zip(runs, kept, strict=True):
                if run not in self._runs:
                    continue
                if found.held and not run.holds:  # handed over, its message lost
                    self.wakes.wake(run.slot.keys.holders, run.slot.member, found.delay)
                elif not found.held and not found.waiting:
                    self._lose(run)

    def _lose(self, run: LimitedRun) -> None:
        if run.holds:
            run.lost = True
            self.hold(run, holds=False)
            logger.warning(
                "Task %s (%s) lost its slot of limit %r: its lease lapsed (Redis was out "
                "of reach); it is no longer counted against the limit",
                run.task_name,
                run.slot.task_id,
                run.name,
            )
        # A waiter whose place lapsed takes a new one.
        self.wakes.wake(run.slot.keys.holders, run.slot.member, -1.0)


_FOLLOWED: Followed[Limits] = Followed()


def follow_limits(middleware: object, limits: Limits) -> None:
    """Let the tasks of ``middleware``'s broker find their places in ``limits`` (`TaskLock`)."""
    _FOLLOWED.follow(middleware, limits)


def limited_run_of(broker: AsyncBroker, task_id: str) -> LimitedRun | None:
    """The limited run of ``task_id`` in this asyncio task, among ``broker``'s middlewares'."""
    return _FOLLOWED.first(broker, lambda limits: limits.current(task_id))


class Limits:
    """The limits of one middleware's runs: a slot at the start, freed at the end."""

    def __init__(
        self,
        prefix: str,
        lease: int | None,
        waiting: int,
        events: EventSink,
        metrics: Callable[[], Metrics | None] = lambda: None,
    ) -> None:
        """Limit runs under ``prefix``; ``waiting`` runs of one limit may wait per loop.

        What happens goes to ``events`` and, once ``metrics`` gives metrics, to them.
        """
        self._prefix = prefix
        self._metrics = metrics
        self._lease_ms = (lease or DEFAULT_LEASE) * 1000
        self._waiting = waiting
        self._events = events
        self._rooms: dict[LoopState, Room] = {}
        self._runs: dict[tuple[str, asyncio.Task[Any] | None], LimitedRun] = {}
        self._bad: set[str] = set()

    def rule_of(self, message: TaskiqMessage) -> LimitRule | None:
        """The limit a run of ``message`` counts against, if any (a bad label is said once)."""
        labels = message.labels
        if "limit_concurrency" not in labels and "limit_rate" not in labels:
            return None
        rule = read_limit_leniently(labels)
        if isinstance(rule, ValueError):
            if message.task_name not in self._bad:
                self._bad.add(message.task_name)
                logger.warning(
                    "Task %s runs without its limit: %s (its sender did not check it)",
                    message.task_name,
                    rule,
                )
            return None
        return rule

    def room(self, state: LoopState) -> Room:
        """The limited runs of ``state``'s loop."""
        room = self._rooms.get(state)
        if room is None:
            room = self._rooms[state] = Room(state, self._metrics())
            state.on_close.append(self._closer(state))
        return room

    async def begin(
        self, rule: LimitRule, message: TaskiqMessage, state: LoopState
    ) -> LimitedRun | None:
        """The place of ``message``'s run in its limit (``None``: the run goes without one).

        When this loop lends its limit all the slots it may to wait in, the
        run would wait behind them: it pauses for a place among them for a
        moment (`Room.make_room`), and is marked to go back to the broker if
        none comes.
        """
        try:
            name = rule.name_of(message)
        except TypeError as exc:
            logger.warning(
                "Task %s (%s) runs without its limit: its key fields cannot be fingerprinted (%s)",
                message.task_name,
                message.task_id,
                exc,
            )
            return None
        task = asyncio.current_task()
        if (message.task_id, task) in self._runs:
            # A retry run inside its attempt's own hooks (an in-process broker
            # that awaits in place): the attempt holds the slot, and waits for it.
            return None
        slot = Slot(limit_keys(self._prefix, name), message.task_id, new_token(), self._lease_ms)
        run = LimitedRun(rule, name, slot, message.task_name, state, task=task)
        self._runs[message.task_id, run.task] = run
        if run.task is not None:
            # However the delivery ends (post_execute, or cancelled before it), the slot goes.
            run.on_task_done = functools.partial(self._task_done, run)
            run.task.add_done_callback(run.on_task_done)
        if not await self.room(state).make_room(name, self._waiting):
            run.requeued = True
        return run

    def _task_done(self, run: LimitedRun, _task: object) -> None:
        if self._runs.get((run.slot.task_id, run.task)) is run:
            self.abandon(run)

    def take_soon(self, run: LimitedRun) -> None:
        """Send the take of ``run``'s slot with the next call of this turn (its claim)."""
        run.took_at = asyncio.get_running_loop().time()
        run.taking = run.state.locks.slots.take_soon(run.slot, run.rule.concurrency, run.rule.rate)

    def put_back(self, run: LimitedRun | None) -> None:
        """Give up a take sent with a claim that did not begin the run (a copy, a wait)."""
        if run is None:
            return
        taking, run.taking = run.taking, None
        if taking is not None:
            taking.drop()
            run.state.locks.slots.free(run.slot)

    async def enter(self, run: LimitedRun, message: TaskiqMessage, broker: AsyncBroker) -> None:
        """Hold ``run``'s slot before its body: take it, or wait in line, or go back.

        A Redis failure is waited out for the run's lease, then the run goes
        without its slot (said): a limit never loses the task.
        """
        try:
            await self._enter(run, message, broker)
        finally:
            run.entered = True

    async def send_back(self, run: LimitedRun, message: TaskiqMessage, broker: AsyncBroker) -> None:
        """Send the run marked to go back to the broker (`begin`); a refused one stays, unmarked."""
        if await self._requeue(run, message, broker):
            run.entered = True

    async def _enter(self, run: LimitedRun, message: TaskiqMessage, broker: AsyncBroker) -> None:
        if run.requeued and await self._requeue(run, message, broker):
            return
        room = self.room(run.state)
        started = time.monotonic()
        waited = False
        while True:
            taken = await self._take(run, message)
            if taken is None:  # Redis failed past the lease: the run goes without
                room.discard(run)
                return
            if run.rule.concurrency:  # a rate alone keeps nothing in Redis to refresh
                room.add(run)
            if isinstance(taken, Waits):
                run.in_line = True
                delay = await self._in_line(room, run, message, broker, first=not waited)
                waited = True
                if delay is _SENT_BACK:
                    return
                if delay is None:
                    continue  # its place lapsed, or the broker refused it: a new place
            else:
                delay = taken.delay
            run.in_line = False
            room.hold(run, holds=True)
            if delay > 0:  # its start in the rate is still to come
                waited = True
                await self._until_start(room, run, delay)
            if waited:
                self._say(LockEventKind.WAITED, run, message, time.monotonic() - started)
            return

    async def _in_line(
        self,
        room: Room,
        run: LimitedRun,
        message: TaskiqMessage,
        broker: AsyncBroker,
        *,
        first: bool,
    ) -> float | _SentBack | None:
        """Wait in line for ``run``'s slot: the delay to its start once handed over.

        ``None``: its place lapsed, take another; `_SENT_BACK`: this loop lends
        the limit no more slots to wait in, and its message went back.
        """
        if room.waiting.get(run.name, 0) >= self._waiting and not run.stays:
            room.discard(run)
            run.state.locks.slots.free(run.slot)
            run.in_line = False
            if await self._requeue(run, message, broker):
                return _SENT_BACK
            return None  # the broker refused it: it waits here after all
        if first:
            self._say(LockEventKind.LIMITED, run, message, None)
        return await self._wait(room, run)

    async def _until_start(self, room: Room, run: LimitedRun, delay: float) -> None:
        """Wait ``delay`` seconds for the start the rate gave ``run``: a run that waits too."""
        room.wait_more(run.name)
        try:
            await asyncio.sleep(delay)
        finally:
            room.wait_less(run.name)

    async def _take(self, run: LimitedRun, message: TaskiqMessage) -> Taken | Waits | None:
        """Take ``run``'s slot (with the take sent with its claim, if any).

        While Redis fails it tries again, for at most the slot's lease; then
        ``None`` (said).
        """
        giving_up = time.monotonic() + run.slot.lease_ms / 1000
        slots = run.state.locks.slots
        while True:
            if run.taking is None:
                run.took_at = asyncio.get_running_loop().time()
                run.taking = slots.take_soon(run.slot, run.rule.concurrency, run.rule.rate)
            # Kept on the run while its reply is awaited: a run cancelled meanwhile
            # gives back what the take may have taken.
            taken = await run.taking.outcome()
            run.taking = None
            if not isinstance(taken, RedisFailed):
                return taken
            if time.monotonic() >= giving_up:
                logger.warning(
                    "Task %s (%s) runs without its slot of limit %r: Redis failed "
                    "(%s: %s) for longer than the slot's lease",
                    message.task_name,
                    message.task_id,
                    run.name,
                    type(taken.error).__name__,
                    taken.error,
                )
                return None
            await asyncio.sleep(_RETRY_AFTER)

    async def _wait(self, room: Room, run: LimitedRun) -> float | None:
        """Wait in line until the slot is handed over; the delay to the start, or ``None``."""
        room.wait_more(run.name)
        channel = run.slot.keys.holders
        try:
            future, look_again = await room.wakes.watch(channel, run.slot.member, run.took_at)
            if look_again:  # a slot handed over before the subscription went unheard
                kept = await run.state.locks.slots.keep([run.slot])
                if not isinstance(kept, RedisFailed) and kept[0].held:
                    return kept[0].delay
            delay = await future
        finally:
            room.wakes.forget(channel, run.slot.member)
            room.wait_less(run.name)
        return None if delay < 0 else delay

    def end(self, message: TaskiqMessage, result: TaskiqResult[Any] | None) -> LimitedRun | None:
        """Free the slot of ``message``'s run (its end, whatever it was); the run, if limited."""
        if not self._runs:  # most processes: no limited run
            return None
        run = self._runs.pop((message.task_id, asyncio.current_task()), None)
        if run is None:
            return None
        if run.task is not None:
            run.task.remove_done_callback(run.on_task_done)
        if run.requeued and result is not None and not result.is_err:
            result.error = NoResultError()  # taskiq then stores nothing: the next delivery will
        self._release(run)
        return run

    def abandon(self, run: LimitedRun) -> None:
        """Free the slot of a run that will not end through ``post_execute`` (cancelled)."""
        self._runs.pop((run.slot.task_id, run.task), None)
        self._release(run)

    def current(self, task_id: str) -> LimitedRun | None:
        """The limited run of ``task_id`` in this asyncio task, if any (for `TaskLock`)."""
        return self._runs.get((task_id, asyncio.current_task()))

    @staticmethod
    async def held(run: LimitedRun) -> bool | RedisFailed:
        """Whether ``run`` still holds its slot (one round trip, which refreshes it)."""
        if not run.holds or run.lost:
            return False
        kept = await run.state.locks.slots.keep([run.slot])
        return kept if isinstance(kept, RedisFailed) else kept[0].held

    def _release(self, run: LimitedRun) -> None:
        room = self._rooms.get(run.state)
        if room is not None:
            room.discard(run)
        if run.taking is not None:
            self.put_back(run)
        elif (run.holds or run.in_line) and not run.lost:
            # Its slot, or its place in line (a run cancelled while it waited).
            run.state.locks.slots.free(run.slot)
        run.in_line = False
        if room is not None:
            room.hold(run, holds=False)
        run.holds = False

    async def _requeue(self, run: LimitedRun, message: TaskiqMessage, broker: AsyncBroker) -> bool:
        """Send ``message`` back to the broker, unchanged; this delivery ends without its body.

        Whether it went: a broker that refused it leaves the run to wait in
        line after all (its message must not be lost).
        """
        if getattr(broker, "await_inplace", False):
            # An in-process broker that runs a message inside its kick would
            # deliver it again right here, in this very run: it waits instead.
            run.stays = True
            return False
        # First: an in-process broker's kick looks the task up in this very
        # asyncio task, and the body to leave out is this delivery's own.
        put_back = leave_out_body(message, _nothing)
        try:
            await broker.kick(broker.formatter.dumps(_as_sent(message)))
        except Exception as exc:  # noqa: BLE001 (any broker's error: the run waits instead)
            put_back()
            run.requeued = False
            run.stays = True
            logger.warning(
                "Could not send task %s (%s) back to the broker (%s: %s); it waits for "
                "limit %r here",
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
                run.name,
            )
            return False
        run.requeued = True
        self._say(LockEventKind.LIMITED, run, message, None)
        return True

    def _say(
        self, kind: LockEventKind, run: LimitedRun, message: TaskiqMessage, waited: float | None
    ) -> None:
        if kind is LockEventKind.WAITED:
            metrics = self._metrics()
            if metrics is not None and waited is not None:
                metrics.waited(waited)
            logger.debug(
                "Task %s (%s) waited %.3fs for limit %r",
                message.task_name,
                message.task_id,
                waited,
                run.name,
            )
        elif run.requeued:
            logger.debug(
                "Task %s (%s) goes back to the broker: limit %r has %d run(s) waiting here",
                message.task_name,
                message.task_id,
                run.name,
                self._waiting,
            )
        if self._events.active:
            self._events.emit(
                kind,
                message.task_name,
                message.task_id,
                run.slot.keys.holders,
                None,
                waited=waited,
                requeued=run.requeued,
            )

    def _closer(self, state: LoopState) -> Any:  # noqa: ANN401 (a coroutine function)
        async def close() -> None:
            room = self._rooms.pop(state, None)
            if room is not None:
                await room.close()

        return close


class _SentBack(enum.Enum):
    SENT_BACK = enum.auto()


_SENT_BACK: Final = _SentBack.SENT_BACK
"""A run in line whose message went back to the broker instead."""


def _as_sent(message: TaskiqMessage) -> TaskiqMessage:
    """``message`` as a kicker sends it: its labels as text, as their types table says them.

    A delivery's labels were parsed back to values (``1``, ``True``); a broker
    that sends labels as headers (NATS) takes text only.
    """
    labels = {name: _label_text(value) for name, value in message.labels.items()}
    return message.model_copy(update={"labels": labels})


def _label_text(value: object) -> str:
    """A label's value as taskiq's kicker writes it (``prepare_label``)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value if isinstance(value, str) else str(value)


async def _nothing(*_args: object, **_kwargs: object) -> None:
    """What a delivery that went back to the broker runs instead of its task."""
