"""DeduplicationScheduler: a refused tick is one INFO line; kiq elsewhere is unchanged.

The real ``taskiq scheduler`` process is in tests/e2e/test_scheduler.py; this is
the same hook called in process, next to an ordinary ``kiq`` of the same call.
"""

from __future__ import annotations

import logging

import pytest
from taskiq import ScheduledTask
from taskiq.schedule_sources import LabelScheduleSource

from taskiq_deduplication import DeduplicationScheduler, DuplicateTaskError
from tests._brokers import BrokerFactory
from tests._tasks import held_report


async def test_a_refused_tick_is_logged_once_at_info_and_a_plain_kiq_still_raises(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await make_broker()
    report, gate = held_report(broker)

    scheduler = DeduplicationScheduler(broker, sources=[LabelScheduleSource(broker)])
    tick = ScheduledTask(
        task_name="report",
        labels={},
        args=[],
        kwargs={"day": "mon"},
        cron="0 6 * * *",
        schedule_id="daily",
    )
    first = await report.kiq(day="mon")
    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    try:
        await scheduler.on_ready(scheduler.sources[0], tick)
        said = [r for r in caplog.records if r.levelno >= logging.INFO]
        # The tick's own lock, then the task's lock that refused it.
        assert [r.levelname for r in said] == ["INFO", "INFO"]
        assert all(r.name == "taskiq_deduplication.scheduler" for r in said)
        assert said[0].getMessage().startswith("Tick (cron minute ")
        assert "report" in said[1].getMessage()
        assert "daily" in said[1].getMessage()
        assert first.task_id in said[1].getMessage()

        caplog.clear()
        with pytest.raises(DuplicateTaskError) as refused:
            await report.kiq(day="mon")
        assert refused.value.holder_task_id == first.task_id
        # A plain kiq's refusal: one INFO line on the refusals' logger (issue 31).
        plain = [(r.name, r.levelname) for r in caplog.records if r.levelno >= logging.INFO]
        assert plain == [("taskiq_deduplication.refusals", "INFO")]
    finally:
        gate.finish.set()
