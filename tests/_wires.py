"""The two ways lock calls go through redis-py (``src/taskiq_deduplication/store/wire/``).

The lean way is the default; the public way, on redis-py's public API, is the
fallback where the probe finds that this redis-py does not allow the lean one.
The tests of the modules in ``BOTH_WIRES`` run on each, as ``[lean]`` and
``[public]`` (the ``redis_wire`` fixture, ``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import redis.asyncio

from taskiq_deduplication.store.wire.probe import WIRE_ENV, lean_fits, misfit_of

#: The modules whose tests run on both ways: the pipeline's mechanics (a hung
#: server, a lost script cache, a shutdown cut short), its recovery from a
#: restart or a failover, and the round trips that runs share.
BOTH_WIRES = frozenset(
    {"tests/faults/test_pipeline.py", "tests/test_redis_trouble.py", "tests/test_sharing.py"}
)


def use_wire(wire: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the test's lock calls go the ``wire`` way: ``"lean"`` or ``"public"``.

    ``"public"`` forces the fallback on redis-py's public API, and fails the test
    unless the probe then picks it; ``"lean"`` is the default way, and skips the
    test where the probe finds that this redis-py does not allow it.
    """
    if wire == "public":
        monkeypatch.setenv(WIRE_ENV, "public")
    else:
        monkeypatch.delenv(WIRE_ENV, raising=False)
    probed = redis.asyncio.Redis().connection_pool.make_connection()  # type: ignore[no-untyped-call]
    lean = lean_fits(probed)
    if wire == "public":
        assert not lean, f"{WIRE_ENV}=public did not make the probe pick the public way"
    elif not lean:
        pytest.skip(f"the lean way does not fit this redis-py: {misfit_of(probed)}")
