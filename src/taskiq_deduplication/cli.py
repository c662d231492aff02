"""``taskiq dedup``: list, inspect and release the locks in Redis, and find a call's key.

A plugin of taskiq's command line, registered in the ``taskiq_cli`` entry-point
group as ``taskiq worker`` and ``taskiq scheduler`` are::

    taskiq dedup list [--url URL] [--prefix P] [--match GLOB] [--json]
    taskiq dedup show KEY [--url URL] [--prefix P] [--json]
    taskiq dedup release [KEY ...] [--match GLOB] [--yes] [--url URL] [--prefix P] [--json]
    taskiq dedup key MODULE:BROKER TASK_NAME [--args JSON] [--kwargs JSON] [--labels JSON]

``--url`` falls back to ``REDIS_URL``. Exit codes: 0 done, 1 not found (no such
lock, or nothing released), 2 bad usage (options, JSON, an app or task that is
not there), 3 Redis failed (unreachable, or the user may not run a command).
Ctrl-C exits with 130. Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import io
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from taskiq.abc.broker import AsyncBroker
from taskiq.abc.cmd import TaskiqCMD
from taskiq.cli.utils import import_object

from taskiq_deduplication import _inspect as inspect
from taskiq_deduplication import _options as options
from taskiq_deduplication._formats import key_pattern, lock_key
from taskiq_deduplication._lock import REDIS_ERRORS
from taskiq_deduplication.middleware import RedisDeduplicationMiddleware

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from taskiq_deduplication._inspect import HeldLock, RedisClient

__all__ = ["DedupCMD", "ExitCode", "main"]

_PROG = "taskiq dedup"
_DEFAULT_PREFIX = "taskiq:deduplication"


class ExitCode(enum.IntEnum):
    """What the exit status of ``taskiq dedup`` says."""

    OK = 0
    """Done: the locks were listed, the lock is held, what was asked was released."""
    NOT_FOUND = 1
    """No such lock (``show``, ``key``), or not all were released (``release``)."""
    USAGE = 2
    """Bad options or JSON, no URL, or an app module, broker or task that is not there."""
    ERROR = 3
    """Redis could not be reached or refused a command (the user may not run it), or else failed."""
    INTERRUPTED = 130
    """Stopped with Ctrl-C, as shells report it."""


class _UsageError(Exception):
    """A mistake in the command line: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Say what is wrong in one line, not argparse's usage block."""
        raise _UsageError(f"{message} (see '{self.prog} --help')")


class DedupCMD(TaskiqCMD):
    """The ``taskiq dedup`` command, found by taskiq in the ``taskiq_cli`` entry points."""

    short_help = "List, inspect and release deduplication locks"

    def exec(self, args: Sequence[str]) -> int:
        """Run ``taskiq dedup`` with the arguments after ``dedup``.

        Args:
            args: The command line after ``taskiq dedup``.

        Returns:
            The exit status, an [ExitCode][taskiq_deduplication.cli.ExitCode].
        """
        return main(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` by default) and return its exit status.

    Args:
        argv: The arguments after ``taskiq dedup``.

    Returns:
        The exit status, an [ExitCode][taskiq_deduplication.cli.ExitCode].
    """
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")  # keys that are not UTF-8
    # What the middleware warns about while computing a key (a key field the call
    # lacks) is said the way the command's own messages are.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"{_PROG}: warning: %(message)s"))
    library = logging.getLogger("taskiq_deduplication")
    library.addHandler(handler)
    try:
        parsed = _parser().parse_args(argv)
        return int(asyncio.run(parsed.run(parsed)))
    except _UsageError as exc:
        return _fail(ExitCode.USAGE, str(exc))
    except REDIS_ERRORS as exc:
        return _fail(ExitCode.ERROR, f"Redis: {type(exc).__name__}: {_one_line(exc)}")
    except KeyboardInterrupt:
        return _fail(ExitCode.INTERRUPTED, "interrupted")
    except Exception as exc:  # noqa: BLE001 (one line, never a traceback, whatever failed)
        return _fail(ExitCode.ERROR, f"{type(exc).__name__}: {_one_line(exc)}")
    finally:
        library.removeHandler(handler)


def _parser() -> _Parser:
    parser = _Parser(
        prog=_PROG,
        description="List, inspect and release the locks of RedisDeduplicationMiddleware.",
        epilog=(
            "exit status: 0 done, 1 not found (no such lock, or nothing released), "
            "2 bad usage, 3 Redis (or anything else) failed"
        ),
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    redis = _Parser(add_help=False)
    redis.add_argument(
        "--url",
        help="Redis URL (redis://, rediss://, unix:// or redis+sentinel://host:port/service); "
        "default: $REDIS_URL",
    )
    redis.add_argument(
        "--prefix",
        default=_DEFAULT_PREFIX,
        help=f"the middleware's key_prefix (default: {_DEFAULT_PREFIX})",
    )
    output = _Parser(add_help=False)
    output.add_argument("--json", action="store_true", help="print JSON instead of text")

    listing = commands.add_parser(
        "list", parents=[redis, output], help="every lock held now, sorted by key"
    )
    listing.add_argument("--match", default="*", metavar="GLOB", help="a glob over lock names")
    listing.set_defaults(run=_list)

    show = commands.add_parser("show", parents=[redis, output], help="one lock")
    show.add_argument("key", metavar="KEY", help="the lock's key, or its name under --prefix")
    show.set_defaults(run=_show)

    release = commands.add_parser(
        "release", parents=[redis, output], help="delete locks, asking first unless --yes"
    )
    release.add_argument(
        "keys", nargs="*", metavar="KEY", help="lock keys, or names under --prefix"
    )
    release.add_argument("--match", metavar="GLOB", help="every lock whose name matches")
    release.add_argument("-y", "--yes", action="store_true", help="do not ask")
    release.set_defaults(run=_release)

    key = commands.add_parser(
        "key",
        parents=[output],
        help="the lock a call would take, and who holds it now",
        description="The key the call would take with the broker's deduplication "
        "middleware (its own code computes it), and whether a task holds it now.",
    )
    key.add_argument(
        "broker", metavar="MODULE:BROKER", help="the app's broker, as for taskiq worker"
    )
    key.add_argument("task_name", metavar="TASK_NAME", help="the task's name")
    key.add_argument("--args", default="[]", metavar="JSON", help="positional arguments")
    key.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments")
    key.add_argument("--labels", default="{}", metavar="JSON", help="labels of the call")
    key.add_argument("--url", help="Redis URL to look in (default: the middleware's own)")
    key.set_defaults(run=_key)
    for sub in (parser, listing, show, release, key):
        sub.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


# The commands


async def _list(args: argparse.Namespace) -> int:
    prefix = _prefix(args)
    async with _connected(args) as client:
        reading = inspect.Reading()
        locks = [
            lock
            async for batch in inspect.lock_batches(
                client, key_pattern(prefix, args.match), prefix, reading
            )
            for lock in batch
        ]
    locks.sort(key=lambda lock: lock.key)
    if args.json:
        _print_json([lock.as_dict() for lock in locks])
    else:
        _print_table(locks)
        print(f"{len(locks)} lock{'' if len(locks) == 1 else 's'} under {prefix}:{args.match}")
    _warn_ttl(reading)
    return ExitCode.OK


async def _show(args: argparse.Namespace) -> int:
    prefix = _prefix(args)
    key = _full_key(prefix, args.key)
    async with _connected(args) as client:
        reading = inspect.Reading()
        found = await inspect.read_locks(client, [key], prefix, reading)
    _warn_ttl(reading)
    if not found:
        if args.json:
            _print_json(None)
        return _fail(ExitCode.NOT_FOUND, f"no lock at {key!r}")
    (lock,) = found
    if args.json:
        _print_json(lock.as_dict())
    else:
        _print_lock(lock)
    return ExitCode.OK


async def _release(args: argparse.Namespace) -> int:
    prefix = _prefix(args)
    if not args.keys and args.match is None:
        raise _UsageError("name the locks to release: KEY ... or --match GLOB")
    async with _connected(args) as client:
        locks, complete = await _to_release(client, args, prefix)
        if not locks:
            if args.json:
                _print_json([])
            return _fail(ExitCode.NOT_FOUND, "nothing to release")
        if not args.yes and not _confirmed(locks):
            return _fail(ExitCode.NOT_FOUND, "nothing released")
        released = await inspect.release(client, locks)
    for lock, done in zip(locks, released, strict=True):
        if args.json:
            continue
        if done:
            print(f"released {lock.key} (held by task {lock.holder_task_id})")
        else:
            _say(f"not released {lock.key!r}: another send holds it now, or it expired")
    if args.json:
        _print_json(
            [
                {**lock.as_dict(), "released": done}
                for lock, done in zip(locks, released, strict=True)
            ]
        )
    return ExitCode.OK if complete and all(released) else ExitCode.NOT_FOUND


async def _to_release(
    client: RedisClient, args: argparse.Namespace, prefix: str
) -> tuple[list[HeldLock], bool]:
    """The locks the command line names, read now, and whether each named key held one."""
    keys = [_full_key(prefix, key) for key in args.keys]
    reading = inspect.Reading()
    found = await inspect.read_locks(client, keys, prefix, reading)
    if args.match is not None:
        pattern = key_pattern(prefix, args.match)
        async for batch in inspect.lock_batches(client, pattern, prefix, reading):
            found += batch
    by_key = {lock.key: lock for lock in found}
    complete = True
    for key in keys:
        if key not in by_key:
            _say(f"no lock at {key!r}")
            complete = False
    locks = []
    for lock in sorted(by_key.values(), key=lambda lock: lock.key):
        if lock.holder_task_id is None:
            _say(f"left alone {lock.key!r}: its value is not a lock of this library")
            complete = False
        else:
            locks.append(lock)
    return locks, complete


async def _key(args: argparse.Namespace) -> int:
    middleware, task_name = _app_middleware(args.broker, args.task_name)
    call_args = _json_argument("--args", args.args, list)
    call_kwargs = _json_argument("--kwargs", args.kwargs, dict)
    call_labels = _json_argument("--labels", args.labels, dict)
    broker = middleware.broker
    task = broker.find_task(task_name)
    assert task is not None  # noqa: S101 (found by _app_middleware)
    # The message exactly as kiq() builds it (labels turned into strings, models
    # into dicts), with the task's own labels under the call's.
    message = task.kicker().with_labels(**call_labels)._prepare_message(*call_args, **call_kwargs)  # noqa: SLF001 (taskiq's own way to build the message kiq sends)
    try:
        key = middleware._send_key(message)  # noqa: SLF001 (the middleware computes it, so the two cannot disagree)
    except (ValueError, TypeError) as exc:
        raise _UsageError(f"task {task_name!r}: {exc}") from None
    result: dict[str, Any] = {
        "task_name": task_name,
        "key": key,
        "held": False,
        "holder_task_id": None,
        "ttl_ms": None,
    }
    if key is None:
        if args.json:
            _print_json(result)
        else:
            print(f"task    {task_name}\nkey     none: deduplication is off for this call")
        return ExitCode.NOT_FOUND
    client, own = await _client_of(middleware, args.url)
    try:
        reading = inspect.Reading()
        found = await inspect.read_locks(client, [key], middleware.key_prefix, reading)
    finally:
        if own:
            await client.aclose()
    _warn_ttl(reading)
    lock = found[0] if found else None
    if args.json:
        if lock is not None:
            result |= {**lock.as_dict(), "held": True}
        _print_json(result)
    else:
        print(f"task    {task_name}\nkey     {key}")
        if lock is None:
            print("held    no: the call would take this lock now")
        else:
            print(f"held    yes, by task {lock.holder_task_id}, {_time_left(lock)}")
    return ExitCode.OK if lock is not None else ExitCode.NOT_FOUND


# What the commands share


def _prefix(args: argparse.Namespace) -> str:
    try:
        return options.check_prefix(args.prefix)
    except ValueError as exc:
        raise _UsageError(f"--prefix: {exc}") from None


def _full_key(prefix: str, key: str) -> str:
    """A lock key as given, or the key of the lock with that name under ``prefix``."""
    return key if key.startswith(f"{prefix}:") else lock_key(prefix, key)


@contextlib.asynccontextmanager
async def _connected(args: argparse.Namespace) -> AsyncIterator[RedisClient]:
    """The client for ``--url`` (or ``REDIS_URL``), closed at the end."""
    url = args.url or os.environ.get("REDIS_URL")
    if not url:
        raise _UsageError("no Redis URL: pass --url or set REDIS_URL")
    try:
        client = await inspect.connect(url)
    except ValueError as exc:
        raise _UsageError(f"--url {inspect.redacted(url)}: {exc}") from None
    try:
        yield client
    finally:
        await client.aclose()


async def _client_of(
    middleware: RedisDeduplicationMiddleware, url: str | None
) -> tuple[RedisClient, bool]:
    """The client for ``url``, else the middleware's own; and whether to close it after."""
    if not url:
        return middleware._new_client()  # noqa: SLF001 (the connection the middleware itself uses)
    try:
        return await inspect.connect(url), True
    except ValueError as exc:
        raise _UsageError(f"--url {inspect.redacted(url)}: {exc}") from None


def _app_middleware(spec: str, task_name: str) -> tuple[RedisDeduplicationMiddleware, str]:
    """The deduplication middleware of the broker ``spec``, which must know ``task_name``."""
    try:
        broker = import_object(spec)
    except Exception as exc:  # noqa: BLE001 (an app's import can fail any way; say how, in a line)
        raise _UsageError(f"cannot import {spec!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(broker, AsyncBroker):
        raise _UsageError(f"{spec!r} is a {type(broker).__name__}, not a taskiq broker")
    middleware = next(
        (m for m in broker.middlewares if isinstance(m, RedisDeduplicationMiddleware)), None
    )
    if middleware is None:
        raise _UsageError(f"broker {spec!r} has no RedisDeduplicationMiddleware")
    if broker.find_task(task_name) is None:
        known = ", ".join(sorted(broker.get_all_tasks())) or "none"
        raise _UsageError(f"broker {spec!r} has no task {task_name!r} (its tasks: {known})")
    return middleware, task_name


def _json_argument(option: str, text: str, kind: type[list[Any] | dict[str, Any]]) -> Any:  # noqa: ANN401 (a JSON list or object)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _UsageError(f"{option}: not JSON: {exc}") from None
    if not isinstance(value, kind):
        raise _UsageError(f"{option}: expected a JSON {'array' if kind is list else 'object'}")
    return value


def _confirmed(locks: Sequence[HeldLock]) -> bool:
    """Show ``locks`` and ask, on stderr, whether to release them; read the answer on stdin."""
    _print_table(locks, file=sys.stderr)
    count = len(locks)
    print(f"Release {count} lock{'' if count == 1 else 's'}? [y/N] ", end="", file=sys.stderr)
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if not answer.endswith("\n"):
        print(file=sys.stderr)
    return answer.strip().lower() in {"y", "yes"}


def _print_table(locks: Sequence[HeldLock], file: Any = None) -> None:  # noqa: ANN401 (a text stream)
    if not locks:
        return
    rows = [("KEY", "HOLDER TASK ID", "TIME LEFT")] + [
        (lock.key, lock.holder_task_id or "-", _time_left(lock)) for lock in locks
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for key, holder, left in rows:
        print(f"{key:<{widths[0]}}  {holder:<{widths[1]}}  {left}", file=file)


def _print_lock(lock: HeldLock) -> None:
    for label, value in (
        ("key", lock.key),
        ("name", lock.name or "-"),
        ("holder task id", lock.holder_task_id or "- (the value is not a lock's)"),
        ("owner token", lock.owner_token or "-"),
        ("time left", _time_left(lock)),
    ):
        print(f"{label:<15} {value}")


def _time_left(lock: HeldLock) -> str:
    return "?" if lock.ttl_ms is None else f"{lock.ttl_ms} ms"


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2))


def _warn_ttl(reading: inspect.Reading) -> None:
    if reading.ttl_denied:
        _say("time left unknown: the Redis user may not run PTTL (grant it +pttl)")


def _say(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr)


def _fail(status: ExitCode, message: str) -> int:
    _say(message if status is not ExitCode.USAGE else f"error: {message}")
    return status


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "no message"
