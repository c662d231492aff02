"""A ``taskiq scheduler`` whose refused ticks are one line of log, not a traceback.

taskiq's scheduler sends each due schedule in an asyncio task of its own and
never looks at how it ended, so a ``DuplicateTaskError`` from that send (a tick
that comes while the run of an earlier tick is still queued or running) surfaces
as asyncio's "Task exception was never retrieved" and a traceback.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from taskiq import TaskiqScheduler

from taskiq_deduplication import _refusals
from taskiq_deduplication.exceptions import DuplicateTaskError

if TYPE_CHECKING:
    from taskiq import ScheduledTask, ScheduleSource

__all__ = ["DeduplicationScheduler"]

logger = logging.getLogger(__name__)


class DeduplicationScheduler(TaskiqScheduler):
    """A ``TaskiqScheduler`` that skips a tick whose task is a duplicate, quietly.

    A tick refused by
    [RedisDeduplicationMiddleware][taskiq_deduplication.RedisDeduplicationMiddleware]
    is logged as one INFO line that names the task, its schedule and the task
    holding the lock, and the scheduler goes on; every other error of a send
    is left as taskiq leaves it. Use it where you use ``TaskiqScheduler``:

    Example:
        ```python
        scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])
        ```
    """

    async def on_ready(self, source: ScheduleSource, task: ScheduledTask) -> None:
        """Send the task of a due schedule; a duplicate is logged and skipped.

        Args:
            source: The schedule source of the schedule.
            task: The schedule that is due.
        """
        handled = _refusals.HANDLED.set(True)
        try:
            await super().on_ready(source, task)
        except DuplicateTaskError as refused:
            logger.info(
                "Scheduled task %s not sent (schedule %s): task %s still holds its lock %r",
                task.task_name,
                task.schedule_id,
                refused.holder_task_id,
                refused.key,
            )
        finally:
            _refusals.HANDLED.reset(handled)
