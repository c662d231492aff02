"""Replies of the lock scripts, read straight from the bytes Redis sent.

A batch's replies usually arrive in one read. redis-py's pure-Python parser
awaits the stream once per line (four times for a three-element array); this
reader takes whatever bytes have arrived and parses every complete reply in
them without yielding. It reads what redis-py's RESP2 and RESP3 parsers read,
the same way: the types a Lua script's reply can take (RESP2 rules, whatever
the connection's protocol), RESP3's scalars, maps, sets and verbatim strings,
and RESP3 pushes (out-of-band notices, such as a managed server's maintenance
notifications), which are set apart for the connection's own push handler. An
error reply becomes the exception redis-py makes of it, and one that means the
connection is done (``LOADING``) is raised, as redis-py raises it. Anything
else is a protocol error, which fails the batch and drops the connection, as a
reply redis-py cannot parse does.

Replies nested deeper than :data:`MAX_DEPTH` are a protocol error too: the
parser recurses for each level of arrays, sets, maps and pushes, and a broken
or hostile server could otherwise send enough levels to exhaust the stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse

#: Parses an error reply's text into the exception redis-py would give for it.
ErrorParser = Callable[[str], Exception]
#: Turns a string reply's bytes into what the client returns (``str`` or ``bytes``).
Decoder = Callable[[bytes], Any]

#: The most levels of aggregates (arrays, sets, maps, pushes; empty and null
#: ones too) a reply may be nested in. A reply nested deeper is a protocol
#: error: :class:`InvalidResponse`, which redis-py raises for bytes it will not
#: read (its hiredis parser too, for a reply nested more than 1024 levels
#: deep), and after which it drops the connection, as the lean way does. A lock
#: script's reply is nested 2 deep at most.
#:
#: redis-py 8.2 (the newest) has no such limit in its pure-Python parsers: they
#: recurse until Python's recursion limit raises ``RecursionError``, which it
#: counts among the errors that leave unreadable bytes and drop the connection
#: (``UNRECOVERABLE_PARSE_ERRORS``, ``redis/_parsers/base.py``). The comment
#: there names the fix on its way (redis-py pull request 4144, not released),
#: which raises ``InvalidResponse`` past 100 levels: this limit is that one.
#: It also keeps this parser (two frames a level) some 800 frames inside
#: Python's default recursion limit, wherever in a task's stack it runs.
MAX_DEPTH: Final = 100

_CRLF: Final = b"\r\n"
_INTEGER: Final = ord(":")  # the most common reply: most scripts answer 1 or 0
_PUSH: Final = b">"


class Incomplete(Exception):  # noqa: N818 (a signal, not an error)
    """The bytes end before the reply does: read more and parse again."""


class _Reading:
    """What one parse needs besides the bytes: how to decode, how to make errors."""

    __slots__ = ("decode", "depth", "error")

    def __init__(self, decode: Decoder | None, error: ErrorParser) -> None:
        self.decode = decode
        self.error = error
        # How many aggregates (arrays, sets, maps, pushes) enclose the reply
        # being read: counted by the aggregates' readers only, so that a flat
        # reply (an integer, a string) pays nothing for the depth guard.
        self.depth = 0

    def text(self, value: bytes) -> Any:  # noqa: ANN401 (str or bytes, as the client returns them)
        return self.decode(value) if self.decode is not None else value


def parse_replies(
    data: bytes, count: int, decode: Decoder | None, error: ErrorParser
) -> tuple[list[Any], list[list[Any]], int]:
    """Parse up to ``count`` replies from the start of ``data``.

    Args:
        data: The bytes received and not parsed yet.
        count: How many replies are still expected.
        decode: Applied to string replies (the client's ``decode_responses``),
            or ``None`` to keep them as bytes.
        error: Turns an error reply's text into its exception; an error reply
            comes back as that exception.

    Returns:
        The complete replies found (at most ``count``), the pushes found
        among them (not replies: for the connection's push handler), and the
        number of bytes they all took. An incomplete last reply is left for
        the next call.

    Raises:
        InvalidResponse: Bytes that are no reply redis-py reads, or a reply
            nested deeper than :data:`MAX_DEPTH`.
        UnicodeDecodeError: A string reply that ``decode`` cannot decode (as
            redis-py raises it).
        redis.exceptions.ConnectionError: An error reply that means the
            connection is done (as redis-py raises it).
    """
    reading = _Reading(decode, error)
    replies: list[Any] = []
    pushes: list[list[Any]] = []
    position = 0
    while len(replies) < count:
        try:
            is_push = data.startswith(_PUSH, position)
            reply, position = _parse(data, position, reading)
        except Incomplete:
            break
        (pushes if is_push else replies).append(reply)
    return replies, pushes, position


def _parse(data: bytes, start: int, reading: _Reading) -> tuple[Any, int]:
    """One reply from ``data`` at ``start``, and where the next one starts."""
    end = data.find(_CRLF, start)
    if end < 0:
        raise Incomplete
    kind = data[start]
    line = data[start + 1 : end]
    try:
        if kind == _INTEGER:
            return int(line), end + 2
        read = _READERS.get(kind)
        if read is None:
            msg = f"Protocol Error: {data[start:end]!r}"
            raise InvalidResponse(msg)
        return read(data, line, end + 2, reading)
    except UnicodeDecodeError:  # a ValueError, but no protocol error: raised as redis-py raises it
        raise
    except ValueError as exc:  # a length or a number that is none
        msg = f"Protocol Error: {data[start:end]!r}"
        raise InvalidResponse(msg) from exc


def _raw(data: bytes, line: bytes, start: int) -> tuple[bytes | None, int]:
    """A length-prefixed body (bulk string, verbatim string, blob error), undecoded."""
    length = int(line)
    if length < 0:  # RESP2's null
        return None, start
    stop = start + length
    if len(data) < stop + 2:
        raise Incomplete
    return data[start:stop], stop + 2


def _bulk(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:
    raw, after = _raw(data, line, start)
    return (None if raw is None else reading.text(raw)), after


def _verbatim(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:
    raw, after = _raw(data, line, start)
    return reading.text((raw or b"")[4:]), after  # past "txt:" or "mkd:"


def _too_deep() -> InvalidResponse:
    """The error for an aggregate nested deeper than :data:`MAX_DEPTH`."""
    return InvalidResponse(f"Protocol Error: a reply nested more than {MAX_DEPTH} levels deep")


def _array(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:
    # Each aggregate, empty or null too, is a level. An error or Incomplete
    # leaves with the depth unrestored: either ends the parse, and the next
    # parse_replies starts from a new _Reading.
    depth = reading.depth + 1
    if depth > MAX_DEPTH:
        raise _too_deep()
    reading.depth = depth
    size = int(line)
    items: list[Any] | None = None
    if size >= 0:  # else RESP2's null array
        items = []
        for _ in range(size):
            item, start = _parse(data, start, reading)
            items.append(item)
    reading.depth = depth - 1
    return items, start


def _map(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:
    depth = reading.depth + 1
    if depth > MAX_DEPTH:
        raise _too_deep()
    reading.depth = depth
    items: dict[Any, Any] = {}
    for _ in range(int(line)):
        key, start = _parse(data, start, reading)
        items[key], start = _parse(data, start, reading)
    reading.depth = depth - 1
    return items, start


def _error(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:  # noqa: ARG001 (a reader's signature)
    error = reading.error(line.decode("utf-8", "replace"))
    if isinstance(error, RedisConnectionError):
        raise error  # as redis-py raises it: the connection is done
    return error, start


def _blob_error(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:
    raw, after = _raw(data, line, start)
    return _error(data, raw or b"", after, reading)


def _scalar(convert: Callable[[bytes], Any]) -> Callable[..., tuple[Any, int]]:
    def read(data: bytes, line: bytes, start: int, reading: _Reading) -> tuple[Any, int]:  # noqa: ARG001 (a reader's signature)
        return convert(line), start

    return read


#: How each type of reply is read, by its first byte (integers, the most
#: common, are read before this is looked at). Sets come back as lists, as
#: redis-py returns them.
_READERS: Final[dict[int, Callable[[bytes, bytes, int, _Reading], tuple[Any, int]]]] = {
    ord("$"): _bulk,
    ord("*"): _array,
    ord("~"): _array,
    _PUSH[0]: _array,
    ord("%"): _map,
    ord("="): _verbatim,
    ord("-"): _error,
    ord("!"): _blob_error,
    ord("+"): lambda data, line, start, reading: (reading.text(line), start),  # noqa: ARG005
    ord("_"): _scalar(lambda _: None),
    ord("#"): _scalar(lambda line: line == b"t"),
    ord(","): _scalar(float),
    ord("("): _scalar(int),
}
