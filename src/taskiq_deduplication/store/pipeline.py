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
import inspect
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from taskiq_deduplication.exceptions import (
    PipelineClosedError,
    UnencodableCallError,
)
from taskiq_deduplication.store.call import Call, Drops, backlog_full, command, encode, timed_out
from taskiq_deduplication.store.wire.connection import Transport, open_transport

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.commands.core import AsyncScript

logger = logging.getLogger(__name__)

# Most calls in one batch (a write-ahead takes all that is queued, up to MAX_QUEUED).
_MAX_BATCH: Final = 512
# Most calls waiting to be sent; more would only wait past their deadline.
MAX_QUEUED: Final = 10_000
# Why a call made after the shutdown fails: the line a run that ends after a
# shutdown logs (a task still running when an in-process broker shut down).
_SHUT_DOWN: Final = (
    "the deduplication middleware was shut down (broker.shutdown()) in this event loop"
)


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

    A call nobody waits for (the lock extension after a send) goes with the
    next call made in the same turn of the event loop, or else is written at
    the end of that turn when the pipeline is idle, so it reaches Redis even if
    the process ends right after ``kiq``; its reply is read with the next batch.
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
        self._transport: Transport = open_transport(client, round_trip)
        self._queue: deque[Call] = deque()
        self._written: list[Call] = []  # sent ahead; their replies are still to be read
        # The calls someone waits for, not yet answered, in the order they were
        # made. They all wait `timeout`, so this is also the order of their
        # deadlines: one timer, for the oldest, serves them all.
        self._waiting: deque[Call] = deque()
        self._expiry: asyncio.TimerHandle | None = None
        self._busy = False
        self._closed = False
        self._sender: asyncio.Task[None] | None = None
        self._flush: asyncio.TimerHandle | None = None  # ends the wait of lingering calls
        self._last_lingering = float("-inf")  # when the last call that may linger came
        self._ahead = False  # a write-ahead is due at the end of this turn of the loop
        self._drops = Drops()  # calls nobody waits for, dropped when the queue is full

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
        encoded_keys, encoded_args = encode(self._encoding, keys, args)
        loop = asyncio.get_running_loop()
        now = loop.time()
        future: asyncio.Future[Any] = loop.create_future()
        self._admit(Call(script, encoded_keys, encoded_args, future, now + self.timeout), loop)
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

    def call_soon(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int]
    ) -> asyncio.Future[Any]:
        """Queue a script call and return the future of its reply, without sending it yet.

        A call made next in this turn of the event loop takes it along in its
        own batch (one round trip for both); else it goes out at the end of
        the turn. The future fails as `call` raises.
        """
        encoded_keys, encoded_args = encode(self._encoding, keys, args)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._admit(
            Call(script, encoded_keys, encoded_args, future, loop.time() + self.timeout), loop
        )
        loop.call_soon(self._send_soon)
        return future

    async def call_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Send several script calls, all in the same batch, and return their replies."""
        if len(self._queue) + len(calls) > MAX_QUEUED:
            raise backlog_full(len(self._queue))
        encoded = [(script, *encode(self._encoding, keys, args)) for script, keys, args in calls]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        futures: list[asyncio.Future[Any]] = []
        for script, keys, args in encoded:
            futures.append(loop.create_future())
            self._admit(Call(script, keys, args, futures[-1], deadline), loop)
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
                Call(script, *encoded, None, loop.time() + self._detached_timeout, what)
            )
            loop.call_soon(self._send_soon)

    async def send_ahead(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> None:
        """Put a call nobody waits for on the wire by the end of this turn of the event loop.

        Over the lean wire, a call made before then in this turn (the next
        ``kiq`` of a caller that sends in a loop) takes it along in its own
        write: one write, and one read event in Redis, for both. Else it is
        written, without waiting for a reply, once the callbacks of this turn
        are done: before a loop that ends (``asyncio.run``) closes. Over
        redis-py's public API, whose writes yield, it is written before this
        returns. A failure is logged as ``what``.
        """
        encoded = self._encode_detached(keys, args, what)
        loop = asyncio.get_running_loop()
        if encoded is None or not self._admit_detached(what, loop):
            return
        self._queue.append(Call(script, *encoded, None, loop.time() + self._detached_timeout, what))
        if self._busy or not (self._transport.writes_ahead and self._transport.ready):
            loop.call_soon(self._send_backlog)
        elif self._transport.writes_at_once:
            if not self._ahead:
                self._ahead = True
                loop.call_soon(self._write_ahead)
        else:
            await self._write_queued()

    def _write_ahead(self) -> None:
        """Write what is queued, its replies read later, unless a batch took it along."""
        self._ahead = False
        if not self._queue:
            return  # a batch of this turn took it along, and reads its reply
        loop = asyncio.get_running_loop()
        if not self._busy and self._transport.ready:
            calls = self._take_batch(loop.time(), len(self._queue))
            if self._transport.write_now([command(call) for call in calls]):
                for call in calls:
                    call.written = True
                self._written += calls
            else:  # bytes still queued on the connection: the sender's bounded way
                self._queue.extendleft(reversed(calls))
        # Read the replies (or send what is queued) soon, unless the next call,
        # often made in the next turn, does it on its way.
        loop.call_soon(self._send_backlog)

    async def _write_queued(self) -> None:
        """Write all that is queued, its replies read with the next batch (redis-py's way)."""
        loop = asyncio.get_running_loop()
        self._busy = True
        calls = self._take_batch(loop.time(), len(self._queue))
        for call in calls:
            call.written = True
        try:
            await self._transport.write([command(call) for call in calls])
        except BaseException as exc:
            # The connection is gone, and with it the replies of anything
            # written ahead before: all of it goes the ordinary way, which
            # reconnects and logs a failure. Nobody waits for these calls, so
            # their error is not the caller's.
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

    def abandon(self) -> None:
        """Give up a pipeline whose event loop was closed while it was still open.

        Nothing runs in that loop any more (closed without ``shutdown_asyncgens()``):
        what is queued is never sent, and its locks expire on their TTL. A
        background sender made in the loop's last turn never started; its
        coroutine is closed here, or it would be reported as never awaited
        whenever the garbage collector finds it.
        """
        self._closed = True
        self._queue.clear()
        self._written = []
        self._waiting.clear()
        sender, self._sender = self._sender, None
        if sender is not None and not sender.done():
            coroutine = sender.get_coro()
            if (
                inspect.iscoroutine(coroutine)
                and inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED
            ):
                coroutine.close()
                # It can never run: not a task "destroyed but pending" either (as
                # asyncio's own run_until_complete() says of its task).
                sender._log_destroy_pending = False  # type: ignore[attr-defined]  # noqa: SLF001

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

    def _send_soon(self) -> None:
        """Send what is queued at the end of a turn, unless calls wait for company.

        A call queued beside a call that lingers (a run's free beside its
        finish, its take beside its claim) goes with that call's batch.
        """
        if self._flush is None:
            self._send_backlog()

    def _flush_lingering(self) -> None:
        """Send the calls that waited for company (unless a batch took them already)."""
        self._flush = None
        self._send_backlog()

    # Admission and expiry

    def _encode_detached(
        self, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> tuple[list[bytes], list[bytes | int]] | None:
        """`encode` for a call nobody waits for: a failure is logged as ``what``."""
        try:
            return encode(self._encoding, keys, args)
        except UnencodableCallError as exc:
            logger.warning("Could not %s: %s", what, exc)
            return None

    def _admit(self, call: Call, loop: asyncio.AbstractEventLoop) -> None:
        """Queue a call someone waits for, or fail it at once."""
        if self._closed:
            raise PipelineClosedError(_SHUT_DOWN)
        if len(self._queue) >= MAX_QUEUED:
            raise backlog_full(len(self._queue))
        self._queue.append(call)
        self._waiting.append(call)
        if self._expiry is None:
            self._expiry = loop.call_at(call.deadline, self._expire)

    def _admit_detached(self, what: str, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a call nobody waits for may be queued; if not, say so in the log."""
        if self._closed:
            logger.debug("Not sending %s: the lock pipeline is closed", what)
            return False
        if len(self._queue) < MAX_QUEUED:
            return True
        self._drops.drop(len(self._queue), loop.time())
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
                future.set_exception(timed_out(call, self.timeout))
            waiting.popleft()
        # Expired calls at the head of the queue go now, not with the next batch:
        # during an outage that batch may be a socket timeout away.
        queue = self._queue
        while queue and queue[0].deadline <= now and not queue[0].written:
            self._drop_expired(queue.popleft())
        self._expiry = loop.call_at(waiting[0].deadline, self._expire) if waiting else None

    def _drop_expired(self, call: Call) -> None:
        """Drop a call that was never sent and whose deadline passed."""
        if call.future is None:
            logger.debug("Not sending %s: nobody needs it any more", call.what)
        elif not call.future.done():
            call.future.set_exception(timed_out(call, self.timeout))

    def _take_batch(self, now: float, most: int = _MAX_BATCH) -> list[Call]:
        """The next calls to send, in order, without those that expired unsent.

        A call dropped here never ran in Redis, so leaving it out keeps the
        order of the rest. A call written before (put back after a lost
        connection or a lost script) is always sent again, in its place,
        whatever its deadline: what it did must not be left half-ordered.
        """
        queue = self._queue
        batch: list[Call] = []
        while queue and len(batch) < most:
            call = queue.popleft()
            if call.deadline <= now and not call.written:
                self._drop_expired(call)
            else:
                batch.append(call)
        if not queue and self._flush is not None:  # no call waits for company any more
            self._flush.cancel()
            self._flush = None
        return batch

    def _resend(self, lost: list[Call]) -> None:
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

    def _abandon(self, calls: list[Call]) -> None:
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

    def _failure(self, call: Call, error: Exception) -> Exception:
        """The error for a call that failed before it was sent."""
        if isinstance(error, (RedisTimeoutError, asyncio.TimeoutError)):
            return timed_out(call, self.timeout, error)
        return error

    async def _send(self, calls: list[Call], written: int, *, inline: bool) -> list[Any]:
        """Send ``calls[written:]`` and read the replies to all of ``calls``.

        Returns the replies to the first calls, in order; the calls after them,
        if any, are back at the head of the queue, to be sent again.
        """
        for call in calls[written:]:
            call.written = True
        try:
            replies = await self._transport.execute([command(call) for call in calls[written:]])
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
            replies = await self._transport.execute([command(call) for call in calls])
        for index, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                self._run_again_by_body(calls[index:])
                return replies[:index]
        return replies

    def _run_again_by_body(self, calls: list[Call]) -> None:
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

    def _settle(self, calls: list[Call], replies: list[Any]) -> None:
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


ScriptCall = tuple["AsyncScript", "Sequence[str]", "Sequence[str | int]"]
"""A script, its keys and its arguments."""


def text(reply: bytes | str) -> str:
    """A reply as ``str``, from a client that decodes responses or one that does not."""
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
