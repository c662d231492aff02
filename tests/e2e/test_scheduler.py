"""``taskiq scheduler`` with a schedule label: every second, for a task that runs three.

The ticks that come while the task runs are duplicates: the scheduler logs each
one it skips and keeps going, and the task never runs twice at once, also when
every send of the schedule has the same fixed task_id.
"""

from __future__ import annotations

import itertools

import pytest

from tests.e2e.app import FIXED_TASK_ID, SCHEDULED_RUN_SECONDS
from tests.e2e.conftest import Launch


@pytest.mark.parametrize("schedule", ["random-id", "fixed-id"])
async def test_task_scheduled_every_second_never_runs_twice_at_once(
    launch: Launch, schedule: str
) -> None:
    app = await launch(broker="redis-list", schedule=schedule)
    app.start_worker()
    scheduler = app.start_scheduler()

    async def two_runs_finished() -> bool:
        return await app.counter("finished", "scheduled") >= 2

    await app.wait_until(two_runs_finished, "two scheduled runs to finish", timeout=30)
    skipped = [line for line in scheduler.log().splitlines() if "not sent" in line]
    started = await app.started("scheduled")
    holders = await app.holders()

    assert scheduler.popen.poll() is None, "the scheduler stopped"
    assert await app.counter("overlaps", "scheduled") == 0, "two runs overlapped"
    for earlier, later in itertools.pairwise(started):
        assert later["at"] - earlier["at"] >= SCHEDULED_RUN_SECONDS
    task_ids = [run["task_id"] for run in started]
    if schedule == "fixed-id":
        assert set(task_ids) == {FIXED_TASK_ID}
    else:
        assert len(set(task_ids)) == len(task_ids)
    # Each tick during a run was skipped, and the log says which task held the lock.
    assert len(skipped) >= 2, scheduler.log()
    for line in skipped:
        assert any(
            f"duplicate of task {task_id}" in line for task_id in {*task_ids, *holders.values()}
        ), line
