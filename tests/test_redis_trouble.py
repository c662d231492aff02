"""What the middleware does when its own Redis misbehaves (on a server of the test's own).

The fault-injection suite in ``tests/faults`` goes further; these tests pin down
the promise of the spec: errors after the message is queued are logged and
swallowed, and the lock expires on its TTL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.asyncio
from taskiq import (
    BrokerMessage,
    InMemoryBroker,
    SimpleRetryMiddleware,
    TaskiqMessage,
    TaskiqMiddleware,
)

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from tests._brokers import HoldingBroker
from tests._locks import without_done
from tests._server import Server

FAST = "?socket_timeout=0.5&socket_connect_timeout=0.5"


async def started(server: Server, **options: Any) -> HoldingBroker:
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(redis_url=server.url + FAST, **options)
    )
    await broker.startup()
    return broker


@pytest.mark.slow
async def test_errors_after_queueing_are_logged_and_swallowed(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await started(server, default_ttl=30)

    @broker.task
    async def job() -> str:
        return "result"

    handle = await job.kiq()
    server.stop()  # before the extension, the re-assert and the release
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await broker.deliver()
    assert (await handle.wait_result(timeout=5)).return_value == "result"
    text = caplog.text
    assert "Could not extend lock" in text
    assert "Could not re-assert lock" in text
    assert "Could not release lock" in text
    await broker.shutdown()


async def test_heartbeat_failures_are_retried_and_never_raise(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await started(server, default_ttl=2)
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")

    @broker.task
    async def slow() -> str:
        server.stop()
        await asyncio.sleep(2.0)  # two heartbeat intervals without Redis
        server.start()
        await asyncio.sleep(1.5)  # the heartbeat recovers and takes the lock back
        return "done"

    handle = await slow.kiq()
    await broker.deliver()
    assert (await handle.wait_result(timeout=5)).return_value == "done"
    assert "Could not refresh 1 deduplication lock" in caplog.text
    assert "had vanished; taken back" in caplog.text
    await broker.shutdown()


async def test_heartbeat_lets_go_of_a_lock_another_send_took(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await started(server, default_ttl=2)
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")

    @broker.task
    async def slow() -> None:
        (key,) = without_done(await client.keys("*"))
        await client.set(key, "othertoken other-task", px=10_000)
        await asyncio.sleep(1.5)  # past one refresh

    await slow.kiq()
    await broker.deliver()
    assert "is now held by task other-task; no longer refreshing it" in caplog.text
    (key,) = without_done(await client.keys("*"))
    assert await client.get(key) == "othertoken other-task"
    await client.aclose()
    await broker.shutdown()


async def test_a_restarted_server_loses_its_scripts_and_the_middleware_reloads_them(
    server: Server,
) -> None:
    broker = await started(server)

    @broker.task
    async def job(n: int) -> None: ...

    await job.kiq(n=0)
    server.restart()  # empty: no keys, no scripts
    await job.kiq(n=0)  # one call: reloaded, then sent again
    with pytest.raises(DuplicateTaskError):
        await job.kiq(n=0)
    client = redis.asyncio.Redis.from_url(server.url)
    await client.script_flush()
    await client.aclose()
    results = await asyncio.gather(*(job.kiq(n=i) for i in range(1, 50)))  # a pipelined batch
    assert len(results) == 49
    with pytest.raises(DuplicateTaskError):
        await job.kiq(n=10)
    await broker.shutdown()


async def test_a_kiq_cancelled_while_waiting_for_redis_leaves_no_lock(server: Server) -> None:
    broker = await started(server, default_ttl=60)
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)

    @broker.task
    async def job(n: int) -> None: ...

    server.pause()
    first = asyncio.ensure_future(job.kiq(n=1))  # on the wire, unanswered
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(job.kiq(n=2))  # queued behind it
    await asyncio.sleep(0.05)
    second.cancel()
    server.resume()
    await first
    with pytest.raises(asyncio.CancelledError):
        await second
    await broker.shutdown()  # sends the release queued for the cancelled send
    (key,) = without_done(await client.keys("*"))  # only the first send's lock
    assert str(await client.get(key)).endswith(first.result().task_id)
    assert len(broker.queued) == 1
    await client.aclose()


async def test_a_kiq_cancelled_mid_round_trip_leaves_at_most_a_grace_ttl_lock(
    server: Server,
) -> None:
    broker = await started(server, default_ttl=60)
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)

    @broker.task
    async def job() -> None: ...

    server.pause()
    sending = asyncio.ensure_future(job.kiq())
    await asyncio.sleep(0.1)  # the acquire is written, its reply cannot come
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    server.resume()
    await broker.shutdown()
    for key in await client.keys("*"):  # the acquire may still have run
        assert 0 < await client.pttl(key) <= 10_000
    assert broker.queued == []
    await job.kiq()  # the middleware goes on working on a new connection
    await broker.shutdown()
    await client.aclose()


async def test_cancelling_the_caller_that_sends_a_batch_loses_no_other_call(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    class PausingBroker(HoldingBroker):
        """Freezes Redis once the first message is queued, before its extension."""

        async def kick(self, message: BrokerMessage) -> None:
            await super().kick(message)
            if len(self.queued) == 1:
                server.pause()

    dedup = RedisDeduplicationMiddleware(redis_url=server.url + FAST, default_ttl=60)
    broker = PausingBroker().with_middlewares(dedup)
    await dedup.startup()
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")

    @broker.task
    async def job(n: int) -> None: ...

    first = await job.kiq(n=1)  # its extension is written ahead, unanswered
    second = asyncio.ensure_future(job.kiq(n=2))  # sends the next batch, with it
    await asyncio.sleep(0.1)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    server.resume()
    await dedup.shutdown()  # the first send's extension is sent again
    ttls = {str(await client.get(key)): await client.pttl(key) for key in await client.keys("*")}
    (first_ttl,) = [ttl for value, ttl in ttls.items() if value.endswith(first.task_id)]
    assert first_ttl > 10_000  # its full TTL, not the grace TTL
    assert "Could not extend" not in caplog.text
    await client.aclose()


async def test_an_event_loop_of_its_own_for_each_run() -> None:
    # A module-level broker used by several asyncio.run() calls, as in tests of
    # an application, must not reuse connections of a closed loop.
    server = Server().start()
    try:
        broker = HoldingBroker().with_middlewares(
            RedisDeduplicationMiddleware(redis_url=server.url)
        )

        @broker.task
        async def job(n: int) -> None: ...

        async def send(n: int) -> None:
            await job.kiq(n=n)
            await broker.deliver()

        await asyncio.get_running_loop().run_in_executor(None, asyncio.run, send(1))
        await asyncio.get_running_loop().run_in_executor(None, asyncio.run, send(2))
        client = redis.asyncio.Redis.from_url(server.url)
        assert without_done(await client.keys("*")) == []
        await client.aclose()
    finally:
        server.cleanup()


class _RefuseScriptsForRetries(TaskiqMiddleware):
    """Takes the scripts from the middleware's Redis user while a retry is sent.

    Placed before the deduplication middleware, its ``pre_send`` runs before the
    retry's acquire and its ``post_send`` after it: that one acquire fails with a
    Redis error (no permission), and Redis works again for everything after it.
    """

    def __init__(self, admin: redis.asyncio.Redis, user: str) -> None:
        super().__init__()
        self.admin = admin
        self.user = user
        self.refused = 0

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        if "_retries" in message.labels:
            self.refused += 1
            await self.admin.acl_setuser(self.user, commands=["-evalsha", "-eval"])
        return message

    async def post_send(self, message: TaskiqMessage) -> None:
        await self.admin.acl_setuser(self.user, commands=["+evalsha", "+eval"])


async def _fail_open_as_a_user_of_its_own(
    server: Server,
) -> tuple[redis.asyncio.Redis, _RefuseScriptsForRetries, RedisDeduplicationMiddleware]:
    """A fail-open middleware on a Redis user whose scripts a retry's send takes away."""
    admin = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    await admin.acl_setuser(
        "dedup", enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all"]
    )
    url = server.url.replace("redis://", "redis://dedup:secret@", 1) + FAST
    dedup = RedisDeduplicationMiddleware(redis_url=url, default_ttl=120, fail_open=True)
    return admin, _RefuseScriptsForRetries(admin, "dedup"), dedup


@pytest.mark.parametrize("retry_first", [True, False], ids=["retry-first", "dedup-first"])
async def test_a_fail_open_retry_that_went_out_without_a_lock_frees_the_old_one(
    server: Server, retry_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    admin, refuse, dedup = await _fail_open_as_a_user_of_its_own(server)
    retry = SimpleRetryMiddleware(default_retry_count=3)
    # A held queue, as a real broker is: each run starts in a context of its own.
    broker = HoldingBroker().with_middlewares(
        *([retry, refuse, dedup] if retry_first else [refuse, dedup, retry])
    )
    runs: list[str] = []

    @broker.task(retry_on_error=True)
    async def job(n: int) -> None:
        runs.append("run")
        if len(runs) == 1:
            raise RuntimeError("the first attempt fails")

    await broker.startup()
    try:
        await job.kiq(n=1)
        with caplog.at_level(logging.WARNING, logger="taskiq_deduplication"):
            await broker.receiver.callback(message=broker.queued.pop(0).message)
        assert refuse.refused == 1
        assert "sending it without a lock (fail_open)" in caplog.text
        assert len(broker.queued) == 1  # the retry, queued without a lock
        # The first attempt released its own lock, since the retry holds none:
        # nothing is left to refuse the next call for two minutes.
        assert await admin.keys("taskiq:deduplication:*") == []
        await broker.deliver()
        assert runs == ["run", "run"]
        await job.kiq(n=1)
    finally:
        await broker.shutdown()
        await admin.aclose()


async def test_a_fail_open_retry_run_in_memory_leaves_the_first_run_to_itself(
    server: Server,
) -> None:
    # InMemoryBroker starts the retry from inside the failing run, so the retry's
    # run inherits a copy of its context: it must not take the first run for its own.
    admin, refuse, dedup = await _fail_open_as_a_user_of_its_own(server)
    broker = InMemoryBroker().with_middlewares(
        SimpleRetryMiddleware(default_retry_count=3), refuse, dedup
    )
    runs: list[str] = []

    @broker.task(retry_on_error=True)
    async def job(n: int) -> None:
        runs.append("run")
        await asyncio.sleep(0.05)  # the retry's run starts before this one ends
        if len(runs) == 1:
            raise RuntimeError("the first attempt fails")

    await broker.startup()
    try:
        await job.kiq(n=1)
        while broker._running_tasks:
            await broker.wait_all()  # raises if a hook of either run raised
        assert runs == ["run", "run"]
        assert await admin.keys("taskiq:deduplication:*") == []
    finally:
        await broker.shutdown()
        await admin.aclose()


@pytest.mark.parametrize("fail_open", [True, False])
async def test_a_reply_that_is_not_text_is_a_redis_failure_like_any_other(
    server: Server, caplog: pytest.LogCaptureFixture, *, fail_open: bool
) -> None:
    """A value under the lock's key that is not UTF-8 (another writer's), on a client that decodes.

    redis-py cannot decode the script's reply: the lock store's boundary makes
    that a Redis failure like an unreachable server, so ``fail_open`` sends the
    call without its lock, and without it the send fails with the error (found
    in review: it escaped the boundary, past ``fail_open``).
    """
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    broker = HoldingBroker().with_middlewares(
        middleware := RedisDeduplicationMiddleware(client=client, fail_open=fail_open)
    )
    await broker.startup()

    @broker.task(deduplication_key="report")
    async def job() -> None: ...

    key = middleware.locks.key_for(job)
    assert key is not None
    raw = redis.asyncio.Redis.from_url(server.url)
    await raw.set(key, b"\xff\xfe not text", px=60_000)
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    try:
        if fail_open:
            await job.kiq()
            assert "sending it without a lock (fail_open)" in caplog.text
            assert "UnicodeDecodeError" in caplog.text
        else:
            with pytest.raises(UnicodeDecodeError):
                await job.kiq()
        assert await raw.get(key) == b"\xff\xfe not text"  # another writer's value, untouched
    finally:
        await broker.shutdown()
        await raw.aclose()
        await client.aclose()
