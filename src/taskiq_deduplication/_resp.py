"""Replies of the lock scripts, read straight from the bytes Redis sent.

A batch's replies usually arrive in one read. redis-py's pure-Python parser
awaits the stream once per line (four times for a three-element array); this
reader takes whatever bytes have arrived and parses every complete reply in
them without yielding. It knows the reply types a Lua script's reply can take
(RESP2 rules, whatever the connection's protocol) and the scalars of RESP3,
and passes over RESP3 pushes (out-of-band notices, such as a managed server's
maintenance notifications); anything else is a protocol error, which fails the
batch and drops the connection, as a reply redis-py cannot parse does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from redis.exceptions import InvalidResponse

#: Parses an error reply's text into the exception redis-py would give for it.
ErrorParser = Callable[[str], Exception]
#: Turns a string reply's bytes into what the client returns (``str`` or ``bytes``).
Decoder = Callable[[bytes], Any]

_CRLF: Final = b"\r\n"
# Type bytes, as ints (indexing bytes gives ints).
_SIMPLE: Final = ord("+")
_ERROR: Final = ord("-")
_INTEGER: Final = ord(":")
_BULK: Final = ord("$")
_ARRAY: Final = ord("*")
_NULL: Final = ord("_")
_BOOLEAN: Final = ord("#")
_DOUBLE: Final = ord(",")
_BIG_NUMBER: Final = ord("(")
_PUSH: Final = ord(">")


class Incomplete(Exception):  # noqa: N818 (a signal, not an error)
    """The bytes end before the reply does: read more and parse again."""


def parse_replies(
    data: bytes, count: int, decode: Decoder | None, error: ErrorParser
) -> tuple[list[Any], int]:
    """Parse up to ``count`` replies from the start of ``data``.

    Args:
        data: The bytes received and not parsed yet.
        count: How many replies are still expected.
        decode: Applied to string replies (the client's ``decode_responses``),
            or ``None`` to keep them as bytes.
        error: Turns an error reply's text into its exception; an error reply
            comes back as that exception.

    Returns:
        The complete replies found (at most ``count``) and the number of bytes
        they took. An incomplete last reply is left for the next call.

    Raises:
        InvalidResponse: A reply of a type no lock script sends.
    """
    replies: list[Any] = []
    position = 0
    while len(replies) < count:
        try:
            if data[position : position + 1] == b">":
                # Out-of-band (RESP3 push: a server's maintenance notice), not
                # a reply: passed over, as the connection's own parser would
                # hand it to its handler and read on.
                _, position = _array(data, *_header(data, position), decode, error)
                continue
            reply, position = _parse(data, position, decode, error)
        except Incomplete:
            break
        replies.append(reply)
    return replies, position


def _header(data: bytes, start: int) -> tuple[int, int]:
    """The number on the line at ``start`` and where the next line starts."""
    end = data.find(_CRLF, start)
    if end < 0:
        raise Incomplete
    return int(data[start + 1 : end]), end + 2


def _parse(data: bytes, start: int, decode: Decoder | None, error: ErrorParser) -> tuple[Any, int]:
    """One reply from ``data`` at ``start``, and where the next one starts."""
    end = data.find(_CRLF, start)
    if end < 0:
        raise Incomplete
    kind = data[start]
    line = data[start + 1 : end]
    after = end + 2
    if kind == _INTEGER:  # the most common: most scripts answer 1 or 0
        return int(line), after
    if kind == _BULK:
        return _bulk(data, int(line), after, decode)
    if kind == _ARRAY:
        return _array(data, int(line), after, decode, error)
    if kind == _ERROR:
        return error(line.decode("utf-8", "replace")), after
    if kind == _SIMPLE:
        return (decode(line) if decode is not None else line), after
    scalar = _SCALARS.get(kind)
    if scalar is None:
        msg = f"Protocol Error: a reply of type {chr(kind)!r} where a lock script's reply was due"
        raise InvalidResponse(msg)
    return scalar(line), after


def _bulk(data: bytes, length: int, start: int, decode: Decoder | None) -> tuple[Any, int]:
    if length < 0:  # RESP2's null
        return None, start
    stop = start + length
    if len(data) < stop + 2:
        raise Incomplete
    value = data[start:stop]
    return (decode(value) if decode is not None else value), stop + 2


def _array(
    data: bytes, size: int, start: int, decode: Decoder | None, error: ErrorParser
) -> tuple[list[Any] | None, int]:
    if size < 0:  # RESP2's null array
        return None, start
    items = []
    for _ in range(size):
        item, start = _parse(data, start, decode, error)
        items.append(item)
    return items, start


#: The RESP3 scalars besides integers, by type byte: what each line means.
_SCALARS: Final[dict[int, Callable[[bytes], Any]]] = {
    _NULL: lambda _: None,
    _BOOLEAN: lambda line: line == b"t",
    _DOUBLE: float,
    _BIG_NUMBER: int,
}
