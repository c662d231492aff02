"""What broke on the oldest versions pyproject admits: each works on every version.

These pass on any installed redis-py, pydantic and taskiq in the declared ranges;
they fail on the floors (``.ci/floors``) if the library uses an API that only
newer versions have.
"""

from __future__ import annotations

import uuid
import warnings

import pydantic
from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.model.fingerprint import call_fingerprint
from tests._brokers import BrokerFactory
from tests._middlewares import MiddlewareFactory


async def test_the_lock_life_cycle_uses_only_what_every_redis_py_has(
    make_middleware: MiddlewareFactory,
) -> None:
    # redis-py 5.0.1 to 5.2.1 require a command name in get_connection(); 5.3 on
    # deprecate passing one. A warning here is an error too.
    middleware = make_middleware()
    broker = InMemoryBroker().with_middlewares(middleware)

    @broker.task
    async def job() -> str:
        return "done"

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        await middleware.startup()
        try:
            task = await job.kiq()
            try:
                await job.kiq()
            except DuplicateTaskError:
                pass
            else:
                raise AssertionError("the second send was not refused")
            assert (await task.wait_result(timeout=5)).return_value == "done"
            await broker.wait_all()
            await job.kiq()  # released: accepted again
            await broker.wait_all()
        finally:
            await middleware.shutdown()


async def test_a_redis_dsn_of_any_pydantic_2_is_accepted(
    redis_url: str, make_broker: BrokerFactory, make_middleware: MiddlewareFactory
) -> None:
    # Before pydantic 2.10 RedisDsn is an Annotated alias, which isinstance() refuses.
    dsn = pydantic.TypeAdapter(pydantic.RedisDsn).validate_python(redis_url)
    middleware = make_middleware(redis_url=dsn)
    assert middleware._url == str(dsn)
    broker = await make_broker(middlewares=[middleware])

    @broker.task
    async def job() -> str:
        return "done"

    task = await job.kiq()
    assert (await task.wait_result(timeout=5)).return_value == "done"
    # A plain string goes through the same check.
    assert make_middleware(redis_url=redis_url)._url == redis_url


def test_a_uuid_fingerprints_like_its_string_on_every_pydantic() -> None:
    # pydantic-core before 2.4 (pydantic 2.0.x) cannot encode a UUID by itself.
    value = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert call_fingerprint("t", [value], {"id": value}) == call_fingerprint(
        "t", [str(value)], {"id": str(value)}
    )
