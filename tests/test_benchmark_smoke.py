"""The benchmark still runs: ``python -m tests.benchmarks --quick`` writes every section.

No timing is checked here: the figures belong to docs/performance.md, not to CI.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.benchmarks import instructions
from tests.benchmarks.harness import Probe, new_prefix

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = (
    "memory",
    "send_path",
    "latency",
    "rejected",
    "lifecycle",
    "round_trips",
    "scripts",
    "heartbeat",
    "limit",
    "limits",
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_benchmark_writes_every_section(redis_url: str, tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.benchmarks",
            "--quick",
            "--json",
            str(output),
            "--redis-url",
            redis_url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(output.read_text())

    assert set(SECTIONS) <= set(results["summary"])
    assert len(results["runs"]) == 1
    assert set(SECTIONS) <= set(results["runs"][0])
    summary = results["summary"]
    for broker in ("null", "list_queue"):
        assert {"1", "64"} <= set(summary["send_path"][broker])
        assert "dedup_per_s" in summary["send_path"][broker]["1"]
        assert "added_p99_us" in summary["latency"][broker]["1"]
    assert {"succeeded", "failed", "retried_once", "rejected"} <= set(summary["round_trips"])
    assert {"100", "1000"} <= set(summary["heartbeat"])
    assert "bytes_per_lock" in summary["memory"]
    # Issue 34's limits: every part ran; the limit held across the two worker
    # processes, and an uncontended limited run took no round trip more.
    limits = summary["limits"]
    assert {"unlimited", "limited", "limited_10_keys"} <= set(limits["drain"])
    assert limits["drain"]["limited"]["peak_runs_of_a_key"]["max"] <= 2
    assert limits["drain"]["limited_10_keys"]["peak_runs_of_a_key"]["max"] <= 2
    trips = limits["round_trips"]
    assert trips["limited"]["round_trips"] == trips["unlimited"]["round_trips"]
    assert trips["limited"]["commands"]["median"] == trips["unlimited"]["commands"]["median"] + 2
    assert limits["memory"]["bytes_per_busy_limit"]["median"] > 0
    assert limits["overhead"]  # the life cycle, on each pinning the machine allows
    assert {row["figure"] for row in results["targets"]} >= {
        "send_path.null.1.ratio",
        "memory.bytes_per_lock",
    }
    assert results["machine"]["nproc"]
    assert "## targets" in completed.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    instructions.available() is not None, reason=f"--instructions: {instructions.available()}"
)
def test_the_instructions_of_a_send_are_counted(redis_url: str, tmp_path: Path) -> None:
    # Two children under callgrind (half a minute or more each): the ruler's
    # difference is one kiq() with the middleware, its interpreter's start cancelled out.
    with _ruler(redis_url, tmp_path) as ruler:
        per_send = ruler.per_operation("send", "dedup")
    # Tens of thousands of Python bytecodes' worth, not a start-up's billions
    # nor a difference that came out empty.
    assert 50_000 < per_send < 50_000_000


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_bytecodes_of_a_send_and_a_run_are_told_by_part(redis_url: str, tmp_path: Path) -> None:
    # No valgrind here: four traced children, a few seconds each.
    with _ruler(redis_url, tmp_path) as ruler:
        send = ruler.bytecodes("send", "dedup")
        run = ruler.bytecodes("run", "dedup")
    # Each part is found where its code is; a kiq() of the middleware's runs no run/ code.
    assert send["store/: the pipeline, the wire, the calls"] > 100
    assert send["send/: sends"] > 10
    assert send.get("run/: runs, executions, the heartbeat", 0) < send["send/: sends"]
    assert run["run/: runs, executions, the heartbeat"] > 100
    assert run["redis-py"] > 100  # taskiq-redis' BRPOP, not counted as asyncio
    assert run["asyncio"] > 100


@contextlib.contextmanager
def _ruler(redis_url: str, scratch: Path) -> Iterator[instructions.Ruler]:
    """A quick ruler on ``redis_url``, whose keys go when it is done."""
    prefix = f"{new_prefix('i')}:"
    probe = Probe(redis_url)
    try:
        yield instructions.Ruler(redis_url, prefix, scratch, quick=True)
    finally:
        probe.delete(prefix)
        probe.close()


def test_instruction_figures_are_told_against_their_baselines() -> None:
    figures = {
        "send": {"without": 100_000.0, "dedup": 600_000.0, "bare_evalsha": 400_000.0},
        "run": dict.fromkeys(instructions.RUN_VARIANTS, 1_000_000.0)
        | {"without": 800_000.0, "floor": 1_000_000.0, "dedup": 1_600_000.0},
        "bytecodes": {
            "run": {"floor": {"asyncio": 900.0}, "dedup": {"asyncio": 1_000.0, "run/": 50.0}}
        },
    }
    text = instructions.describe(figures)
    assert "added by the middleware            500,000  (1.25 bare EVALSHAs" in text
    assert "a run, dedup                     1,600,000  (2.00 of without, 0.62 floor/this)" in text
    assert "bytecodes a run, dedup over floor" in text
    assert "bytecodes a send" not in text  # none were traced
    assert (
        "       100  asyncio\n          50  run/\n         150  in all (1,050 against 900)" in text
    )
