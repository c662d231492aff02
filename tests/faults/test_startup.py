"""Fault 1: Redis is down when the broker starts."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import Any

import pytest
import redis.exceptions

from taskiq_deduplication import DeduplicationError
from tests._server import Server, free_port
from tests._tasks import echo_task
from tests.faults._harness import LogRecords
from tests.faults.conftest import FAST, BrokerMaker, Recovery

pytestmark = pytest.mark.timeout(30)

_RETRYING = re.compile(r"attempt (\d+) of (\d+).*retrying in ([\d.]+)s")


async def failed_startup(
    make_recording_broker: BrokerMaker, **options: Any
) -> tuple[pytest.ExceptionInfo[ConnectionError], float]:
    """Start a broker whose Redis is a port nothing listens on; it must fail.

    Returns:
        The error, and when the startup began (``time.monotonic()``).
    """
    dead = f"redis://127.0.0.1:{free_port()}/0?{FAST}"
    broker = await make_recording_broker(dead, start=False, **options)
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        await broker.startup()
    return caught, started


async def test_startup_retries_with_backoff_then_raises_connection_error(
    make_recording_broker: BrokerMaker, logs: LogRecords
) -> None:
    caught, started = await failed_startup(
        make_recording_broker, startup_retries=4, startup_retry_delay=0.1
    )
    elapsed = time.monotonic() - started

    # The builtin ConnectionError (what the spec promises), not redis-py's own,
    # which is no subclass of it, and one of the library's errors; the last
    # Redis error is chained.
    assert isinstance(caught.value, DeduplicationError)
    assert not isinstance(caught.value, redis.exceptions.RedisError)
    assert "4 attempt" in str(caught.value)
    assert isinstance(caught.value.__cause__, (redis.exceptions.RedisError, OSError))

    retrying = [r for r in logs.records if _RETRYING.search(r.getMessage())]
    # One warning before each retry: 4 attempts, 3 waits of 0.1, 0.2, 0.4 s.
    found = [_RETRYING.search(r.getMessage()) for r in retrying]
    assert [(int(m[1]), int(m[2]), float(m[3])) for m in found if m] == [
        (1, 4, 0.1),
        (2, 4, 0.2),
        (3, 4, 0.4),
    ]
    gaps = [b.created - a.created for a, b in itertools.pairwise(retrying)]
    assert gaps[0] >= 0.1 * 0.9
    assert gaps[1] >= 0.2 * 0.9
    assert gaps[1] > gaps[0]  # the backoff grows
    # 0.7 s of backoff in total; generous bound for the refused connects around it.
    assert 0.7 * 0.9 <= elapsed < 6.0


async def test_startup_with_one_attempt_does_not_wait(
    make_recording_broker: BrokerMaker, logs: LogRecords
) -> None:
    _, started = await failed_startup(
        make_recording_broker, startup_retries=1, startup_retry_delay=5.0
    )
    assert time.monotonic() - started < 4.0  # no 5 s wait after the only attempt
    assert logs.warnings("retrying") == []


async def test_redis_coming_up_during_the_retries_lets_startup_succeed(
    make_recording_broker: BrokerMaker, logs: LogRecords, recovery: Recovery
) -> None:
    server = Server()  # not started yet: its port refuses connections
    try:
        broker = await make_recording_broker(
            f"{server.url}?{FAST}", start=False, startup_retries=8, startup_retry_delay=0.1
        )
        startup = asyncio.create_task(broker.startup())
        await asyncio.sleep(0.5)  # a few failed attempts
        assert not startup.done()
        await asyncio.to_thread(server.start)
        up_at = time.monotonic()
        await asyncio.wait_for(startup, timeout=15)
        recovery("startup: server up -> startup() returns", time.monotonic() - up_at)
        assert len(logs.warnings("retrying")) >= 2

        work = echo_task(broker)

        handle = await work.kiq(x=1)
        assert (await handle.wait_result(timeout=5)).return_value == 1
    finally:
        server.cleanup()


async def test_startup_against_a_server_that_answers_late_is_bounded(
    make_recording_broker: BrokerMaker, server: Server
) -> None:
    # A hung server at startup: every PING times out, the retries still end.
    server.pause()
    broker = await make_recording_broker(
        f"{server.url}?{FAST}", start=False, startup_retries=2, startup_retry_delay=0.1
    )
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        await broker.startup()
    assert time.monotonic() - started < 8.0
    assert isinstance(caught.value.__cause__, (redis.exceptions.RedisError, OSError, TimeoutError))
