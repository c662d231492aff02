"""The pipeline: every script call in order, those of the same instant together.

One batch is on the wire at a time, over one connection the pipeline keeps.
Order matters (a release must not be overtaken by a heartbeat refresh of the
same lock), and one connection means that a burst of ``kiq`` calls waits for
Redis instead of exhausting the client's pool.
"""

from __future__ import annotations

import asyncio
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
    from redis.asyncio.connection import AbstractConnection
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
    sends its call at once, from its own task, together with anything queued
    (a lock extension left by the previous ``kiq``). Calls made while a batch is
    in flight wait for it and then go out together in the next one, sent by a
    background task; so does a call nobody waits for.
    """

    def __init__(self, client: Redis | RedisCluster, scripts: Sequence[AsyncScript]) -> None:
        """Send through ``client`` the calls of ``scripts``; nothing is sent yet."""
        self.scripts = scripts
        self._transport: _Transport = (
            _ClusterTransport(client) if isinstance(client, RedisCluster) else _Connection(client)
        )
        self._queue: deque[_Call] = deque()
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

    def call_detached(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> None:
        """Queue a script call nobody waits for; a failure is logged as ``what``."""
        self._queue.append(_Call(script, keys, args, None, what))
        # Not now: a call made in this loop iteration (the next kiq) may carry it.
        asyncio.get_running_loop().call_soon(self._send_backlog)

    async def drain(self) -> None:
        """Wait until every queued call has been sent and answered."""
        while self._queue or self._busy:
            self._send_backlog()
            if self._sender is not None:
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
        """Load every script into the server (again, after it lost them)."""
        replies = await self._transport.execute(
            [("SCRIPT", "LOAD", s.script) for s in self.scripts]
        )
        for script, sha in zip(self.scripts, replies, strict=True):
            if isinstance(sha, BaseException):
                raise sha
            script.sha = text(sha)

    def _send_backlog(self) -> None:
        if self._queue and not self._busy and (self._sender is None or self._sender.done()):
            self._sender = asyncio.get_running_loop().create_task(self._send_all())

    async def _send_all(self) -> None:
        while self._queue and not self._busy:
            await self._send_batch(None)

    async def _send_batch(self, mine: asyncio.Future[Any] | None) -> None:
        self._busy = True
        count = min(len(self._queue), _MAX_BATCH)
        batch = [self._queue.popleft() for _ in range(count)]
        try:
            replies = await self._send(batch)
        except asyncio.CancelledError:
            # The sending task was cancelled mid-send; the other callers were not.
            if mine is not None:
                mine.cancel()
            interrupted = RedisConnectionError("the batch was interrupted by a cancellation")
            _settle(batch, [interrupted] * len(batch))
            raise
        except Exception as exc:  # noqa: BLE001 (handed to each caller)
            replies = [exc] * len(batch)
        finally:
            self._busy = False
            self._send_backlog()
        _settle(batch, replies)

    async def _send(self, batch: list[_Call]) -> list[Any]:
        replies = await self._transport.execute([_evalsha(call) for call in batch])
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # The server lost its script cache (a restart or a failover). A call
            # that failed this way did not run, so running it now is safe; all of
            # our scripts go missing together, so the order of a batch holds.
            await self.load_scripts()
            retried = await self._transport.execute([_evalsha(batch[i]) for i in missing])
            for i, reply in zip(missing, retried, strict=True):
                replies[i] = reply
        return replies


Command = tuple[Any, ...]


def _evalsha(call: _Call) -> Command:
    return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


class _Transport(Protocol):
    async def execute(self, commands: list[Command]) -> list[Any]:
        """Send the commands in one round trip; error replies come back as exceptions."""

    async def close(self) -> None:
        """Release what the transport holds."""


class _Connection:
    """One connection of a ``Redis`` client's pool, kept for all batches.

    Batches go out one at a time, so one connection is all the lock commands need:
    a burst of callers waits for its turn here instead of emptying the pool, and
    no batch pays for taking a connection from the pool and giving it back.
    """

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._held: AbstractConnection | None = None

    async def execute(self, commands: list[Command]) -> list[Any]:
        try:
            return await self._execute(commands)
        except RedisConnectionError:
            # A connection that broke while idle (a restarted server) fails on
            # first use: reconnect once. Every lock script is idempotent for its
            # owner, so a batch that may have run already can safely run again.
            return await self._execute(commands)

    async def _execute(self, commands: list[Command]) -> list[Any]:
        connection = self._held
        if connection is None:
            connection = self._held = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await connection.send_packed_command(connection.pack_commands(commands), False)  # noqa: FBT003 (redis-py's check_health)
            return [await _read_reply(connection) for _ in commands]
        except BaseException:
            # Unread replies would answer the next batch: start over on a new one.
            self._held = None
            await connection.disconnect()
            await self._pool.release(connection)
            raise

    async def close(self) -> None:
        if self._held is not None:
            connection, self._held = self._held, None
            await self._pool.release(connection)


async def _read_reply(connection: AbstractConnection) -> Any:  # noqa: ANN401 (any reply)
    try:
        return await connection.read_response()
    except ResponseError as error:
        return error


class _ClusterTransport:
    """A ``RedisCluster`` client's pipeline, which sends each key to its node."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client

    async def execute(self, commands: list[Command]) -> list[Any]:
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
