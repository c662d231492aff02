"""What a new user meets first (issue 31): typos refused, quiet refusals, named locks.

Each test here failed on the version the issue was filed against.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis.asyncio
from taskiq import InMemoryBroker

import taskiq_deduplication
from taskiq_deduplication import DuplicateTaskError, InvalidSettingError
from taskiq_deduplication.model.formats import read_lock_value
from tests._brokers import HoldingBroker
from tests._locks import lock_keys, lock_value
from tests._middlewares import MiddlewareFactory


async def test_a_misspelt_label_at_the_call_site_is_refused_naming_the_right_one(
    broker: HoldingBroker,
) -> None:
    @broker.task
    async def report(n: int) -> None: ...

    with pytest.raises(InvalidSettingError, match=r"did you mean 'deduplication_ttl'\?"):
        await report.kicker().with_labels(deduplication_tll=5).kiq(1)
    assert broker.queued == []  # nothing locked, nothing sent
    await report.kicker().with_labels(deduplication_ttl=5).kiq(1)
    assert len(broker.queued) == 1


async def test_a_broker_used_without_startup_checks_its_tasks_at_the_first_kiq(
    make_middleware: MiddlewareFactory,
) -> None:
    broker = HoldingBroker().with_middlewares(make_middleware())

    @broker.task(deduplication_tll=60)
    async def report(n: int) -> None: ...

    @broker.task
    async def other(n: int) -> None: ...

    for _ in range(2):  # every kiq, until the labels are fixed
        with pytest.raises(ValueError, match=r"report: unknown label 'deduplication_tll'"):
            await other.kiq(1)
    assert broker.queued == []
    await broker.shutdown()


async def test_a_refused_duplicate_is_one_info_line_on_a_logger_of_its_own(
    broker: HoldingBroker, caplog: pytest.LogCaptureFixture
) -> None:
    @broker.task
    async def report(n: int) -> None: ...

    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    first = await report.kiq(1)
    caplog.clear()
    for _ in range(5):  # a double-click burst
        with pytest.raises(DuplicateTaskError):
            await report.kiq(1)
    said = [(r.name, r.levelname) for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [("taskiq_deduplication.refusals", "INFO")] * 5
    assert all(first.task_id in r.getMessage() for r in caplog.records if r.levelno)
    # Silencing refusals leaves every other logger of the library as it was.
    logging.getLogger("taskiq_deduplication.refusals").setLevel(logging.WARNING)
    try:
        caplog.clear()
        with pytest.raises(DuplicateTaskError):
            await report.kiq(1)
        assert [r for r in caplog.records if r.name.endswith("refusals")] == []
    finally:
        logging.getLogger("taskiq_deduplication.refusals").setLevel(logging.NOTSET)


#: The loggers that keep the short names the docs give them, not their modules'.
DOCUMENTED_LOGGERS = {
    "observe/refusals.py": "taskiq_deduplication.refusals",
    "observe/events.py": "taskiq_deduplication.events",
    "scheduler/schedulers.py": "taskiq_deduplication.scheduler",
}


def test_every_module_logs_on_a_logger_named_for_it() -> None:
    """The issue: refusals and Redis warnings shared one logger, so silencing one silenced both.

    Each module of every folder logs on its own logger: named for the module, or,
    for the three the docs name, by that name.
    """
    package = Path(taskiq_deduplication.__path__[0])
    named = {
        str(path.relative_to(package)): line
        for path in sorted(package.rglob("*.py"))
        for line in path.read_text("utf-8").splitlines()
        if line.startswith("logger = logging.getLogger(")
    }
    assert len(named) > 10, named
    expected = {
        module: f'logger = logging.getLogger("{DOCUMENTED_LOGGERS[module]}")'
        if module in DOCUMENTED_LOGGERS
        else "logger = logging.getLogger(__name__)"
        for module in named
    }
    assert named == expected
    assert len(set(named.values())) == len(DOCUMENTED_LOGGERS) + 1


@pytest.mark.parametrize("record", [None, False])
async def test_a_lock_records_its_task_name_by_default(
    make_middleware: MiddlewareFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    record: bool | None,
) -> None:
    options = {} if record is None else {"record_task_name": record}
    broker = InMemoryBroker().with_middlewares(make_middleware(**options))
    await broker.startup()

    @broker.task
    async def build_report(n: int) -> None: ...

    try:
        # "expired" keeps the lock after the run, for the test to read.
        await build_report.kicker().with_labels(deduplication_until="expired").kiq(1)
        await broker.wait_all()
        (key,) = await lock_keys(redis_client, prefix)
        info = read_lock_value(await lock_value(redis_client, key))
        assert info is not None
        assert info.task_name == (None if record is False else build_report.task_name)
    finally:
        await broker.shutdown()
