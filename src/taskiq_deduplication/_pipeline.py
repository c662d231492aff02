"""The pipeline: every script call in order, those of the same instant together.

One batch is on the wire at a time, over one connection the pipeline keeps.
Order matters (a release must not be overtaken by a heartbeat refresh of the
same lock), and one connection means that a burst of ``kiq`` calls waits for
Redis instead of exhausting the client's pool.

Every call has a deadline, set when the call is made. A call still unanswered
at its deadline fails then, however long the backlog ahead of it; one not sent
by then is never sent. The queue is capped, so an outage of any length costs
bounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import (  # type: ignore[attr-defined]
    AbstractConnection,
    async_timeout,  # the timeout redis-py reads under, on every Python
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from taskiq_deduplication.exceptions import (
    BacklogFullError,
    CallTimeoutError,
    PipelineClosedError,
    UnencodableCallError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from redis.asyncio import Redis
    from redis.asyncio.connection import ConnectionPool
    from redis.commands.core import AsyncScript

# Named for what it logs, not for the private module it lives in.
logger = logging.getLogger("taskiq_deduplication.pipeline")

# Most calls in one batch (a write-ahead takes all that is queued, up to MAX_QUEUED).
_MAX_BATCH: Final = 512
# Most calls waiting to be sent; more would only wait past their deadline.
MAX_QUEUED: Final = 10_000
# Seconds between two warnings about calls dropped because the queue was full.
_DROP_WARNING_INTERVAL: Final = 10.0


@dataclass(eq=False, slots=True)
class _Call:
    script: AsyncScript
    keys: Sequence[bytes]
    args: Sequence[bytes | int]
    """Encoded when the call is made: text Redis cannot take fails this call alone."""
    future: asyncio.Future[Any] | None
    """Where the reply goes, or ``None`` for a call nobody waits for."""
    deadline: float
    """Event-loop time after which nobody waits for the reply, nor needs it sent."""
    what: str = ""
    """What the call does, for the log, when nobody waits for it."""
    written: bool = False
    """It went out at least once, so it may have run in Redis."""
    by_body: bool = False
    """Send it with EVAL: the server lost the script once while it was on the way."""


class Pipeline:
    """Sends script calls in order, batching those issued in the same instant.

    One batch is on the wire at a time. A caller that finds the pipeline idle
    and connected sends its call at once, from its own task, together with
    anything queued. Calls made while a batch is in flight wait for it and then
    go out together in the next one, sent by a background task, which also
    makes every (re)connection: a caller never waits for a connect.

    A call that may linger (a run's start or end while other runs go on) and
    follows such a call closely does not go at once: it waits, up to its
    linger time, for the next batch, so the starts and ends of many short runs
    share round trips instead of taking one each.

    A call nobody waits for (the lock extension after a send) is written to the
    connection at once when the pipeline is idle, so it reaches Redis even if the
    process ends right after ``kiq``; its reply is read with the next batch.
    """

    def __init__(
        self,
        client: Redis | RedisCluster,
        scripts: Sequence[AsyncScript],
        *,
        timeout: float,
        detached_timeout: float,
        round_trip: Callable[[float], None] | None = None,
    ) -> None:
        """Send through ``client`` the calls of ``scripts``; nothing is sent yet.

        Args:
            client: The Redis client.
            scripts: The scripts the calls run.
            timeout: Seconds a caller waits for a reply, from the moment it calls.
            detached_timeout: Seconds after which a call nobody waits for is not
                worth sending any more. Never shorter than ``timeout``, so that
                a later call is never dropped while an earlier one still goes.
            round_trip: Told the seconds of each round trip (the metrics), if given.
        """
        self.scripts = scripts
        self.timeout = timeout
        encoder = client.get_encoder()
        self._encoding: tuple[str, str] = (encoder.encoding, encoder.encoding_errors)
        self._detached_timeout = max(detached_timeout, timeout)
        self._transport: _Transport = (
            _ClusterTransport(client) if isinstance(client, RedisCluster) else _Connection(client)
        )
        if round_trip is not None:
            self._transport = _TimedTransport(self._transport, round_trip)
        self._queue: deque[_Call] = deque()
        self._written: list[_Call] = []  # sent ahead; their replies are still to be read
        # The calls someone waits for, not yet answered, in the order they were
        # made. They all wait `timeout`, so this is also the order of their
        # deadlines: one timer, for the oldest, serves them all.
        self._waiting: deque[_Call] = deque()
        self._expiry: asyncio.TimerHandle | None = None
        self._busy = False
        self._closed = False
        self._sender: asyncio.Task[None] | None = None
        self._flush: asyncio.TimerHandle | None = None  # ends the wait of lingering calls
        self._last_lingering = float("-inf")  # when the last call that may linger came
        self._dropped = 0  # calls nobody waits for, dropped since the last warning
        self._next_drop_warning = 0.0

    @property
    def queued(self) -> int:
        """The number of calls waiting to be sent."""
        return len(self._queue)

    async def call(
        self,
        script: AsyncScript,
        keys: Sequence[str],
        args: Sequence[str | int],
        *,
        linger: float = 0.0,
    ) -> Any:  # noqa: ANN401 (a script's reply)
        """Send a script call and return its reply.

        Args:
            script: The script to run.
            keys: Its keys.
            args: Its arguments.
            linger: Seconds the call may wait for company, when calls that
                may linger come this often (the starts and ends of many runs):
                it then goes with the next batch that goes out, or once that
                time is up, and so shares its round trip. ``0``: at once.

        Raises:
            CallTimeoutError: No reply within ``timeout`` seconds of the call.
            BacklogFullError: Too many calls wait already.
            redis.exceptions.RedisError: Redis failed otherwise.
        """
        encoded_keys, encoded_args = self._encode(keys, args)
        loop = asyncio.get_running_loop()
        now = loop.time()
        future: asyncio.Future[Any] = loop.create_future()
        self._admit(_Call(script, encoded_keys, encoded_args, future, now + self.timeout), loop)
        if linger:
            # Only a call that follows another one that could linger closely
            # waits: a lone run's start and end go at once, as every call does.
            company, self._last_lingering = now - self._last_lingering < linger, now
            if company:
                if self._flush is None:
                    self._flush = loop.call_at(now + linger, self._flush_lingering)
                return await future
        # Sent from this task only over a connection that is open already: the
        # write follows the call at once and redis-py reads within socket_timeout,
        # so this caller is done by about its deadline. A (re)connect can take a
        # connect timeout and then a socket timeout: the background sender's job.
        if not self._busy and self._transport.ready:
            try:
                await self._send_batch(inline=True)
            except BaseException:
                future.cancel()  # nobody will look at it any more
                raise
        else:
            self._send_backlog()
        return await future

    async def call_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Send several script calls, all in the same batch, and return their replies."""
        if len(self._queue) + len(calls) > MAX_QUEUED:
            raise self._backlog_full()
        encoded = [(script, *self._encode(keys, args)) for script, keys, args in calls]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        futures: list[asyncio.Future[Any]] = []
        for script, keys, args in encoded:
            futures.append(loop.create_future())
            self._admit(_Call(script, keys, args, futures[-1], deadline), loop)
        try:
            if not self._busy and self._transport.ready and futures:
                await self._send_batch(inline=True)
            else:
                self._send_backlog()
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
        encoded = self._encode_detached(keys, args, what)
        loop = asyncio.get_running_loop()
        if encoded is not None and self._admit_detached(what, loop):
            self._queue.append(
                _Call(script, *encoded, None, loop.time() + self._detached_timeout, what)
            )
            loop.call_soon(self._send_backlog)

    async def send_ahead(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> None:
        """Put a call nobody waits for on the wire now if the pipeline is idle.

        A failure is logged as ``what``.
        """
        encoded = self._encode_detached(keys, args, what)
        loop = asyncio.get_running_loop()
        if encoded is None or not self._admit_detached(what, loop):
            return
        self._queue.append(
            _Call(script, *encoded, None, loop.time() + self._detached_timeout, what)
        )
        if not self._busy and self._transport.writes_ahead and self._transport.ready:
            # All that is queued: its replies are read in one go with the next batch.
            calls = self._take_batch(loop.time(), len(self._queue))
            if self._transport.write_now([_command(call) for call in calls]):
                # On the wire without a turn of the event loop. Its reply is
                # read by the next batch: the next call, often made in this very
                # loop iteration, or else the background sender, soon.
                for call in calls:
                    call.written = True
                self._written += calls
                loop.call_soon(self._send_backlog)
                return
            self._queue.extendleft(reversed(calls))
            self._busy = True
            calls = self._take_batch(loop.time(), len(self._queue))
            for call in calls:
                call.written = True
            try:
                await self._transport.write([_command(call) for call in calls])
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
                loop.call_soon(self._send_backlog)
        else:
            loop.call_soon(self._send_backlog)

    async def drain(self) -> None:
        """Wait until every call has been sent and its reply read (or it expired)."""
        while self._queue or self._written or self._busy:
            self._send_backlog()
            if self._sender is not None and not self._sender.done():
                await asyncio.shield(self._sender)
            else:  # a caller is sending its own batch
                await asyncio.sleep(0)

    async def close(self) -> None:
        """Send what is queued, then give the connection back to the client's pool.

        Cut short (cancelled, as by a worker's shutdown timeout), it stops the
        background sender and fails what is left, and never hands back a
        connection that still has replies to read or a command in flight: such
        a connection is disconnected first, or handed back by the caller that
        uses it once that caller is done with it.
        """
        try:
            await self.drain()
        finally:
            self._shut()
            # Shielded: cancelled once more, the connection still goes back.
            await asyncio.shield(self._transport.close())

    async def load_scripts(self) -> None:
        """Load every script into the server, as the first thing sent."""
        await self.drain()
        self._busy = True
        try:
            replies = await self._transport.execute(
                [("SCRIPT", "LOAD", s.script) for s in self.scripts]
            )
            for script, sha in zip(self.scripts, replies, strict=True):
                if isinstance(sha, BaseException):
                    raise sha
                script.sha = text(sha)
        finally:
            self._busy = False
            self._send_backlog()

    def _flush_lingering(self) -> None:
        """Send the calls that waited for company (unless a batch took them already)."""
        self._flush = None
        self._send_backlog()

    # Admission and expiry

    def _encode(
        self, keys: Sequence[str], args: Sequence[str | int]
    ) -> tuple[tuple[bytes, ...], tuple[bytes | int, ...]]:
        """A call's keys and arguments as the connection sends them, encoded now.

        Encoded when the call is made, not when its batch is packed: a key that
        the client cannot encode (a lone surrogate, as ``os.fsdecode`` gives for
        a file name that is not UTF-8) fails its own call here, and never the
        batch it would have shared with other calls.

        Raises:
            UnencodableCallError: A key or argument cannot be encoded.
        """
        encoding, errors = self._encoding
        try:
            return (
                tuple(key.encode(encoding, errors) for key in keys),
                tuple(a.encode(encoding, errors) if isinstance(a, str) else a for a in args),
            )
        except UnicodeEncodeError as exc:
            # The text itself is not logged: an argument may be a task's arguments.
            msg = (
                f"a deduplication lock call cannot be sent: a key or an argument is not "
                f"text that the Redis client can encode as {encoding!r} ({exc.reason} at "
                f"position {exc.start})"
            )
            raise UnencodableCallError(msg) from None

    def _encode_detached(
        self, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> tuple[tuple[bytes, ...], tuple[bytes | int, ...]] | None:
        """`_encode` for a call nobody waits for: a failure is logged as ``what``."""
        try:
            return self._encode(keys, args)
        except UnencodableCallError as exc:
            logger.warning("Could not %s: %s", what, exc)
            return None

    def _admit(self, call: _Call, loop: asyncio.AbstractEventLoop) -> None:
        """Queue a call someone waits for, or fail it at once."""
        if self._closed:
            msg = "the deduplication lock pipeline is closed"
            raise PipelineClosedError(msg)
        if len(self._queue) >= MAX_QUEUED:
            raise self._backlog_full()
        self._queue.append(call)
        self._waiting.append(call)
        if self._expiry is None:
            self._expiry = loop.call_at(call.deadline, self._expire)

    def _backlog_full(self) -> BacklogFullError:
        return BacklogFullError(
            f"the Redis backlog is full: {len(self._queue)} deduplication lock calls "
            f"wait for Redis already (it is slow or not answering)"
        )

    def _admit_detached(self, what: str, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a call nobody waits for may be queued; if not, say so in the log."""
        if self._closed:
            logger.debug("Not sending %s: the lock pipeline is closed", what)
            return False
        if len(self._queue) < MAX_QUEUED:
            return True
        # Once per interval, not once per call: an outage drops them by thousands.
        self._dropped += 1
        now = loop.time()
        if now >= self._next_drop_warning:
            logger.warning(
                "The Redis backlog is full (%d lock calls waiting): dropped %d lock "
                "extension(s) or release(s); their locks expire on their TTL",
                len(self._queue),
                self._dropped,
            )
            self._dropped = 0
            self._next_drop_warning = now + _DROP_WARNING_INTERVAL
        return False

    def _expire(self) -> None:
        """Fail every call whose deadline passed, whether queued or on the wire."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        waiting = self._waiting
        while waiting:
            call = waiting[0]
            future = call.future
            if future is not None and not future.done():
                if call.deadline > now:
                    break
                future.set_exception(self._timeout(call))
            waiting.popleft()
        # Expired calls at the head of the queue go now, not with the next batch:
        # during an outage that batch may be a socket timeout away.
        queue = self._queue
        while queue and queue[0].deadline <= now and not queue[0].written:
            self._drop_expired(queue.popleft())
        self._expiry = loop.call_at(waiting[0].deadline, self._expire) if waiting else None

    def _timeout(self, call: _Call, cause: BaseException | None = None) -> CallTimeoutError:
        if call.written:
            message = f"no reply from Redis to a deduplication lock call within {self.timeout:g}s"
        else:
            message = f"a deduplication lock call could not be sent within {self.timeout:g}s"
        message += " (the client's socket_timeout)"
        if cause is not None:
            message += f": {cause}"
        return CallTimeoutError(message, sent=call.written)

    def _drop_expired(self, call: _Call) -> None:
        """Drop a call that was never sent and whose deadline passed."""
        if call.future is None:
            logger.debug("Not sending %s: nobody needs it any more", call.what)
        elif not call.future.done():
            call.future.set_exception(self._timeout(call))

    def _take_batch(self, now: float, most: int = _MAX_BATCH) -> list[_Call]:
        """The next calls to send, in order, without those that expired unsent.

        A call dropped here never ran in Redis, so leaving it out keeps the
        order of the rest. A call written before (put back after a lost
        connection or a lost script) is always sent again, in its place,
        whatever its deadline: what it did must not be left half-ordered.
        """
        queue = self._queue
        batch: list[_Call] = []
        while queue and len(batch) < most:
            call = queue.popleft()
            if call.deadline <= now and not call.written:
                self._drop_expired(call)
            else:
                batch.append(call)
        return batch

    def _resend(self, lost: list[_Call]) -> None:
        """Put calls whose replies were lost back at the head of the queue, in order."""
        if self._closed:
            self._abandon(lost)
        else:
            self._queue.extendleft(reversed(lost))

    def _shut(self) -> None:
        """Stop sending: fail what is queued or written ahead, stop the background sender."""
        self._closed = True
        for timer in (self._expiry, self._flush):
            if timer is not None:
                timer.cancel()
        self._expiry = self._flush = None
        if self._sender is not None:
            # The batch it has on the wire comes back through _resend and fails.
            self._sender.cancel()
        lost, self._written = [*self._written, *self._queue], []
        self._queue.clear()
        self._abandon(lost)

    def _abandon(self, calls: list[_Call]) -> None:
        detached = 0
        for call in calls:
            if call.future is None:
                detached += 1
            elif not call.future.done():
                message = "the deduplication middleware shut down before Redis answered"
                call.future.set_exception(PipelineClosedError(message))
        if detached:
            logger.warning(
                "Shutdown cut short: %d lock extension(s) or release(s) not sent; "
                "their locks expire on their TTL",
                detached,
            )

    # Sending

    def _send_backlog(self) -> None:
        idle = not self._busy and (self._sender is None or self._sender.done())
        if idle and not self._closed and (self._queue or self._written):
            self._sender = asyncio.get_running_loop().create_task(self._send_all())

    async def _send_all(self) -> None:
        while (self._queue or self._written) and not self._busy:
            await self._send_batch(inline=False)

    async def _send_batch(self, *, inline: bool) -> None:
        """Send the next batch and settle its calls.

        ``inline``: sent from a caller's own task, over a connection that is
        ready; else from the background sender, which connects first, so that
        calls that expire while it connects are dropped before they go out.
        """
        self._busy = True
        try:
            failure: Exception | None = None
            if not inline and not self._transport.ready:
                try:
                    await self._transport.connect()
                except Exception as exc:  # noqa: BLE001 (handed to each caller)
                    failure = exc
            written, self._written = self._written, []
            calls = written + self._take_batch(asyncio.get_running_loop().time())
            if failure is not None:
                replies: list[Any] = [self._failure(call, failure) for call in calls]
            elif not calls:
                replies = []
            else:
                try:
                    replies = await self._send(calls, len(written), inline=inline)
                except asyncio.CancelledError:
                    # The caller that was sending this batch was cancelled; the
                    # others in it were not. Their replies went with the
                    # connection, so the batch is sent again by the background
                    # sender: every lock script is idempotent for its owner, so
                    # a call that ran already may run again.
                    self._resend(calls)
                    raise
                except Exception as exc:  # noqa: BLE001 (handed to each caller)
                    replies = [exc] * len(calls)
        finally:
            self._busy = False
            self._send_backlog()
        self._settle(calls[: len(replies)], replies)

    def _failure(self, call: _Call, error: Exception) -> Exception:
        """The error for a call that failed before it was sent."""
        if isinstance(error, (RedisTimeoutError, asyncio.TimeoutError)):
            return self._timeout(call, error)
        return error

    async def _send(self, calls: list[_Call], written: int, *, inline: bool) -> list[Any]:
        """Send ``calls[written:]`` and read the replies to all of ``calls``.

        Returns the replies to the first calls, in order; the calls after them,
        if any, are back at the head of the queue, to be sent again.
        """
        for call in calls[written:]:
            call.written = True
        try:
            replies = await self._transport.execute([_command(call) for call in calls[written:]])
        except RedisConnectionError:
            if inline:
                # The connection broke (a restarted server, a cut). The
                # background sender reconnects and sends these again; the
                # caller waits for that no longer than its deadline.
                self._resend(calls)
                return []
            # A connection that broke while idle fails on first use: reconnect
            # once and send everything again, the calls written ahead too. Every
            # lock script is idempotent for its owner, so a call that may have
            # run already can safely run again.
            replies = await self._transport.execute([_command(call) for call in calls])
        for index, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                self._run_again_by_body(calls[index:])
                return replies[:index]
        return replies

    def _run_again_by_body(self, calls: list[_Call]) -> None:
        """Send again, in order and with EVAL, the calls from the first NOSCRIPT on.

        The server lost its script cache (a restart, a failover, SCRIPT FLUSH).
        The first call that failed did not run, but a later one may have: some
        other process may have loaded the scripts in between, and a call that
        ran then ran out of order. Running all of them again, in order, puts
        the order back: what each lock ends up as is decided by its owner's
        last call that creates or deletes it (acquire and re-assert set the
        owner's value, release deletes it, extend only changes the TTL of a
        lock its owner holds; none of them touches another owner's lock
        except an acquire taking over the lock it replaces). So running an
        owner's calls again after some of them ran early ends with the same
        lock as running them once, in order: a release that ran early, ahead of
        the re-assert that failed, runs again after it. Calls of different
        owners of one key in the same batch raced anyway; the second run gives
        an outcome of that race, and each caller gets the second run's reply,
        so its answer matches what Redis holds. EVAL carries the script itself,
        so it cannot fail with NOSCRIPT again, and it caches the script, so the
        EVALSHAs after it work again.
        """
        logger.debug("Redis lost its scripts: sending %d lock call(s) again", len(calls))
        for call in calls:
            call.by_body = True
        self._resend(calls)

    def _settle(self, calls: list[_Call], replies: list[Any]) -> None:
        for call, reply in zip(calls, replies, strict=True):
            if call.future is None:
                if isinstance(reply, BaseException):
                    logger.warning("Could not %s: %s: %s", call.what, type(reply).__name__, reply)
            elif call.future.done():
                pass  # its caller was cancelled or timed out, and no longer waits
            elif isinstance(reply, BaseException):
                call.future.set_exception(reply)
            else:
                call.future.set_result(reply)
        # Replies come in the order the calls were made: the settled ones are
        # at the head, where the expiry timer would otherwise find them later.
        waiting = self._waiting
        while waiting and (waiting[0].future is None or waiting[0].future.done()):
            waiting.popleft()


Command = tuple[Any, ...]
ScriptCall = tuple["AsyncScript", "Sequence[str]", "Sequence[str | int]"]
"""A script, its keys and its arguments."""


def _command(call: _Call) -> Command:
    if call.by_body:
        return ("EVAL", call.script.script, len(call.keys), *call.keys, *call.args)
    return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


class _Transport(Protocol):
    writes_ahead: bool
    """Whether ``write`` can put commands on the wire before their replies are read."""

    @property
    def ready(self) -> bool:
        """Whether a call can go out now without (re)connecting first."""

    async def connect(self) -> None:
        """Make the transport ready, or raise the error that prevents it."""

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
    """

    writes_ahead = True

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._held: AbstractConnection | None = None
        self._in_use = False  # an operation is under way on the connection
        self._unread = 0  # replies written for and not read yet
        self._closed = False  # give the connection back when the operation ends

    @property
    def ready(self) -> bool:
        return not self._in_use and self._held is not None and self._held.is_connected

    async def connect(self) -> None:
        if not self.ready:
            await self._begin_operation()
            await self._end_operation()

    def write_now(self, commands: list[Command]) -> bool:
        if not self.ready:
            return False
        connection = self._held
        assert connection is not None  # noqa: S101 (ready says so)
        if not _write_at_once(connection, _pack(connection, commands)):
            return False
        self._unread += len(commands)
        return True

    async def write(self, commands: list[Command]) -> None:
        connection = await self._begin_operation()
        try:
            await _send(connection, _pack(connection, commands))
            self._unread += len(commands)
        except BaseException:
            await self._end_operation(failed=True)
            raise
        await self._end_operation()

    async def execute(self, commands: list[Command]) -> list[Any]:
        connection = await self._begin_operation()
        replies: list[Any] = []
        try:
            if commands:
                await _send(connection, _pack(connection, commands))
                self._unread += len(commands)
            if _reads_replies_itself(type(connection)):
                await self._read_lean(connection, replies)
            else:  # a connection whose class reads in its own way
                while self._unread:
                    replies.append(await _read_reply(connection))
                    self._unread -= 1
        except BaseException:
            await self._end_operation(failed=True)
            raise
        await self._end_operation()
        return replies

    async def _read_lean(self, connection: AbstractConnection, replies: list[Any]) -> None:
        """Read every unread reply under one timeout, straight from redis-py's parser.

        What ``read_response`` does for each reply, done once for them all:
        the socket timeout (a batch's replies come together, and a call's own
        deadline is the pipeline's to keep), the errors it raises, the health
        check's clock. An error reply comes back as the exception it is.
        """
        parser: Any = connection._parser  # noqa: SLF001 (redis-py's, since 4.2)
        timeout = connection.socket_timeout
        try:
            async with async_timeout(timeout) if timeout else contextlib.nullcontext():
                while self._unread:
                    replies.append(await parser.read_response())
                    self._unread -= 1
        except asyncio.TimeoutError:
            msg = f"Timeout reading from {connection._host_error()}"  # noqa: SLF001
            raise RedisTimeoutError(msg) from None
        except OSError as exc:
            msg = f"Error while reading from {connection._host_error()} : {exc.args}"  # noqa: SLF001
            raise RedisConnectionError(msg) from exc
        if connection.health_check_interval:
            loop = asyncio.get_running_loop()
            connection.next_health_check = loop.time() + connection.health_check_interval

    async def _begin_operation(self) -> AbstractConnection:
        self._in_use = True
        try:
            if self._held is None or not self._held.is_connected:
                await self._give_back(disconnect=True)  # one the client closed under us
                args = ("EVALSHA",) if _wants_command_name(type(self._pool)) else ()
                self._held = connection = await self._pool.get_connection(*args)  # type: ignore[no-untyped-call]
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
        if disconnect or self._unread:
            self._unread = 0
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

    def __init__(self, transport: _Transport, round_trip: Callable[[float], None]) -> None:
        self._transport = transport
        self._round_trip = round_trip
        self.writes_ahead = transport.writes_ahead

    @property
    def ready(self) -> bool:
        return self._transport.ready

    async def connect(self) -> None:
        await self._transport.connect()

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


def text(reply: bytes | str) -> str:
    """A reply as ``str``, from a client that decodes responses or one that does not."""
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
