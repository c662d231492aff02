"""Command line of the soak: ``python -m tests.soak --minutes 10`` (or ``--seconds 60``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from tests.soak.run import Options, soak

#: The numeric options of a run: name, type, default and help.
_NUMBERS: tuple[tuple[str, type[float | int], float, str], ...] = (
    ("--rate", float, 40.0, "sends a second (default 40)"),
    ("--dup-share", float, 0.3, "share of sends that repeat a recent call"),
    (
        "--chain-share",
        float,
        0.03,
        "share of new list-broker calls that send from a second event loop (0.03)",
    ),
    ("--ttl", int, 15, "the middleware's default_ttl (15)"),
    ("--socket-timeout", float, 1.0, "socket timeout to Redis (1.0 s)"),
    (
        "--latency-margin",
        float,
        0.5,
        "how far past the socket timeout the lock's part of a kiq may go (0.5 s)",
    ),
    ("--workers", int, 2, "worker processes per broker (2)"),
    ("--fault-gap", float, 2.0, "mean quiet time between faults (2.0 s)"),
)


def parse(argv: list[str]) -> Options:
    """The options of the command line."""
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--seconds", type=float, help="how long to send for")
    length.add_argument("--minutes", type=float, help="how long to send for")
    for name, kind, default, text in _NUMBERS:
        parser.add_argument(name, type=kind, default=default, help=text)
    parser.add_argument(
        "--long-pauses",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let some Redis pauses outlast the TTL (default: on for runs of 3 minutes or more)",
    )
    parser.add_argument(
        "--running-ttl",
        type=int,
        default=None,
        help="send the deduplication_running_ttl label with this value",
    )
    parser.add_argument(
        "--redelivery-window",
        type=int,
        default=None,
        help=(
            "the middleware's redelivery_window (where the library has it), and how long "
            "after a success the report counts a copy that ran as a breach "
            "(default: the library's own; none where it has no such option)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument(
        "--keep-ledger", action="store_true", help="keep the PostgreSQL schema at the end"
    )
    parser.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    long_pauses = args.long_pauses if args.long_pauses is not None else seconds >= 180
    return Options(
        seconds=seconds,
        rate=args.rate,
        dup_share=args.dup_share,
        chain_share=args.chain_share,
        ttl=args.ttl,
        socket_timeout=args.socket_timeout,
        latency_margin=args.latency_margin,
        workers=args.workers,
        fault_gap=args.fault_gap,
        long_pauses=long_pauses,
        running_ttl=args.running_ttl,
        redelivery_window=args.redelivery_window,
        seed=args.seed,
        keep=args.keep_ledger,
        out=args.report,
    )


async def _main(options: Options) -> int:
    # SIGTERM ends the soak as Ctrl-C does: cancelled, and cleaned up on the way out.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await soak(options)


def main() -> int:
    """Run the soak; its exit status says whether every invariant held."""
    options = parse(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("taskiq_deduplication").setLevel(logging.ERROR)
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        return asyncio.run(_main(options))
    print("soak interrupted; everything it started was ended", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
