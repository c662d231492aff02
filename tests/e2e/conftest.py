"""Fixtures of the end-to-end suite: real processes against real brokers.

A test calls ``await launch(broker=...)`` to get an :class:`App`: a client
broker started in the test process, and a way to start the other processes of
the application (``taskiq worker``, ``taskiq scheduler``, client processes) with
the same configuration. Each process runs in a process group of its own, and
every group is killed, by its id, when the test ends, whatever the outcome.

RabbitMQ and NATS are used where they answer; when they do not, the tests that
need them skip, or fail if ``DEDUP_REQUIRE_SERVICES=1`` says they must be there.
``DEDUP_E2E_AMQP_URL`` and ``DEDUP_E2E_NATS_URL`` point at other servers. So is
PostgreSQL, for the tests that keep a ledger (``launch(..., ledger=True)``);
``DEDUP_E2E_PG_DSN`` points at another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
import redis.asyncio
from taskiq import AsyncBroker, AsyncTaskiqDecoratedTask

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.model.formats import holder_task_id
from tests.e2e import ledger
from tests.e2e.app import BROKERS, CONFIG_ENV, Config, Tasks, build_broker

REPO = Path(__file__).resolve().parents[2]
AMQP_URL = os.environ.get("DEDUP_E2E_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("DEDUP_E2E_NATS_URL", "nats://127.0.0.1:4222")
#: Longest a test waits for something it expects to happen soon.
WAIT = 20.0
#: How often a wait looks again.
POLL = 0.02

T = TypeVar("T")


# Services


@functools.cache
def _unreachable(url: str) -> str | None:
    """Why the server of ``url`` cannot be reached, or ``None`` when it answers."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    assert port is not None, url
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return f"{host}:{port} does not answer ({exc})"
    return None


def require_broker_server(broker: str) -> None:
    """Skip the test (or fail it, with DEDUP_REQUIRE_SERVICES=1) when ``broker`` is down."""
    url = {"rabbitmq": AMQP_URL, "nats": NATS_URL}.get(broker)
    if url is None:
        return  # the Redis brokers use the session's own Redis
    _require(broker, _unreachable(url))


def require_postgres() -> None:
    """Skip the test (or fail it, as above) when the ledger's PostgreSQL is down."""
    _require("PostgreSQL", _pg_unreachable(ledger.DSN))


@functools.cache
def _pg_unreachable(dsn: str) -> str | None:
    """Why PostgreSQL at ``dsn`` cannot be used, or ``None`` when it answers."""
    import psycopg  # noqa: PLC0415 (only for the tests that keep a ledger)

    try:
        psycopg.connect(dsn, connect_timeout=2).close()
    except psycopg.Error as exc:
        return f"{dsn!r} does not answer ({str(exc).strip()})"
    return None


def _require(service: str, problem: str | None) -> None:
    if problem is None:
        return
    reason = f"{service} server is not reachable: {problem}"
    if os.environ.get("DEDUP_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason}; DEDUP_REQUIRE_SERVICES=1 requires it")
    pytest.skip(f"{reason} (set DEDUP_REQUIRE_SERVICES=1 to fail instead)")


@pytest.fixture(params=BROKERS)
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Each broker the suite runs on, in turn."""
    kind: str = request.param
    require_broker_server(kind)
    return kind


# Processes


def _state(pid: int) -> str | None:
    """The state letter of process ``pid`` in /proc, ``None`` when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer runs: it waits to be reaped)."""
    return _state(pid) not in {None, "Z", "X"}


def live_processes() -> Iterator[tuple[Path, int]]:
    """Every live process (not a zombie): its ``/proc`` entry and its process group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] not in {"Z", "X"}:
                yield entry, int(fields[2])
        except (OSError, IndexError, ValueError):
            continue


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    return [int(entry.name) for entry, group in live_processes() if group == pgid]


@dataclass
class Process:
    """A process a test started, in a process group of its own."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        """The pid of the process (and the id of its group)."""
        return self.popen.pid

    def children(self) -> list[int]:
        """The live processes of its group other than itself (worker processes)."""
        return [pid for pid in group_members(self.pid) if pid != self.pid]

    def log(self) -> str:
        """What it has written to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """Wait for it to exit; return its exit status."""
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL its whole group, reap it, and wait until no member is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while members := group_members(self.pid):
            # Orphaned members (worker processes whose parent died first) are
            # not in the group's kill: kill them by pid.
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                msg = f"{self.name}: processes {members} survived SIGKILL"
                raise RuntimeError(msg)
            time.sleep(POLL)


@dataclass
class Processes:
    """The processes of one test; :meth:`kill_all` ends every one of them."""

    workdir: Path
    started: list[Process] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Process:
        """Start ``argv`` in the repository with ``env`` added to this environment."""
        log_path = self.workdir / f"{len(self.started):02d}-{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = Process(name, popen, log_path)
        self.started.append(process)
        return process

    def kill_all(self) -> None:
        """End every process started, the last one first."""
        errors = []
        for process in reversed(self.started):
            try:
                process.kill()
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # noqa: PERF203 (kill each)
                errors.append(exc)
        if errors:
            raise errors[0]

    def logs(self) -> str:
        """The tail of every process's log, for a failure message."""
        return "\n".join(
            f"--- {process.name} (pid {process.pid}) ---\n{process.log()[-3000:]}"
            for process in self.started
        )


# The application


@dataclass
class App:
    """The application of one test, seen from the test: a client and its processes."""

    config: Config
    broker: AsyncBroker
    tasks: Tasks
    redis: redis.asyncio.Redis
    processes: Processes

    # Starting processes

    def env(self) -> dict[str, str]:
        """The environment that hands the configuration to another process."""
        return {CONFIG_ENV: self.config.to_json()}

    def start_worker(self, *options: str) -> Process:
        """Start ``taskiq worker tests.e2e.app:worker_broker --workers 2``."""
        argv = [sys.executable, "-m", "taskiq", "worker", "tests.e2e.app:worker_broker"]
        return self.processes.start(
            "worker", [*argv, "--workers", "2", "--shutdown-timeout", "5", *options], self.env()
        )

    def start_scheduler(self, *options: str, kind: str | None = None) -> Process:
        """Start ``taskiq scheduler tests.e2e.app:scheduler``; ``kind`` picks its scheduler."""
        argv = [sys.executable, "-m", "taskiq", "scheduler", "tests.e2e.app:scheduler"]
        config = self.config if kind is None else self.config.replace(scheduler_kind=kind)
        env = {CONFIG_ENV: config.to_json()}
        return self.processes.start("scheduler", [*argv, *options], env)

    def start_client(self, name: str, *args: str) -> Process:
        """Start a client process: ``python -m tests.e2e.client ARGS``."""
        argv = [sys.executable, "-m", "tests.e2e.client", *args]
        return self.processes.start(name, argv, self.env())

    # Looking at Redis

    async def wait_until(
        self, condition: Callable[[], Awaitable[T]], what: str, timeout: float = WAIT
    ) -> T:
        """Poll ``condition`` until it returns something true; return that."""
        deadline = time.monotonic() + timeout
        while True:
            value = await condition()
            if value:
                return value
            if time.monotonic() > deadline:
                msg = f"gave up after {timeout}s waiting for {what}\n{self.processes.logs()}"
                raise AssertionError(msg)
            await asyncio.sleep(POLL)

    async def report(self, *name: object) -> list[str]:
        """What the processes pushed to the report ``name`` so far, in order."""
        return [_text(item) for item in await self.redis.lrange(self.config.key(*name), 0, -1)]

    async def counter(self, *name: object) -> int:
        """The value of counter ``name``; 0 when nothing counted it yet."""
        return int(await self.redis.get(self.config.key(*name)) or 0)

    async def started(self, tag: str) -> list[dict[str, Any]]:
        """The runs of ``tag`` that have started so far, in order."""
        return [json.loads(item) for item in await self.report("started", tag)]

    async def wait_started(self, tag: str, runs: int = 1) -> list[dict[str, Any]]:
        """Wait until ``runs`` runs of ``tag`` have started; return them."""

        async def enough() -> list[dict[str, Any]]:
            started = await self.started(tag)
            return started if len(started) >= runs else []

        return await self.wait_until(enough, f"run {runs} of {tag!r} to start")

    async def runs(self, tag: str) -> int:
        """How many times ``tag`` has run (started) so far."""
        return await self.counter("runs", tag)

    async def open_gate(self, tag: str, runs: int = 1) -> None:
        """Let ``runs`` runs of ``tag`` finish."""
        await self.redis.rpush(self.config.key("gate", tag), *["open"] * runs)

    async def locks(self) -> dict[str, str]:
        """Every deduplication lock of the test: key -> value."""
        keys = [key async for key in self.redis.scan_iter(match=f"{self.config.lock_prefix}:*")]
        values = await self.redis.mget(keys) if keys else []
        return {
            _text(key): _text(value)
            for key, value in zip(keys, values, strict=True)
            if value is not None
        }

    async def holders(self) -> dict[str, str]:
        """Every deduplication lock of the test: key -> the task_id holding it."""
        return {key: holder_task_id(value) or value for key, value in (await self.locks()).items()}

    async def lock_of(self, task_id: str) -> str | None:
        """The key of the lock held by ``task_id``, if any."""
        return next((k for k, holder in (await self.holders()).items() if holder == task_id), None)

    async def wait_no_locks(self, what: str = "every lock to be released") -> None:
        """Wait until the test has no lock left."""

        async def none_left() -> bool:
            return not await self.locks()

        await self.wait_until(none_left, what)

    async def assert_no_locks_for(self, seconds: float) -> None:
        """Check, for ``seconds``, that no lock comes back (nothing refreshes a lock)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert await self.locks() == {}, "a released lock came back"
            await asyncio.sleep(POLL * 5)

    async def wait_refreshed(self, key: str, ttl: float) -> None:
        """Wait until a heartbeat refreshes lock ``key``; it never has more than ``ttl`` s left."""
        previous = ttl * 1000

        async def refreshed() -> bool:
            nonlocal previous
            pttl = await self.redis.pttl(key)
            assert 0 < pttl <= ttl * 1000, (
                f"lock {key} has PTTL {pttl}, expected 0 < PTTL <= {ttl}s"
            )
            went_up, previous = pttl > previous, pttl
            return went_up

        await self.wait_until(refreshed, f"a heartbeat to refresh lock {key}")

    async def watch_expire(self, key: str, ttl: float) -> None:
        """Watch lock ``key`` until it expires within ``ttl`` s, refreshed by nobody."""
        previous = await self.redis.pttl(key)
        assert 0 < previous <= ttl * 1000, f"lock {key} has PTTL {previous}"

        async def expired() -> bool:
            nonlocal previous
            pttl = await self.redis.pttl(key)
            assert pttl <= previous, f"lock {key} was refreshed: PTTL {previous} -> {pttl}"
            previous = pttl
            return pttl == -2  # the key does not exist

        await self.wait_until(expired, f"lock {key} to expire", timeout=ttl + 5)

    async def assert_duplicate(
        self,
        task: AsyncTaskiqDecoratedTask[..., Any],
        holder: str,
        labels: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> DuplicateTaskError:
        """Send ``task(**kwargs)`` and check it is rejected as a duplicate of ``holder``."""
        kicker = task.kicker().with_labels(**(labels or {}))
        with pytest.raises(DuplicateTaskError) as caught:
            await kicker.kiq(**kwargs)
        assert caught.value.holder_task_id == holder
        return caught.value


def _text(value: bytes | str) -> str:
    # The client decodes responses; redis-py's types do not know it.
    return value.decode() if isinstance(value, bytes) else value


def _names(prefix: str) -> str:
    # RabbitMQ queue and NATS stream names: letters, digits and dashes only.
    return "dedup-e2e-" + prefix.rsplit(":", 1)[-1]


Launch = Callable[..., Awaitable[App]]


@pytest.fixture
async def launch(
    redis_url: str,
    prefix: str,
    redis_client: redis.asyncio.Redis,
    tmp_path: Path,
) -> AsyncIterator[Launch]:
    """Start the application of this test: ``await launch(broker=..., **config)``.

    Returns an :class:`App` whose client broker is started. With ``ledger=True``
    the test gets a ledger in PostgreSQL of its own (``tests/e2e/ledger.py``).
    At the end every process is killed, the client stopped, the broker's queues
    deleted and the ledger dropped.
    """
    processes = Processes(tmp_path)
    apps: list[App] = []
    schemas: list[str] = []

    async def start(**options: Any) -> App:
        require_broker_server(options["broker"])
        if options.pop("ledger", False):
            require_postgres()
            schema = "dedup_e2e_" + prefix.rsplit(":", 1)[-1].replace("-", "_")
            if schema not in schemas:
                ledger.create(ledger.DSN, schema)
                schemas.append(schema)
            options["ledger"] = schema
        config = Config(
            redis_url=redis_url,
            prefix=prefix,
            name=_names(prefix),
            amqp_url=AMQP_URL,
            nats_url=NATS_URL,
            pg_dsn=ledger.DSN,
            **options,
        )
        broker, tasks = build_broker(config)
        app = App(config, broker, tasks, redis_client, processes)
        apps.append(app)
        await broker.startup()
        return app

    try:
        yield start
    finally:
        try:
            processes.kill_all()
        finally:
            try:
                for app in apps:
                    try:
                        await app.broker.shutdown()
                    finally:
                        await _delete_broker_objects(app.config)
            finally:
                for schema in schemas:
                    ledger.drop(ledger.DSN, schema)


async def _delete_broker_objects(config: Config) -> None:
    """Delete what the test created on RabbitMQ or NATS (Redis keys go with the prefix)."""
    if config.broker == "rabbitmq":
        import aio_pika  # noqa: PLC0415 (only for RabbitMQ)

        connection = await aio_pika.connect(config.amqp_url)
        async with connection:
            channel = await connection.channel()
            for queue in (config.name, f"{config.name}.dead", f"{config.name}.delay"):
                await channel.queue_delete(queue)
            await channel.exchange_delete(config.name)
    elif config.broker == "nats":
        import nats  # noqa: PLC0415 (only for NATS)

        client = await nats.connect(config.nats_url)
        try:
            await client.jetstream().delete_stream(config.name)
        finally:
            await client.close()
