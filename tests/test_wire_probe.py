"""The probe that picks the way through redis-py: lean where redis-py allows it, else public.

The ``redis_wire`` fixture (with ``tests/_wires.py``) runs the pipeline's own
tests on both ways; these check the choice itself, on the connections of the
redis-py installed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
import redis.asyncio.connection
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.store.wire.probe import WIRE_ENV, misfit_of
from tests._brokers import BrokerFactory, HoldingBroker

#: The parser redis-py picks by itself (hiredis, or its RESP2 or RESP3 parser,
#: by version): redis-py 8's maintenance notifications refuse its RESP2 parser,
#: and redis-py 5's RESP3 parser misreads replies on a RESP2 connection.
DefaultParser: type[Any] = redis.asyncio.connection.DefaultParser


class ParserOfANewerRedisPy(DefaultParser):  # type: ignore[misc] # a class picked at import
    """A parser whose ``read_response`` takes an argument the lean way does not pass.

    What a redis-py release that reads replies differently looks like to the
    probe; redis-py itself always passes ``disable_decoding``, so it still works.
    """

    async def read_response(self, disable_decoding: bool, **more: Any) -> Any:
        return await super().read_response(disable_decoding=disable_decoding, **more)


@pytest.mark.parametrize("parser", ["default", "RESP2", "RESP3"])
def test_the_lean_way_fits_redis_pys_own_connections(parser: str) -> None:
    options: dict[str, Any] = {}
    if parser != "default":
        options["parser_class"] = _AsyncRESP2Parser if parser == "RESP2" else _AsyncRESP3Parser
    connection = redis.asyncio.ConnectionPool(**options).make_connection()  # type: ignore[no-untyped-call]
    assert misfit_of(connection) == ""


@pytest.fixture
async def newer_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A client whose connections read with :class:`ParserOfANewerRedisPy`."""
    client = redis.asyncio.Redis.from_url(redis_url, parser_class=ParserOfANewerRedisPy)
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_connection_the_lean_way_does_not_fit_sends_through_the_public_api(
    newer_client: redis.asyncio.Redis,
    make_broker: BrokerFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WIRE_ENV, raising=False)
    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    broker = await make_broker(broker_class=HoldingBroker, client=newer_client)

    @broker.task
    async def send_email(user_id: int) -> None: ...

    await send_email.kiq(user_id=42)
    with pytest.raises(DuplicateTaskError):
        await send_email.kiq(user_id=42)
    await send_email.kiq(user_id=43)
    assert len(broker.queued) == 2

    told = [r for r in caplog.records if "public API" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in told] == [
        (
            logging.DEBUG,
            (
                "Lock calls go through redis-py's public API on Connection connections "
                "(parser ParserOfANewerRedisPy): it has no _parser with a read_response() coroutine"
            ),
        )
    ]
