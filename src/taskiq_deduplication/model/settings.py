"""Every setting, read once: an option and its label alike.

An option and its label (``default_ttl``, ``deduplication_ttl``) are parsed by
one function, which reads a label's string form too: taskiq turns every label
into a string before any middleware sees it (``deduplication=False`` arrives as
``"False"``, ``deduplication_key_fields=["a"]`` as ``"['a']"``), and scheduled
sends lose even the type table the worker uses to turn them back. Options are
typed values, never read from a string. Labels are strict on the sender and
tolerant on the worker, and parsed once per raw value.
"""

from __future__ import annotations

import ast
import difflib
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from taskiq_deduplication.exceptions import InvalidSettingError
from taskiq_deduplication.model.policies import FINISHED, POLICIES, Policy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from taskiq.abc.broker import AsyncBroker

ENABLED_LABEL: Final = "deduplication"
TTL_LABEL: Final = "deduplication_ttl"
KEY_LABEL: Final = "deduplication_key"
KEY_FIELDS_LABEL: Final = "deduplication_key_fields"
RUNNING_TTL_LABEL: Final = "deduplication_running_ttl"
UNTIL_LABEL: Final = "deduplication_until"
SUCCESS_TTL_LABEL: Final = "deduplication_success_ttl"
MERGE_LABEL: Final = "deduplication_merge"
DEBOUNCE_LABEL: Final = "deduplication_debounce"
DEBOUNCE_MAX_LABEL: Final = "deduplication_debounce_max"
EXCLUSIVE_LABEL: Final = "deduplication_exclusive"
#: Every label a user may set; a task label that starts like them but is none
#: of them is a typo, reported when the broker starts.
USER_LABELS: Final = (
    ENABLED_LABEL,
    TTL_LABEL,
    KEY_LABEL,
    KEY_FIELDS_LABEL,
    RUNNING_TTL_LABEL,
    UNTIL_LABEL,
    SUCCESS_TTL_LABEL,
    MERGE_LABEL,
    DEBOUNCE_LABEL,
    DEBOUNCE_MAX_LABEL,
    EXCLUSIVE_LABEL,
)
_USER_LABEL_PREFIX: Final = "deduplication"

#: The longest lock TTL, in seconds (ten years): far beyond any task, and well
#: inside what Redis can store as an expiry in milliseconds.
MAX_TTL: Final = 10 * 365 * 24 * 3600

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


@dataclass(frozen=True, slots=True)
class Defaults:
    """What a send gets when its labels say nothing: the middleware's options."""

    enabled: bool
    ttl: int
    policy: Policy = FINISHED
    success_ttl: int = 0
    """Seconds a lock stays after success, for the policies that remember it."""
    heartbeat: bool = True
    """Whether the heartbeat is on; a running lease needs it."""
    exclusive: bool = True
    """Whether runs of one lock key wait for each other."""


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
    policy: Policy = FINISHED
    success_ttl: int = 0
    """Seconds the lock stays after a successful run (0 for the policies without it)."""
    merge: tuple[int, int] | None = None
    """For a task whose calls merge while one is queued: the quiet period and
    the maximum wait of its debounce in milliseconds (0 and 0: no debounce)."""
    exclusive: bool = True
    """Whether a run waits for another run of the same lock key to end first."""


def read_send_options(labels: Mapping[str, Any], defaults: Defaults) -> SendOptions | None:
    """Read the deduplication labels of a message about to be sent.

    Args:
        labels: The message's labels.
        defaults: What the middleware's options say when a label is absent.

    Returns:
        The options, or ``None`` when deduplication is off for this send.

    Raises:
        ValueError: A label has a value that is not valid, alone or with the
            others; the message names the label and the value.
    """
    _check_known(labels)
    enabled = labels.get(ENABLED_LABEL)
    if not (
        defaults.enabled
        if enabled is None
        else _parse(_parse_bool, ENABLED_LABEL, enabled, text=True)
    ):
        return None
    ttl = labels.get(TTL_LABEL)
    key = labels.get(KEY_LABEL)
    fields = labels.get(KEY_FIELDS_LABEL)
    running_ttl = labels.get(RUNNING_TTL_LABEL)
    until = labels.get(UNTIL_LABEL)
    success_ttl = labels.get(SUCCESS_TTL_LABEL)
    exclusive = labels.get(EXCLUSIVE_LABEL)
    policy = (
        defaults.policy if until is None else _parse(_parse_until, UNTIL_LABEL, until, text=True)
    )
    if running_ttl is not None and not (defaults.heartbeat and policy.heartbeat):
        reason = (
            "the heartbeat (heartbeat=True)"
            if policy.heartbeat
            else f"a policy with a heartbeat, not {UNTIL_LABEL}={policy.name!r}"
        )
        msg = f"label {RUNNING_TTL_LABEL!r} needs {reason}"
        raise InvalidSettingError(msg)
    if success_ttl is None:
        remembered = defaults.success_ttl if policy.remembers_success else 0
    else:
        remembered = _parse(_parse_success_ttl, SUCCESS_TTL_LABEL, success_ttl, text=True)
        if remembered and not policy.remembers_success:
            msg = (
                f"label {SUCCESS_TTL_LABEL!r} ({remembered}s) needs "
                f"{UNTIL_LABEL}='finished', not {policy.name!r}: only a lock held until "
                "its task finished can be kept after a success"
            )
            raise InvalidSettingError(msg)
    return SendOptions(
        ttl=defaults.ttl if ttl is None else _parse(_parse_ttl, TTL_LABEL, ttl, text=True),
        merge=_read_merge(labels),
        key=None if key is None else _parse(_parse_key, KEY_LABEL, key),
        key_fields=None if fields is None else _parse(_parse_key_fields, KEY_FIELDS_LABEL, fields),
        running_ttl=(
            None
            if running_ttl is None
            else _parse(_parse_ttl, RUNNING_TTL_LABEL, running_ttl, text=True)
        ),
        policy=policy,
        success_ttl=remembered,
        exclusive=(
            defaults.exclusive
            if exclusive is None
            else _parse(_parse_bool, EXCLUSIVE_LABEL, exclusive, text=True)
        ),
    )


def _read_merge(labels: Mapping[str, Any]) -> tuple[int, int] | None:
    merge = labels.get(MERGE_LABEL)
    quiet = labels.get(DEBOUNCE_LABEL)
    longest = labels.get(DEBOUNCE_MAX_LABEL)
    merging = merge is not None and _parse(_parse_merge, MERGE_LABEL, merge)
    if quiet is None:
        if longest is not None:
            msg = f"label {DEBOUNCE_MAX_LABEL!r} needs {DEBOUNCE_LABEL!r}, the quiet period"
            raise InvalidSettingError(msg)
        return (0, 0) if merging else None
    if merge is not None and not merging:
        msg = f"label {DEBOUNCE_LABEL!r} merges the calls it waits for: it needs {MERGE_LABEL!r}"
        msg += " to be 'latest' or absent"
        raise InvalidSettingError(msg)
    quiet_ms = _parse(_parse_period, DEBOUNCE_LABEL, quiet)
    longest_ms = 0 if longest is None else _parse(_parse_period, DEBOUNCE_MAX_LABEL, longest)
    if longest_ms and longest_ms < quiet_ms:
        msg = (
            f"label {DEBOUNCE_MAX_LABEL!r} ({longest_ms / 1000:g}s) must not be shorter "
            f"than {DEBOUNCE_LABEL!r} ({quiet_ms / 1000:g}s)"
        )
        raise InvalidSettingError(msg)
    return quiet_ms, longest_ms


def check_task_labels(
    tasks: Iterable[tuple[str, Mapping[str, Any]]],
    defaults: Defaults,
    checks: Iterable[Callable[[Mapping[str, Any]], object]] = (),
) -> None:
    """Check the labels of registered tasks as their sends will, all at once.

    Args:
        tasks: Each task's name and the labels it was declared with.
        defaults: The middleware's options.
        checks: More checks of a task's labels, each raising ``ValueError``
            (the limits' labels).

    Raises:
        ValueError: One or more tasks have a bad or unknown deduplication
            label; the message lists each, task by task.
    """
    problems: list[str] = []
    for name, task_labels in tasks:
        found = [_unknown(label) for label in task_labels if _is_unknown(label)]
        try:
            read_send_options(
                {k: v for k, v in task_labels.items() if not _is_unknown(k)}, defaults
            )
        except ValueError as exc:
            found.append(str(exc))
        for check in checks:
            try:
                check(task_labels)
            except ValueError as exc:  # noqa: PERF203 (each check's problem, said)
                found.append(str(exc))
        problems += (f"  {name}: {problem}" for problem in found)
    if problems:
        count = len(problems)
        msg = f"{count} bad deduplication label{'s' if count > 1 else ''}:\n" + "\n".join(problems)
        raise InvalidSettingError(msg)


def _is_unknown(label: str) -> bool:
    """Whether ``label`` reads like one of ours but is none of them: a typo."""
    return label.startswith(_USER_LABEL_PREFIX) and label not in USER_LABELS


def _unknown(label: str) -> str:
    close = difflib.get_close_matches(label, USER_LABELS, n=1)
    return f"unknown label {label!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _check_known(labels: Mapping[str, Any]) -> None:
    """Refuse a send with a label that reads like ours but is none of them (a typo)."""
    for label in labels:
        if _is_unknown(label):
            raise InvalidSettingError(_unknown(label))


def read_running_ttl(labels: Mapping[str, Any], *, default: int | None) -> int | None:
    """Read the running lease of a task about to run, in seconds, never raising.

    The sender checked the label already; a value it did not write (a sender
    without this middleware) falls back to ``default``.
    """
    value = labels.get(RUNNING_TTL_LABEL)
    if value is None:
        return default
    try:
        seconds: int = _uncached_if_unhashable(_parse_ttl, value)(value, text=True)
    except (TypeError, ValueError):
        return default
    return seconds


# Options


def check_bool(name: str, value: object) -> bool:
    """A yes-or-no option (labels such as ``deduplication`` are read alike)."""
    flag: bool = _option(_parse_bool, name, value)
    return flag


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    """The option ``name``: a whole number from ``minimum`` (to ``maximum``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name} must be a whole number of at least {minimum}, not {value!r}"
        raise InvalidSettingError(msg)
    if maximum is not None and value > maximum:
        msg = f"{name} must be at most {maximum}, not {value!r}"
        raise InvalidSettingError(msg)
    return value


def check_seconds(name: str, value: object) -> float:
    """The option ``name``: a finite number of seconds, at least 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        msg = f"{name} must be a finite number of seconds of at least 0, not {value!r}"
        raise InvalidSettingError(msg)
    return float(value)


def check_prefix(value: object) -> str:
    """The ``key_prefix`` option: a non-empty string that can be part of a Redis key."""
    if not isinstance(value, str) or not value:
        msg = f"key_prefix must be a non-empty string, not {value!r}"
        raise InvalidSettingError(msg)
    try:
        check_text(value)
    except ValueError as exc:
        msg = f"key_prefix {value!r} cannot be a Redis key: {exc}"
        raise InvalidSettingError(msg) from None
    return value


#: The running lease of a task whose worker has the heartbeat and no
#: ``running_ttl``: a worker that dies mid-task frees its calls within it.
DEFAULT_RUNNING_LEASE: Final = 30
#: ``redelivery_window`` unless set: past every broker's default redelivery
#: horizon (NATS ``ack_wait`` 30 s, a Streams reclaim after 10 minutes,
#: RabbitMQ's consumer timeout 30 minutes), with as long again to wait in a queue.
DEFAULT_REDELIVERY_WINDOW: Final = 3600


def check_running_ttl(value: object, heartbeat: bool, interval: float | None) -> int | None:  # noqa: FBT001 (checked options, passed on)
    """The ``running_ttl`` option: ``None`` (the default lease), 0 (none) or a lease in seconds."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None if value is None else 0
    seconds = check_ttl("running_ttl", value)
    if not heartbeat:
        msg = "running_ttl needs the heartbeat: a lease nobody refreshes lapses mid-run"
        raise InvalidSettingError(msg)
    if interval is not None and interval >= seconds:
        msg = (
            f"heartbeat_interval ({interval}s) must be shorter than running_ttl "
            f"({seconds}s), or the lease expires between refreshes"
        )
        raise InvalidSettingError(msg)
    return seconds


def default_lease(running_ttl: int | None, heartbeat: bool, interval: float | None) -> int | None:  # noqa: FBT001 (checked options, passed on)
    """The lease of a run whose label sets none, in seconds (``None``: none; see the option).

    Three ``heartbeat_interval`` where that is longer than the default, so that
    the interval a user chose is kept; none without the heartbeat to keep it.
    """
    if running_ttl is not None:
        return running_ttl or None
    if not heartbeat:
        return None
    if interval is None:
        return DEFAULT_RUNNING_LEASE
    return max(DEFAULT_RUNNING_LEASE, math.ceil(3 * interval))


def check_interval(value: object, default_ttl: int) -> float | None:
    """The ``heartbeat_interval`` option: ``None`` or seconds, checked against ``default_ttl``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        msg = f"heartbeat_interval must be a positive number of seconds or None, not {value!r}"
        raise InvalidSettingError(msg)
    if value >= default_ttl:
        msg = (
            f"heartbeat_interval ({value}s) must be shorter than default_ttl "
            f"({default_ttl}s), or the lock expires between refreshes"
        )
        raise InvalidSettingError(msg)
    return float(value)


def check_until(value: object) -> Policy:
    """The policy named by the ``default_until`` option, as its label names one."""
    policy: Policy = _option(_parse_until, "default_until", value)
    return policy


def check_success_ttl(value: object) -> int:
    """The ``default_success_ttl`` option, as its label: whole seconds, 0 for none."""
    seconds: int = _option(_parse_success_ttl, "default_success_ttl", value)
    return seconds


def check_ttl(name: str, value: object) -> int:
    """A TTL option (``default_ttl``, ``running_ttl``), as its label: 1 s to ten years."""
    seconds: int = _option(_parse_ttl, name, value)
    return seconds


class Options(Protocol):
    """The options that a send and a run read as the middleware has them now."""

    @property
    def key_prefix(self) -> str:
        """Prefix of every lock key (an application may set it after construction)."""

    @property
    def fail_open(self) -> bool:
        """Whether a Redis error lets a send or a run go on without its lock."""

    @property
    def heartbeat(self) -> bool:
        """Whether running tasks' locks are refreshed."""

    @property
    def heartbeat_interval(self) -> float | None:
        """Seconds between refreshes, if set."""

    @property
    def running_ttl(self) -> int | None:
        """The running lease in seconds, if the ``running_ttl`` option sets one."""

    @property
    def running_lease(self) -> int | None:
        """The running lease in seconds of a task whose label sets none (`default_lease`)."""

    @property
    def redelivery_window(self) -> int:
        """Seconds a call that succeeded is remembered for copies of its message (0: not)."""

    @property
    def broker(self) -> AsyncBroker:
        """The broker the middleware is registered on."""

    @property
    def record_task_name(self) -> bool:
        """Whether each lock records its task's name."""


# Parsers, each shared by an option and a label where both exist


def _parse(parser: Any, label: str, value: object, **how: bool) -> Any:  # noqa: ANN401 (each parser has its own type)
    """``value`` of ``label`` as ``parser`` reads it (``text=True``: from its string too)."""
    try:
        return _uncached_if_unhashable(parser, value)(value, **how)
    except ValueError as exc:
        msg = f"invalid value {value!r} for label {label!r}: {exc}"
        raise InvalidSettingError(msg) from None


def _option(parser: Any, name: str, value: object) -> Any:  # noqa: ANN401 (each parser has its own type)
    """``value`` of option ``name`` as ``parser`` reads a label's, but never from a string."""
    try:
        return _uncached_if_unhashable(parser, value)(value, text=False)
    except ValueError as exc:
        msg = f"invalid value {value!r} for option {name!r}: {exc}"
        raise InvalidSettingError(msg) from None


def _uncached_if_unhashable(parser: Any, value: object) -> Any:  # noqa: ANN401
    try:
        hash(value)
    except TypeError:  # an unhashable raw value (a list) skips the cache
        return parser.__wrapped__
    return parser


@functools.lru_cache(maxsize=256, typed=True)
def _parse_bool(value: object, *, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    msg = "expected a boolean (True or False)"
    raise ValueError(msg)


@functools.lru_cache(maxsize=256, typed=True)
def _parse_ttl(value: object, *, text: bool) -> int:
    return _whole_seconds(value, text=text, least=1, what="the TTL")


def _whole_seconds(value: object, *, text: bool, least: int, what: str) -> int:
    """Whole seconds from ``least`` to ten years (from a string too, with ``text``)."""
    if isinstance(value, bool):
        msg = "expected a whole number of seconds, not a boolean"
        raise ValueError(msg)
    if text and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if not isinstance(value, int):
        msg = "expected a whole number of seconds"
        raise ValueError(msg)
    if not least <= value <= MAX_TTL:
        msg = f"{what} must be from {least} to {MAX_TTL} seconds (ten years)"
        raise ValueError(msg)
    return value


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
    check_text(value)
    return value


def parse_key(value: object) -> str:
    """A key as the ``deduplication_key`` label takes it (also a limit's); ``ValueError`` if not."""
    return _parse_key(value)


def parse_key_fields(value: object) -> tuple[str, ...]:
    """Key fields as ``deduplication_key_fields`` takes them (a limit's too), or ``ValueError``."""
    fields: tuple[str, ...] = _uncached_if_unhashable(_parse_key_fields, value)(value)
    return fields


def check_text(value: str) -> None:
    """Check that Redis can take ``value`` as text (UTF-8); raise ``ValueError`` if not.

    A lone surrogate is what ``os.fsdecode`` and ``os.listdir`` give for a file
    name that is not UTF-8: no Redis client can send it.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = (
            f"it is not UTF-8 text: a lone surrogate at position {exc.start} (a file "
            "name that is not UTF-8 reads so; encode it, e.g. with os.fsencode(name).hex())"
        )
        raise ValueError(msg) from None


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


@functools.lru_cache(maxsize=64, typed=True)
def _parse_until(value: object, *, text: bool) -> Policy:
    name = value.strip().lower() if text and isinstance(value, str) else value
    policy = POLICIES.get(name) if isinstance(name, str) else None
    if policy is None:
        msg = f"expected one of {', '.join(map(repr, POLICIES))}"
        raise ValueError(msg)
    return policy


@functools.lru_cache(maxsize=256, typed=True)
def _parse_success_ttl(value: object, *, text: bool) -> int:
    return _whole_seconds(value, text=text, least=0, what="the success TTL")


@functools.lru_cache(maxsize=64, typed=True)
def _parse_merge(value: object) -> bool:
    name = value.strip().lower() if isinstance(value, str) else value
    if name == "latest":
        return True
    if name in {"off", "none", "false"} or name is False:
        return False
    msg = "expected 'latest' (or 'off')"
    raise ValueError(msg)


@functools.lru_cache(maxsize=256, typed=True)
def _parse_period(value: object) -> int:
    """Seconds (a whole or decimal number, above 0) as milliseconds."""
    if isinstance(value, bool):
        msg = "expected a number of seconds, not a boolean"
        raise ValueError(msg)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            msg = "expected a number of seconds"
            raise ValueError(msg) from None
    if not isinstance(value, (int, float)) or not 0 < value <= MAX_TTL:
        msg = f"expected a number of seconds above 0, at most {MAX_TTL} (ten years)"
        raise ValueError(msg)
    return max(round(value * 1000), 1)
