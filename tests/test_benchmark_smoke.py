"""The benchmark still runs: ``python -m tests.benchmarks --quick`` writes every section.

No timing is checked here: the figures belong to docs/performance.md, not to CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
