"""The command line: ``python -m tests.benchmarks [--quick] [--json PATH] [--plot] ...``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from tests.benchmarks import report, scenarios
from tests.benchmarks.harness import Probe, new_prefix, quiet_logging

#: The sections in the order they run. Memory goes first, on a server whose
#: keyspace the earlier sections have not filled with locks that expire meanwhile.
SECTIONS = (
    "memory",
    "send_path",
    "overhead",
    "rejected",
    "lifecycle",
    "round_trips",
    "scripts",
    "heartbeat",
    "limit",
    "workers",
    "limits",
)
DEFAULT_JSON = Path("benchmark-results/latest.json")
IMAGES = Path("docs/images")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks",
        description=(
            "Measure taskiq-deduplication against taskiq without middleware, side by side, "
            "on the same Redis."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help=f"where to write the results ({DEFAULT_JSON})",
    )
    parser.add_argument("--plot", action="store_true", help=f"draw PNG charts into {IMAGES}/")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="the Redis to use (default: REDIS_URL, else a throwaway server of our own)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run everything N times; report median and spread"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the send path with py-spy and say where the time goes",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count the instructions of a send and of a run (valgrind's callgrind)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        help="run only this section (repeatable); latency comes with send_path",
    )
    return parser


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[tuple[str, bool]]:
    """The URL of the Redis to measure on, and whether the benchmark owns that server."""
    if url:
        yield url, False
        return
    from tests._server import Server  # noqa: PLC0415 (only when no Redis was given)

    server = Server().start()
    if len(os.sched_getaffinity(0)) > 1:
        # One core for the server, so that the client can be pinned beside it or apart.
        os.sched_setaffinity(server.pid, {min(os.sched_getaffinity(0))})
    try:
        yield server.url, True
    finally:
        server.cleanup()


async def _run_once(bench: scenarios.Bench, only: list[str] | None) -> report.Results:
    results: report.Results = {"seconds": {}}
    for name in SECTIONS:
        if only and name not in only:
            continue
        started = time.perf_counter()
        if name == "send_path":
            results["send_path"], results["latency"] = await scenarios.send_path(bench)
        elif name == "workers":
            from tests.benchmarks import workers  # noqa: PLC0415 (starts processes)

            results[name] = await workers.workers(bench)
        elif name == "limits":
            from tests.benchmarks import limits  # noqa: PLC0415 (starts processes)

            results[name] = await limits.limits(bench)
        else:
            results[name] = await getattr(scenarios, name)(bench)
        results["seconds"][name] = time.perf_counter() - started
        _say(f"  {name}: {results['seconds'][name]:.1f} s")
    return results


def _extras(
    args: argparse.Namespace, url: str, probe: Probe, settings: scenarios.Settings
) -> dict[str, report.Results | None]:
    """What ``--profile`` and ``--instructions`` add to the results (``None``: not asked)."""
    extras: dict[str, report.Results | None] = {"profile": None, "instructions": None}
    if args.profile:
        from tests.benchmarks import profiling  # noqa: PLC0415 (needs py-spy, which is optional)

        bench = scenarios.Bench(url, probe, settings)
        try:
            extras["profile"] = asyncio.run(profiling.send_path(bench, args.json.parent))
        finally:
            for prefix in bench.prefixes:
                probe.delete(prefix)
    if args.instructions:
        extras["instructions"] = _count_instructions(url, probe, quick=args.quick)
    return extras


def _count_instructions(url: str, probe: Probe, *, quick: bool) -> report.Results:
    """Instructions per send and per run (see `tests.benchmarks.instructions`)."""
    from tests.benchmarks import instructions  # noqa: PLC0415 (runs valgrind)

    _say("counting instructions under callgrind (about ten minutes; --quick: two)")
    prefix = f"{new_prefix('i')}:"
    try:
        return instructions.measure(url, prefix, quick=quick)
    finally:
        probe.delete(prefix)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table, write the JSON (and the charts)."""
    args = _parser().parse_args(argv)
    if args.repeat < 1:
        _parser().error("--repeat must be at least 1")
    if args.instructions:
        from tests.benchmarks import instructions  # noqa: PLC0415

        why_not = instructions.available()
        if why_not is not None:  # said before the sections run, not after
            _parser().error(f"--instructions: {why_not}")
    settings = scenarios.Settings.quick() if args.quick else scenarios.Settings.full()
    quiet_logging()
    started = time.perf_counter()
    runs: list[report.Results] = []
    with _redis(args.redis_url) as (url, own_server):
        probe = Probe(url)
        try:
            meta = report.machine(probe.server_version(), own_server=own_server)
            _say(f"benchmark on {meta['redis_server']} ({'own' if own_server else url})")
            for index in range(args.repeat):
                _say(f"run {index + 1} of {args.repeat}")
                bench = scenarios.Bench(url, probe, settings)
                try:
                    runs.append(asyncio.run(_run_once(bench, args.only)))
                finally:
                    for prefix in bench.prefixes:
                        probe.delete(prefix)
            extras = _extras(args, url, probe, settings)
        finally:
            probe.close()
    meta["load_average_end"] = list(os.getloadavg())
    meta["seconds"] = time.perf_counter() - started
    summary = report.summarize(runs)
    target_rows = report.targets(summary)
    output: report.Results = {
        "command": shlex.join(["python", "-m", "tests.benchmarks", *(argv or sys.argv[1:])]),
        "machine": meta,
        "settings": asdict(settings),
        "summary": summary,
        "targets": target_rows,
        **extras,
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(output, indent=2) + "\n")
    sys.stdout.flush()
    sys.stdout.write(report.table(summary, target_rows))
    if extras["profile"] is not None:
        from tests.benchmarks import profiling  # noqa: PLC0415

        sys.stdout.write(profiling.describe(extras["profile"]))
    if extras["instructions"] is not None:
        from tests.benchmarks import instructions  # noqa: PLC0415

        sys.stdout.write(instructions.describe(extras["instructions"]))
    if args.plot:
        from tests.benchmarks import charts  # noqa: PLC0415 (matplotlib is optional)

        for path in charts.draw(summary, IMAGES):
            _say(f"wrote {path}")
    _say(f"wrote {args.json} in {meta['seconds']:.0f} s")
    return 0
