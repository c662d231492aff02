"""The lean way on a redis-py connection: the bytes it writes, and how it reads the replies.

What ``store/wire/connection.py`` does itself where redis-py's public API would:
pack a batch (the bytes redis-py would send), and read every reply that has
arrived from the connection's stream at once (parsed by ``store/wire/resp.py``,
whose own tests are ``tests/test_reply_parser.py``), with the errors redis-py
would raise.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from redis._parsers import _AsyncRESP3Parser
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import BusyLoadingError, InvalidResponse
from redis.exceptions import ConnectionError as RedisConnectionError

from taskiq_deduplication.store.wire.connection import _Connection, _pack, _reads_replies_itself
from taskiq_deduplication.store.wire.probe import WIRE_ENV
from taskiq_deduplication.store.wire.resp import MAX_DEPTH, parse_replies
from tests.test_reply_parser import PUSH, RESP3_REPLIES, UNRECOVERABLE, same


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_packed_lock_calls_are_the_bytes_redis_py_sends(encoding: str) -> None:
    connection = redis.asyncio.Redis(encoding=encoding).connection_pool.make_connection()  # type: ignore[no-untyped-call]
    commands = [
        ("EVALSHA", "a" * 40, 2, "taskiq:deduplication:é", "fence", "tok task-1", 30_000, 0, -1),
        ("EVAL", "return redis.call('GET', KEYS[1])", 1, "k" * 70_000),  # past redis-py's chunking
        ("SCRIPT", "LOAD", "return 1"),
    ]
    assert _pack(connection, commands) == [b"".join(connection.pack_commands(commands))]


@pytest.mark.parametrize("value", [True, 1.5, None])
def test_an_argument_of_another_type_is_refused_by_name(value: object) -> None:
    connection = redis.asyncio.Redis().connection_pool.make_connection()  # type: ignore[no-untyped-call]
    with pytest.raises(TypeError, match=type(value).__name__):
        _pack(connection, [("EVALSHA", "a" * 40, 0, value)])


def test_replies_come_from_the_parser_only_where_read_response_is_redis_pys_own() -> None:
    for plain in (Connection, SSLConnection, UnixDomainSocketConnection):
        assert _reads_replies_itself(plain)
    # A demoted master's READONLY must reach the Sentinel connection's own reader,
    # which reconnects to the new master.
    assert not _reads_replies_itself(SentinelManagedConnection)


def _reading(chunks: list[bytes], unread: int) -> tuple[Any, Any]:
    """A pipeline connection with ``unread`` replies due, and a redis-py connection to read."""
    client = redis.asyncio.Redis()
    connection: Any = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    connection._reader = stream = asyncio.StreamReader()

    async def arrive() -> None:  # each chunk after a turn of the event loop, as from a socket
        for chunk in chunks:
            await asyncio.sleep(0)
            stream.feed_data(chunk)
        await asyncio.sleep(0)
        stream.feed_eof()

    pipeline_connection = _Connection(client)
    pipeline_connection._unread = unread
    asyncio.get_running_loop().create_task(arrive())
    return pipeline_connection, connection


async def test_replies_that_arrive_in_pieces_are_read_as_they_come() -> None:
    data = b"".join(RESP3_REPLIES)
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    reading, connection = _reading(chunks, len(RESP3_REPLIES))
    replies: list[Any] = []
    await reading._read_lean(connection, replies)
    whole = parse_replies(data, len(RESP3_REPLIES), None, _AsyncRESP3Parser.parse_error)[0]
    same(replies, whole)
    assert (reading._unread, reading._rest) == (0, b"")


async def test_an_error_reply_that_means_the_connection_is_done_is_raised() -> None:
    # As redis-py raises it: a server that is loading its data answers nothing else.
    reading, connection = _reading([b":1\r\n", b"-LOADING Redis is loading the dataset\r\n"], 2)
    replies: list[Any] = []
    with pytest.raises(BusyLoadingError):
        await reading._read_lean(connection, replies)
    assert replies == [1]


async def test_a_push_on_the_lock_connection_goes_to_the_connections_push_handler() -> None:
    reading, connection = _reading([b":1\r\n" + PUSH, b":0\r\n"], 2)
    handled: list[Any] = []

    async def handler(push: Any) -> None:
        handled.append(push)

    connection._parser.handle_push_response = handler
    replies: list[Any] = []
    await reading._read_lean(connection, replies)
    assert replies == [1, 0]
    assert handled == [[b"MIGRATING", 17, {b"slots": 30}]]


async def test_a_connection_closed_before_every_reply_came_is_a_connection_error() -> None:
    reading, connection = _reading([b":1\r\n$5\r\nab"], 3)
    replies: list[Any] = []
    with pytest.raises(RedisConnectionError, match="closed"):
        await reading._read_lean(connection, replies)
    assert replies == [1]


#: A script whose reply is ``1`` in ARGV[1] arrays, one inside the other.
_NESTED = "local reply = 1 for _ = 1, tonumber(ARGV[1]) do reply = {reply} end return reply"


def _nested_value(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture
async def lean_connection(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[_Connection]:
    """The pipeline's connection to the test Redis, the lean way."""
    monkeypatch.delenv(WIRE_ENV, raising=False)
    client = redis.asyncio.Redis.from_url(redis_url)
    transport = _Connection(client)
    try:
        yield transport
    finally:
        await transport.close()
        await client.aclose()


async def test_a_reply_from_redis_nested_too_deep_fails_its_batch_and_drops_the_connection(
    lean_connection: _Connection,
) -> None:
    replies = await lean_connection.execute([("EVAL", _NESTED, 0, MAX_DEPTH)])
    assert replies == [_nested_value(MAX_DEPTH)]
    held = lean_connection._held
    assert held is not None
    assert lean_connection._lean, "the probe did not pick the lean way"

    with pytest.raises(InvalidResponse, match=f"more than {MAX_DEPTH} levels") as failed:
        await lean_connection.execute([("EVAL", _NESTED, 0, MAX_DEPTH + 1), ("PING",)])
    # What redis-py's own connection drops itself for, after such bytes.
    assert isinstance(failed.value, UNRECOVERABLE)
    # The reply after it was never read: the connection is dropped, not reused.
    assert lean_connection._held is None
    assert not held.is_connected

    # The next batch goes on a new connection, and is read right.
    assert await lean_connection.execute([("EVAL", _NESTED, 0, 2)]) == [[[1]]]
