"""A lock as ``taskiq dedup`` prints it: a table row, the lines of ``show``, a JSON object.

A lock's record (its task name, policy, age, and whether a broker accepted its
send) is shown where the lock has one; a lock taken by an older version, which
has none, prints as it always did. A limit of runs prints as a row of the table
of ``limits``, or as a JSON object of `LimitInfo`'s fields.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from taskiq_deduplication.locks import LimitInfo, LockInfo


def print_table(locks: Sequence[LockInfo], file: Any = None) -> None:  # noqa: ANN401 (a text stream)
    """Print ``locks`` as the table of ``taskiq dedup list`` (nothing for none)."""
    if not locks:
        return
    # What the locks record, in columns of their own when any lock has a record
    # (locks of an older version alone print as they always did).
    recorded = any(lock.policy is not None for lock in locks)
    head = ("TASK", "POLICY", "AGE", "SENT") if recorded else ()
    rows = [("KEY", "HOLDER TASK ID", *head, "TIME LEFT")] + [
        (
            lock.key,
            lock.holder_task_id or "-",
            *(_record(lock) if recorded else ()),
            time_left(lock),
        )
        for lock in locks
    ]
    _print_rows(rows, file)


def _print_rows(rows: Sequence[tuple[str, ...]], file: Any) -> None:  # noqa: ANN401 (a text stream)
    """Print ``rows`` in columns as wide as their widest cell (the last one as it is)."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [f"{cell:<{width}}" for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]), file=file)


def _record(lock: LockInfo) -> tuple[str, str, str, str]:
    """A lock's record as table cells: task name, policy, age, whether sent."""
    if lock.policy is None:
        return ("-", "-", "-", "-")
    sent = "?" if lock.sent is None else "yes" if lock.sent else "not yet"
    return (lock.task_name or "-", lock.policy, _age(lock), sent)


def print_lock(lock: LockInfo) -> None:
    """Print one lock as ``taskiq dedup show`` does: a field a line."""
    lines = [
        ("key", lock.key),
        ("name", lock.name or "-"),
        ("holder task id", lock.holder_task_id or "- (the value is not a lock's)"),
        ("owner token", lock.owner or "-"),
        ("time left", time_left(lock)),
    ]
    if lock.policy is not None:  # a lock that records what it is for
        lines[3:3] = [
            ("task name", lock.task_name or "- (not recorded: record_task_name)"),
            ("policy", lock.policy),
            ("age", _age(lock)),
            (
                "sent",
                "yes: a broker accepted it"
                if lock.sent
                else "not yet: the broker has not accepted the holder's send",
            ),
        ]
    for label, value in lines:
        print(f"{label:<15} {value}")


def _age(lock: LockInfo) -> str:
    return "?" if lock.age is None else f"{round(lock.age * 1000)} ms"


def time_left(lock: LockInfo) -> str:
    """What is left of ``lock``'s TTL, in milliseconds, or ``?`` if unknown."""
    ttl_ms = _ttl_ms(lock)
    return "?" if ttl_ms is None else f"{ttl_ms} ms"


def _ttl_ms(lock: LockInfo) -> int | None:
    return None if lock.ttl is None else round(lock.ttl * 1000)


def as_dict(lock: LockInfo) -> dict[str, Any]:
    """The lock as the JSON output shows it (a record's fields only where it has one)."""
    shown: dict[str, Any] = {
        "key": lock.key,
        "name": lock.name,
        "holder_task_id": lock.holder_task_id,
        "owner_token": lock.owner,
        "ttl_ms": _ttl_ms(lock),
    }
    if lock.policy is not None:
        shown |= {
            "task_name": lock.task_name,
            "policy": lock.policy,
            "age_ms": None if lock.age is None else round(lock.age * 1000),
            "sent": lock.sent,
        }
    return shown


def print_limits(limits: Sequence[LimitInfo], file: Any = None) -> None:  # noqa: ANN401 (a text stream)
    """Print ``limits`` as the table of ``taskiq dedup limits`` (nothing for none)."""
    if not limits:
        return
    rows = [("LIMIT", "IN USE", "RATE", "WAITING")] + [
        (limit.name, in_use(limit), limit.rate or "-", str(limit.waiting)) for limit in limits
    ]
    _print_rows(rows, file)


def in_use(limit: LimitInfo) -> str:
    """The runs that hold a slot of ``limit``, of how many: ``"2/5"``; ``"-"`` without one."""
    return "-" if limit.concurrency is None else f"{limit.in_use}/{limit.concurrency}"


def limit_as_dict(limit: LimitInfo) -> dict[str, Any]:
    """The limit as the JSON output shows it: `LimitInfo`'s fields."""
    return dataclasses.asdict(limit)
