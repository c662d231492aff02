"""The lean way's reply parser (``store/wire/resp.py``) against redis-py's own.

Every reply a lock script can get is read as redis-py's pure-Python parser for
the connection's protocol reads it: the same values, the same errors. Random
replies, cut into random reads, check the same of every reply type the parser
knows; a reply nested deeper than :data:`MAX_DEPTH` is a protocol error.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable
from typing import Any, Final

import pytest
import redis._parsers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis._parsers.encoders import Encoder
from redis.exceptions import BusyLoadingError, InvalidResponse, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError

from taskiq_deduplication.store.wire.resp import MAX_DEPTH, parse_replies

#: The parse errors after which redis-py drops the connection, as the installed
#: redis-py names them (older releases, such as the floor's, do not: the same three).
NAMES_ITS_ERRORS: Final = hasattr(redis._parsers, "UNRECOVERABLE_PARSE_ERRORS")
UNRECOVERABLE: tuple[type[Exception], ...] = getattr(
    redis._parsers,
    "UNRECOVERABLE_PARSE_ERRORS",
    (InvalidResponse, UnicodeDecodeError, RecursionError),
)


def bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


#: Replies of every type a lock script (or SCRIPT LOAD) gets back, as Redis
#: sends them on either protocol, then only on RESP2 and only on RESP3.
_BOTH = [
    b":1\r\n",
    b":-12345678901234\r\n",
    bulk("tok task-1 é".encode()),
    bulk(b""),
    b"+OK\r\n",
    b"*3\r\n:1\r\n:0\r\n" + bulk(b""),
    b"*3\r\n:3\r\n:4999\r\n" + bulk(b"~abcdefghij task-2 +"),
    b"*2\r\n*2\r\n:1\r\n" + bulk(b"a") + b"*0\r\n",
    b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
    b"-ERR Error running script (call to f_x): @user_script:1: boom\r\n",
]
RESP2_REPLIES: Final = [*_BOTH, b"$-1\r\n", b"*-1\r\n"]
RESP3_REPLIES: Final = [
    *_BOTH,
    b"_\r\n",
    b"#t\r\n",
    b",1.5\r\n",
    b"(3492890328409238509324850943850943825\r\n",
    b"%2\r\n+a\r\n:1\r\n" + bulk(b"b") + b"~2\r\n:1\r\n:2\r\n",
    b"=8\r\ntxt:hi\r\n\r\n",
    b"!9\r\nERR boom!\r\n",
]
#: A managed server's maintenance notice (RESP3), with a map in it.
PUSH: Final = b">3\r\n" + bulk(b"MIGRATING") + b":17\r\n%1\r\n+slots\r\n:30\r\n"

_PARSE_ERROR = _AsyncRESP3Parser.parse_error


def same(ours: list[Any], theirs: list[Any]) -> None:
    """Assert that two lists of replies hold the same types and values."""
    assert [(type(reply), str(reply)) for reply in ours] == [
        (type(reply), str(reply)) for reply in theirs
    ]


async def _redis_pys_reading(
    protocol: int, chunks: list[bytes], count: int, *, decode: bool
) -> list[Any]:
    """What redis-py's own parser for ``protocol`` makes of ``count`` replies.

    The bytes arrive as ``chunks``, each after a turn of the event loop, as
    from a socket; then the stream ends.
    """
    parser: Any = (_AsyncRESP3Parser if protocol == 3 else _AsyncRESP2Parser)(65536)
    stream = asyncio.StreamReader()
    parser._stream = stream
    parser.encoder = Encoder("utf-8", "strict", decode_responses=decode)  # type: ignore[no-untyped-call]
    parser._connected = True

    async def arrive() -> None:
        for chunk in chunks:
            stream.feed_data(chunk)
            await asyncio.sleep(0)
        stream.feed_eof()

    arriving = asyncio.get_running_loop().create_task(arrive())
    try:
        return [await parser.read_response() for _ in range(count)]
    finally:
        await arriving


def _our_reading(chunks: list[bytes], count: int, *, decode: bool) -> list[Any]:
    """What ``parse_replies`` makes of ``count`` replies arriving as ``chunks``.

    As the lean way reads (``_Connection._take_replies``): after each read, the
    complete replies are taken and the rest is kept for the next; a stream that
    ends before the last reply is the connection closed.
    """
    encoder = Encoder("utf-8", "strict", decode_responses=True)  # type: ignore[no-untyped-call]
    decoder = encoder.decode if decode else None
    replies: list[Any] = []
    data = b""
    for chunk in chunks:
        data += chunk
        found, pushes, used = parse_replies(data, count - len(replies), decoder, _PARSE_ERROR)
        assert pushes == []
        replies += found
        data = data[used:]
    if len(replies) < count:
        msg = "Connection closed by server."
        raise RedisConnectionError(msg)
    assert data == b""  # nothing past the replies due
    return replies


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("protocol", [2, 3])
async def test_replies_are_read_as_redis_pys_parser_reads_them(protocol: int, decode: bool) -> None:
    replies_sent = RESP3_REPLIES if protocol == 3 else RESP2_REPLIES
    data = b"".join(replies_sent)
    encoder = Encoder("utf-8", "strict", decode_responses=True)  # type: ignore[no-untyped-call]
    decoder = encoder.decode if decode else None
    replies, pushes, used = parse_replies(data, len(replies_sent), decoder, _PARSE_ERROR)
    assert (pushes, used) == ([], len(data))
    theirs = await _redis_pys_reading(protocol, [data], len(replies_sent), decode=decode)
    same(replies, theirs)
    assert isinstance(replies[8], NoScriptError)  # the pipeline sends the body again


def test_replies_cut_anywhere_are_read_whole_once_the_rest_arrives() -> None:
    sent = [*RESP2_REPLIES, *RESP3_REPLIES]
    data = b"".join(sent)
    whole, _, _ = parse_replies(data, len(sent), None, _PARSE_ERROR)
    for cut in range(len(data) + 1):
        first, _, used = parse_replies(data[:cut], len(sent), None, _PARSE_ERROR)
        # Only whole replies: each one read is complete, and none is cut short.
        assert used == sum(len(reply) for reply in sent[: len(first)])
        rest, _, more = parse_replies(data[used:], len(sent) - len(first), None, _PARSE_ERROR)
        assert used + more == len(data)
        same(first + rest, whole)


def test_no_more_replies_are_read_than_are_due() -> None:
    replies = parse_replies(b":1\r\n:2\r\n", 1, None, _PARSE_ERROR)
    assert replies == ([1], [], 4)


def test_a_push_between_replies_is_set_apart_for_the_push_handler() -> None:
    data = b":1\r\n" + PUSH + b":0\r\n"
    parsed = parse_replies(data, 2, None, _PARSE_ERROR)
    assert parsed == ([1, 0], [[b"MIGRATING", 17, {b"slots": 30}]], len(data))
    parsed = parse_replies(data[:-2], 2, None, _PARSE_ERROR)
    assert parsed == ([1], [[b"MIGRATING", 17, {b"slots": 30}]], 4 + len(PUSH))


@pytest.mark.parametrize("reply", [b"|1\r\n+a\r\n+b\r\n:1\r\n", b"?x\r\n", b":one\r\n", b"$x\r\n"])
def test_bytes_that_are_no_reply_are_a_protocol_error(reply: bytes) -> None:
    with pytest.raises(InvalidResponse, match="Protocol Error"):
        parse_replies(reply, 1, None, _PARSE_ERROR)


def test_an_error_that_ends_the_connection_is_raised_wherever_it_is() -> None:
    # As redis-py raises it, even inside an array.
    with pytest.raises(BusyLoadingError):
        parse_replies(b"*2\r\n-LOADING busy\r\n:1\r\n", 1, None, _PARSE_ERROR)


def test_a_string_that_does_not_decode_raises_what_redis_pys_parser_raises() -> None:
    # UnicodeDecodeError, as redis-py raises it; not a protocol error.
    decode = Encoder("utf-8", "strict", decode_responses=True).decode  # type: ignore[no-untyped-call]
    with pytest.raises(UnicodeDecodeError):
        parse_replies(b"*1\r\n" + bulk(b"\xff"), 1, decode, _PARSE_ERROR)


# Random replies, in random reads: against redis-py's own parser

#: The codes and texts of error replies that redis-py gives exceptions of
#: their own to (three of them ConnectionErrors, raised), and others.
_ERROR_CODES = st.sampled_from(
    [
        b"ERR",
        b"ERR max number of clients reached",
        b"ERR invalid password",
        b"NOSCRIPT No matching script. Please use EVAL.",
        b"LOADING Redis is loading the dataset in memory",
        b"READONLY You can't write against a read only replica.",
        b"OOM command not allowed",
        b"NOPERM",
        b"WRONGTYPE Operation against a key holding the wrong kind of value",
        b"Syntax error at offset 3",
        b"",
    ]
)
#: Cluster redirections, worded as Redis words them (redis-py's exceptions for
#: them parse the slot and the address, and fail on anything else).
_REDIRECTIONS = st.sampled_from([b"MOVED 3999 127.0.0.1:6381", b"ASK 3999 127.0.0.1:6381"])


#: A simple string's or an error's text: any bytes but CR and LF, as Redis sends them.
_LINE = st.binary(max_size=12).map(lambda text: text.replace(b"\r", b"").replace(b"\n", b""))
#: A bulk string's bytes: text, binary (CRLF inside too) or empty.
_BODY = st.one_of(
    st.text(max_size=12).map(str.encode),
    st.binary(max_size=12),
    st.sampled_from([b"", b"\r\n", b"a\r\nb", b"\r", b"\n", b"$3\r\n"]),
)
_INTEGERS = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**64])
)
#: Frames that are no reply, the same protocol error for both parsers.
_JUNK = st.sampled_from([b"?x\r\n", b"|1\r\n", b":abc\r\n", b"$x\r\n", b"*x\r\n", b":\r\n"])


def _errors(texts: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """An error reply's text: a code and ``texts`` after it, or a redirection."""
    coded = st.tuples(_ERROR_CODES, texts).map(lambda parts: b" ".join(parts).strip())
    return coded | _REDIRECTIONS


def _replies(protocol: int) -> st.SearchStrategy[bytes]:
    """One reply of any type ``protocol`` has (pushes aside), as Redis would send it."""
    scalars = [
        _INTEGERS.map(lambda number: b":%d\r\n" % number),
        _BODY.map(bulk),
        _LINE.map(lambda text: b"+%s\r\n" % text),
        _errors(_LINE).map(lambda text: b"-%s\r\n" % text),
    ]
    keys = st.one_of(scalars[:3])  # a map's keys: hashable (no aggregates), no errors
    if protocol == 2:
        scalars += [st.just(b"$-1\r\n"), st.just(b"*-1\r\n")]
    else:
        scalars += [
            st.just(b"_\r\n"),
            st.sampled_from([b"#t\r\n", b"#f\r\n"]),
            st.floats(allow_nan=False).map(lambda number: b",%r\r\n" % number),
            _INTEGERS.map(lambda number: b"(%d\r\n" % number),
            _BODY.map(lambda text: b"=%d\r\ntxt:%s\r\n" % (len(text) + 4, text)),
            _errors(_BODY).map(lambda text: b"!" + bulk(text)[1:]),
        ]

    def aggregates(items: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
        listed = st.lists(items, max_size=4)
        kinds = [listed.map(lambda parts: b"*%d\r\n%s" % (len(parts), b"".join(parts)))]
        if protocol == 3:
            kinds += [
                listed.map(lambda parts: b"~%d\r\n%s" % (len(parts), b"".join(parts))),
                st.lists(st.tuples(keys, items), max_size=3).map(
                    lambda pairs: b"%%%d\r\n%s" % (len(pairs), b"".join(k + v for k, v in pairs))
                ),
            ]
        return st.one_of(kinds)

    return st.recursive(st.one_of(scalars), aggregates, max_leaves=12)


@st.composite
def _arrivals(draw: st.DrawFn, protocol: int) -> tuple[int, list[bytes]]:
    """Replies (one in ten times a frame that is no reply among them) and the reads they come in."""
    replies = draw(st.lists(_replies(protocol), min_size=1, max_size=6))
    if draw(st.integers(0, 9)) == 0:
        replies.insert(draw(st.integers(0, len(replies))), draw(_JUNK))
    data = b"".join(replies)
    cuts = draw(st.lists(st.integers(1, len(data) - 1), max_size=8)) if len(data) > 1 else []
    edges = [0, *sorted(set(cuts)), len(data)]
    return len(replies), [data[start:end] for start, end in itertools.pairwise(edges)]


def _normal(reply: Any) -> Any:
    """``reply`` in a form that compares by type and value, all the way down."""
    if isinstance(reply, list):
        return [_normal(item) for item in reply]
    if isinstance(reply, dict):
        return ("map", [(_normal(key), _normal(value)) for key, value in reply.items()])
    if isinstance(reply, BaseException):
        return (type(reply), str(reply))
    if isinstance(reply, float):
        return (float, repr(reply))
    return (type(reply), reply)


#: Bounded (300 examples in all, a few seconds), and no deadline nor health
#: check on speed: an example's time is the machine's, not the parser's.
_FUZZ = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("protocol", [2, 3])
@_FUZZ
@given(data=st.data())
async def test_random_replies_in_random_reads_are_read_as_redis_pys_parser_reads_them(
    protocol: int, decode: bool, data: st.DataObject
) -> None:
    count, chunks = data.draw(_arrivals(protocol), label="count, chunks")

    async def ours() -> list[Any]:
        return _our_reading(chunks, count, decode=decode)

    theirs = _redis_pys_reading(protocol, chunks, count, decode=decode)
    ours_, theirs_ = await _outcome(ours()), await _outcome(theirs)
    if not NAMES_ITS_ERRORS and ours_[0] == theirs_[0] == "raised":
        # An older redis-py (the floors') raises other errors for a malformed
        # frame (a ValueError for a bad number): that both refuse it is the point.
        return
    assert ours_ == theirs_


async def _outcome(reading: Awaitable[list[Any]]) -> tuple[object, ...]:
    """``("read", the replies)``, or ``("raised", the error's type, its text)``."""
    try:
        replies = await reading
    except AssertionError:
        raise
    except Exception as error:  # noqa: BLE001 (the error is what is compared)
        return ("raised", type(error), str(error))
    return ("read", _normal(replies))


# Nesting: up to MAX_DEPTH levels read, deeper a protocol error


def _nested(depth: int, inner: bytes = b":1\r\n", level: bytes = b"*1\r\n") -> bytes:
    """``inner`` in ``depth`` aggregates, each holding the next (``level`` is one's header)."""
    return level * depth + inner


#: Replies nested exactly MAX_DEPTH levels deep (an empty or null aggregate is
#: a level too), the same on either protocol, then RESP2's and RESP3's own.
_AT_THE_LIMIT = [
    _nested(MAX_DEPTH),
    _nested(MAX_DEPTH - 1, b"*0\r\n"),
    # Siblings: each one's depth is given back when it ends.
    b"*2\r\n" + _nested(MAX_DEPTH - 1) + _nested(MAX_DEPTH - 1, bulk(b"a\r\nb")),
]
_AT_THE_LIMIT_RESP2 = [*_AT_THE_LIMIT, _nested(MAX_DEPTH - 1, b"*-1\r\n")]
_AT_THE_LIMIT_RESP3 = [
    *_AT_THE_LIMIT,
    _nested(MAX_DEPTH, level=b"~1\r\n"),
    _nested(MAX_DEPTH, level=b"%1\r\n+key\r\n"),
    _nested(MAX_DEPTH // 2, _nested(MAX_DEPTH - MAX_DEPTH // 2, level=b"%1\r\n:7\r\n")),
]


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_reply_nested_as_deep_as_the_limit_is_read_as_redis_pys_parser_reads_it(
    protocol: int,
) -> None:
    sent = _AT_THE_LIMIT_RESP3 if protocol == 3 else _AT_THE_LIMIT_RESP2
    data = b"".join(sent)
    theirs = await _redis_pys_reading(protocol, [data], len(sent), decode=False)
    assert _normal(_our_reading([data], len(sent), decode=False)) == _normal(theirs)
    # In reads of a few bytes: a reply cut short is parsed again from its start.
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    assert _normal(_our_reading(chunks, len(sent), decode=False)) == _normal(theirs)


@pytest.mark.parametrize(
    "reply",
    [
        _nested(MAX_DEPTH + 1),
        _nested(MAX_DEPTH, b"*0\r\n"),
        _nested(MAX_DEPTH, b"*-1\r\n"),
        _nested(MAX_DEPTH + 1, level=b"~1\r\n"),
        _nested(MAX_DEPTH + 1, level=b"%1\r\n+key\r\n"),
        _nested(MAX_DEPTH, b"%1\r\n" + _nested(1) + b":2\r\n"),  # a key too deep
        b">2\r\n+notice\r\n" + _nested(MAX_DEPTH),  # a push is a level
        b"*2\r\n:1\r\n" + _nested(MAX_DEPTH),
        _nested(100_000),  # far past Python's recursion limit
    ],
    ids=[
        "array",
        "empty",
        "null",
        "set",
        "map",
        "map-key",
        "push",
        "second-item",
        "100000-levels",
    ],
)
def test_a_reply_nested_deeper_than_the_limit_is_a_protocol_error(reply: bytes) -> None:
    with pytest.raises(InvalidResponse, match=f"Protocol Error: .* more than {MAX_DEPTH} levels"):
        parse_replies(reply, 1, None, _PARSE_ERROR)
    # Whatever came before it: the replies already read are not returned.
    with pytest.raises(InvalidResponse):
        parse_replies(b":1\r\n" + reply, 2, None, _PARSE_ERROR)


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_reply_nested_far_too_deep_fails_in_both_parsers_and_drops_the_connection(
    protocol: int,
) -> None:
    # 100,000 levels: past the limit (ours, redis-py's to come) and past Python's
    # recursion limit, where redis-py 8.2's parser, which has no limit yet, ends.
    # Either error is one redis-py's connection drops itself for, as the lean way does.
    reply = _nested(100_000)
    with pytest.raises(InvalidResponse) as ours:
        _our_reading([reply], 1, decode=False)
    with pytest.raises(UNRECOVERABLE):
        await _redis_pys_reading(protocol, [reply], 1, decode=False)
    assert isinstance(ours.value, UNRECOVERABLE)
