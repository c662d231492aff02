"""A tick of a schedule: which tick it is, and how long its tick lock lives.

Every scheduler replica that finds a schedule due names the tick the same way,
from what the schedule is: its task name, positional and keyword arguments,
labels, ``task_id``, and its cron (with ``cron_offset``), interval or time.
Never from its ``schedule_id``: ``LabelScheduleSource`` draws one at random in
each process for a schedule label that names none. Two schedules
equal in all of these send the same call at the same moments; they are one
schedule here, and each of their ticks goes out once.

A schedule with a cron is a cron schedule, else one with an interval is an
interval schedule, else it is a one-off (``time``): the order in which taskiq's
scheduler looks at them. A schedule with both a cron and an interval is sent by
taskiq's scheduler on either path: its cron's tick where the cron is due (once
per cron minute), its interval's ticks in between. Its tick is named by the
path that sent it (see `tick_of`'s ``by_cron``), and every replica tells the
path the way its own taskiq loop took it (`CronPaths`): a send is the cron's
when the cron is due and the replica's last send on the cron's path is a
minute or more ago, else it is the interval's. Not "the first send of a
minute": a replica whose cron goes out at second 30 (it started then) sends
interval ticks before it in each minute, and those are interval ticks on every
replica, never the minute's cron tick. How a tick is told apart, and how long
its lock lives:

- cron: one tick per cron minute, counted in the schedule's own time (its
  ``cron_offset``, a time zone or a shift); the lock lives to the end of the
  next minute, so a scheduler restarted within the minute finds it, and so
  does a replica whose clock is behind by up to a minute.
- interval: one lock per schedule, living the interval less half a second
  from the moment it reaches Redis. Another replica finds it still there up
  to then: sends by different replicas are at least the interval less half a
  second apart, whatever the offset between their clocks (not a whole
  interval: two replicas whose clocks are 0.4 s apart may send 1.6 s apart on
  a 2 s interval). The replica that holds the lock takes it over at its own
  next tick (its source remembers the lock it took), so a lock that reached
  Redis late never holds back the next tick of the replica that sent.
- one-off: one lock per schedule and time, living a day (`ONE_OFF_TTL_MS`): a
  one-off written in code comes back at every start, and one in a source that
  deletes what it sent is still in the other replicas' copies of the source
  until they read it again (every minute by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from taskiq.cli.scheduler.run import CronValueError, is_cron_task_now

from taskiq_deduplication.model.fingerprint import schedule_fingerprint
from taskiq_deduplication.model.formats import tick_key

if TYPE_CHECKING:
    from collections.abc import Mapping

    from taskiq import ScheduledTask

#: How much shorter than its interval an interval tick's lock lives.
INTERVAL_MARGIN_MS: Final = 500
#: How long the lock of a one-off's tick lives: a day.
ONE_OFF_TTL_MS: Final = 24 * 60 * 60 * 1000
_MINUTE: Final = 60
# Seconds from one pass of taskiq's scheduler loop to the next (its default loop interval).
_NEXT_PASS: Final = 1
# Labels that do not say what a schedule is (see `_labels`).
_NOT_WHAT: Final = frozenset({"schedule_id", "types_of_exceptions"})
_PLAIN: Final = (str, int, float, bool, type(None), list, dict)


@dataclass(frozen=True, slots=True)
class Tick:
    """One tick of a schedule, as every replica names it."""

    key: str
    """Its tick lock, ``<prefix>#tick:<identity>``."""
    ttl_ms: int
    """How long the tick lock lives once taken."""
    when: str
    """The tick in words, for the logs: ``"cron minute 2026-12-02 06:00"``."""
    takes_over_after: float | None = None
    """For an interval's tick: how many seconds after its own last tick of the
    schedule a scheduler takes over the lock it took then. Half the interval:
    longer than between two alike schedules sent in one pass of taskiq's loop
    (those stay one schedule), shorter than to the loop's next tick."""


def tick_of(
    prefix: str, task: ScheduledTask, now: datetime, *, by_cron: bool | None = None
) -> Tick:
    """The tick of ``task`` that is due at ``now``.

    Args:
        prefix: The middleware's ``key_prefix``.
        task: The schedule.
        now: When the tick is due.
        by_cron: Whether the tick is its cron's (``None``: whenever the
            schedule has a cron); ``False`` for the interval's tick of a
            schedule that has both.

    Raises:
        TypeError: The schedule's arguments or labels cannot be fingerprinted.
    """
    interval = _seconds(task.interval)
    fields: dict[str, Any] = {
        "args": task.args,
        "kwargs": task.kwargs,
        "labels": _labels(task.labels),
        "task_id": task.task_id,
        "cron": task.cron,
        "cron_offset": _offset(task.cron_offset),
        "interval": interval,
        "time": None if task.time is None else _utc(task.time).isoformat(),
    }
    identity = schedule_fingerprint(task.task_name, fields)
    if by_cron is None:
        by_cron = task.cron is not None
    if by_cron and task.cron is not None:
        own = now.timestamp() + _shift(task.cron_offset, now)
        minute = math.floor(own / _MINUTE)
        label = datetime.fromtimestamp(minute * _MINUTE, tz=timezone.utc).strftime("%Y-%m-%d %H:%M")
        ttl_ms = math.ceil(((minute + 2) * _MINUTE - own) * 1000)
        return Tick(tick_key(prefix, f"{identity}:{minute}"), ttl_ms, f"cron minute {label}")
    if interval is not None:
        ttl_ms = max(round(interval * 1000) - INTERVAL_MARGIN_MS, INTERVAL_MARGIN_MS)
        return Tick(tick_key(prefix, identity), ttl_ms, f"interval {interval:g}s", interval / 2)
    return Tick(tick_key(prefix, identity), ONE_OFF_TTL_MS, f"time {fields['time']}")


@dataclass(frozen=True, slots=True)
class _CronSend:
    at: datetime
    """When this process sent the schedule on its cron's path."""
    first: bool
    """Sent with no send on that path before it in this process: the first
    pass of taskiq's loop, unless ``--skip-first-run`` made it the interval's."""


class CronPaths:
    """Which sends of schedules with both a cron and an interval are their cron's, in one process.

    taskiq's loop sends such a schedule on its cron's path when the cron is due
    (in its ``cron_offset``) and the loop's last send of that ``schedule_id``
    on that path is a minute or more ago, in whole seconds as taskiq rounds
    them; else on its interval's path. The loop keeps that last send to itself:
    this replays it from the sends the process makes, so that every replica
    names a send by the path its own loop took, whatever second of the minute
    its cron goes out at. The rule, for a send at ``now``:

    - the cron's tick, if the cron is due at ``now`` and this process sent no
      cron's tick of the schedule in the minute (rounded) before ``now``;
    - the interval's tick otherwise.

    ``taskiq scheduler --skip-first-run`` marks every cron sent at the start of
    the first minute without sending it: then the first send, which this takes
    for the cron's, was the interval's. The send after it tells: after a first
    cron's tick taskiq's loop sends the interval's at once (due since it never
    went out), before the interval has passed and before the next minute's
    cron could be due; otherwise that first send counts from the start of its
    minute, as taskiq counts it. Not replayed: a cron's tick that taskiq's loop
    skips because the schedule's previous send is still under way (the next
    send, an interval's, is taken for the cron's tick of that minute).
    """

    def __init__(self, remembered: int) -> None:
        """Remember the cron's sends of up to ``remembered`` schedules."""
        self._remembered = remembered
        self._sends: dict[str, _CronSend] = {}

    def by_cron(self, task: ScheduledTask, now: datetime) -> bool:
        """Whether taskiq's loop sends ``task`` at ``now`` on its cron's path (remembered if so)."""
        if task.cron is None:
            return False
        last = self._sends.get(task.schedule_id)
        if last is not None and last.first:
            last = _CronSend(_first_send(task, last.at, now), first=False)
            self._sends[task.schedule_id] = last
        try:
            due = is_cron_task_now(
                task.cron, now, task.cron_offset, None if last is None else last.at
            )
        except CronValueError:
            return False
        if due:
            self._remember(task.schedule_id, _CronSend(now, first=last is None))
        return due

    def _remember(self, schedule_id: str, send: _CronSend) -> None:
        self._sends.pop(schedule_id, None)
        if len(self._sends) >= self._remembered:
            # A send more than a minute old no longer holds the next one back.
            recent = send.at - timedelta(minutes=2)
            self._sends = {k: v for k, v in self._sends.items() if v.at >= recent}
            while len(self._sends) >= self._remembered:
                del self._sends[next(iter(self._sends))]
        self._sends[schedule_id] = send


def _first_send(task: ScheduledTask, at: datetime, now: datetime) -> datetime:
    """When taskiq's loop counts the first cron's send (at ``at``) made, seen from the next send.

    ``at`` itself when the next send (``now``) is the interval's that taskiq
    sends on the pass right after a first cron's tick (a second later); the
    start of ``at``'s minute when it is what ``--skip-first-run`` leaves: the
    interval come round, or the cron due again counted from that start. On
    the very next pass both could be, and taskiq's default (no skip) is taken.
    """
    passed = round((now - at).total_seconds())
    start = at.replace(second=0, microsecond=0)
    if passed <= _NEXT_PASS:
        return at
    interval = _seconds(task.interval)
    if interval is not None and passed >= round(interval):
        return start
    try:
        due_from_start = is_cron_task_now(task.cron or "", now, task.cron_offset, start)
    except CronValueError:
        return at
    return start if due_from_start else at


def _labels(labels: Mapping[str, Any]) -> dict[str, Any]:
    """The labels that say what a schedule is, as taskiq sends them.

    Not ``schedule_id``: taskiq's scheduler writes it into the schedule's own
    labels as it sends a tick, so a schedule would be another one from its
    second tick on (and a random one in each process for ``LabelScheduleSource``).
    Not ``types_of_exceptions``: taskiq never sends it (it holds classes).
    Values that are not plain data count as their ``str()``, which is how
    taskiq sends them.
    """
    return {
        name: value if isinstance(value, _PLAIN) else str(value)
        for name, value in labels.items()
        if name not in _NOT_WHAT
    }


def is_one_off(task: ScheduledTask) -> bool:
    """Whether ``task`` is a one-off: sent once, then gone from a source that deletes it."""
    return task.time is not None and task.cron is None and task.interval is None


def _seconds(interval: int | timedelta | None) -> float | None:
    if isinstance(interval, timedelta):
        return interval.total_seconds()
    return None if interval is None else float(interval)


def _offset(offset: str | timedelta | None) -> str | float | None:
    return offset.total_seconds() if isinstance(offset, timedelta) else offset


def _utc(time: datetime) -> datetime:
    # A naive time is UTC, as taskiq's scheduler reads it.
    if time.tzinfo is None:
        return time.replace(tzinfo=timezone.utc)
    return time.astimezone(timezone.utc)


def _shift(offset: str | timedelta | None, now: datetime) -> float:
    """Seconds from UTC to the schedule's own time at ``now``, as taskiq applies it."""
    if isinstance(offset, timedelta):
        return offset.total_seconds()
    if isinstance(offset, str):
        try:
            delta = now.astimezone(ZoneInfo(offset)).utcoffset()
        except (ZoneInfoNotFoundError, ModuleNotFoundError, ValueError):
            return 0.0  # taskiq's scheduler never finds such a schedule due
        return 0.0 if delta is None else delta.total_seconds()
    return 0.0
