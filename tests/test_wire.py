"""What the lock pipeline does on the wire itself: the bytes and replies redis-py would give."""

from __future__ import annotations

import pytest
import redis.asyncio
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection

from taskiq_deduplication._redis_wire import _pack, _reads_replies_itself


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
