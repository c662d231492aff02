"""The lock pipeline's door to redis-py: every use of its private API is here.

The pipeline (``store/pipeline.py``) orders, batches and replays lock calls; this
module puts a batch on the wire and reads its replies, over one connection of a
``Redis`` client's pool (or a ``RedisCluster`` client's own pipeline).

Two ways through a plain connection:

- **lean** (the default): the pipeline packs a batch itself, hands it to the
  connection's socket writer (``_writer``) without a turn of the event loop,
  and reads the replies from the connection's stream (``_reader``) under one
  timeout, parsing every reply that has arrived at once (``store/wire/resp.py``), where
  ``read_response`` would await each line of each reply. Error replies become
  the exceptions the connection's parser (``_parser``) makes of them. This
  relies on redis-py's private attributes, which redis-py may change in any
  release.
- **public**: redis-py's public API only, ``pack_commands``,
  ``send_packed_command`` and ``read_response`` for each reply. The same
  commands and round trips, with a little more work per call.

A probe (``store/wire/probe.py``) picks the way when the pipeline takes its first
connection of a class: lean if that connection has the private attributes the
lean way uses, in the shapes it expects; else public, said once at DEBUG on the
``taskiq_deduplication.pipeline`` logger. Setting the environment variable
``TASKIQ_DEDUP_REDIS_WIRE=public`` forces the public way (for the tests, and
as a way out should a redis-py release break the lean way unnoticed); it is
read whenever the pipeline takes a connection, and is no public setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from taskiq_deduplication.store.wire.probe import async_timeout, lean_fits
from taskiq_deduplication.store.wire.resp import Decoder, ErrorParser, parse_replies

if TYPE_CHECKING:
    from collections.abc import Callable

    from redis.asyncio import Redis
    from redis.asyncio.connection import ConnectionPool

# The pipeline's logger: what this module says is about the lock pipeline.
logger = logging.getLogger(__name__)


Command = tuple[Any, ...]

#: The most bytes taken from the stream in one read (a batch's replies are short).
_READ_SIZE: Final = 65536
#: What redis-py says when the server closed the connection.
_CLOSED: Final = "Connection closed by server."


def open_transport(
    client: Redis | RedisCluster, round_trip: Callable[[float], None] | None = None
) -> Transport:
    """The transport for ``client``'s lock calls; nothing is connected yet.

    Args:
        client: The Redis client.
        round_trip: Told the seconds of each round trip (the metrics), if given.
    """
    transport: Transport = (
        _ClusterTransport(client) if isinstance(client, RedisCluster) else _Connection(client)
    )
    if round_trip is not None:
        transport = _TimedTransport(transport, round_trip)
    return transport


class Transport(Protocol):
    """What the pipeline sends its batches through."""

    writes_ahead: bool
    """Whether ``write`` can put commands on the wire before their replies are read."""

    @property
    def ready(self) -> bool:
        """Whether a call can go out now without (re)connecting first."""

    async def connect(self) -> None:
        """Make the transport ready, or raise the error that prevents it."""

    @property
    def writes_at_once(self) -> bool:
        """Whether :meth:`write_now` can put commands on the wire now (the lean way, ready)."""

    def write_now(self, commands: list[Command]) -> bool:
        """Put the commands on the wire without yielding, if that can be done now.

        Returns whether they went; :meth:`execute` reads their replies later.
        """

    async def write(self, commands: list[Command]) -> None:
        """Send the commands now; :meth:`execute` reads their replies later."""

    async def execute(self, commands: list[Command]) -> list[Any]:
        """Send ``commands`` in one round trip and read the replies.

        Returns the replies to the commands sent earlier with ``write``, then
        those to ``commands``. Error replies come back as exceptions.
        """

    async def close(self) -> None:
        """Release what the transport holds."""


class _Connection:
    """One connection of a ``Redis`` client's pool, kept for all batches.

    Batches go out one at a time, so one connection is all the lock commands need:
    a burst of callers waits for its turn here instead of emptying the pool, and
    no batch pays for taking a connection from the pool and giving it back.

    The connection goes back to the pool only when nothing is in flight on it
    and no reply is left unread; otherwise it is disconnected first, since the
    next user's commands would read those replies. Only the operation that holds
    it gives it back, once.

    The connection is written to and read from the lean way or the public way,
    as the probe (``probe.lean_fits``) says for each connection taken.
    """

    writes_ahead = True

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._held: AbstractConnection | None = None
        self._in_use = False  # an operation is under way on the connection
        self._unread = 0  # replies written for and not read yet
        self._closed = False  # give the connection back when the operation ends
        self._lean = False  # the held connection goes the lean way
        self._rest = b""  # bytes read past the last reply parsed (a reply's start)
        # Replies of calls written ahead, lost with a connection closed under the
        # pipeline while it was idle: the next operation says so (see _lost).
        self._lost = 0

    @property
    def ready(self) -> bool:
        return not self._in_use and self._held is not None and self._held.is_connected

    async def connect(self) -> None:
        if not self.ready:
            await self._begin_operation()
            await self._end_operation()

    @property
    def writes_at_once(self) -> bool:
        return self._lean and self.ready

    def write_now(self, commands: list[Command]) -> bool:
        if not self.ready or not self._lean:  # redis-py's public API always yields
            return False
        connection = self._held
        assert connection is not None  # noqa: S101 (ready says so)
        if not _write_at_once(connection, _pack(connection, commands)):
            return False
        self._unread += len(commands)
        return True

    async def write(self, commands: list[Command]) -> None:
        connection = await self._begin_operation()
        await self._raise_if_lost()
        try:
            await self._send(connection, commands)
            self._unread += len(commands)
        except BaseException:
            await self._end_operation(failed=True)
            raise
        await self._end_operation()

    async def execute(self, commands: list[Command]) -> list[Any]:
        connection = await self._begin_operation()
        await self._raise_if_lost()
        replies: list[Any] = []
        try:
            if commands:
                await self._send(connection, commands)
                self._unread += len(commands)
            if self._lean and _reads_replies_itself(type(connection)):
                await self._read_lean(connection, replies)
            else:  # the public way, or a connection whose class reads in its own way
                while self._unread:
                    replies.append(await _read_reply(connection))
                    self._unread -= 1
        except BaseException:
            await self._end_operation(failed=True)
            raise
        await self._end_operation()
        return replies

    async def _send(self, connection: AbstractConnection, commands: list[Command]) -> None:
        if self._lean:
            await _send(connection, _pack(connection, commands))
        else:
            await connection.send_packed_command(connection.pack_commands(commands), False)  # noqa: FBT003 (redis-py's check_health)

    async def _read_lean(self, connection: AbstractConnection, replies: list[Any]) -> None:
        """Read every unread reply under one timeout, from the connection's stream.

        What ``read_response`` does for each reply, done once for them all:
        the socket timeout (a batch's replies come together, and a call's own
        deadline is the pipeline's to keep), the errors it raises, the health
        check's clock. The bytes are parsed as they arrive (`store/wire/resp.py`), every
        reply they hold at once; an error reply comes back as the exception it
        is, as redis-py's parser makes it.
        """
        stream = connection._reader  # noqa: SLF001 (redis-py's, since 4.2)
        if stream is None:  # disconnected under the batch
            raise RedisConnectionError(_CLOSED)
        parse_error = connection._parser.parse_error  # noqa: SLF001
        encoder = connection.encoder
        decode = encoder.decode if encoder.decode_responses else None
        timeout = connection.socket_timeout
        # A push (RESP3: a managed server's maintenance notice) goes to the
        # parser's handler, as redis-py's parser hands it on as it reads.
        handle_push = getattr(connection._parser, "handle_push_response", None)  # noqa: SLF001
        data = self._rest
        try:
            async with async_timeout(timeout) if timeout else contextlib.nullcontext():
                while True:
                    data, pushes = self._take_replies(data, replies, decode, parse_error)
                    for push in pushes:
                        if handle_push is not None:
                            await handle_push(push)
                    if not self._unread:
                        break
                    chunk = await stream.read(_READ_SIZE)
                    if not chunk:
                        raise RedisConnectionError(_CLOSED)
                    data += chunk
        except asyncio.TimeoutError:
            msg = f"Timeout reading from {connection._host_error()}"  # noqa: SLF001
            raise RedisTimeoutError(msg) from None
        except OSError as exc:
            msg = f"Error while reading from {connection._host_error()} : {exc.args}"  # noqa: SLF001
            raise RedisConnectionError(msg) from exc
        finally:
            self._rest = data
        if connection.health_check_interval:
            loop = asyncio.get_running_loop()
            connection.next_health_check = loop.time() + connection.health_check_interval

    def _take_replies(
        self, data: bytes, replies: list[Any], decode: Decoder | None, parse_error: ErrorParser
    ) -> tuple[bytes, list[list[Any]]]:
        """Move the complete replies at the start of ``data`` to ``replies``.

        Returns the bytes left, and the pushes found among the replies.
        """
        if not data:
            return data, []
        found, pushes, used = parse_replies(data, self._unread, decode, parse_error)
        self._unread -= len(found)
        replies += found
        return data[used:], pushes

    async def _raise_if_lost(self) -> None:
        """Fail the operation that begins if replies were lost with a connection before it.

        The pipeline then sends those calls again, with the rest, on the new
        connection (every lock script is idempotent for its owner): read on
        instead, the replies of this batch would go to the calls written ahead.
        """
        if self._lost:
            lost, self._lost = self._lost, 0
            await self._end_operation()  # the new connection is sound
            msg = f"the connection closed with {lost} lock call replies unread; sending them again"
            raise RedisConnectionError(msg)

    async def _begin_operation(self) -> AbstractConnection:
        self._in_use = True
        try:
            if self._held is None or not self._held.is_connected:
                # One the client closed under us (its pool's disconnect(), say):
                # the replies still due on it are gone, and the pipeline must know.
                self._lost += self._unread
                await self._give_back(disconnect=True)
                args = ("EVALSHA",) if _wants_command_name(type(self._pool)) else ()
                self._held = connection = await self._pool.get_connection(*args)  # type: ignore[no-untyped-call]
                self._lean = lean_fits(connection)
                # A hung server still accepts connections (its kernel does): lock
                # calls go out only on a connection that has answered, so a hung
                # server does not collect batch after batch to run when it wakes.
                await connection.send_command("PING", check_health=False)
                await connection.read_response()
        except BaseException:
            await self._end_operation(failed=True)
            raise
        return self._held

    async def _end_operation(self, *, failed: bool = False) -> None:
        self._in_use = False
        if failed:
            # Unread replies would answer the next batch: start over on a new one.
            await self._give_back(disconnect=True)
        elif self._closed:
            await self._give_back()

    async def _give_back(self, *, disconnect: bool = False) -> None:
        connection, self._held = self._held, None
        if connection is None:
            return
        if disconnect or self._unread or self._rest:
            self._unread, self._rest = 0, b""
            await connection.disconnect(nowait=True)
        await self._pool.release(connection)

    async def close(self) -> None:
        self._closed = True
        if not self._in_use:  # else the operation under way gives it back
            await self._give_back()


@functools.cache
def _wants_command_name(pool_class: type[ConnectionPool]) -> bool:
    """Whether the pool's ``get_connection`` requires a command name.

    redis-py 5.0.1 to 5.2.1 require one (and ignore it); from 5.3 on it is
    optional and passing it is deprecated (a warning).
    """
    parameter = inspect.signature(pool_class.get_connection).parameters.get("command_name")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _pack(connection: AbstractConnection, commands: list[Command]) -> list[bytes]:
    """``commands`` in the Redis protocol, in one buffer, as redis-py would put them.

    redis-py's ``pack_commands`` asks of every argument what type it is and
    chunks large values; the arguments of a lock call are only ever ``bytes``
    (keys, tokens, merged arguments, encoded when the call was made), ``str``
    (the command and the script's digest) and ``int`` (TTLs, counts), and one
    buffer is what the socket takes anyway. ``str`` is encoded as the
    connection encodes it.
    """
    encoder = connection.encoder
    encoding, errors = encoder.encoding, encoder.encoding_errors
    parts: list[bytes] = []
    append = parts.append
    for command in commands:
        append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, bytes):  # a call's keys and arguments, encoded when made
                data = arg
            elif isinstance(arg, str):
                data = arg.encode(encoding, errors)
            elif isinstance(arg, int) and not isinstance(arg, bool):
                data = b"%d" % arg
            else:  # no lock call has another type
                msg = f"a lock call's argument must be bytes, str or int, not {type(arg).__name__}"
                raise TypeError(msg)
            append(b"$%d\r\n%s\r\n" % (len(data), data))
    return [b"".join(parts)]


def _write_at_once(connection: AbstractConnection, packed: list[bytes]) -> bool:
    """Hand ``packed`` to the socket now, without yielding, if nothing is queued before it.

    redis-py's ``send_packed_command`` bounds every write with
    ``asyncio.wait_for``, which before Python 3.12 runs the write in a task of
    its own: two more turns of the event loop for each batch. A write to a
    connection whose buffer is empty cannot block (the transport tries the
    socket at once and keeps whatever the kernel did not take), so it needs no
    timeout; a connection with bytes still queued (Redis is not reading) goes
    the bounded way, through redis-py.
    """
    writer = getattr(connection, "_writer", None)  # redis-py's StreamWriter, since 4.2
    transport = getattr(writer, "transport", None)
    if writer is None or transport is None or transport.is_closing():
        return False
    if transport.get_write_buffer_size():
        return False
    writer.writelines(packed)
    return True


async def _send(connection: AbstractConnection, packed: list[bytes]) -> None:
    """Write ``packed`` at once if the connection can take it, else through redis-py."""
    if not _write_at_once(connection, packed):
        await connection.send_packed_command(packed, False)  # noqa: FBT003 (redis-py's check_health)


def _reads_replies_itself(connection_class: type[AbstractConnection]) -> bool:
    """Whether the pipeline may read replies of ``connection_class`` from its parser.

    Only a class that reads as redis-py's own connections do: one that
    overrides ``read_response`` (a Sentinel-managed connection turns a
    demoted master's ``READONLY`` into a reconnect) is read through it.
    """
    return connection_class.read_response is AbstractConnection.read_response


async def _read_reply(connection: AbstractConnection) -> Any:  # noqa: ANN401 (any reply)
    try:
        return await connection.read_response()
    except ResponseError as error:
        return error


class _ClusterTransport:
    """A ``RedisCluster`` client's pipeline, which sends each key to its node."""

    writes_ahead = False

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        # The cluster client connects by itself; after a failure the next round
        # trip goes from the background sender, not from a caller's task.
        self.ready = True

    async def connect(self) -> None:
        pass

    writes_at_once = False

    def write_now(self, commands: list[Command]) -> bool:  # noqa: ARG002 (the protocol's)
        return False

    async def write(self, commands: list[Command]) -> None:
        raise NotImplementedError

    async def execute(self, commands: list[Command]) -> list[Any]:
        self.ready = False
        if commands and commands[0][:2] == ("SCRIPT", "LOAD"):
            replies = [await self._client.script_load(command[2]) for command in commands]
        else:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = list(await pipe.execute(raise_on_error=False))
        self.ready = True
        return replies

    async def close(self) -> None:
        pass


class _TimedTransport:
    """A transport that tells how long each round trip took, answered or failed."""

    def __init__(self, transport: Transport, round_trip: Callable[[float], None]) -> None:
        self._transport = transport
        self._round_trip = round_trip
        self.writes_ahead = transport.writes_ahead

    @property
    def ready(self) -> bool:
        return self._transport.ready

    async def connect(self) -> None:
        await self._transport.connect()

    @property
    def writes_at_once(self) -> bool:
        return self._transport.writes_at_once

    def write_now(self, commands: list[Command]) -> bool:
        return self._transport.write_now(commands)  # no round trip either

    async def write(self, commands: list[Command]) -> None:
        await self._transport.write(commands)  # no round trip: its replies come with execute

    async def execute(self, commands: list[Command]) -> list[Any]:
        start = time.perf_counter()
        try:
            return await self._transport.execute(commands)
        finally:
            self._round_trip(time.perf_counter() - start)

    async def close(self) -> None:
        await self._transport.close()
