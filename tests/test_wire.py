"""What the lock pipeline does on the wire itself: the bytes and replies redis-py would give."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis._parsers.encoders import Encoder
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import BusyLoadingError, InvalidResponse, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError

from taskiq_deduplication._redis_wire import _Connection, _pack, _reads_replies_itself
from taskiq_deduplication._resp import parse_replies


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


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


#: Replies of every type a lock script (or SCRIPT LOAD) gets back, as Redis
#: sends them on either protocol, then only on RESP2 and only on RESP3.
_BOTH = [
    b":1\r\n",
    b":-12345678901234\r\n",
    _bulk("tok task-1 é".encode()),
    _bulk(b""),
    b"+OK\r\n",
    b"*3\r\n:1\r\n:0\r\n" + _bulk(b""),
    b"*3\r\n:3\r\n:4999\r\n" + _bulk(b"~abcdefghij task-2 +"),
    b"*2\r\n*2\r\n:1\r\n" + _bulk(b"a") + b"*0\r\n",
    b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
    b"-ERR Error running script (call to f_x): @user_script:1: boom\r\n",
]
_RESP2 = [*_BOTH, b"$-1\r\n", b"*-1\r\n"]
_RESP3 = [
    *_BOTH,
    b"_\r\n",
    b"#t\r\n",
    b",1.5\r\n",
    b"(3492890328409238509324850943850943825\r\n",
    b"%2\r\n+a\r\n:1\r\n" + _bulk(b"b") + b"~2\r\n:1\r\n:2\r\n",
    b"=8\r\ntxt:hi\r\n\r\n",
    b"!9\r\nERR boom!\r\n",
]


async def _redis_pys_reading(protocol: int, data: bytes, count: int, *, decode: bool) -> list[Any]:
    """What redis-py's own parser for ``protocol`` makes of ``data``: ``count`` replies."""
    parser: Any = (_AsyncRESP3Parser if protocol == 3 else _AsyncRESP2Parser)(65536)
    stream = asyncio.StreamReader()
    stream.feed_data(data)
    parser._stream = stream
    parser.encoder = Encoder("utf-8", "strict", decode_responses=decode)  # type: ignore[no-untyped-call]
    parser._connected = True
    return [await parser.read_response() for _ in range(count)]


def _same(ours: list[Any], theirs: list[Any]) -> None:
    assert [(type(reply), str(reply)) for reply in ours] == [
        (type(reply), str(reply)) for reply in theirs
    ]


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("protocol", [2, 3])
async def test_replies_are_read_as_redis_pys_parser_reads_them(protocol: int, decode: bool) -> None:
    replies_sent = _RESP3 if protocol == 3 else _RESP2
    data = b"".join(replies_sent)
    encoder = Encoder("utf-8", "strict", decode_responses=True)  # type: ignore[no-untyped-call]
    decoder = encoder.decode if decode else None
    replies, pushes, used = parse_replies(
        data, len(replies_sent), decoder, _AsyncRESP3Parser.parse_error
    )
    assert (pushes, used) == ([], len(data))
    theirs = await _redis_pys_reading(protocol, data, len(replies_sent), decode=decode)
    _same(replies, theirs)
    assert isinstance(replies[8], NoScriptError)  # the pipeline sends the body again


def test_replies_cut_anywhere_are_read_whole_once_the_rest_arrives() -> None:
    sent = [*_RESP2, *_RESP3]
    data = b"".join(sent)
    whole, _, _ = parse_replies(data, len(sent), None, _AsyncRESP3Parser.parse_error)
    for cut in range(len(data) + 1):
        first, _, used = parse_replies(data[:cut], len(sent), None, _AsyncRESP3Parser.parse_error)
        # Only whole replies: each one read is complete, and none is cut short.
        assert used == sum(len(reply) for reply in sent[: len(first)])
        rest, _, more = parse_replies(
            data[used:], len(sent) - len(first), None, _AsyncRESP3Parser.parse_error
        )
        assert used + more == len(data)
        _same(first + rest, whole)


def test_no_more_replies_are_read_than_are_due() -> None:
    replies = parse_replies(b":1\r\n:2\r\n", 1, None, _AsyncRESP3Parser.parse_error)
    assert replies == ([1], [], 4)


#: A managed server's maintenance notice (RESP3), with a map in it.
_PUSH = b">3\r\n" + _bulk(b"MIGRATING") + b":17\r\n%1\r\n+slots\r\n:30\r\n"


def test_a_push_between_replies_is_set_apart_for_the_push_handler() -> None:
    data = b":1\r\n" + _PUSH + b":0\r\n"
    parsed = parse_replies(data, 2, None, _AsyncRESP3Parser.parse_error)
    assert parsed == ([1, 0], [[b"MIGRATING", 17, {b"slots": 30}]], len(data))
    parsed = parse_replies(data[:-2], 2, None, _AsyncRESP3Parser.parse_error)
    assert parsed == ([1], [[b"MIGRATING", 17, {b"slots": 30}]], 4 + len(_PUSH))


@pytest.mark.parametrize("reply", [b"|1\r\n+a\r\n+b\r\n:1\r\n", b"?x\r\n", b":one\r\n", b"$x\r\n"])
def test_bytes_that_are_no_reply_are_a_protocol_error(reply: bytes) -> None:
    with pytest.raises(InvalidResponse, match="Protocol Error"):
        parse_replies(reply, 1, None, _AsyncRESP3Parser.parse_error)


def test_an_error_that_ends_the_connection_is_raised_wherever_it_is() -> None:
    # As redis-py raises it, even inside an array.
    with pytest.raises(BusyLoadingError):
        parse_replies(b"*2\r\n-LOADING busy\r\n:1\r\n", 1, None, _AsyncRESP3Parser.parse_error)


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
    data = b"".join(_RESP3)
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    reading, connection = _reading(chunks, len(_RESP3))
    replies: list[Any] = []
    await reading._read_lean(connection, replies)
    _same(replies, parse_replies(data, len(_RESP3), None, _AsyncRESP3Parser.parse_error)[0])
    assert (reading._unread, reading._rest) == (0, b"")


async def test_an_error_reply_that_means_the_connection_is_done_is_raised() -> None:
    # As redis-py raises it: a server that is loading its data answers nothing else.
    reading, connection = _reading([b":1\r\n", b"-LOADING Redis is loading the dataset\r\n"], 2)
    replies: list[Any] = []
    with pytest.raises(BusyLoadingError):
        await reading._read_lean(connection, replies)
    assert replies == [1]


async def test_a_push_on_the_lock_connection_goes_to_the_connections_push_handler() -> None:
    reading, connection = _reading([b":1\r\n" + _PUSH, b":0\r\n"], 2)
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
