"""What a refused, joined or merged call logs, on a logger of its own.

A refusal is the library working, not trouble: one INFO line per refused call
on the ``taskiq_deduplication.refusals`` logger (this module's), naming the
task, its task_id, the lock key and the holder, never the arguments. Silence
it, or raise it, without touching the warnings about Redis and locks that the
other loggers under ``taskiq_deduplication`` carry.

A caller that handles and logs the refusal itself (the
[DeduplicationScheduler][taskiq_deduplication.DeduplicationScheduler]) sets
`HANDLED` around its ``kiq``, and the refusal is logged at DEBUG level only.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Final

#: Named for what it logs, not for the module: a documented name (docs/usage.md).
logger = logging.getLogger("taskiq_deduplication.refusals")

#: Whether the ``kiq`` running in this context has its refusals handled by its caller.
HANDLED: Final[ContextVar[bool]] = ContextVar("taskiq_deduplication_refusal_handled", default=False)


def refused(task_name: str, task_id: str, holder: str | None, key: str, *, why: str) -> None:
    """Say that the call ``task_id`` was not sent: ``holder`` holds its lock ``key``.

    ``holder`` is the holder's task_id, with whether its send was accepted yet;
    ``why`` ends the line (whether the call's arguments differ).
    """
    logger.log(
        logging.DEBUG if HANDLED.get() else logging.INFO,
        "Task %s (%s) not sent: a duplicate of task %s, which holds lock %r%s",
        task_name,
        task_id,
        holder,
        key,
        why,
    )


def joined(task_name: str, task_id: str, holder: str | None, key: str, *, why: str) -> None:
    """Say that the call ``task_id`` joined ``holder`` instead (`kiq_or_join`)."""
    logger.log(
        logging.DEBUG if HANDLED.get() else logging.INFO,
        "Task %s (%s) joined task %s, which holds lock %r%s",
        task_name,
        task_id,
        holder,
        key,
        why,
    )


def merged(task_name: str, task_id: str, holder: str | None, key: str) -> None:
    """Say that the call ``task_id`` gave its arguments to ``holder``, queued under ``key``."""
    logger.info(
        "Task %s (%s) not sent: its arguments replaced those of task %s, queued with lock %r",
        task_name,
        task_id,
        holder,
        key,
    )
