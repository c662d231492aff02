"""The probe that picks the lock pipeline's way through redis-py, lean or public.

``store/wire/connection.py`` says what the two ways are. The lean way uses redis-py's
private API; this probe checks, once per kind of connection, that what it uses
is there, in the shapes it expects, and says once, at DEBUG on the
``taskiq_deduplication.pipeline`` logger, where it is not.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Callable

    from redis.asyncio.connection import AbstractConnection

try:  # the timeout redis-py reads under, on every Python
    from redis.asyncio.connection import async_timeout as async_timeout  # type: ignore[attr-defined]  # noqa: PLC0414 (what the lean way reads under, in connection.py)
except ImportError:  # a redis-py that reads otherwise: the probe picks the public way
    async_timeout = None

# The pipeline's logger: what this module says is about the lock pipeline.
logger = logging.getLogger(__name__)

#: The environment variable that forces the public way (see ``store/wire/connection.py``).
WIRE_ENV: Final = "TASKIQ_DEDUP_REDIS_WIRE"


def lean_fits(connection: AbstractConnection) -> bool:
    """Whether ``connection`` goes the lean way (see ``store/wire/connection.py``).

    The lean way's needs are checked once per kind of connection (its class
    and its parser's, which the client's ``parser_class`` and protocol pick),
    on the first connection of that kind; :data:`WIRE_ENV` is read every time.
    """
    kind = (type(connection), type(getattr(connection, "_parser", None)))
    misfit = _MISFITS.get(kind)
    if misfit is None:
        misfit = _MISFITS[kind] = misfit_of(connection)
    if os.environ.get(WIRE_ENV, "").strip().lower() == "public":
        misfit = f"{WIRE_ENV}=public"
    if misfit and (kind, misfit) not in _TOLD:
        _TOLD.add((kind, misfit))
        logger.debug(
            "Lock calls go through redis-py's public API on %s connections (parser %s): %s",
            kind[0].__name__,
            kind[1].__name__,
            misfit,
        )
    return not misfit


#: Per kind of connection (its class, its parser's), why the lean way does not
#: fit it ("" when it does).
_MISFITS: dict[tuple[type[AbstractConnection], type[Any]], str] = {}
#: The choices of the public way logged so far: each is logged once.
_TOLD: set[tuple[tuple[type[AbstractConnection], type[Any]], str]] = set()


def misfit_of(connection: AbstractConnection) -> str:
    """Why the lean way cannot use ``connection``, or ``""`` if it can.

    What the lean way touches (``_pack``, ``_write_at_once``, ``_read_lean``),
    in the shapes it uses: a parser whose ``read_response`` is a coroutine
    taking no argument (the ``PING`` of a new connection) and which has
    ``parse_error()``, ``_host_error()``, the ``_writer`` and ``_reader``
    attributes (``None`` until connected), the numbers of the read timeout and
    the health check, the encoder's encoding, and redis-py's ``async_timeout``.
    """
    read = getattr(getattr(connection, "_parser", None), "read_response", None)
    host_error = getattr(connection, "_host_error", None)
    encoder = getattr(connection, "encoder", None)
    checks = (
        (async_timeout is not None, "redis.asyncio.connection has no async_timeout"),
        (
            inspect.iscoroutinefunction(read) and _takes_no_argument(read),
            "it has no _parser with a read_response() coroutine",
        ),
        (callable(host_error) and _takes_no_argument(host_error), "it has no _host_error()"),
        (hasattr(connection, "_writer"), "it has no _writer"),
        (hasattr(connection, "_reader"), "it has no _reader"),
        (
            callable(getattr(getattr(connection, "_parser", None), "parse_error", None)),
            "its _parser has no parse_error()",
        ),
        (_is_number(connection, "socket_timeout", or_none=True), "no socket_timeout number"),
        (_is_number(connection, "health_check_interval"), "no health_check_interval number"),
        (_is_number(connection, "next_health_check"), "no next_health_check number"),
        (
            all(isinstance(getattr(encoder, name, None), str) for name in _ENCODING),
            "it has no encoder with an encoding",
        ),
    )
    return next((why for fits, why in checks if not fits), "")


_ENCODING: Final = ("encoding", "encoding_errors")


def _is_number(connection: AbstractConnection, name: str, *, or_none: bool = False) -> bool:
    missing = object()
    value = getattr(connection, name, missing)
    return isinstance(value, (int, float)) or (or_none and value is None)


def _takes_no_argument(function: Callable[..., Any]) -> bool:
    try:
        inspect.signature(function).bind()
    except (TypeError, ValueError):  # ValueError: no signature to read
        return False
    return True
