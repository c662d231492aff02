"""One lock call on its way to Redis: what it carries, and how it fails.

Its keys and arguments are encoded when the call is made, so that text the
client cannot encode fails that call alone, never the batch it would share; it
goes out by its script's SHA, or by the script's body after the server lost it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn

from taskiq_deduplication.exceptions import (
    REDIS_ERRORS,
    BacklogFullError,
    CallTimeoutError,
    UnencodableCallError,
)

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Sequence

    from redis.commands.core import AsyncScript

    from taskiq_deduplication.store.wire.connection import Command

# The pipeline's logger: it logs what becomes of the calls.
logger = logging.getLogger(__name__)

# Seconds between two warnings about calls dropped because the queue was full.
_DROP_WARNING_INTERVAL: Final = 10.0


#: What a lock call can fail with when Redis does not answer it as a script
#: would: redis-py's errors, the socket's and the deadline's, and a reply that
#: is not UTF-8 on a client that decodes (a foreign value under the prefix),
#: which both ways through redis-py raise as ``UnicodeDecodeError``.
REDIS_FAILURES: Final = (*REDIS_ERRORS, UnicodeDecodeError)


@dataclass(frozen=True, slots=True)
class RedisFailed:
    """A lock operation that Redis did not answer, and why: the caller decides what it means."""

    error: Exception
    """What redis-py raised (a connection or response error, a timeout)."""

    def __bool__(self) -> NoReturn:
        """Refuse to be read as a yes or a no: a failure is neither (``is True`` is)."""
        msg = f"a lock call Redis did not answer is neither true nor false: {self.error!r}"
        raise TypeError(msg)

    def raise_error(self) -> NoReturn:
        """Raise the error, for a caller whose own caller gets it (``kiq`` without fail-open)."""
        raise self.error


@dataclass(eq=False, slots=True)
class Call:
    """One script call: its encoded keys and arguments, and who waits for its reply."""

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


def encode(
    encoding: tuple[str, str], keys: Sequence[str], args: Sequence[str | int]
) -> tuple[list[bytes], list[bytes | int]]:
    """A call's keys and arguments as the connection sends them, encoded now.

    Encoded when the call is made, not when its batch is packed: a key that
    the client cannot encode (a lone surrogate, as ``os.fsdecode`` gives for
    a file name that is not UTF-8) fails its own call here, and never the
    batch it would have shared with other calls.

    Raises:
        UnencodableCallError: A key or argument cannot be encoded.
    """
    name, errors = encoding
    try:
        # List comprehensions: a lock call is made at each end of every run.
        return (
            [key.encode(name, errors) for key in keys],
            [a.encode(name, errors) if isinstance(a, str) else a for a in args],
        )
    except UnicodeEncodeError as exc:
        # The text itself is not logged: an argument may be a task's arguments.
        msg = (
            f"a deduplication lock call cannot be sent: a key or an argument is not "
            f"text that the Redis client can encode as {name!r} ({exc.reason} at "
            f"position {exc.start})"
        )
        raise UnencodableCallError(msg) from None


def timed_out(call: Call, timeout: float, cause: BaseException | None = None) -> CallTimeoutError:
    """The error of ``call``, unanswered ``timeout`` seconds after it was made."""
    if call.written:
        message = f"no reply from Redis to a deduplication lock call within {timeout:g}s"
    else:
        message = f"a deduplication lock call could not be sent within {timeout:g}s"
    message += " (the client's socket_timeout)"
    if cause is not None:
        message += f": {cause}"
    return CallTimeoutError(message, sent=call.written)


def command(call: Call) -> Command:
    """The command that sends ``call``: by its script's SHA, or by its body."""
    if call.by_body:
        return ("EVAL", call.script.script, len(call.keys), *call.keys, *call.args)
    return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


def backlog_full(queued: int) -> BacklogFullError:
    """The error of a call made while ``queued`` calls wait already, the most there may be."""
    return BacklogFullError(
        f"the Redis backlog is full: {queued} deduplication lock calls "
        f"wait for Redis already (it is slow or not answering)"
    )


class Drops:
    """Calls nobody waits for, dropped because the queue was full: said once per interval.

    An outage drops them by thousands; one warning every ten seconds says how many.
    """

    def __init__(self) -> None:
        """Start with none dropped."""
        self._dropped = 0
        self._next_warning = 0.0

    def drop(self, queued: int, now: float) -> None:
        """Count one more dropped call (``queued`` wait); warn if the interval is over."""
        self._dropped += 1
        if now >= self._next_warning:
            logger.warning(
                "The Redis backlog is full (%d lock calls waiting): dropped %d lock "
                "extension(s) or release(s); their locks expire on their TTL",
                queued,
                self._dropped,
            )
            self._dropped = 0
            self._next_warning = now + _DROP_WARNING_INTERVAL
