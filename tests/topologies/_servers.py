"""Topologies of throwaway servers on loopback: a Redis Cluster and a Sentinel set.

Built from the same binary as the rest of the suite (``tests/_server.py``), so
they run on Valkey as well as on Redis. Every process is ended by pid.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests._server import Server, free_port

_SLOTS = 16384
_READY_TIMEOUT = 20.0


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it) is free as well."""
    while True:
        port = free_port()
        if port <= 55535:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


def _wait(condition: object, what: str, timeout: float = _READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            msg = f"{what} not ready within {timeout}s"
            raise RuntimeError(msg)
        time.sleep(0.05)


@dataclass
class Cluster:
    """A Redis Cluster of ``primaries`` nodes, each with ``replicas`` replicas."""

    primaries: int = 3
    replicas: int = 0
    nodes: list[Server] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A URL of one node, enough for ``RedisCluster.from_url`` to find the rest."""
        return self.nodes[0].url

    def start(self) -> Cluster:
        """Start the nodes, give each primary its slots, join them, wait until ``ok``."""
        count = self.primaries * (1 + self.replicas)
        try:
            self._start_nodes(count)
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nodes(self, count: int) -> None:
        for _ in range(count):
            port = _cluster_port()
            node = Server(
                port=port,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "1000",
                ),
            )
            self.nodes.append(node.start())

    def _form(self) -> None:
        # redis-py's sync client is untyped for these commands.
        clients: list[Any] = [redis.Redis(port=node.port, socket_timeout=5) for node in self.nodes]
        try:
            per_node = _SLOTS // self.primaries
            for index in range(self.primaries):
                first = index * per_node
                last = _SLOTS - 1 if index == self.primaries - 1 else first + per_node - 1
                clients[index].execute_command("CLUSTER ADDSLOTSRANGE", first, last)
            for client in clients[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[0].port)
            _wait(
                lambda: all(
                    len(c.execute_command("CLUSTER NODES")) == len(self.nodes) for c in clients
                ),
                "cluster membership",
            )
            ids = [c.execute_command("CLUSTER MYID").decode() for c in clients]
            for index in range(self.primaries, len(self.nodes)):
                primary = (index - self.primaries) % self.primaries
                clients[index].execute_command("CLUSTER REPLICATE", ids[primary])
            _wait(
                lambda: all(
                    c.execute_command("CLUSTER INFO").get("cluster_state") == "ok" for c in clients
                ),
                "cluster state",
            )
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        """End every node."""
        for node in self.nodes:
            node.cleanup()


@dataclass
class Sentinels:
    """A primary, one replica and three sentinels watching them as ``service``."""

    service: str = "dedup"
    primary: Server = field(default_factory=Server)
    replica: Server | None = None
    sentinel_ports: list[int] = field(default_factory=list)
    _sentinels: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _dirs: list[Path] = field(default_factory=list)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Where the sentinels listen."""
        return [("127.0.0.1", port) for port in self.sentinel_ports]

    def start(self) -> Sentinels:
        """Start primary, replica and sentinels; wait until the sentinels agree."""
        self.primary.start()
        try:
            self.replica = Server(extra_args=("--replicaof", "127.0.0.1", str(self.primary.port)))
            self.replica.start()
            _wait(self._replica_in_sync, "replication")
            for _ in range(3):
                self._start_sentinel()
            _wait(self._sentinels_see_everyone, "sentinels")
        except BaseException:
            self.stop()
            raise
        return self

    def _replica_in_sync(self) -> bool:
        assert self.replica is not None
        with redis.Redis(port=self.replica.port, socket_timeout=1) as client:
            info: Any = client.info("replication")
            return bool(info.get("master_link_status") == "up")

    def _start_sentinel(self) -> None:
        port = free_port()
        workdir = self.primary.workdir / f"sentinel-{port}"
        workdir.mkdir()
        config = workdir / "sentinel.conf"
        config.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f"dir {workdir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 5000\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        log = (workdir / "sentinel.log").open("ab")
        process = subprocess.Popen(
            [self.primary.binary, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self._sentinels.append(process)
        self.sentinel_ports.append(port)
        self._dirs.append(workdir)

    def _sentinels_see_everyone(self) -> bool:
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                state: Any = client.sentinel_master(self.service)
                if state["num-other-sentinels"] < 2 or state["num-slaves"] < 1:
                    return False
            finally:
                client.close()
        return True

    def current_primary_port(self) -> int:
        """The port the sentinels name as the primary now."""
        client = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1)
        try:
            address: Any = client.sentinel_get_master_addr_by_name(self.service)
            return int(address[1])
        finally:
            client.close()

    def stop(self) -> None:
        """End sentinels, replica and primary."""
        for process in self._sentinels:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=5)
        self._sentinels.clear()
        if self.replica is not None:
            self.replica.cleanup()
        self.primary.cleanup()
