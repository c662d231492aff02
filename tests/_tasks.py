"""Tasks that the test holds open: each run starts, then waits until the test lets it end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from taskiq import AsyncBroker


@dataclass
class Gate:
    """What a held task's runs wait on: ``started`` once ``expected`` runs began, ``finish``."""

    expected: int = 1
    begun: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    finish: asyncio.Event = field(default_factory=asyncio.Event)

    async def run_through(self) -> None:
        """A run's body: count it as begun, then wait until the test sets ``finish``."""
        self.begun += 1
        if self.begun >= self.expected:
            self.started.set()
        await self.finish.wait()


def held_task(broker: AsyncBroker, task_name: str | None = None) -> tuple[Any, Gate]:
    """Register ``work(x)``, which returns ``x`` once its gate's ``finish`` is set.

    Returns:
        The task (``await work.kiq(x=1)``) and its gate.
    """
    gate = Gate()

    async def work(x: int) -> int:
        await gate.run_through()
        return x

    return broker.register_task(work, task_name=task_name), gate


async def held_run(broker: AsyncBroker) -> tuple[Any, Gate, Any]:
    """Register ``held_task``'s ``work(x)``, send ``work(x=1)`` and return once it runs.

    Returns:
        The task, its gate (set ``finish`` to end the run) and the running call's handle.
    """
    work, gate = held_task(broker)
    handle = await work.kiq(x=1)
    await asyncio.wait_for(gate.started.wait(), 5)
    return work, gate, handle


def held_slow(broker: AsyncBroker) -> tuple[Any, Gate]:
    """Register ``slow()``, which takes no argument and ends once its gate's ``finish`` is set."""
    gate = Gate()

    async def slow() -> None:
        await gate.run_through()

    return broker.register_task(slow), gate


def held_report(broker: AsyncBroker, **labels: Any) -> tuple[Any, Gate]:
    """Register ``report(day)`` (task name ``"report"``), which ends once ``finish`` is set.

    ``labels`` go on the task (a ``schedule``, say).
    """
    gate = Gate()

    async def report(day: str) -> None:
        await gate.run_through()

    return broker.register_task(report, task_name="report", **labels), gate


async def all_running(broker: AsyncBroker, count: int) -> tuple[Any, asyncio.Event]:
    """Send ``count`` distinct calls of ``job(n)`` and return once every one of them runs.

    Returns:
        The task and the event that lets every run end.
    """
    gate = Gate(expected=count)

    async def job(n: int) -> None:
        await gate.run_through()

    task = broker.register_task(job)
    await asyncio.gather(*(task.kiq(n=i) for i in range(count)))
    await gate.started.wait()
    return task, gate.finish


def echo_task(broker: AsyncBroker) -> Any:
    """Register ``work(x)``, which returns ``x`` at once."""

    async def work(x: int) -> int:
        return x

    return broker.register_task(work)


async def warmed_echo(broker: AsyncBroker) -> Any:
    """``echo_task``, run once: the middleware's connection to Redis is open (warm)."""
    work = echo_task(broker)
    await (await work.kiq(x=0)).wait_result(timeout=5)
    return work
