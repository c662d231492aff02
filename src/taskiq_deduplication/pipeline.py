"""The pipeline: every script call in order, those of the same instant together.

One batch is on the wire at a time, over one connection the pipeline keeps.
Order matters (a release must not be overtaken by a heartbeat refresh of the
same lock), and one connection means that a burst of ``kiq`` calls waits for
Redis instead of exhausting the client's pool.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from redis.asyncio import Redis
    from redis.asyncio.connection import AbstractConnection, ConnectionPool
    from redis.commands.core import AsyncScript

logger = logging.getLogger(__name__)

# Most commands in one batch.
_MAX_BATCH: Final = 512


@dataclass(slots=True)
class _Call:
    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[str | int]
    future: asyncio.Future[Any] | None
    what: str = ""


class Pipeline:
    """Sends script calls in order, batching those issued in the same instant.

    One batch is on the wire at a time. A caller that finds the pipeline idle
    sends its call at once, from its own task, together with anything queued.
    Calls made while a batch is in flight wait for it and then go out together
    in the next one, sent by a background task.

    A call nobody waits for (the lock extension after a send) is written to the
    connection at once when the pipeline is idle, so it reaches Redis even if the
    process ends right after ``kiq``; its reply is read with the next batch.
    """

    def __init__(self, client: Redis | RedisCluster, scripts: Sequence[AsyncScript]) -> None:
        """Send through ``client`` the calls of ``scripts``; nothing is sent yet."""
        self.scripts = scripts
        self._transport: _Transport = (
            _ClusterTransport(client) if isinstance(client, RedisCluster) else _Connection(client)
        )
        self._queue: deque[_Call] = deque()
        self._written: list[_Call] = []  # sent ahead; their replies are still to be read
        self._busy = False
        self._sender: asyncio.Task[None] | None = None

    async def call(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int]
    ) -> Any:  # noqa: ANN401 (a script's reply)
        """Send a script call and return its reply."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Call(script, keys, args, future))
        if not self._busy:
            await self._send_batch(future)
        return await future

    async def call_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Send several script calls, all in the same batch, and return their replies."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        for script, keys, args in calls:
            futures.append(loop.create_future())
            self._queue.append(_Call(script, keys, args, futures[-1]))
        try:
            if not self._busy and futures:
                await self._send_batch(futures[0])
            await asyncio.wait(futures)
        except BaseException:
            for future in futures:  # nobody will look at them any more
                future.cancel()
            raise
        errors = [future.exception() for future in futures]  # each one retrieved
        for error in errors:
            if error is not None:
                raise error
        return [future.result() for future in futures]

    def queue(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> None:
        """Queue a script call nobody waits for; a failure is logged as ``what``."""
        self._queue.append(_Call(script, keys, args, None, what))
        asyncio.get_running_loop().call_soon(self._send_backlog)

    async def send_ahead(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> None:
        """Put a call nobody waits for on the wire now if the pipeline is idle.

        A failure is logged as ``what``.
        """
        self._queue.append(_Call(script, keys, args, None, what))
        if not self._busy and self._transport.writes_ahead:
            self._busy = True
            calls = list(self._queue)
            self._queue.clear()
            try:
                await self._transport.write([_evalsha(call) for call in calls])
            except BaseException as exc:
                # The connection is gone, and with it the replies of anything
                # written ahead before: all of it goes the ordinary way, which
                # reconnects and logs a failure. Nobody waits for this call, so
                # its error is not the caller's.
                lost, self._written = self._written + calls, []
                self._resend(lost)
                if not isinstance(exc, Exception):
                    raise
            else:
                self._written += calls
            finally:
                self._busy = False
                # Read the replies (or send what is queued) soon, unless the next
                # call, often made in this very loop iteration, does it on its way.
                asyncio.get_running_loop().call_soon(self._send_backlog)
        else:
            asyncio.get_running_loop().call_soon(self._send_backlog)

    async def drain(self) -> None:
        """Wait until every call has been sent and its reply read."""
        while self._queue or self._written or self._busy:
            self._send_backlog()
            if self._sender is not None and not self._sender.done():
                await asyncio.shield(self._sender)
            else:  # a caller is sending its own batch
                await asyncio.sleep(0)

    async def close(self) -> None:
        """Send what is queued, then give the connection back to the client's pool."""
        try:
            await self.drain()
        finally:
            await self._transport.close()

    async def load_scripts(self) -> None:
        """Load every script into the server, as the first thing sent."""
        await self.drain()
        self._busy = True
        try:
            await self._load_scripts()
        finally:
            self._busy = False
            self._send_backlog()

    async def _load_scripts(self) -> None:
        replies = await self._transport.execute(
            [("SCRIPT", "LOAD", s.script) for s in self.scripts]
        )
        for script, sha in zip(self.scripts, replies, strict=True):
            if isinstance(sha, BaseException):
                raise sha
            script.sha = text(sha)

    def _resend(self, lost: list[_Call]) -> None:
        """Put calls whose replies were lost back at the head of the queue, in order."""
        self._queue.extendleft(reversed(lost))

    def _send_backlog(self) -> None:
        idle = not self._busy and (self._sender is None or self._sender.done())
        if idle and (self._queue or self._written):
            self._sender = asyncio.get_running_loop().create_task(self._send_all())

    async def _send_all(self) -> None:
        while (self._queue or self._written) and not self._busy:
            await self._send_batch(None)

    async def _send_batch(self, mine: asyncio.Future[Any] | None) -> None:
        self._busy = True
        written, self._written = self._written, []
        count = min(len(self._queue), _MAX_BATCH)
        batch = [self._queue.popleft() for _ in range(count)]
        try:
            replies = await self._send(written, batch)
        except asyncio.CancelledError:
            # The caller that was sending this batch was cancelled; the others in
            # it were not. Their replies went with the connection, so the batch is
            # sent again by the background sender: every lock script is
            # idempotent for its owner, so a call that ran already may run again.
            if mine is not None:
                mine.cancel()
            self._resend(written + batch)
            raise
        except Exception as exc:  # noqa: BLE001 (handed to each caller)
            replies = [exc] * (len(written) + len(batch))
        finally:
            self._busy = False
            self._send_backlog()
        _settle(written + batch, replies)

    async def _send(self, written: list[_Call], batch: list[_Call]) -> list[Any]:
        """Send ``batch``; return the replies to ``written`` and then to ``batch``."""
        replies = await self._transport.execute(
            [_evalsha(call) for call in batch], written=[_evalsha(call) for call in written]
        )
        calls = written + batch
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # The server lost its script cache (a restart or a failover). A call
            # that failed this way did not run, so running it now is safe; all of
            # our scripts go missing together, so the order of a batch holds.
            await self._load_scripts()
            retried = await self._transport.execute([_evalsha(calls[i]) for i in missing])
            for i, reply in zip(missing, retried, strict=True):
                replies[i] = reply
        return replies


Command = tuple[Any, ...]
ScriptCall = tuple["AsyncScript", "Sequence[str]", "Sequence[str | int]"]
"""A script, its keys and its arguments."""


def _evalsha(call: _Call) -> Command:
    return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


class _Transport(Protocol):
    writes_ahead: bool
    """Whether ``write`` can put commands on the wire before their replies are read."""

    async def write(self, commands: list[Command]) -> None:
        """Send the commands now; :meth:`execute` reads their replies later."""

    async def execute(
        self, commands: list[Command], *, written: Sequence[Command] = ()
    ) -> list[Any]:
        """Send ``commands`` in one round trip and read the replies.

        Returns the replies to ``written`` (sent earlier with ``write``), then
        those to ``commands``. Error replies come back as exceptions.
        """

    async def close(self) -> None:
        """Release what the transport holds."""


class _Connection:
    """One connection of a ``Redis`` client's pool, kept for all batches.

    Batches go out one at a time, so one connection is all the lock commands need:
    a burst of callers waits for its turn here instead of emptying the pool, and
    no batch pays for taking a connection from the pool and giving it back.
    """

    writes_ahead = True

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._held: AbstractConnection | None = None

    async def write(self, commands: list[Command]) -> None:
        connection = await self._connection()
        try:
            await connection.send_packed_command(connection.pack_commands(commands), False)  # noqa: FBT003 (redis-py's check_health)
        except BaseException:
            await self._drop(connection)
            raise

    async def execute(
        self, commands: list[Command], *, written: Sequence[Command] = ()
    ) -> list[Any]:
        try:
            return await self._execute(commands, unread=len(written))
        except RedisConnectionError:
            # A connection that broke while idle (a restarted server) fails on
            # first use: reconnect once and send everything again, the calls
            # written ahead too. Every lock script is idempotent for its owner,
            # so a call that may have run already can safely run again.
            return await self._execute([*written, *commands], unread=0)

    async def _execute(self, commands: list[Command], unread: int) -> list[Any]:
        connection = await self._connection()
        try:
            if commands:
                await connection.send_packed_command(connection.pack_commands(commands), False)  # noqa: FBT003 (redis-py's check_health)
            return [await _read_reply(connection) for _ in range(unread + len(commands))]
        except BaseException:
            await self._drop(connection)
            raise

    async def _connection(self) -> AbstractConnection:
        if self._held is None:
            args = ("EVALSHA",) if _wants_command_name(type(self._pool)) else ()
            self._held = await self._pool.get_connection(*args)  # type: ignore[no-untyped-call]
        return self._held

    async def _drop(self, connection: AbstractConnection) -> None:
        # Unread replies would answer the next batch: start over on a new one.
        self._held = None
        await connection.disconnect()
        await self._pool.release(connection)

    async def close(self) -> None:
        if self._held is not None:
            connection, self._held = self._held, None
            await self._pool.release(connection)


@functools.cache
def _wants_command_name(pool_class: type[ConnectionPool]) -> bool:
    """Whether the pool's ``get_connection`` requires a command name.

    redis-py 5.0.1 to 5.2.1 require one (and ignore it); from 5.3 on it is
    optional and passing it is deprecated (a warning).
    """
    parameter = inspect.signature(pool_class.get_connection).parameters.get("command_name")
    return parameter is not None and parameter.default is inspect.Parameter.empty


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

    async def write(self, commands: list[Command]) -> None:
        raise NotImplementedError

    async def execute(
        self, commands: list[Command], *, written: Sequence[Command] = ()
    ) -> list[Any]:
        assert not written, "a cluster pipeline cannot write ahead"  # noqa: S101
        if commands and commands[0][:2] == ("SCRIPT", "LOAD"):
            return [await self._client.script_load(command[2]) for command in commands]
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def close(self) -> None:
        pass


def _settle(batch: list[_Call], replies: list[Any]) -> None:
    for call, reply in zip(batch, replies, strict=True):
        if call.future is None:
            if isinstance(reply, BaseException):
                logger.warning("Could not %s: %s: %s", call.what, type(reply).__name__, reply)
        elif call.future.done():
            pass  # its caller was cancelled and no longer waits
        elif isinstance(reply, BaseException):
            call.future.set_exception(reply)
        else:
            call.future.set_result(reply)


def text(reply: bytes | str) -> str:
    """A reply as ``str``, from a client that decodes responses or one that does not."""
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
