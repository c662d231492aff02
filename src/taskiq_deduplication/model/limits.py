"""Keyed flow control: what the ``limit_*`` labels ask for, and the keys of a limit.

A limit is "at most N runs of this kind at once" (``limit_concurrency``) and "at
most N run starts per period" (``limit_rate``, with ``limit_burst``), shared by
every run that names the same limit: its ``limit_key`` (by default the task's
own name), one per value of its ``limit_key_fields``. Limits act when a run
starts and never refuse a send; the sender checks the labels so that a bad one
fails the ``kiq``, and the worker reads them again, tolerant of what a sender
without this middleware wrote. Nothing here talks to Redis.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from taskiq_deduplication.exceptions import InvalidSettingError
from taskiq_deduplication.model.fingerprint import fields_fingerprint
from taskiq_deduplication.model.formats import KEY_SEPARATOR, SIDE_SEPARATOR
from taskiq_deduplication.model.settings import parse_key, parse_key_fields

if TYPE_CHECKING:
    from collections.abc import Mapping

    from taskiq import TaskiqMessage

CONCURRENCY_LABEL: Final = "limit_concurrency"
RATE_LABEL: Final = "limit_rate"
BURST_LABEL: Final = "limit_burst"
KEY_LABEL: Final = "limit_key"
KEY_FIELDS_LABEL: Final = "limit_key_fields"
#: Every label of a limit.
LABELS: Final = (CONCURRENCY_LABEL, RATE_LABEL, BURST_LABEL, KEY_LABEL, KEY_FIELDS_LABEL)
LIMIT_LABEL_START: Final = "limit_"

#: The most runs of one limit at once, and the most starts in one period: far
#: beyond what one key of Redis is for (a holder is a member of a sorted set).
MAX_COUNT: Final = 100_000
#: The longest period of a rate: one day.
_MAX_PERIOD_S: Final = 86_400
_UNITS: Final = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
_RATE: Final = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([a-z]+)\s*$")

#: The keys of one limit, after ``<prefix>#limit:{<name>}``: who runs (the base
#: itself), their run tokens, who waits and until when, and the limit's own record.
_KINDS: Final = ("", ":tokens", ":waiting", ":leases", ":meta")
LIMIT_KIND: Final = "limit"


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` run starts per ``period_s`` seconds, ``burst`` of them at once."""

    count: int
    period_s: int
    burst: int = 1

    @property
    def interval_us(self) -> int:
        """Microseconds between two starts at the steady rate (rounded up: never faster)."""
        return math.ceil(self.period_s * 1_000_000 / self.count)

    @property
    def tolerance_us(self) -> int:
        """How far ahead of the steady rate a start may come: ``burst - 1`` intervals."""
        return (self.burst - 1) * self.interval_us

    def __str__(self) -> str:
        """The rate as its label spells it: ``"10/s"``, ``"2/5s"``."""
        for unit, seconds in (("h", 3600), ("m", 60)):
            if self.period_s % seconds == 0:
                times = self.period_s // seconds
                return f"{self.count}/{'' if times == 1 else times}{unit}"
        return f"{self.count}/{'' if self.period_s == 1 else self.period_s}s"


@dataclass(frozen=True, slots=True)
class LimitRule:
    """What a task's (or a call's) ``limit_*`` labels ask for."""

    concurrency: int | None
    """At most this many runs of the limit at once, or ``None``."""
    rate: Rate | None
    """At most so many starts per period, or ``None``."""
    key: str | None
    """The limit's name, shared by every task that names it; ``None``: the task's own."""
    key_fields: tuple[str, ...] | None
    """Keyword arguments that make one limit per value, or ``None``."""

    def name_of(self, message: TaskiqMessage) -> str:
        """The name of the limit that a run of ``message`` counts against.

        The limit's key (or the task's name), and with key fields the digest of
        their values: never the values themselves, which may be secret.

        Raises:
            TypeError: A key field's value cannot be fingerprinted.
        """
        base = self.key if self.key is not None else message.task_name
        if self.key_fields is None:
            return base
        present = {f: message.kwargs[f] for f in self.key_fields if f in message.kwargs}
        if all(type(value) in _PLAIN for value in present.values()):
            return _fields_name(base, tuple(present.items()))
        return _fields_name.__wrapped__(base, tuple(present.items()))


#: The types of argument values whose limit names are remembered: values equal
#: to each other only when they fingerprint alike (unlike ``1``, ``1.0``, ``True``).
_PLAIN: Final = (str, int)


@functools.lru_cache(maxsize=4096)
def _fields_name(base: str, fields: tuple[tuple[str, Any], ...]) -> str:
    """A limit's name from its base and its key fields' values (a digest of them)."""
    return f"{base}{KEY_SEPARATOR}{fields_fingerprint(base, dict(fields))[:22]}"


@dataclass(frozen=True, slots=True)
class LimitKeys:
    """The Redis keys of one limit, all in one hash slot (``{<name>}``).

    The first is also the channel on which a freed slot is handed to its next
    waiter.
    """

    holders: str
    tokens: str
    waiting: str
    leases: str
    meta: str

    @property
    def all(self) -> list[str]:
        """The keys in the order ``limit.lua`` takes them."""
        return [self.holders, self.tokens, self.waiting, self.leases, self.meta]


def limit_keys(prefix: str, name: str) -> LimitKeys:
    """The keys of the limit ``name`` under ``prefix``."""
    base = f"{prefix}{SIDE_SEPARATOR}{LIMIT_KIND}{KEY_SEPARATOR}{{{name}}}"
    return LimitKeys(*(base + kind for kind in _KINDS))


def limit_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern for the record of every limit under ``prefix``."""
    literal = re.sub(r"([*?\[\]\\])", r"\\\1", prefix)
    return f"{literal}{SIDE_SEPARATOR}{LIMIT_KIND}{KEY_SEPARATOR}{{*}}{_KINDS[-1]}"


def limit_name(prefix: str, meta_key: str) -> str | None:
    """The name of the limit whose record is ``meta_key``, or ``None`` if it is none."""
    head = f"{prefix}{SIDE_SEPARATOR}{LIMIT_KIND}{KEY_SEPARATOR}{{"
    tail = "}" + _KINDS[-1]
    if not (meta_key.startswith(head) and meta_key.endswith(tail)):
        return None
    return meta_key[len(head) : -len(tail)] or None


def read_limit(labels: Mapping[str, Any]) -> LimitRule | None:
    """The limit ``labels`` ask for, or ``None``; strict, as the sender and startup check.

    Raises:
        ValueError: A limit label has a bad value, or names a limit without
            one (``limit_key`` without ``limit_concurrency`` or ``limit_rate``);
            the message names the label.
    """
    for label in labels:
        if label.startswith(LIMIT_LABEL_START) and label not in LABELS:
            close = difflib.get_close_matches(label, LABELS, n=1, cutoff=0.8)
            if close:
                msg = f"unknown label {label!r} (did you mean {close[0]!r}?)"
                raise InvalidSettingError(msg)
    values = tuple(_text_of(labels.get(label)) for label in LABELS)
    return _read(*values)


def read_limit_leniently(labels: Mapping[str, Any]) -> LimitRule | ValueError | None:
    """`read_limit` on a worker: a bad label is returned, to be said, not raised."""
    try:
        return _read(*(_text_of(labels.get(label)) for label in LABELS))
    except ValueError as exc:
        return exc


def _text_of(value: object) -> object:
    """A label's value as the cache can key it: lists as their text, as taskiq sends them."""
    return str(value) if isinstance(value, (list, tuple)) else value


@functools.lru_cache(maxsize=256)
def _read(
    concurrency: object, rate: object, burst: object, key: object, key_fields: object
) -> LimitRule | None:
    if concurrency is None and rate is None:
        for label, value in (
            (BURST_LABEL, burst),
            (KEY_LABEL, key),
            (KEY_FIELDS_LABEL, key_fields),
        ):
            if value is not None:
                msg = f"label {label!r} needs {CONCURRENCY_LABEL!r} or {RATE_LABEL!r}"
                raise InvalidSettingError(msg + ": it names no limit")
        return None
    if burst is not None and rate is None:
        msg = f"label {BURST_LABEL!r} needs {RATE_LABEL!r}"
        raise InvalidSettingError(msg)
    bursts = 1 if burst is None else _labelled(BURST_LABEL, burst, _count)
    return LimitRule(
        concurrency=None
        if concurrency is None
        else _labelled(CONCURRENCY_LABEL, concurrency, _count),
        rate=None if rate is None else _labelled(RATE_LABEL, rate, _rate, bursts),
        key=None if key is None else _labelled(KEY_LABEL, key, parse_key),
        key_fields=None
        if key_fields is None
        else _labelled(KEY_FIELDS_LABEL, key_fields, parse_key_fields),
    )


def _labelled(label: str, value: object, parser: Any, *more: object) -> Any:  # noqa: ANN401 (each parser has its own type)
    try:
        return parser(value, *more)
    except ValueError as exc:
        msg = f"invalid value {value!r} for label {label!r}: {exc}"
        raise InvalidSettingError(msg) from None


def _count(value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        msg = "expected a whole number"
        raise ValueError(msg)
    if not 1 <= value <= MAX_COUNT:
        msg = f"expected from 1 to {MAX_COUNT}"
        raise ValueError(msg)
    return value


def _rate(value: object, burst: int) -> Rate:
    match = _RATE.match(value) if isinstance(value, str) else None
    unit = _UNITS.get(match.group(3)) if match else None
    if match is None or unit is None:
        msg = 'expected "N/s", "N/m" or "N/h" (or a multiple of the unit: "N/5s")'
        raise ValueError(msg)
    count = int(match.group(1))
    period = int(match.group(2) or 1) * unit
    if not 1 <= count <= MAX_COUNT:
        msg = f"the count must be from 1 to {MAX_COUNT}"
        raise ValueError(msg)
    if not 1 <= period <= _MAX_PERIOD_S:
        msg = f"the period must be from 1 second to {_MAX_PERIOD_S} seconds (one day)"
        raise ValueError(msg)
    return Rate(count, period, burst)
