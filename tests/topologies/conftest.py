"""Topologies for the whole module: a 3-primary Redis Cluster and a Sentinel set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.topologies._servers import Cluster, Sentinels


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A 3-primary cluster, started once for the module."""
    nodes = Cluster(primaries=3).start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def sentinels() -> Iterator[Sentinels]:
    """A primary, a replica and three sentinels, started once for the module."""
    watched = Sentinels().start()
    try:
        yield watched
    finally:
        watched.stop()
