"""Several ``taskiq scheduler`` processes, and restarts: each tick of a schedule is sent once.

Two real scheduler processes run the same schedules (``LabelScheduleSource``,
which gives the schedule another ``schedule_id`` in each process) with a
``DeduplicationScheduler`` or a ``TaskiqScheduler`` on
``DeduplicatedScheduleSource``; a worker runs the quick scheduled task and
counts each run in Redis, the ledger. Each scheduler logs every tick it finds
due ("Sending task ...") and then which replica sent it.
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime, timezone

import pytest

from tests.e2e.app import TICKED
from tests.e2e.conftest import App, Launch, Process

_DUE = "Sending task e2e.ticked "
_SENT = re.compile(r"of scheduled task e2e\.ticked \(schedule \w+\): sending from replica (\S+)")
_NOT_SENT = re.compile(
    r"of scheduled task e2e\.ticked \(schedule \w+\): not sent here, replica (\S+) sent it"
)


def due(process: Process) -> int:
    """How many ticks ``process`` has found due so far."""
    return process.log().count(_DUE)


def sent(process: Process) -> list[str]:
    """The replicas named by each tick that ``process`` sent."""
    return _SENT.findall(process.log())


def not_sent(process: Process) -> list[str]:
    """The replicas named by each tick that ``process`` found sent already."""
    return _NOT_SENT.findall(process.log())


def decided(process: Process) -> int:
    """How many ticks ``process`` has sent or left to another replica."""
    return len(sent(process)) + len(not_sent(process))


def assert_clean(*schedulers: Process) -> None:
    """No traceback, nothing left unretrieved, no error in any scheduler's log."""
    for scheduler in schedulers:
        log = scheduler.log()
        for banned in ("Traceback", "never retrieved", "[ERROR", "[WARNING"):
            assert banned not in log, log


async def wait_decided(app: App, ticks: int, *schedulers: Process, timeout: float = 30) -> None:
    """Wait until each of ``schedulers`` has decided ``ticks`` ticks."""

    async def done() -> bool:
        return all(decided(scheduler) >= ticks for scheduler in schedulers)

    await app.wait_until(done, f"each scheduler to decide {ticks} tick(s)", timeout=timeout)


async def wait_runs(app: App, runs: int) -> None:
    """Wait until the ledger has ``runs`` runs of the scheduled task."""

    async def enough() -> bool:
        return await app.runs(TICKED) >= runs

    await app.wait_until(enough, f"{runs} run(s) of the scheduled task")


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["dedup", "wrapped"])
async def test_two_schedulers_send_each_interval_tick_once(launch: Launch, kind: str) -> None:
    app = await launch(broker="redis-list", ticks="interval")
    app.start_worker()
    first = app.start_scheduler(kind=kind)
    second = app.start_scheduler(kind=kind)

    # Each finds a tick due every 2 s: six each (twelve in all) in about 12 s.
    async def six_each() -> bool:
        return due(first) >= 6 and due(second) >= 6

    await app.wait_until(six_each, "six ticks due in each scheduler", timeout=45)
    runs = await app.runs(TICKED)
    found = (due(first), due(second))
    # One run per tick, not one per tick and scheduler (twice as many).
    assert runs <= max(found) + 1, (runs, found, app.processes.logs())

    # Every tick found due ends in one line, naming the replica that sent it.
    await wait_decided(app, max(found), first, second)
    for scheduler in (first, second):
        assert set(sent(scheduler)) <= {replica_of(scheduler)}
        assert set(not_sent(scheduler)) <= {replica_of(first), replica_of(second)}
    sends = len(sent(first)) + len(sent(second))
    await wait_runs(app, sends)
    assert await app.runs(TICKED) <= len(sent(first)) + len(sent(second))
    assert_clean(first, second)


def replica_of(process: Process) -> str:
    """How the logs name the scheduler process ``process``: ``<host>/<pid>``."""
    replicas = {*sent(process), *not_sent(process)}
    own = {name for name in replicas if name.endswith(f"/{process.pid}")}
    return own.pop() if own else f"?/{process.pid}"


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_two_schedulers_and_a_restart_send_each_cron_minute_once(launch: Launch) -> None:
    app = await launch(broker="redis-list", ticks="cron")
    app.start_worker()
    # The restart below must come within the minute the schedulers start in:
    # start before its second 20, leaving 40 s for two starts and a restart
    # on a loaded machine (at most 40 s of waiting for the next minute).
    if (into_minute := datetime.now(timezone.utc).second) >= 20:
        await asyncio.sleep(60.5 - into_minute)
    minute = datetime.now(timezone.utc).replace(second=0, microsecond=0)
    # One scheduler of each kind: they share the tick locks.
    first = app.start_scheduler(kind="dedup")
    second = app.start_scheduler(kind="wrapped")

    # Started within a cron minute, taskiq's scheduler sends its tick at once.
    await wait_decided(app, 1, first, second)
    await wait_runs(app, 1)
    second.kill()
    restarted = app.start_scheduler(kind="dedup")
    await wait_decided(app, 1, restarted)
    assert datetime.now(timezone.utc).replace(second=0, microsecond=0) == minute
    assert not_sent(restarted), restarted.log()
    assert await app.runs(TICKED) == 1

    # The next minute: one tick again, sent once.
    await wait_decided(app, 2, first, restarted, timeout=75)
    await wait_runs(app, 2)
    assert len(sent(first)) + len(sent(second)) + len(sent(restarted)) == 2
    assert await app.runs(TICKED) == 2
    assert_clean(first, second, restarted)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["dedup", "wrapped"])
async def test_a_one_off_is_sent_once_across_schedulers_and_restarts(
    launch: Launch, kind: str
) -> None:
    # A one-off written in code, its time past: every scheduler start finds it due.
    app = await launch(broker="redis-list", ticks="one-off", one_off_at=time.time() - 1)
    app.start_worker()
    first = app.start_scheduler(kind=kind)
    second = app.start_scheduler(kind=kind)
    await wait_decided(app, 1, first, second)
    await wait_runs(app, 1)

    first.kill()
    second.kill()
    restarted = [app.start_scheduler(kind=kind), app.start_scheduler(kind=kind)]
    await wait_decided(app, 1, *restarted)
    assert [len(not_sent(scheduler)) for scheduler in restarted] == [1, 1]
    assert await app.runs(TICKED) == 1
    assert_clean(first, second, *restarted)
