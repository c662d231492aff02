"""One test over each topology: a single server, a Redis Cluster, a Sentinel set.

A core behaviour test decorated with ``@all_topologies()`` runs three times, as
``limits``' ``all_storage`` runs its storage tests; the ``topology`` fixture
(``tests/conftest.py``) hands it a ``Topology``. The servers themselves are
``tests/topologies/_servers.py``'s; here are the clients the docs recommend for
them, and the skip where this machine cannot start them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel

from tests.topologies._servers import Cluster, Sentinels

#: The topologies a test decorated with ``all_topologies()`` runs on.
TOPOLOGIES = ("single", "cluster", "sentinel")
#: Set to a comma-separated subset of ``TOPOLOGIES`` to skip the others (``single``).
TOPOLOGIES_ENV = "DEDUP_TEST_TOPOLOGIES"


def all_topologies(*, hash_tag: bool = False) -> pytest.MarkDecorator:
    """Run the test on each topology (``limits``' ``all_storage``, for this middleware).

    Args:
        hash_tag: On the Cluster, put the test's prefix in a hash tag
            (``{test:...}``): a task that merges its calls, takes a fence or
            keeps a run slot needs its lock and the keys beside it in one slot.
            Without it the test's locks spread over every primary.
    """
    # Under pytest-xdist, one worker runs every test of a topology: one Cluster
    # and one Sentinel set for the whole run, not one per worker.
    return pytest.mark.parametrize(
        "topology",
        [
            pytest.param("single", id="single"),
            pytest.param(
                "cluster{}" if hash_tag else "cluster",
                id="cluster",
                marks=pytest.mark.xdist_group("cluster"),
            ),
            pytest.param("sentinel", id="sentinel", marks=pytest.mark.xdist_group("sentinel")),
        ],
        indirect=True,
    )


@dataclass
class Topology:
    """Where a test's locks live: the key prefix, and the client the middlewares share."""

    name: str
    prefix: str
    client: redis.asyncio.Redis | None = None
    """``None`` on the single server: each middleware builds its own from the URL."""


TopologyT = TypeVar("TopologyT")


def start_or_skip(start: Callable[[], TopologyT], what: str) -> TopologyT:
    """Start a topology of servers, or skip the test where this machine cannot."""
    try:
        return start()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no {what} could be started here: {exc}")


def cluster_client(nodes: Cluster) -> RedisCluster:
    """A cluster client found from one node's URL, as the docs say to build it."""
    return RedisCluster.from_url(nodes.url, decode_responses=True)


def primary_client(watched: Sentinels, *, socket_timeout: float = 0.5) -> redis.asyncio.Redis:
    """The client the docs recommend: the sentinels' current primary, short timeouts.

    ``socket_timeout`` is also the middleware's budget for a lock call, from
    the moment it is made (see ``docs/reliability.md``).
    """
    sentinel = Sentinel(watched.addresses, socket_timeout=0.5)  # type: ignore[no-untyped-call,unused-ignore]
    client: redis.asyncio.Redis = sentinel.master_for(
        watched.service,
        socket_timeout=socket_timeout,
        socket_connect_timeout=0.5,
        decode_responses=True,
    )
    return client
