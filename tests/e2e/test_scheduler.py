"""``taskiq scheduler`` with a schedule label: every second, for a task that runs three.

The ticks that come while the task runs are duplicates: the scheduler logs each
one it skips and keeps going, and the task never runs twice at once, also when
every send of the schedule has the same fixed task_id. With the
``DeduplicationScheduler`` of the docs, each skipped tick is one INFO line.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from taskiq_deduplication.model.formats import holder_task_id
from tests.e2e.app import FIXED_TASK_ID, SCHEDULED_RUN_SECONDS
from tests.e2e.conftest import REPO, Launch
from tests.test_docs_examples import _check_output


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


# The scheduler of docs/examples/scheduler/: a refused tick is one INFO line.

QUIET_APP = REPO / "docs" / "examples" / "scheduler"
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\[(?P<level>\w+)\s*\]\[[^\]]*\] ", re.MULTILINE)
_REFUSED = "not sent (schedule sales-report)"


def _without_prefixes(log: str) -> str:
    """The log with each line's time and code location cut, its level kept."""
    return _LOG_PREFIX.sub(r"[\g<level>] ", log)


@pytest.mark.timeout(60)
def test_a_refused_tick_of_the_deduplication_scheduler_is_one_info_line(
    redis_url: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    def clean() -> None:
        client.delete("reports", *client.scan_iter(match="reports:dedup:*"))

    clean()
    log_path = tmp_path / "scheduler.log"
    with log_path.open("wb") as out:
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "taskiq", "scheduler", "reports:scheduler"],
            cwd=QUIET_APP,
            env={**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        # The third refusal comes a tick after the second one's send ended and
        # was collected, which is when "Task exception was never retrieved" shows.
        while log_path.read_text().count(_REFUSED) < 3:
            assert scheduler.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        log = log_path.read_text()
        (key,) = client.scan_iter(match="reports:dedup:*")
        holder = holder_task_id(str(client.get(key)))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(scheduler.pid, signal.SIGKILL)
        scheduler.wait(timeout=10)
        clean()
        client.close()

    lines = _without_prefixes(log).splitlines()
    assert all(line.startswith("[INFO] ") for line in lines), log
    for banned in ("Traceback", "never retrieved", "DuplicateTaskError", "a duplicate of task"):
        assert banned not in log, log
    sends = [line for line in lines if line.startswith("[INFO] Sending task")]
    refusals = [line for line in lines if _REFUSED in line]
    # Each tick after the first is refused, in one line that names the holder.
    assert len(refusals) >= 3, log
    assert len(sends) - len(refusals) in {1, 2}, log  # 2: a tick was being sent at the end
    for line in refusals:
        assert f"reports:build_sales_report {_REFUSED}: task {holder} still holds" in line, line
    # The docs show the log up to the second refusal.
    second = [index for index, line in enumerate(lines) if _REFUSED in line][1]
    _check_output(QUIET_APP / "reports.py", "\n".join(lines[: second + 1]) + "\n")
