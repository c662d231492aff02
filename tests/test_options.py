"""Constructor options: their defaults, the ready-client option, and bad values."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.asyncio
from pydantic import RedisDsn

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from tests._brokers import BrokerFactory, HoldingBroker
from tests._middlewares import client_of
from tests._server import free_port


def test_defaults_are_the_documented_ones() -> None:
    middleware = RedisDeduplicationMiddleware(redis_url="redis://localhost:6379")
    assert middleware.default_deduplication is True
    assert middleware.default_ttl == 300
    assert middleware.key_prefix == "taskiq:deduplication"
    assert middleware.startup_retries == 3
    assert middleware.startup_retry_delay == 1.0
    assert middleware.heartbeat is True
    assert middleware.heartbeat_interval is None
    assert middleware.fail_open is False
    assert middleware.running_ttl is None


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("default_deduplication", "yes"),
        ("default_ttl", 0),
        ("default_ttl", -1),
        ("default_ttl", 1.5),
        ("default_ttl", True),
        ("default_ttl", "300"),
        ("key_prefix", ""),
        ("key_prefix", 5),
        ("startup_retries", 0),
        ("startup_retries", 2.0),
        ("startup_retry_delay", -1),
        ("startup_retry_delay", float("nan")),
        ("startup_retry_delay", "1"),
        ("heartbeat", 1),
        ("heartbeat_interval", 0),
        ("heartbeat_interval", -2),
        ("heartbeat_interval", "20"),
        ("heartbeat_interval", 300),
        ("fail_open", None),
    ],
)
def test_invalid_option_raises_naming_it(option: str, value: object) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        RedisDeduplicationMiddleware(redis_url="redis://localhost:6379", **options)


@pytest.mark.parametrize("url", ["", "http://localhost:6379", "localhost:6379", 6379])
def test_invalid_url_raises_naming_it(url: Any) -> None:
    with pytest.raises(ValueError, match="redis_url"):
        RedisDeduplicationMiddleware(redis_url=url)


def test_exactly_one_of_url_and_client() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        RedisDeduplicationMiddleware()
    client = redis.asyncio.Redis()
    with pytest.raises(ValueError, match="exactly one"):
        RedisDeduplicationMiddleware(redis_url="redis://localhost", client=client)
    with pytest.raises(ValueError, match="client"):
        RedisDeduplicationMiddleware(client="redis://localhost")  # type: ignore[arg-type]


async def test_redis_dsn_is_accepted(redis_url: str, prefix: str) -> None:
    middleware = RedisDeduplicationMiddleware(redis_url=RedisDsn(redis_url), key_prefix=prefix)
    broker = HoldingBroker().with_middlewares(middleware)
    await broker.startup()

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    await broker.shutdown()


async def test_client_built_from_the_url_has_timeouts(redis_url: str) -> None:
    middleware = RedisDeduplicationMiddleware(redis_url=redis_url)
    await middleware.startup()
    kwargs = client_of(middleware).connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 5.0
    assert kwargs["socket_connect_timeout"] == 5.0
    await middleware.shutdown()

    tuned = RedisDeduplicationMiddleware(redis_url=f"{redis_url}?socket_timeout=0.5")
    await tuned.startup()
    kwargs = client_of(tuned).connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.5
    await tuned.shutdown()


async def test_a_ready_client_is_used_and_left_open(redis_url: str, prefix: str) -> None:
    # decode_responses=True: the middleware reads replies as str as well as bytes.
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(client=client, key_prefix=prefix)
    )
    await broker.startup()

    @broker.task
    async def job() -> None: ...

    sent = await job.kiq()
    with pytest.raises(DuplicateTaskError) as caught:
        await job.kiq()
    assert caught.value.holder_task_id == sent.task_id
    (key,) = [k async for k in client.scan_iter(match=f"{prefix}:*")]
    assert str(await client.get(key)).endswith(sent.task_id)
    await broker.shutdown()
    assert await client.ping()  # still usable: the middleware did not close it
    await client.delete(key)
    await client.aclose()


async def test_startup_retries_with_backoff_then_raises_connection_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=0.2"
    middleware = RedisDeduplicationMiddleware(
        redis_url=url, startup_retries=3, startup_retry_delay=0.05
    )
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    with pytest.raises(ConnectionError, match="3 attempt") as caught:
        await middleware.startup()
    assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
    retries = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert len(retries) == 2  # a warning before each of the two retries
    assert "retrying in 0.1s" in retries[1]  # 0.05 * 2**1
    await middleware.shutdown()


async def test_startup_succeeds_once_redis_answers(redis_url: str) -> None:
    middleware = RedisDeduplicationMiddleware(redis_url=redis_url, startup_retries=1)
    await middleware.startup()
    await middleware.startup()  # a second startup (another broker role) is harmless
    await middleware.shutdown()
    await middleware.shutdown()


async def test_nothing_is_left_running_in_the_event_loop_after_shutdown(
    make_broker: BrokerFactory,
) -> None:
    before = asyncio.all_tasks()
    broker = await make_broker(default_ttl=3)

    @broker.task
    async def job(n: int) -> None:
        await asyncio.sleep(0.05)

    await asyncio.gather(*(job.kiq(n=i) for i in range(20)))
    await broker.wait_all()
    await broker.shutdown()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()


async def test_hooks_work_without_startup(redis_url: str, prefix: str) -> None:
    # InMemoryBroker users sometimes forget broker.startup(); the lock still works.
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(redis_url=redis_url, key_prefix=prefix)
    )

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    await broker.deliver()
    await broker.shutdown()
