"""Fixtures of the fault suite: a server of each test's own, a proxy, brokers, logs.

Every fault test starts its own throwaway server (never the session's shared
one), so that it can stop, pause and restart it. Each broker is shut down and
each server and proxy ended when the test ends, whatever happened in it.

The suite measures how long the middleware takes to recover from each fault;
``tests/conftest.py`` prints the measurements in the terminal summary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from taskiq import TaskiqMiddleware

from tests._middlewares import MiddlewareFactory
from tests._recoveries import RECOVERY_PROPERTY
from tests._server import Server
from tests._teardown import owned
from tests.faults._harness import LogRecords, RecordingBroker
from tests.faults._proxy import Proxy

# How long the end of a test waits for the tasks it left running.
_TASK_GRACE = 5.0
# The longest a broker's shutdown may take, even with Redis gone.
_SHUTDOWN_LIMIT = 10.0

#: Fast failure for every middleware that talks to a fault-injected server.
FAST = "socket_timeout=0.5&socket_connect_timeout=0.5&timeout=1"


@pytest.fixture
async def proxy(server: Server) -> AsyncIterator[Proxy]:
    """A proxy to this test's server, which the test can cut and restore."""
    own = await Proxy(server.port).start()
    try:
        yield own
    finally:
        await own.close()


@pytest.fixture
def logs() -> Iterator[LogRecords]:
    """Every record the library logs during the test, down to DEBUG."""
    yield from owned(LogRecords().attach(), LogRecords.detach)


BrokerMaker = Callable[..., Awaitable[RecordingBroker]]


@pytest.fixture
async def make_recording_broker(
    make_middleware: MiddlewareFactory,
) -> AsyncIterator[BrokerMaker]:
    """Build started recording brokers with one deduplication middleware each.

    ``await make_recording_broker(url, hold=..., kick_error=..., on_kick=..., start=True,
    **options)``; ``options`` go to the middleware (``key_prefix`` defaults to this
    test's prefix). Every broker is shut down at the end of the test.
    """
    brokers: list[RecordingBroker] = []

    async def make(
        url: str,
        *,
        hold: bool = False,
        kick_error: Exception | None = None,
        on_kick: Any = None,
        start: bool = True,
        extra: tuple[TaskiqMiddleware, ...] = (),
        **options: Any,
    ) -> RecordingBroker:
        broker = RecordingBroker(hold=hold, kick_error=kick_error, on_kick=on_kick)
        broker.with_middlewares(*extra, make_middleware(redis_url=url, **options))
        brokers.append(broker)
        if start:
            await broker.startup()
        return broker

    yield make
    stuck = 0
    for broker in brokers:
        await _stop_tasks(broker)
        shutdown = asyncio.ensure_future(broker.shutdown())
        done, _ = await asyncio.wait({shutdown}, timeout=_SHUTDOWN_LIMIT)
        if done:
            shutdown.result()
        else:
            shutdown.cancel()
            stuck += 1
    if stuck:
        pytest.fail(f"{stuck} broker.shutdown() did not return within {_SHUTDOWN_LIMIT}s")


@pytest.fixture
def make_fast_broker(make_recording_broker: BrokerMaker, server: Server) -> BrokerMaker:
    """``make_recording_broker`` on this test's own server, failing fast (``FAST``).

    ``await make_fast_broker(**options)`` takes the same options, all but the URL.
    """

    async def make(**options: Any) -> RecordingBroker:
        return await make_recording_broker(f"{server.url}?{FAST}", **options)

    return make


async def _stop_tasks(broker: RecordingBroker) -> None:
    """Let the broker's running tasks end; cancel those a failed test left waiting.

    ``asyncio.wait`` rather than ``wait_for``: taskiq's receiver may swallow a
    cancellation, and ``wait_for`` would then wait for ever.
    """
    running = set(broker._running_tasks)
    if not running:
        return
    _, pending = await asyncio.wait(running, timeout=_TASK_GRACE)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=_TASK_GRACE)


#: The ``recovery`` fixture: ``recovery(what, seconds)`` records a recovery time.
Recovery = Callable[[str, float], None]


@pytest.fixture
def recovery(request: pytest.FixtureRequest) -> Recovery:
    """Record how long the middleware took to recover from the fault of this test.

    The measurement travels with the test's report (as a user property), so that
    ``tests/conftest.py`` prints it at the end of the run, in the process that
    reports, also when pytest-xdist runs the test in a worker process.
    """

    def record(what: str, seconds: float) -> None:
        request.node.user_properties.append((RECOVERY_PROPERTY, (what, seconds)))

    return record
