"""Deduplication for taskiq: the same task is never queued or run twice at once.

Register [RedisDeduplicationMiddleware][taskiq_deduplication.RedisDeduplicationMiddleware]
on the broker; a ``kiq()`` whose task is already queued or running raises
[DuplicateTaskError][taskiq_deduplication.DuplicateTaskError].
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

from taskiq_deduplication.__about__ import __version__

if TYPE_CHECKING:
    from taskiq_deduplication.calls import JoinedTask, TaskLock, kiq_or_join
    from taskiq_deduplication.exceptions import (
        BacklogFullError,
        CallTimeoutError,
        DeduplicationError,
        DuplicateTaskError,
        InvalidArgumentError,
        InvalidSettingError,
        MissingMiddlewareError,
        NoLockError,
        PipelineClosedError,
        ResultLostError,
        StartupError,
        UnencodableCallError,
        UnfingerprintableError,
        WorkerStartError,
    )
    from taskiq_deduplication.locks import LimitInfo, LockInfo, Locks
    from taskiq_deduplication.middleware import RedisDeduplicationMiddleware
    from taskiq_deduplication.observe.events import LockEvent, LockEventKind
    from taskiq_deduplication.scheduler import DeduplicatedScheduleSource, DeduplicationScheduler

__all__ = [
    "BacklogFullError",
    "CallTimeoutError",
    "DeduplicatedScheduleSource",
    "DeduplicationError",
    "DeduplicationScheduler",
    "DuplicateTaskError",
    "InvalidArgumentError",
    "InvalidSettingError",
    "JoinedTask",
    "LimitInfo",
    "LockEvent",
    "LockEventKind",
    "LockInfo",
    "Locks",
    "MissingMiddlewareError",
    "NoLockError",
    "PipelineClosedError",
    "RedisDeduplicationMiddleware",
    "ResultLostError",
    "StartupError",
    "TaskLock",
    "UnencodableCallError",
    "UnfingerprintableError",
    "WorkerStartError",
    "__version__",
    "kiq_or_join",
]

# Where each public name lives. They are imported when first used: every
# `taskiq` command loads `taskiq dedup` (an entry point), and its start should
# not pay for the middleware and the Redis client when it needs neither.
_MODULES: Final = {
    "BacklogFullError": "exceptions",
    "CallTimeoutError": "exceptions",
    "DeduplicatedScheduleSource": "scheduler",
    "DeduplicationError": "exceptions",
    "DeduplicationScheduler": "scheduler",
    "DuplicateTaskError": "exceptions",
    "InvalidArgumentError": "exceptions",
    "InvalidSettingError": "exceptions",
    "JoinedTask": "calls",
    "LimitInfo": "locks",
    "LockEvent": "observe.events",
    "LockEventKind": "observe.events",
    "LockInfo": "locks",
    "Locks": "locks",
    "MissingMiddlewareError": "exceptions",
    "NoLockError": "exceptions",
    "PipelineClosedError": "exceptions",
    "RedisDeduplicationMiddleware": "middleware",
    "ResultLostError": "exceptions",
    "StartupError": "exceptions",
    "TaskLock": "calls",
    "UnencodableCallError": "exceptions",
    "UnfingerprintableError": "exceptions",
    "WorkerStartError": "exceptions",
    "kiq_or_join": "calls",
}


def __getattr__(name: str) -> object:
    """Import the public name ``name`` from its module on first use."""
    module = _MODULES.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names, as if they were imported already."""
    return sorted({*globals(), *__all__})
