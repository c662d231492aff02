"""Prometheus metrics on lock events (the ``metrics`` extra: ``prometheus_client``).

The metrics live in ``prometheus_client``'s default registry, so the ``/metrics``
that shows taskiq's own shows them too. That registry refuses a name twice, so
they are made once per process and shared by every middleware that records.

``prometheus_client`` is imported when the first middleware starts, not when it
is built: taskiq's ``PrometheusMiddleware`` sets ``PROMETHEUS_MULTIPROC_DIR``
in its constructor, and ``prometheus_client`` reads it once, on import, to pick
between in-process and multi-process values. Imported later, the metrics of a
``taskiq worker`` with several processes land in the directory its ``/metrics``
collects. The gauge counts up and down (no callback), which works in both modes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from taskiq_deduplication.observe.events import LockEvent, LockEventKind

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

_SENDS: Final = {
    LockEventKind.LOCKED: "locked",
    LockEventKind.DUPLICATE: "duplicate",
    LockEventKind.MERGED: "merged",
    LockEventKind.JOINED: "joined",
    LockEventKind.FAIL_OPEN: "fail_open",
    LockEventKind.OFF: "off",
}
_LOCK_EVENTS: Final = {
    LockEventKind.RELEASED: "released",
    LockEventKind.TAKEN_BACK: "taken_back",
    LockEventKind.LOST: "lost",
    LockEventKind.WAITING: "waiting",
    LockEventKind.SKIPPED: "skipped",
    LockEventKind.LIMITED: "limited",
    LockEventKind.WAITED: "waited",
}


@dataclass(frozen=True, slots=True)
class Metrics:
    """The process's deduplication metrics."""

    sends: Any
    lock_events: Any
    held_locks: Any
    redis_seconds: Any
    limit_slots: Any
    limit_waiting: Any
    limit_wait_seconds: Any
    _counters: dict[tuple[LockEventKind, str], Any] = field(default_factory=dict, repr=False)
    """The labelled counter of each event kind and task name, looked up once."""

    def record(self, event: LockEvent) -> None:
        """Count ``event``: a subscriber of every middleware that records metrics."""
        counter = self._counters.get((event.kind, event.task_name))
        if counter is None:
            counter = self._counter(event.kind, event.task_name)
            if counter is None:
                return
        counter.inc()

    def _counter(self, kind: LockEventKind, task_name: str) -> Any:  # noqa: ANN401 (a prometheus child)
        """The counter that counts events of ``kind`` for ``task_name``, if one does."""
        outcome = _SENDS.get(kind)
        if outcome is not None:
            counter = self.sends.labels(task_name, outcome)
        elif kind in _LOCK_EVENTS:
            counter = self.lock_events.labels(task_name, _LOCK_EVENTS[kind])
        else:
            return None
        # Bounded by the task names the process knows, times the event kinds.
        self._counters[kind, task_name] = counter
        return counter

    def held(self, change: int) -> None:
        """Count ``change`` more (or fewer) locks kept alive by a heartbeat."""
        self.held_locks.inc(change)

    def slots(self, change: int) -> None:
        """Count ``change`` more (or fewer) slots of limits held by this process's runs."""
        self.limit_slots.inc(change)

    def waiting(self, change: int) -> None:
        """Count ``change`` more (or fewer) runs of this process that wait for their limit."""
        self.limit_waiting.inc(change)

    def waited(self, seconds: float) -> None:
        """Record how long a run waited for its limit before it started."""
        self.limit_wait_seconds.observe(seconds)

    @property
    def round_trip(self) -> Callable[[float], None]:
        """Record the seconds of one Redis round trip."""
        observe: Callable[[float], None] = self.redis_seconds.observe
        return observe


_made = threading.Lock()
_metrics: Metrics | None = None
_unavailable = False


def process_metrics() -> Metrics | None:
    """The metrics of this process, made on first call; ``None`` without ``prometheus_client``."""
    global _metrics, _unavailable  # noqa: PLW0603 (one set of metrics per process, by design)
    with _made:
        if _metrics is not None or _unavailable:
            return _metrics
        try:
            import prometheus_client  # noqa: PLC0415 (optional, imported on first use)
        except ImportError:
            _unavailable = True
            return None
        try:
            _metrics = Metrics(
                sends=prometheus_client.Counter(
                    "taskiq_deduplication_sends",
                    "Sends (kiq) seen by the deduplication middleware, by outcome",
                    ["task_name", "outcome"],
                ),
                lock_events=prometheus_client.Counter(
                    "taskiq_deduplication_lock_events",
                    "What happened to the locks of running tasks",
                    ["task_name", "event"],
                ),
                held_locks=prometheus_client.Gauge(
                    "taskiq_deduplication_held_locks",
                    "Locks of running tasks that this process keeps alive",
                    multiprocess_mode="livesum",
                ),
                redis_seconds=prometheus_client.Histogram(
                    "taskiq_deduplication_redis_seconds",
                    "Time of each Redis round trip of the lock pipeline (one batch)",
                    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
                ),
                limit_slots=prometheus_client.Gauge(
                    "taskiq_deduplication_limit_slots",
                    "Slots of limits (limit_concurrency) held by this process's runs",
                    multiprocess_mode="livesum",
                ),
                limit_waiting=prometheus_client.Gauge(
                    "taskiq_deduplication_limit_waiting",
                    "Runs of this process that wait for their limit before they start",
                    multiprocess_mode="livesum",
                ),
                limit_wait_seconds=prometheus_client.Histogram(
                    "taskiq_deduplication_limit_wait_seconds",
                    "How long each run that waited for its limit waited",
                    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 3600),
                ),
            )
        except ValueError as exc:  # the names are taken in the default registry
            logger.warning("Deduplication metrics are off: %s", exc)
            _unavailable = True
        return _metrics
