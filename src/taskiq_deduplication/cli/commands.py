"""``taskiq dedup``: list, inspect and release the locks in Redis, find a call's key, see limits.

A plugin of taskiq's command line, registered in the ``taskiq_cli`` entry-point
group as ``taskiq worker`` and ``taskiq scheduler`` are::

    taskiq dedup list [--app MODULE:BROKER | --prefix P] [--url URL] [--match GLOB] [--json]
    taskiq dedup show KEY [--app MODULE:BROKER | --prefix P] [--url URL] [--json]
    taskiq dedup release [KEY ...] [--match GLOB] [--yes] [--app ... | --prefix P] [--url URL]
    taskiq dedup key MODULE:BROKER TASK_NAME [--args JSON] [--kwargs JSON] [--labels JSON]
    taskiq dedup key --app MODULE:BROKER TASK_NAME [...]
    taskiq dedup limits [--app MODULE:BROKER | --prefix P] [--url URL] [--match GLOB] [--json]
    taskiq dedup web [--app MODULE:BROKER | --url URL [--prefix P]] [--host H] [--port N] [...]

``--app`` imports the application's broker as ``taskiq worker`` does (from the
current directory, then ``PYTHONPATH``) and reads the Redis URL and the key
prefix from its deduplication middleware. ``--url`` overrides the URL; without
either, ``REDIS_URL`` names it. A KEY is a full key, as the library prints it
anywhere, or a lock's name under the prefix. A TASK_NAME is a task's full name
(``module:function``), or its function's name where no other task has it. The
page of ``web`` is read-only unless ``--allow-release-without-auth`` says that
whoever reaches it may release locks (it has no login of its own).

Exit codes: 0 done, 1 not found (no such lock, or nothing released), 2 bad
usage (options, JSON, an app or task that is not there), 3 Redis failed
(unreachable, or the user may not run a command). Ctrl-C exits with 130. Every
error is one line on stderr.

What a command needs is imported when it runs: every ``taskiq`` command loads
this module, and ``--help`` or a usage error needs no Redis client.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn
from urllib.parse import urlsplit

from taskiq.abc.cmd import TaskiqCMD

from taskiq_deduplication.cli import text
from taskiq_deduplication.model.formats import DEFAULT_PREFIX

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence

    from taskiq_deduplication.locks import LockInfo, Locks
    from taskiq_deduplication.middleware import RedisDeduplicationMiddleware

__all__ = ["DedupCMD", "ExitCode", "main"]

_PROG = "taskiq dedup"
# Locks released at once: their scripts share the client's connections.
_RELEASED_AT_ONCE: Final = 1000


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
    except KeyboardInterrupt:
        return _fail(ExitCode.INTERRUPTED, "interrupted")
    except Exception as exc:  # noqa: BLE001 (one line, never a traceback, whatever failed)
        from taskiq_deduplication.exceptions import REDIS_ERRORS  # noqa: PLC0415 (see the docstring)

        said = f"{type(exc).__name__}: {_one_line(exc)}"
        return _fail(ExitCode.ERROR, f"Redis: {said}" if isinstance(exc, REDIS_ERRORS) else said)
    finally:
        library.removeHandler(handler)


def _parser() -> _Parser:
    parser = _Parser(
        prog=_PROG,
        description="List, inspect and release the locks of RedisDeduplicationMiddleware, "
        "and see the limits of runs.",
        epilog=(
            "exit status: 0 done, 1 not found (no such lock, or nothing released), "
            "2 bad usage, 3 Redis (or anything else) failed"
        ),
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    app = _Parser(add_help=False)
    app.add_argument(
        "--app",
        metavar="MODULE:BROKER",
        help="the app's broker, as for taskiq worker: its deduplication middleware "
        "gives the Redis URL and the key prefix",
    )
    redis = _Parser(add_help=False, parents=[app])
    redis.add_argument(
        "--url",
        help="Redis URL (redis://, rediss://, unix:// or redis+sentinel://host:port/service); "
        "default: the app's, else $REDIS_URL",
    )
    redis.add_argument(
        "--prefix",
        help=f"the middleware's key_prefix, without --app (default: {DEFAULT_PREFIX})",
    )
    output = _Parser(add_help=False)
    output.add_argument("--json", action="store_true", help="print JSON instead of text")

    listing = commands.add_parser(
        "list", parents=[redis, output], help="every lock held now, sorted by key"
    )
    listing.add_argument("--match", default="*", metavar="GLOB", help="a glob over lock names")
    listing.set_defaults(run=_list)

    show = commands.add_parser("show", parents=[redis, output], help="one lock")
    show.add_argument("key", metavar="KEY", help="the lock's full key, or its name")
    show.set_defaults(run=_show)

    release = commands.add_parser(
        "release", parents=[redis, output], help="delete locks, asking first unless --yes"
    )
    release.add_argument("keys", nargs="*", metavar="KEY", help="full lock keys, or names")
    release.add_argument("--match", metavar="GLOB", help="every lock whose name matches")
    release.add_argument("-y", "--yes", action="store_true", help="do not ask")
    release.set_defaults(run=_release)

    key = commands.add_parser(
        "key",
        parents=[app, output],
        usage=f"{_PROG} key [-h] (MODULE:BROKER | --app MODULE:BROKER) TASK_NAME [options]",
        help="the lock a call would take, and who holds it now",
        description="The key the call would take with the broker's deduplication "
        "middleware (its own code computes it), and whether a task holds it now.",
    )
    key.add_argument(
        "call",
        nargs="+",
        metavar="[MODULE:BROKER] TASK_NAME",
        help="the app's broker, as for taskiq worker (unless --app names it), and the task's "
        "name: its full name (module:function), or its function's name if no other task has it",
    )
    key.add_argument("--args", default="[]", metavar="JSON", help="positional arguments")
    key.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments")
    key.add_argument("--labels", default="{}", metavar="JSON", help="labels of the call")
    key.add_argument("--url", help="Redis URL to look in (default: the middleware's own)")
    key.set_defaults(run=_key)

    limits = commands.add_parser(
        "limits",
        parents=[redis, output],
        help="every limit of runs: in use, limit, rate, waiting",
        description="Every limit of runs (limit_concurrency, limit_rate) under the prefix, "
        "sorted by name: the runs that hold a slot, of how many; the rate; the runs that wait.",
    )
    limits.add_argument(
        "--match", default="*", metavar="GLOB", help="a glob over limit names (fnmatch's)"
    )
    limits.set_defaults(run=_limits)

    web = commands.add_parser(
        "web",
        parents=[redis],
        help="serve the locks page (needs the extra [web])",
        description="Serve the locks page (taskiq_deduplication.web) until Ctrl-C. "
        "With --app it also computes the key a call would take.",
    )
    web.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    web.add_argument("--port", type=int, default=8000, help="the port to listen on")
    web.add_argument(
        "--allow-release-without-auth",
        action="store_true",
        help="offer releases to whoever reaches the page, which has no login of its own: "
        "only behind a proxy that asks for one (read-only without it)",
    )
    # Refused with a word on the flag above: served alone, a release is anyone's.
    web.add_argument("--allow-release", action="store_true", help=argparse.SUPPRESS)
    web.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path a proxy serves the page under (/ops/locks), for its links",
    )
    web.set_defaults(run=_web)
    for sub in (parser, listing, show, release, key, limits, web):
        sub.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


@dataclass(frozen=True)
class _Where:
    """Where the command line's locks are: their key prefix, and the app's middleware."""

    prefix: str | None
    """The prefix given (``--prefix``, ``--app``), ``None`` for the default."""
    middleware: RedisDeduplicationMiddleware | None


def _where(args: argparse.Namespace) -> _Where:
    if args.app is not None:
        if args.prefix is not None:
            msg = "--prefix: not with --app, whose middleware names its key_prefix"
            raise _UsageError(msg)
        middleware = _app_middleware(args.app)
        return _Where(middleware.key_prefix, middleware)
    if args.prefix is None:
        return _Where(None, None)
    from taskiq_deduplication.model import settings  # noqa: PLC0415 (see the docstring)

    try:
        return _Where(settings.check_prefix(args.prefix), None)
    except ValueError as exc:
        raise _UsageError(f"--prefix: {exc}") from None


# The commands


async def _list(args: argparse.Namespace) -> int:
    async with _opened(args, _where(args)) as locks:
        found = [lock async for lock in locks.scan(args.match)]
    found.sort(key=lambda lock: lock.key)
    if args.json:
        _print_json([text.as_dict(lock) for lock in found])
    else:
        text.print_table(found)
        count = len(found)
        print(f"{count} lock{'' if count == 1 else 's'} under {locks.prefix}:{args.match}")
    _warn_ttl(found)
    return ExitCode.OK


async def _show(args: argparse.Namespace) -> int:
    async with _opened(args, _where(args)) as locks:
        lock = await locks.get(args.key)
    _warn_ttl([lock] if lock is not None else [])
    if lock is None:
        if args.json:
            _print_json(None)
        return _fail(ExitCode.NOT_FOUND, _missing(locks, args.key))
    if args.json:
        _print_json(text.as_dict(lock))
    else:
        text.print_lock(lock)
    return ExitCode.OK


async def _release(args: argparse.Namespace) -> int:
    where = _where(args)
    if not args.keys and args.match is None:
        raise _UsageError("name the locks to release: KEY ... or --match GLOB")
    async with _opened(args, where) as locks:
        found, complete = await _to_release(locks, args)
        if not found:
            if args.json:
                _print_json([])
            return _fail(ExitCode.NOT_FOUND, "nothing to release")
        if not args.yes and not _confirmed(found):
            return _fail(ExitCode.NOT_FOUND, "nothing released")
        released: list[bool] = []
        for start in range(0, len(found), _RELEASED_AT_ONCE):
            batch = found[start : start + _RELEASED_AT_ONCE]
            released += await asyncio.gather(*(locks.release(lock) for lock in batch))
    for lock, done in zip(found, released, strict=True):
        if args.json:
            continue
        if done:
            print(f"released {lock.key} (held by task {lock.holder_task_id})")
        else:
            _say(f"not released {lock.key!r}: another send holds it now, or it expired")
    if args.json:
        _print_json(
            [
                {**text.as_dict(lock), "released": done}
                for lock, done in zip(found, released, strict=True)
            ]
        )
    return ExitCode.OK if complete and all(released) else ExitCode.NOT_FOUND


async def _to_release(locks: Locks, args: argparse.Namespace) -> tuple[list[LockInfo], bool]:
    """The locks the command line names, read now, and whether each named key held one."""
    named = await asyncio.gather(*(locks.get(key) for key in args.keys))
    pairs = zip(args.keys, named, strict=True)
    missing = [_missing(locks, key) for key, lock in pairs if lock is None]
    found = [lock for lock in named if lock is not None]
    if args.match is not None:
        found += [lock async for lock in locks.scan(args.match)]
    by_key = {lock.key: lock for lock in found}
    for message in missing:
        _say(message)
    complete = not missing
    chosen = []
    for lock in sorted(by_key.values(), key=lambda lock: lock.key):
        if lock.holder_task_id is None:
            _say(f"left alone {lock.key!r}: its value is not a lock of this library")
            complete = False
        else:
            chosen.append(lock)
    return chosen, complete


async def _key(args: argparse.Namespace) -> int:
    spec, given = _app_and_task(args)
    middleware = _app_middleware(spec)
    broker = middleware.broker
    from taskiq_deduplication.store.scan import find_task  # noqa: PLC0415 (see the docstring)

    try:
        task = find_task(broker, given)
    except ValueError as exc:  # a function's name that several tasks share
        raise _UsageError(str(exc)) from None
    if task is None:
        known = ", ".join(sorted(broker.get_all_tasks())) or "none"
        raise _UsageError(f"broker {spec!r} has no task {given!r} (its tasks: {known})")
    task_name = task.task_name
    call_args = _json_argument("--args", args.args, list)
    call_kwargs = _json_argument("--kwargs", args.kwargs, dict)
    call_labels = _json_argument("--labels", args.labels, dict)
    # The call as kiq() makes it, with the task's own labels under the call's:
    # the middleware computes its key, so the two cannot disagree.
    try:
        key = middleware.locks.key_for(
            task.kicker().with_labels(**call_labels), *call_args, **call_kwargs
        )
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
    async with _opened(args, _Where(middleware.key_prefix, middleware)) as locks:
        lock = await locks.get(key)
    _warn_ttl([lock] if lock is not None else [])
    if args.json:
        if lock is not None:
            result |= {**text.as_dict(lock), "held": True}
        _print_json(result)
    else:
        print(f"task    {task_name}\nkey     {key}")
        if lock is None:
            print("held    no: the call would take this lock now")
        else:
            print(f"held    yes, by task {lock.holder_task_id}, {text.time_left(lock)}")
    return ExitCode.OK if lock is not None else ExitCode.NOT_FOUND


async def _limits(args: argparse.Namespace) -> int:
    async with _opened(args, _where(args)) as locks:
        found = await locks.limits(args.match)
    if args.json:
        _print_json([text.limit_as_dict(limit) for limit in found])
    else:
        text.print_limits(found)
        count = len(found)
        matching = "" if args.match == "*" else f" matching {args.match}"
        print(f"{count} limit{'' if count == 1 else 's'} under {locks.prefix}{matching}")
    return ExitCode.OK


async def _web(args: argparse.Namespace) -> int:
    if args.allow_release and not args.allow_release_without_auth:
        msg = (
            "--allow-release: served alone the page has no login, so whoever reaches it "
            "could release locks; put it behind a proxy that asks for one and pass "
            "--allow-release-without-auth, or mount locks_app(..., authorize=...) in your app"
        )
        raise _UsageError(msg)
    where = _where(args)
    try:
        import uvicorn  # noqa: PLC0415 (see the docstring)

        from taskiq_deduplication.web.app import allow_anyone, locks_app  # noqa: PLC0415
    except ImportError as exc:
        raise _UsageError(f"{exc.name or exc}: install taskiq-dedup[web]") from None
    if where.middleware is not None and args.url:
        msg = "--url: not with --app, whose middleware the page uses"
        raise _UsageError(msg)
    # No login of its own: releases are offered only when the operator says anyone may.
    releases = args.allow_release_without_auth
    authorize = allow_anyone if releases else None
    url = args.url or (None if where.middleware is not None else os.environ.get("REDIS_URL"))
    if url:
        async with _opened(args, where):  # the URL is checked before the server starts
            pass
        app = locks_app(url, prefix=where.prefix, allow_release=releases, authorize=authorize)
    elif where.middleware is not None:
        app = locks_app(where.middleware, allow_release=releases, authorize=authorize)
    else:
        raise _UsageError("no Redis URL: pass --url or --app, or set REDIS_URL")
    config = uvicorn.Config(
        app, host=args.host, port=args.port, root_path=args.root_path, log_level="warning"
    )
    prefix = where.prefix or DEFAULT_PREFIX
    address = f"http://{args.host}:{args.port}/"
    _say(f"serving the locks under {prefix} at {address} (Ctrl-C stops)")
    if releases:
        _say(
            f"warning: whoever reaches {address} may release locks: the page has no login "
            "of its own (--allow-release-without-auth)"
        )
    server = uvicorn.Server(config)
    await server.serve()
    # Stopped by Ctrl-C (or SIGTERM): say so whether or not the signal, which
    # uvicorn passes on once it has shut down, reaches asyncio.run before we return.
    return ExitCode.INTERRUPTED if server.should_exit else ExitCode.OK


# What the commands share


def _app_and_task(args: argparse.Namespace) -> tuple[str, str]:
    """The app's broker and the task's name that ``key`` was given."""
    if args.app is not None and len(args.call) == 1:
        return args.app, args.call[0]
    if args.app is None and len(args.call) == 2:  # noqa: PLR2004 (the broker and the task)
        return args.call[0], args.call[1]
    msg = "expected MODULE:BROKER TASK_NAME, or --app MODULE:BROKER TASK_NAME"
    raise _UsageError(msg)


def _missing(locks: Locks, key: str) -> str:
    """What to say of a KEY that names no lock: where it was looked for."""
    first, *other = locks.lookup_keys(key)
    nor = f" (nor at {other[0]!r})" if other else ""
    return f"no lock at {first!r}{nor}"


@contextlib.asynccontextmanager
async def _opened(args: argparse.Namespace, where: _Where) -> AsyncIterator[Locks]:
    """The locks at ``--url``, else the app's, else ``REDIS_URL``'s; closed at the end if ours."""
    from taskiq_deduplication.locks import Locks  # noqa: PLC0415 (see the docstring)

    url = args.url
    if not url and where.middleware is not None:
        url = where.middleware.redis_url
        if url is None:  # built with a client of the app's: use it, as the app does
            yield where.middleware.locks
            return
    url = url or os.environ.get("REDIS_URL")
    if not url:
        raise _UsageError("no Redis URL: pass --url or --app, or set REDIS_URL")
    async with contextlib.AsyncExitStack() as stack:
        try:
            locks = await stack.enter_async_context(Locks.from_url(url, prefix=where.prefix))
        except ValueError as exc:
            raise _UsageError(f"--url {_redacted(url)}: {exc}") from None
        yield locks


def _redacted(url: str) -> str:
    """``url`` with its password replaced, fit to print."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _app_middleware(spec: str) -> RedisDeduplicationMiddleware:
    """The deduplication middleware of the broker ``spec`` (``module:variable``)."""
    from taskiq.abc.broker import AsyncBroker  # noqa: PLC0415 (see the docstring)
    from taskiq.cli.utils import import_object  # noqa: PLC0415

    from taskiq_deduplication.middleware import RedisDeduplicationMiddleware  # noqa: PLC0415

    try:
        # As taskiq worker imports it: from the current directory, then sys.path
        # (PYTHONPATH and the installed packages).
        broker = import_object(spec)
    except Exception as exc:  # noqa: BLE001 (an app's import can fail any way; say how, in a line)
        said = f"cannot import {spec!r}: {type(exc).__name__}: {exc}"
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing and f"{spec.partition(':')[0]}.".startswith(f"{missing}."):
            # The app's own module, not one it imports: say where it was looked for.
            said += f" (looked in the current directory, {Path.cwd()}, and on PYTHONPATH)"
        raise _UsageError(said) from None
    if not isinstance(broker, AsyncBroker):
        raise _UsageError(f"{spec!r} is a {type(broker).__name__}, not a taskiq broker")
    middleware = next(
        (m for m in broker.middlewares if isinstance(m, RedisDeduplicationMiddleware)), None
    )
    if middleware is None:
        raise _UsageError(f"broker {spec!r} has no RedisDeduplicationMiddleware")
    return middleware


def _json_argument(option: str, text: str, kind: type[list[Any] | dict[str, Any]]) -> Any:  # noqa: ANN401 (a JSON list or object)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _UsageError(f"{option}: not JSON: {exc}") from None
    if not isinstance(value, kind):
        raise _UsageError(f"{option}: expected a JSON {'array' if kind is list else 'object'}")
    return value


def _confirmed(locks: Sequence[LockInfo]) -> bool:
    """Show ``locks`` and ask, on stderr, whether to release them; read the answer on stdin."""
    text.print_table(locks, file=sys.stderr)
    count = len(locks)
    print(f"Release {count} lock{'' if count == 1 else 's'}? [y/N] ", end="", file=sys.stderr)
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if not answer.endswith("\n"):
        print(file=sys.stderr)
    return answer.strip().lower() in {"y", "yes"}


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2))


def _warn_ttl(locks: Iterable[LockInfo]) -> None:
    if not all(lock.ttl_readable for lock in locks):
        _say("time left unknown: the Redis user may not run PTTL (grant it +pttl)")


def _say(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr)


def _fail(status: ExitCode, message: str) -> int:
    _say(message if status is not ExitCode.USAGE else f"error: {message}")
    return status


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "no message"
