"""Storms: 8 client processes, each firing 100 concurrent sends at the same moment.

With one task and one set of arguments, exactly one of the 800 sends is
accepted and the task runs once; every other caller is told who holds the lock.
With 800 different arguments, every send is accepted and each task runs once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from taskiq import AsyncTaskiqTask

from tests.e2e.client import STORM_TAG
from tests.e2e.conftest import App, Launch

CLIENTS = 8
SENDS = 100


async def _storm(
    launch: Launch, broker_kind: str, mode: str
) -> tuple[App, list[dict[str, list[Any]]]]:
    """Launch the app and its worker, run the storm; return the app and what each client saw."""
    app = await launch(broker=broker_kind)
    app.start_worker()
    clients = [
        app.start_client(f"storm-{i}", "storm", str(i), str(SENDS), mode) for i in range(CLIENTS)
    ]

    async def all_ready() -> bool:
        return len(await app.report("ready")) == CLIENTS

    await app.wait_until(all_ready, "every storm client to start", timeout=60)
    async with app.redis.pipeline(transaction=False) as pipe:  # one go for all
        for i in range(CLIENTS):
            pipe.rpush(app.config.key("go", i), "go")
        await pipe.execute()

    async def all_reported() -> list[str]:
        reports = await app.report("storm")
        return reports if len(reports) == CLIENTS else []

    reports = await app.wait_until(all_reported, "every storm client to report", timeout=60)
    for client in clients:
        assert client.wait(timeout=20) == 0, client.log()
    return app, [json.loads(report) for report in reports]


@pytest.mark.slow
async def test_storm_of_identical_sends_accepts_one_and_runs_it_once(
    launch: Launch, broker_kind: str
) -> None:
    app, reports = await _storm(launch, broker_kind, "same")

    assert [error for report in reports for error in report["errors"]] == []
    accepted = [task_id for report in reports for task_id in report["accepted"]]
    assert len(accepted) == 1
    holders = [holder for report in reports for holder in report["holders"]]
    assert holders == accepted * (CLIENTS * SENDS - 1)

    await app.wait_started(STORM_TAG)
    await app.open_gate(STORM_TAG)
    winner = AsyncTaskiqTask[Any](accepted[0], app.broker.result_backend)
    assert not (await winner.wait_result(timeout=20)).is_err
    assert await app.runs(STORM_TAG) == 1
    assert await app.locks() == {}


@pytest.mark.slow
async def test_storm_of_distinct_sends_accepts_all_and_runs_each_once(
    launch: Launch, broker_kind: str
) -> None:
    app, reports = await _storm(launch, broker_kind, "distinct")

    assert [error for report in reports for error in report["errors"]] == []
    assert [holder for report in reports for holder in report["holders"]] == []
    accepted = [task_id for report in reports for task_id in report["accepted"]]
    assert len(set(accepted)) == CLIENTS * SENDS

    async def all_ran() -> dict[int, int]:
        counts = await app.redis.hgetall(app.config.key("count"))
        return (
            {int(n): int(runs) for n, runs in counts.items()}
            if len(counts) == CLIENTS * SENDS
            else {}
        )

    runs = await app.wait_until(all_ran, "every task to run", timeout=40)
    assert runs == dict.fromkeys(range(CLIENTS * SENDS), 1)
    await app.wait_no_locks()
