"""Deduplication for taskiq: the same task is never queued or run twice at once.

Register [RedisDeduplicationMiddleware][taskiq_deduplication.RedisDeduplicationMiddleware]
on the broker; a ``kiq()`` whose task is already queued or running raises
[DuplicateTaskError][taskiq_deduplication.DuplicateTaskError].
"""

from taskiq_deduplication.__about__ import __version__
from taskiq_deduplication.calls import JoinedTask, TaskLock, kiq_or_join
from taskiq_deduplication.events import LockEvent, LockEventKind
from taskiq_deduplication.exceptions import DeduplicationError, DuplicateTaskError, NoLockError
from taskiq_deduplication.middleware import RedisDeduplicationMiddleware
from taskiq_deduplication.scheduler import DeduplicationScheduler

__all__ = [
    "DeduplicationError",
    "DeduplicationScheduler",
    "DuplicateTaskError",
    "JoinedTask",
    "LockEvent",
    "LockEventKind",
    "NoLockError",
    "RedisDeduplicationMiddleware",
    "TaskLock",
    "__version__",
    "kiq_or_join",
]
