"""Reading the task labels: strict on the sender, tolerant on the worker.

taskiq turns every label into a string before any middleware sees it
(``deduplication=False`` arrives as ``"False"``, ``deduplication_key_fields=["a"]``
as ``"['a']"``), and scheduled sends lose even the type table the worker uses to
turn them back. So every label is read here from its string form as well as
from its Python value. Parsing is cached per raw value: the same few label
values come back on every ``kiq``.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

ENABLED_LABEL = "deduplication"
TTL_LABEL = "deduplication_ttl"
KEY_LABEL = "deduplication_key"
KEY_FIELDS_LABEL = "deduplication_key_fields"
RUNNING_TTL_LABEL = "deduplication_running_ttl"

# Added by the sender to each message it locked; read back by the worker.
# They travel raw (as strings), like taskiq's own "_retries".
LOCK_KEY_LABEL = "_deduplication_lock_key"
LOCK_OWNER_LABEL = "_deduplication_lock_owner"
LOCK_TTL_LABEL = "_deduplication_lock_ttl"
LOCK_LABELS = (LOCK_KEY_LABEL, LOCK_OWNER_LABEL, LOCK_TTL_LABEL)

#: The longest lock TTL, in seconds (ten years): far beyond any task, and well
#: inside what Redis can store as an expiry in milliseconds.
MAX_TTL = 10 * 365 * 24 * 3600

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


@dataclass(frozen=True, slots=True)
class SendOptions:
    """What the labels of one send ask for, once deduplication is on."""

    ttl: int
    """Lock TTL in seconds."""
    key: str | None
    """Explicit lock key, or ``None`` to fingerprint the call."""
    key_fields: tuple[str, ...] | None
    """Keyword arguments that make up the fingerprint, or ``None`` for all of them."""
    running_ttl: int | None = None
    """The running lease in seconds, if the label sets one (read again by the worker)."""


def read_send_options(
    labels: Mapping[str, Any], *, default_enabled: bool, default_ttl: int, heartbeat: bool = True
) -> SendOptions | None:
    """Read the deduplication labels of a message about to be sent.

    Args:
        labels: The message's labels.
        default_enabled: Whether deduplication is on when the label is absent.
        default_ttl: Lock TTL in seconds when the label is absent.
        heartbeat: Whether the heartbeat is on; a running lease needs it.

    Returns:
        The options, or ``None`` when deduplication is off for this send.

    Raises:
        ValueError: A label has a value that is not valid; the message names
            the label and the value.
    """
    enabled = labels.get(ENABLED_LABEL)
    if not (default_enabled if enabled is None else _parse(_parse_bool, ENABLED_LABEL, enabled)):
        return None
    ttl = labels.get(TTL_LABEL)
    key = labels.get(KEY_LABEL)
    fields = labels.get(KEY_FIELDS_LABEL)
    running_ttl = labels.get(RUNNING_TTL_LABEL)
    if running_ttl is not None and not heartbeat:
        msg = f"label {RUNNING_TTL_LABEL!r} needs the heartbeat (heartbeat=True)"
        raise ValueError(msg)
    return SendOptions(
        ttl=default_ttl if ttl is None else _parse(_parse_ttl, TTL_LABEL, ttl),
        key=None if key is None else _parse(_parse_key, KEY_LABEL, key),
        key_fields=None if fields is None else _parse(_parse_key_fields, KEY_FIELDS_LABEL, fields),
        running_ttl=(
            None if running_ttl is None else _parse(_parse_ttl, RUNNING_TTL_LABEL, running_ttl)
        ),
    )


def read_running_ttl(labels: Mapping[str, Any], *, default: int | None) -> int | None:
    """Read the running lease of a task about to run, in seconds, never raising.

    The sender checked the label already; a value it did not write (a sender
    without this middleware) falls back to ``default``.
    """
    value = labels.get(RUNNING_TTL_LABEL)
    if value is None:
        return default
    try:
        return _parse_ttl(value)
    except (TypeError, ValueError):  # TypeError: an unhashable value
        return default


@dataclass(frozen=True, slots=True)
class LockLabels:
    """The lock a sender took for a message, as the worker reads it back."""

    key: str
    token: str
    ttl: int


def read_lock_labels(labels: Mapping[str, Any], task_id: str) -> LockLabels | None:
    """Read the lock a sender recorded on the message ``task_id``, never raising.

    Args:
        labels: The labels of a message.
        task_id: The message's ``task_id``. Labels copied onto another message
            (a middleware that reuses a parent's labels) name another owner and
            do not count.

    Returns:
        The lock, or ``None`` when the message carries no (well-formed) lock of
        its own: sent without deduplication, or by a sender without this
        middleware.
    """
    key = labels.get(LOCK_KEY_LABEL)
    owner = labels.get(LOCK_OWNER_LABEL)
    ttl = labels.get(LOCK_TTL_LABEL)
    if not (isinstance(key, str) and isinstance(owner, str) and key):
        return None
    token, _, owner_task_id = owner.partition(" ")
    if not token or owner_task_id != task_id:
        return None
    try:
        seconds = _parse_ttl(ttl)
    except (TypeError, ValueError):  # TypeError: an unhashable value
        return None
    return LockLabels(key=key, token=token, ttl=seconds)


def write_lock_labels(labels: dict[str, Any], key: str, owner: str, ttl: int) -> None:
    """Record on a message the lock its sender took, ``owner`` being the lock's value."""
    labels[LOCK_KEY_LABEL] = key
    labels[LOCK_OWNER_LABEL] = owner
    labels[LOCK_TTL_LABEL] = str(ttl)


def drop_lock_labels(labels: dict[str, Any]) -> None:
    """Remove a lock record, e.g. one a retry copied from the attempt before."""
    for label in LOCK_LABELS:
        labels.pop(label, None)


def _parse(parser: Any, label: str, value: object) -> Any:  # noqa: ANN401 (each parser has its own type)
    try:
        hash(value)
    except TypeError:  # an unhashable raw value (a list) skips the cache
        parser = parser.__wrapped__
    try:
        return parser(value)
    except ValueError as exc:
        msg = f"invalid value {value!r} for label {label!r}: {exc}"
        raise ValueError(msg) from None


@functools.lru_cache(maxsize=256, typed=True)
def _parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    msg = "expected a boolean (True or False)"
    raise ValueError(msg)


@functools.lru_cache(maxsize=256, typed=True)
def _parse_ttl(value: object) -> int:
    if isinstance(value, bool):
        msg = "expected a whole number of seconds, not a boolean"
        raise ValueError(msg)
    if isinstance(value, int):
        seconds = value
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        seconds = int(value)
    else:
        msg = "expected a whole number of seconds"
        raise ValueError(msg)
    if not 1 <= seconds <= MAX_TTL:
        msg = f"the TTL must be from 1 to {MAX_TTL} seconds (ten years)"
        raise ValueError(msg)
    return seconds


@functools.lru_cache(maxsize=256, typed=True)
def _parse_key(value: object) -> str:
    if not isinstance(value, str):
        msg = "expected a string"
        raise ValueError(msg)
    if not value:
        msg = "the key must not be empty"
        raise ValueError(msg)
    if value == "None":
        # with_labels(deduplication_key=None) arrives as this string: it would
        # silently make every call share one lock.
        msg = "None is not a key; leave the label out to fingerprint the call"
        raise ValueError(msg)
    return value


@functools.lru_cache(maxsize=256, typed=True)
def _parse_key_fields(value: object) -> tuple[str, ...]:
    names: object = value
    if isinstance(value, str):
        # "['user_id']" is how a list label arrives; '["user_id"]' (JSON) parses too.
        try:
            names = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            msg = "expected a list of keyword argument names, such as ['user_id']"
            raise ValueError(msg) from None
    if not isinstance(names, (list, tuple)) or not names:
        msg = "expected a non-empty list of keyword argument names, such as ['user_id']"
        raise ValueError(msg)
    for name in names:
        if not (isinstance(name, str) and name.isidentifier()):
            msg = f"{name!r} is not a keyword argument name"
            raise ValueError(msg)
    return tuple(dict.fromkeys(names))
