"""Schedules under deduplication: each tick of a schedule sent once across replicas.

`schedulers.py` holds the scheduler and the schedule source that take a tick
lock before they send; `ticks.py` says what a tick is (its name, the key of its
lock, how long that lives).
"""

from taskiq_deduplication.scheduler.schedulers import (
    DeduplicatedScheduleSource,
    DeduplicationScheduler,
)

__all__ = ["DeduplicatedScheduleSource", "DeduplicationScheduler"]
