"""The heartbeat: one loop per process that keeps the locks of running tasks alive.

Each running task is a `Beat` with its own interval. The loop sleeps until
the earliest beat is due, then re-asserts every beat that is due or within half
an interval of it, all in one batch. Beats that start at different moments are
thereby pulled together, so a worker running thousands of tasks with the same
TTL spends about one round trip per interval, not one per task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from taskiq_deduplication.model.formats import holder_task_id
from taskiq_deduplication.observe.events import EventSink, LockEventKind
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.lock_store import Lock, LockStore, Reasserted

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

# How soon a refresh that failed on a Redis error is tried again, at the most.
_RETRY_AFTER = 1.0


@dataclass(eq=False, slots=True)
class Beat:
    """The lock of one running task, and when it is next refreshed."""

    lock: Lock
    task_name: str
    interval: float
    due: float = 0.0


class Heartbeat:
    """Refreshes the locks of running tasks until each task ends."""

    def __init__(
        self,
        store: LockStore,
        events: EventSink | None = None,
        *,
        held: Callable[[int], None] | None = None,
    ) -> None:
        """Create an idle heartbeat; its loop runs only while there are beats.

        What a refresh finds (a lock taken back, a lock lost) goes to
        ``events``; every change in the number of beats goes to ``held``.
        """
        self._store = store
        self._events = events or EventSink()
        self._held = held
        self._beats: set[Beat] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._next_wake = float("inf")
        # Starts the loop when the first beat falls due: a task that ends
        # before its first refresh (most do) never costs an asyncio task.
        self._start_timer: asyncio.TimerHandle | None = None
        self._start_at = float("inf")

    def __len__(self) -> int:
        """The number of locks being kept alive."""
        return len(self._beats)

    def add(self, beat: Beat) -> None:
        """Keep ``beat``'s lock alive, first refreshing it one interval from now."""
        beat.due = time.monotonic() + beat.interval
        if self._held is not None and beat not in self._beats:
            self._held(1)
        self._beats.add(beat)
        if self._loop_task is not None and not self._loop_task.done():
            if beat.due < self._next_wake:
                self._wakeup.set()
        elif beat.due < self._start_at:
            if self._start_timer is not None:
                self._start_timer.cancel()
            self._start_timer = asyncio.get_running_loop().call_later(beat.interval, self._start)
            self._start_at = beat.due

    def _start(self) -> None:
        self._start_timer, self._start_at = None, float("inf")
        if self._beats and (self._loop_task is None or self._loop_task.done()):
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, beat: Beat) -> None:
        """Stop refreshing ``beat``'s lock; a refresh already sent may still land."""
        if self._held is not None and beat in self._beats:
            self._held(-1)
        self._beats.discard(beat)
        if not self._beats:
            self._wakeup.set()

    async def stop(self) -> None:
        """Stop refreshing every lock and end the loop."""
        if self._held is not None and self._beats:
            self._held(-len(self._beats))
        self._beats.clear()
        if self._start_timer is not None:
            self._start_timer.cancel()
            self._start_timer, self._start_at = None, float("inf")
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    async def _run(self) -> None:
        while self._beats:
            now = time.monotonic()
            self._next_wake = min(beat.due for beat in self._beats)
            if self._next_wake > now:
                self._wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self._next_wake - now)
                continue
            self._next_wake = float("inf")
            due = [beat for beat in self._beats if beat.due - beat.interval / 2 <= now]
            for beat in due:
                beat.due = now + beat.interval
            await self._refresh(due)

    async def _refresh(self, beats: list[Beat]) -> None:
        replies = await self._store.reassert([beat.lock for beat in beats])
        if isinstance(replies, RedisFailed):
            logger.warning(
                "Could not refresh %d deduplication lock(s): %s: %s; trying again",
                len(beats),
                type(replies.error).__name__,
                replies.error,
            )
            retry_at = time.monotonic() + _RETRY_AFTER
            for beat in beats:
                beat.due = min(beat.due, retry_at)
            return
        for beat, reply in zip(beats, replies, strict=True):
            if beat not in self._beats:
                continue  # the task ended while the refresh was in flight
            if reply == Reasserted.TAKEN_BACK:
                logger.warning(
                    "Lock %r of running task %s (%s) had vanished; taken back",
                    beat.lock.key,
                    beat.task_name,
                    beat.lock.task_id,
                )
                self._events.emit(
                    LockEventKind.TAKEN_BACK,
                    beat.task_name,
                    beat.lock.task_id,
                    beat.lock.key,
                    beat.lock.task_id,
                )
            elif isinstance(reply, str):
                holder = holder_task_id(reply)
                logger.warning(
                    "Lock %r of running task %s (%s) is now held by task %s; "
                    "no longer refreshing it",
                    beat.lock.key,
                    beat.task_name,
                    beat.lock.task_id,
                    holder,
                )
                self._events.emit(
                    LockEventKind.LOST, beat.task_name, beat.lock.task_id, beat.lock.key, holder
                )
                self.discard(beat)
