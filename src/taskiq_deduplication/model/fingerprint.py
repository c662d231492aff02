"""The fingerprint of a task call: a SHA-256 digest of a canonical encoding.

Two calls get the same fingerprint exactly when a worker would receive the same
call: the same task name, the same positional arguments and the same keyword
arguments (in any order). Values are compared as taskiq sends them, as JSON:
``1``, ``1.0``, ``"1"`` and ``True`` differ; a ``UUID`` and its string, or a
pydantic model and the dict it dumps to, do not. Values that JSON alone cannot
encode (UUID, datetime, Decimal, pydantic models, dataclasses, enums, sets,
bytes, ...) are encoded deterministically, so a set fingerprints the same in
every process whatever its iteration order, and bytes that are not UTF-8 (which
only a non-JSON formatter can send) are encoded as base64.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import ipaddress
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
import pydantic_core

from taskiq_deduplication.exceptions import UnfingerprintableError

__all__ = ["call_fingerprint", "fields_fingerprint", "schedule_fingerprint"]

_JSON_SCALARS = (str, int, float, bool, type(None))
# Encoded as their str(), which is what a recent pydantic-core gives too (so the
# fingerprints stay the same); older ones (pydantic 2.0.x) cannot encode them.
_AS_STRING = (
    uuid.UUID,
    ipaddress.IPv4Address,
    ipaddress.IPv6Address,
    ipaddress.IPv4Interface,
    ipaddress.IPv6Interface,
    ipaddress.IPv4Network,
    ipaddress.IPv6Network,
)


def call_fingerprint(task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """Fingerprint a whole call: task name, positional and keyword arguments.

    Args:
        task_name: Name of the task.
        args: Positional arguments, as in the message.
        kwargs: Keyword arguments, as in the message.

    Returns:
        The SHA-256 digest, in unpadded base64url (43 characters).

    Raises:
        TypeError: An argument has a type that cannot be encoded.
    """
    return _digest(task_name, [task_name, list(args), dict(kwargs)])


def fields_fingerprint(task_name: str, fields: Mapping[str, Any]) -> str:
    """Fingerprint a task name and a chosen subset of its keyword arguments.

    The encoding has a different shape from `call_fingerprint`'s, so a
    fields fingerprint never equals a whole-call one.

    Args:
        task_name: Name of the task.
        fields: The keyword arguments that make up the key.

    Returns:
        The SHA-256 digest, in unpadded base64url (43 characters).

    Raises:
        TypeError: An argument has a type that cannot be encoded.
    """
    return _digest(task_name, [task_name, dict(fields)])


def schedule_fingerprint(task_name: str, schedule: Mapping[str, Any]) -> str:
    """Fingerprint what a schedule is: its task and the fields that say what and when it sends.

    The encoding has a shape of its own, so it never equals a call's fingerprint.

    Args:
        task_name: Name of the scheduled task.
        schedule: The schedule's fields (arguments, labels, cron, interval, time...).

    Returns:
        The SHA-256 digest, in unpadded base64url (43 characters).

    Raises:
        TypeError: A field has a type that cannot be encoded.
    """
    return _digest(task_name, ["schedule", task_name, dict(schedule)])


def _digest(task_name: str, call: list[Any]) -> str:
    try:
        canonical = _canonical(call, depth=0)
        encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        msg = (
            f"cannot fingerprint the arguments of task {task_name!r}: {exc}. "
            "Pass values that taskiq can serialise, or set the 'deduplication_key' "
            "label to choose the lock key yourself."
        )
        raise UnfingerprintableError(msg) from None
    digest = hashlib.sha256(encoded.encode("utf-8", "surrogatepass")).digest()
    # base64url rather than hex: the whole digest in 43 characters, not 64, which
    # keeps a lock key (and so Redis memory per lock) small.
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


_MAX_DEPTH = 200


def _canonical(value: Any, depth: int) -> Any:  # noqa: ANN401 (any argument value)
    """Turn ``value`` into plain JSON data that encodes it deterministically."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if depth > _MAX_DEPTH:
        msg = "arguments nested too deeply (a circular reference?)"
        raise ValueError(msg)
    depth += 1
    if isinstance(value, Mapping):
        return {_canonical_key(k): _canonical(v, depth) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item, depth) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(item, depth) for item in value), key=_sort_key)
    if isinstance(value, _AS_STRING):
        return str(value)
    return _canonical(_plainer(value), depth)


def _plainer(value: object) -> Any:  # noqa: ANN401 (a value on its way to plain data)
    """One step from a value JSON cannot encode towards plain data."""
    if isinstance(value, pydantic.BaseModel):
        # Python mode keeps nested sets as sets, so their order is fixed by the caller.
        return value.model_dump(mode="python")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bytes, bytearray)):
        try:
            return value.decode("utf-8")  # as taskiq's JSON formatter sends it
        except UnicodeDecodeError:
            # Only other formatters can send these; the NUL keeps them apart from any str key.
            return {"\x00bytes": base64.b64encode(value).decode("ascii")}
    try:
        return pydantic_core.to_jsonable_python(value)
    except pydantic_core.PydanticSerializationError:
        msg = f"values of type {type(value).__qualname__} cannot be encoded"
        raise TypeError(msg) from None


def _canonical_key(key: object) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, _JSON_SCALARS):
        # The same spelling json gives a non-string key: 1 -> "1", None -> "null".
        return json.dumps(key)
    return _sort_key(_canonical(key, depth=0))


def _sort_key(item: object) -> str:
    return json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
