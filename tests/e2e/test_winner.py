"""Waiting for the winner across processes, exactly as the spec's recipe says.

One client process sends a task; callers in another process are rejected as
duplicates, build a handle to the winner from ``holder_task_id`` and get the
winner's result from the shared ``RedisAsyncResultBackend``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from taskiq import AsyncTaskiqTask

from taskiq_deduplication import DuplicateTaskError
from tests.e2e.conftest import Launch


async def test_rejected_callers_wait_for_the_winners_result(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind)
    app.start_worker()
    app.start_client("winner", "winner", "w")

    async def winner_task_id() -> list[str]:
        return await app.report("winner")

    [winner_id] = await app.wait_until(winner_task_id, "the winner's send")
    await app.wait_started("w")

    async def recipe() -> AsyncTaskiqTask[Any]:
        try:
            handle = await app.tasks.hold.kiq(tag="w")
        except DuplicateTaskError as err:
            if err.holder_task_id is None:
                raise  # the lock was released in the meantime; retry the kiq() instead
            handle = AsyncTaskiqTask(err.holder_task_id, app.broker.result_backend)
        return handle

    handles = await asyncio.gather(*(recipe() for _ in range(3)))
    assert {handle.task_id for handle in handles} == {winner_id}

    await app.open_gate("w")
    results = await asyncio.gather(*(handle.wait_result(timeout=20) for handle in handles))

    async def winner_result() -> list[str]:
        return await app.report("winner-result")

    [seen] = await app.wait_until(winner_result, "the winner's result")
    seen_by_winner = json.loads(seen)
    assert [result.return_value for result in results] == [seen_by_winner] * 3
    assert seen_by_winner["run"] == 1
    assert await app.runs("w") == 1
