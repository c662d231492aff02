"""The soak's conductor: start everything, inject faults, drain, check, clean up.

Layout of one run (every server private to it, every port on loopback)::

    client process ─┐                        ┌─> redis-server (locks)     LOCK_PORT
    taskiq workers ─┼─> proxy LOCK_PROXY ────┘
                    ├─> proxy LIST_PROXY ───┬─> redis-server (list queue and stream, AOF)
                    ├─> proxy STREAM_PROXY ─┘                               LIST_PORT
                    ├─> proxy AMQP_PROXY ─────> the machine's RabbitMQ (5672)
                    └─> proxy NATS_PROXY ─────> the machine's NATS (4222)

The middleware's Redis is restarted, paused and cut; the brokers are cut at
their proxies (the machine's RabbitMQ and NATS are shared, so they are never
restarted: a cut of every connection is what a restart looks like to their
clients), and the Redis of the list and stream brokers is restarted (with an
append-only file, so that the queues survive as a persistent broker's would).
Workers get SIGKILL and SIGTERM and are replaced. Every fault is written to the
ledger with its start and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from taskiq_deduplication.model.limits import limit_keys, limit_name, limit_pattern
from tests._server import Server
from tests.e2e.conftest import Process, Processes, live_processes
from tests.faults._proxy import Proxy
from tests.soak import ledger, report
from tests.soak.app import (
    BROKERS,
    CONFIG_ENV,
    MAX_ATTEMPTS,
    SoakConfig,
    build,
    library_redelivery_window,
)

logger = logging.getLogger(__name__)

LOCK_PORT, LIST_PORT, LOCK_PROXY, LIST_PROXY, AMQP_PROXY = 6395, 6396, 6397, 6398, 6399
STREAM_PROXY, NATS_PROXY = 6393, 6394
AMQP_HOST, AMQP_PORT = "127.0.0.1", 5672
NATS_PORT = 4222
#: How often resident memory is sampled.
RSS_EVERY = 1.0
#: Longest wait for the queues to drain after the last send.
DRAIN_LIMIT = 120.0
#: The drain ends when nothing changed in the ledger for this long.
SETTLED = 15.0
#: Longest wait for a worker to end after SIGTERM before it gets SIGKILL.
SIGTERM_GRACE = 15.0

FAULTS = (
    *(f"worker-{how}:{kind}" for how in ("sigkill", "sigterm") for kind in BROKERS),
    "redis-restart:locks",
    "redis-pause:locks",
    "redis-cut:locks",
    *(f"broker-cut:{kind}" for kind in BROKERS),
    "broker-restart:redis-list",
)
"""Every fault, one of each per round. ``broker-restart:redis-list`` restarts the
Redis of the list and the stream brokers."""


@dataclass(frozen=True)
class Options:
    """What the command line asked for."""

    seconds: float
    rate: float = 40.0
    dup_share: float = 0.3
    chain_share: float = 0.03
    ttl: int = 15
    socket_timeout: float = 1.0
    latency_margin: float = 0.5
    workers: int = 2
    fault_gap: float = 2.0
    long_pauses: bool = False
    running_ttl: int | None = None
    redelivery_window: int | None = None
    seed: int = 0
    keep: bool = False
    out: Path | None = None


@dataclass
class Worker:
    """One ``taskiq worker`` process group of a broker."""

    kind: str
    index: int
    process: Process


@dataclass
class Watched:
    """A process the conductor has seen: for memory samples and death times."""

    pid: int
    pgid: int
    role: str
    broker: str | None
    first_seen: float
    last_seen: float
    fate: str = "alive"


@dataclass
class Conductor:
    """The state of one run, and the steps of it."""

    options: Options
    config: SoakConfig
    workdir: Path
    rng: random.Random
    lock_server: Server
    list_server: Server
    proxies: dict[str, Proxy]
    processes: Processes
    workers: list[Worker] = field(default_factory=list)
    client: Process | None = None
    watched: dict[int, Watched] = field(default_factory=dict)
    rss_rows: list[dict[str, Any]] = field(default_factory=list)
    fault_rows: list[dict[str, Any]] = field(default_factory=list)
    serial: int = 0

    # Processes

    def env(self) -> dict[str, str]:
        """The environment that hands the configuration to a process."""
        return {CONFIG_ENV: self.config.to_json()}

    def start_worker(self, kind: str, index: int) -> Worker:
        """Start one ``taskiq worker`` for ``kind`` (one worker child process)."""
        argv = [
            sys.executable,
            "-m",
            "taskiq",
            "worker",
            f"tests.soak.app:{kind.replace('-', '_')}_worker",
            "--workers",
            "1",
            "--shutdown-timeout",
            "5",
            "--log-level",
            "WARNING",
        ]
        self.serial += 1
        name = f"{kind}-w{index}-{self.serial}"
        worker = Worker(kind, index, self.processes.start(name, argv, self.env()))
        self.workers.append(worker)
        return worker

    def start_client(self) -> Process:
        """Start the client process, which sends for the run's duration."""
        o = self.options
        argv = [sys.executable, "-m", "tests.soak.client"]
        argv += [str(o.seconds), str(o.rate), str(o.dup_share), str(o.chain_share), str(o.seed)]
        self.client = self.processes.start("client", argv, self.env())
        return self.client

    def mark(self, pgid: int, fate: str, at: float) -> None:
        """Note that every live process of group ``pgid`` ends now, and how."""
        for seen in self.watched.values():
            if seen.pgid == pgid and seen.fate == "alive":
                seen.fate, seen.last_seen = fate, at

    # Memory

    async def sample_forever(self) -> None:
        """Sample the resident memory of the client and every worker process."""
        while True:
            self.sample()
            await asyncio.sleep(RSS_EVERY)

    def sample(self) -> None:
        """One sample of every watched process group."""
        groups: dict[int, tuple[str, str | None]] = {
            w.process.pid: (f"{w.kind}-w{w.index}", w.kind) for w in self.workers
        }
        if self.client is not None:
            groups[self.client.pid] = ("client", None)
        now = time.time()
        alive: set[int] = set()
        for pid, pgid, kb in _scan_processes(set(groups)):
            role, kind = groups[pgid]
            role += "-parent" if pid == pgid and role != "client" else ""
            role += "-child" if pid != pgid else ""
            seen = self.watched.get(pid)
            if seen is None:
                seen = self.watched[pid] = Watched(pid, pgid, role, kind, now, now)
            seen.last_seen = now
            alive.add(pid)
            self.rss_rows.append({"pid": pid, "role": role, "at": now, "kb": kb})
        for seen in self.watched.values():
            if seen.fate == "alive" and seen.pid not in alive:
                seen.fate = "exited"

    # Faults

    async def faults_forever(self) -> None:
        """Inject faults, one at a time, every kind once per shuffled round."""
        deck: list[str] = []
        while True:
            await asyncio.sleep(0.5 + self.rng.expovariate(1 / self.options.fault_gap))
            if not deck:
                deck = list(FAULTS)
                self.rng.shuffle(deck)
            await self.inject(deck.pop())

    async def inject(self, fault: str) -> None:
        """Inject one fault, undo it, and write it to the ledger."""
        kind, target = fault.split(":")
        started = time.time()
        detail = ""
        try:
            if kind in {"worker-sigkill", "worker-sigterm"}:
                detail = await self.kill_worker(target, kind)
            elif kind == "redis-restart":
                await asyncio.to_thread(self.lock_server.restart)
            elif kind == "broker-restart":
                await asyncio.to_thread(self.list_server.restart)
            elif kind == "redis-pause":
                seconds = self.pause_seconds()
                detail = "(past the TTL)" if seconds > self.options.ttl else ""
                self.lock_server.pause()
                try:
                    await asyncio.sleep(seconds)
                finally:
                    self.lock_server.resume()
            else:  # redis-cut, broker-cut
                proxy = self.proxies["locks" if kind == "redis-cut" else target]
                seconds = self.rng.uniform(0.5, 3.0)
                await proxy.cut()
                try:
                    await asyncio.sleep(seconds)
                finally:
                    await proxy.restore()
        finally:
            ended = time.time()
            row = {"kind": kind, "target": target, "started": started, "ended": ended}
            self.fault_rows.append({**row, "detail": detail})
            logger.info("fault %s on %s, %.1fs %s", kind, target, ended - started, detail)

    def pause_seconds(self) -> float:
        """How long a pause lasts: mostly short; with long pauses, sometimes past the TTL."""
        if self.options.long_pauses and self.rng.random() < 0.25:
            return self.options.ttl + self.rng.uniform(1.0, 4.0)
        return self.rng.uniform(1.0, 4.0)

    async def kill_worker(self, kind: str, how: str) -> str:
        """SIGKILL or SIGTERM a worker group of ``kind``, then start its replacement."""
        candidates = [w for w in self.workers if w.kind == kind]
        worker = self.rng.choice(candidates)
        self.sample()  # know its current child before it goes
        pgid = worker.process.pid
        children = worker.process.children()
        if how == "worker-sigkill":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.mark(pgid, "sigkill", time.time())
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(worker.process.popen.wait, SIGTERM_GRACE)
            self.mark(
                pgid,
                "sigterm" if worker.process.popen.poll() is not None else "sigterm+kill",
                time.time(),
            )
        await asyncio.to_thread(worker.process.kill)
        self.workers.remove(worker)
        self.start_worker(kind, worker.index)
        return f"group {pgid}, children {children}"

    # Drain and checks

    async def drain(self) -> float:
        """Wait until every accepted send has run to its end (or the ledger stops changing).

        Returns:
            The time the ledger last changed.
        """
        last_change, previous = time.time(), None
        limit = time.monotonic() + DRAIN_LIMIT
        stream = build(self.config, "redis-stream", client=True)
        await stream.broker.startup()
        try:
            while time.monotonic() < limit:
                # The messages of a killed stream worker are claimed by the next
                # read that finds a new message: with no more sends, poke.
                with contextlib.suppress(Exception):
                    await stream.poke.kiq()
                state = await asyncio.to_thread(self._ledger_state)
                pending, _fingerprint = state
                if state != previous:
                    previous, last_change = state, time.time()
                if pending == 0 or time.time() - last_change > SETTLED:
                    break
                await asyncio.sleep(1.0)
        finally:
            await stream.broker.shutdown()
        return last_change

    def _ledger_state(self) -> tuple[int, tuple[Any, ...]]:
        pending = ledger.scalar(
            self.config.pg_dsn,
            self.config.schema,
            "SELECT count(*) FROM kiqs k WHERE k.outcome = 'accepted' AND NOT EXISTS ("
            " SELECT 1 FROM runs r WHERE r.task_id = k.task_id AND (r.outcome = 'ok'"
            f" OR (r.outcome = 'failed' AND r.attempt >= {MAX_ATTEMPTS - 1})))",
        )
        seen = ledger.scalar(
            self.config.pg_dsn,
            self.config.schema,
            "SELECT ARRAY[count(*), count(ended), coalesce(max(id), 0)] FROM runs",
        )
        return int(pending), tuple(seen)

    def locks_left(self) -> list[dict[str, Any]]:
        """Every lock under the run's prefix, straight from the server (not the proxy)."""
        with redis.Redis(port=LOCK_PORT, decode_responses=True, socket_timeout=5) as client:
            keys = list(client.scan_iter(match=f"{self.config.lock_prefix}:*", count=1000))
            return [{"key": k, "value": client.get(k), "pttl": client.pttl(k)} for k in keys]

    def limit_places_left(self) -> list[dict[str, Any]]:
        """Every live place in a limit (a slot held, a place in line), straight from the server.

        Live: its lease (a score, in microseconds) runs beyond the server's ``TIME``.
        """
        prefix = self.config.lock_prefix
        places = []
        with redis.Redis(port=LOCK_PORT, decode_responses=True, socket_timeout=5) as client:
            for meta in client.scan_iter(match=limit_pattern(prefix), count=1000):
                name = limit_name(prefix, meta)
                if name is None:
                    continue
                keys = limit_keys(prefix, name)
                seconds, micros = client.time()
                now = seconds * 1_000_000 + micros
                for kind, key in (("holder", keys.holders), ("waiter", keys.leases)):
                    for member, deadline in client.zrangebyscore(
                        key, f"({now}", "+inf", withscores=True
                    ):
                        places.append(
                            {
                                "limit": name,
                                "kind": kind,
                                "member": member,
                                "deadline": deadline / 1e6,
                            }
                        )
        return places

    def save(self) -> None:
        """Write what the conductor saw to the ledger."""
        dsn, schema = self.config.pg_dsn, self.config.schema
        ledger.insert(dsn, schema, "faults", self.fault_rows)
        ledger.insert(dsn, schema, "rss", self.rss_rows)
        ledger.insert(
            dsn,
            schema,
            "procs",
            [
                {
                    "pid": w.pid,
                    "role": w.role,
                    "broker": w.broker,
                    "first_seen": w.first_seen,
                    "last_seen": w.last_seen,
                    "fate": w.fate,
                }
                for w in self.watched.values()
            ],
        )
        self.fault_rows, self.rss_rows = [], []


def _scan_processes(pgids: set[int]) -> list[tuple[int, int, int]]:
    """``(pid, pgid, rss_kb)`` of every live process in one of ``pgids``."""
    found = []
    for entry, pgid in live_processes():
        if pgid not in pgids:
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        kb = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")),
            0,
        )
        found.append((int(entry.name), pgid, kb))
    return found


async def _delete_rabbitmq_objects(config: SoakConfig) -> None:
    """Delete the run's queues and exchange, straight on RabbitMQ (not the proxy)."""
    import aio_pika  # noqa: PLC0415 (only at cleanup)

    connection = await aio_pika.connect(f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/")
    async with connection:
        channel = await connection.channel()
        name = config.queue("rabbitmq")
        for queue in (name, f"{name}.dead", f"{name}.delay"):
            await channel.queue_delete(queue)
        await channel.exchange_delete(name)


async def _delete_nats_objects(config: SoakConfig) -> None:
    """Delete the run's JetStream stream, straight on NATS (not the proxy)."""
    import nats  # noqa: PLC0415 (only at cleanup)

    client = await nats.connect(f"nats://127.0.0.1:{NATS_PORT}")
    try:
        await client.jetstream().delete_stream(config.queue("nats"))
    finally:
        await client.close()


async def soak(options: Options) -> int:
    """Run the soak; return the exit status (1 when an invariant is broken)."""
    run_id = uuid.uuid4().hex[:10]
    workdir = Path(tempfile.mkdtemp(prefix=f"dedup-soak-{run_id}-"))
    t = options.socket_timeout
    config = SoakConfig(
        run_id=run_id,
        lock_redis_url=(
            f"redis://127.0.0.1:{LOCK_PROXY}/0?socket_timeout={t}&socket_connect_timeout={t}"
        ),
        list_redis_url=f"redis://127.0.0.1:{LIST_PROXY}/0",
        amqp_url=f"amqp://guest:guest@127.0.0.1:{AMQP_PROXY}/?reconnect_interval=1",
        stream_redis_url=f"redis://127.0.0.1:{STREAM_PROXY}/0",
        nats_url=f"nats://127.0.0.1:{NATS_PROXY}",
        pg_dsn=ledger.DSN,
        ttl=options.ttl,
        running_ttl=options.running_ttl,
        redelivery_window=options.redelivery_window,
    )
    for service, port in (("RabbitMQ", AMQP_PORT), ("NATS", NATS_PORT), ("PostgreSQL", 5432)):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError as exc:  # noqa: PERF203 (two checks, each with its message)
            print(f"{service} does not answer on 127.0.0.1:{port} ({exc})", file=sys.stderr)
            return 2
    print(f"soak {run_id}: {options.seconds:.0f}s, logs in {workdir}", flush=True)
    lock_server = Server(port=LOCK_PORT, workdir=workdir / "redis-locks")
    list_server = Server(
        port=LIST_PORT,
        workdir=workdir / "redis-list",
        extra_args=("--appendonly", "yes", "--appendfsync", "always"),
    )
    for server in (lock_server, list_server):
        server.workdir.mkdir()
    proxies = {
        "locks": Proxy(LOCK_PORT, port=LOCK_PROXY),
        "redis-list": Proxy(LIST_PORT, port=LIST_PROXY),
        "redis-stream": Proxy(LIST_PORT, port=STREAM_PROXY),
        "rabbitmq": Proxy(AMQP_PORT, port=AMQP_PROXY),
        "nats": Proxy(NATS_PORT, port=NATS_PROXY),
    }
    conductor = Conductor(
        options,
        config,
        workdir,
        random.Random(options.seed),
        lock_server,
        list_server,
        proxies,
        Processes(workdir),
    )
    background: list[asyncio.Task[None]] = []
    schema_made = rabbit_used = passed = False
    try:
        lock_server.start()
        list_server.start()
        for proxy in proxies.values():
            await proxy.start()
        ledger.create(config.pg_dsn, config.schema)
        schema_made = True
        rabbit_used = True
        for kind in BROKERS:
            for index in range(options.workers):
                conductor.start_worker(kind, index)
        await asyncio.sleep(3.0)  # let the workers declare their queues and start listening
        background.append(asyncio.create_task(conductor.sample_forever()))
        client = conductor.start_client()
        await asyncio.sleep(2.0)  # faults start once sending has
        background.append(asyncio.create_task(conductor.faults_forever()))
        deadline = time.monotonic() + options.seconds + 60 + 30
        while client.popen.poll() is None:
            if time.monotonic() > deadline:
                msg = f"the client did not end in time\n{conductor.processes.logs()}"
                raise RuntimeError(msg)
            await asyncio.sleep(0.2)
        faults = background.pop()
        faults.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await faults  # a fault in progress is undone by its own finally
        if client.popen.returncode != 0:
            msg = f"the client failed ({client.popen.returncode}):\n{client.log()[-3000:]}"
            raise RuntimeError(msg)
        print("sending done; draining", flush=True)
        settled_at = await conductor.drain()
        # Everything has ended: no lock may outlive one TTL from here.
        wait = max(0.0, settled_at + options.ttl + 2.0 - time.time())
        print(f"drained; waiting {wait:.0f}s (TTL + 2s) before the lock scan", flush=True)
        await asyncio.sleep(wait)
        conductor.sample()
        locks = conductor.locks_left()
        # Before the workers stop: a run that never ends keeps its slot alive until then.
        slots = conductor.limit_places_left()
        for worker in list(conductor.workers):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.process.pid, signal.SIGTERM)
        for worker in list(conductor.workers):
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(worker.process.popen.wait, SIGTERM_GRACE)
            conductor.mark(worker.process.pid, "stopped", time.time())
        background.pop().cancel()
        conductor.save()
        data = {
            table: ledger.load(config.pg_dsn, config.schema, table)
            for table in (
                "runs",
                "kiqs",
                "faults",
                "procs",
                "rss",
                "notes",
                "send_failures",
                "hooks",
                "results",
            )
        }
        window = options.redelivery_window
        if window is None:
            window = library_redelivery_window()  # None: the library remembers no copies
        result = report.analyse(
            data,
            locks,
            {
                **options_dict(options),
                "fail_open": list(config.fail_open),
                "redelivery_window": window,
                "settled_at": settled_at,
            },
            slots,
        )
        text = report.render(result)
        print(text, flush=True)
        if options.out is not None:
            options.out.write_text(json.dumps(result, indent=2, default=str))
            print(f"report: {options.out}", flush=True)
        (workdir / "report.json").write_text(json.dumps(result, indent=2, default=str))
        passed = not result["breaches"]
        return 0 if passed else 1
    finally:
        for task in background:
            task.cancel()
        try:
            conductor.processes.kill_all()
        finally:
            for proxy in proxies.values():
                await proxy.close()
            lock_server.stop()
            list_server.stop()
            if rabbit_used:
                try:
                    await _delete_rabbitmq_objects(config)
                except Exception as exc:  # noqa: BLE001 (cleanup goes on)
                    print(f"could not delete the RabbitMQ queues: {exc}", file=sys.stderr)
                try:
                    await _delete_nats_objects(config)
                except Exception as exc:  # noqa: BLE001 (cleanup goes on)
                    print(f"could not delete the NATS stream: {exc}", file=sys.stderr)
            if schema_made and not options.keep:
                ledger.drop(config.pg_dsn, config.schema)
            elif schema_made:
                print(f"ledger kept in schema {config.schema}", flush=True)
            for server in (lock_server, list_server):
                shutil.rmtree(server.workdir, ignore_errors=True)
            if passed and not options.keep:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                print(f"logs kept in {workdir}", flush=True)


def options_dict(options: Options) -> dict[str, Any]:
    """The options as plain values, for the report."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()}
