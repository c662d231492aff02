"""Instructions per send and per run, counted by valgrind's callgrind: a ruler for small changes.

``python -m tests.benchmarks --instructions`` (needs ``valgrind``). On a shared
machine a drain or a ``compare.sh`` run cannot tell a change of a few percent
from the weather: the same tree moves by more than that between runs. Callgrind
counts the instructions the client executes instead; for the same interpreter,
code and inputs they repeat to a few tenths of a percent (timers that fire or
not in a turn of the event loop are what is left of the weather).

Each figure takes two child processes under ``valgrind --tool=callgrind``,
doing the same thing ``low`` and ``high`` times:
``(I(high) - I(low)) / (high - low)`` is the instructions of one more, the
interpreter's start, the imports and the connections cancelling out.

- **send**: one ``kiq()`` on a null broker, without and with the middleware,
  and the unit of ``rt_limit.py``: one bare ``EVALSHA`` through redis-py.
- **run**: one run of a 1 ms task on a worker: taskiq's ``Receiver`` drains a
  ``ListQueueBroker`` queue, 100 runs at a time, as ``taskiq worker`` does.
  Without a middleware, with `worker_app.Floor` (one awaited script at each
  end of a run, nothing else), with ours, and with ours less one feature each
  (metrics, heartbeat), to see what each costs. The queue is filled by a
  sender outside valgrind, with the same middleware, so every message carries
  what the variant's sends write on it. A child whose runs did not all run,
  or that logged a warning, fails: its count would measure something else.

Instructions are not time: a round trip's wait costs none, and Redis' own
work is not in them. They are the client's CPU, which is what a drain runs
out of when the variants compared wait for Redis as often.

Where they go: two more children per variant, not under valgrind, count the
bytecodes each source file executes in the measured part (``sys.settrace``
with opcode events), ``low`` and ``high`` times again; the parts of the code
(`_parts`) sum them, and the table gives each part's bytecodes per operation
over the baseline's (a run: the floor; a send: plain taskiq).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import selectors
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import redis
import taskiq
import taskiq_redis

import taskiq_deduplication
from tests.benchmarks import worker_app

ROOT = Path(__file__).resolve().parents[2]

SEND_VARIANTS = ("without", "dedup", "bare_evalsha")
RUN_VARIANTS = ("without", "floor", "dedup", "dedup_no_metrics", "dedup_no_heartbeat")
#: Middleware options of each run variant that uses ours.
_OPTIONS: dict[str, dict[str, Any]] = {
    "dedup": {},
    "dedup_no_metrics": {"metrics": False},
    "dedup_no_heartbeat": {"heartbeat": False},
}
_TOTAL = re.compile(rb"^(?:summary|totals): (\d+)", re.MULTILINE)
_GENERATED = "generated methods (dataclasses, namedtuples)"
#: The variant whose bytecodes each kind's parts are told against.
_BASELINE = {"send": "without", "run": "floor"}
_TRACE_ENV = "DEDUP_BENCH_TRACE"
#: How long a child may take (seconds): valgrind runs the client some 50 times slower.
_CHILD_TIMEOUT = 1800


def _parts() -> list[tuple[str, str]]:
    """Where each part of the code is (a directory or a file), the most specific first."""
    ours = Path(taskiq_deduplication.__file__).parent
    places: list[tuple[Path, str]] = [
        (ours / "store", "store/: the pipeline, the wire, the calls"),
        (ours / "run", "run/: runs, executions, the heartbeat"),
        (ours / "send", "send/: sends"),
        (ours / "model", "model/: labels, fingerprint, formats"),
        (ours / "observe", "metrics and events"),
        (ours, "the rest of the middleware"),
        (Path(worker_app.__file__), "the floor's middleware"),
        (Path(taskiq_redis.__file__).parent, "taskiq-redis"),
        (Path(taskiq.__file__).parent, "taskiq"),
        (Path(redis.__file__).parent, "redis-py"),
        (Path(asyncio.__file__).parent, "asyncio"),
        (Path(selectors.__file__), "asyncio"),
    ]
    with contextlib.suppress(ImportError):  # the metrics extra
        import prometheus_client  # noqa: PLC0415

        places.insert(5, (Path(prometheus_client.__file__).parent, "metrics and events"))
    return [(str(place.resolve()), part) for place, part in places]


def _part_of(source: str, parts: list[tuple[str, str]]) -> str:
    """The part of the code ``source`` (a code object's file name) belongs to."""
    if source.startswith("<"):  # code made at run time: <string> is a dataclass's __init__
        return _GENERATED
    resolved = str(Path(source).resolve())
    for place, part in parts:
        if resolved == place or resolved.startswith(place + os.sep):
            return part
    return "other (the standard library, pydantic, ...)"


@dataclass(frozen=True)
class Counts:
    """How many operations the two child processes of a figure do."""

    low: int
    high: int

    @classmethod
    def for_kind(cls, kind: str, *, quick: bool) -> Counts:
        """The counts of ``kind`` ("send" or "run"): a few in a quick run."""
        if quick:
            return cls(10, 30)
        return cls(500, 1500) if kind == "send" else cls(200, 600)


def available() -> str | None:
    """Why instructions cannot be counted here, or ``None`` if they can."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (Debian: apt install valgrind)"
    return None


def measure(url: str, prefix: str, *, quick: bool) -> dict[str, Any]:
    """Instructions per send and per run of every variant, on the Redis at ``url``.

    Every key the children make starts with ``prefix``, for the caller to delete.
    """
    with tempfile.TemporaryDirectory(prefix="dedup-callgrind-") as scratch:
        ruler = Ruler(url, prefix, Path(scratch), quick=quick)
        return {
            "send": {variant: ruler.per_operation("send", variant) for variant in SEND_VARIANTS},
            "run": {variant: ruler.per_operation("run", variant) for variant in RUN_VARIANTS},
            "bytecodes": {
                kind: {variant: ruler.bytecodes(kind, variant) for variant in (baseline, "dedup")}
                for kind, baseline in _BASELINE.items()
            },
        }


def describe(results: dict[str, Any]) -> str:
    """The figures as text, with each variant against its baseline."""
    send, run = results["send"], results["run"]
    lines = ["", "Instructions (callgrind; the client's, per operation)", ""]
    lines.append(f"  kiq(), plain taskiq            {send['without']:>11,.0f}")
    lines.append(f"  kiq(), with the middleware     {send['dedup']:>11,.0f}")
    added = send["dedup"] - send["without"]
    lines.append(
        f"  added by the middleware        {added:>11,.0f}"
        f"  ({added / send['bare_evalsha']:.2f} bare EVALSHAs through redis-py,"
        f" {send['bare_evalsha']:,.0f} each)"
    )
    lines.append("")
    for variant in RUN_VARIANTS:
        figure = run[variant]
        lines.append(
            f"  a run, {variant:<24}{figure:>11,.0f}"
            f"  ({figure / run['without']:.2f} of without, {run['floor'] / figure:.2f} floor/this)"
        )
    for kind, baseline in _BASELINE.items():
        traced = results.get("bytecodes", {}).get(kind)
        if traced:
            lines += ["", f"  bytecodes a {kind}, dedup over {baseline}, by part"]
            lines += _by_part(traced["dedup"], traced[baseline])
    return "\n".join(lines) + "\n"


def _by_part(ours: dict[str, float], theirs: dict[str, float]) -> list[str]:
    """Lines of the bytecodes each part executes more (or less) in ``ours``, most first."""
    lines = []
    for part in sorted(set(ours) | set(theirs), key=lambda p: theirs.get(p, 0) - ours.get(p, 0)):
        extra = ours.get(part, 0) - theirs.get(part, 0)
        if abs(extra) >= 1:
            lines.append(f"    {extra:>8,.0f}  {part}")
    mine, baseline = sum(ours.values()), sum(theirs.values())
    lines.append(f"    {mine - baseline:>8,.0f}  in all ({mine:,.0f} against {baseline:,.0f})")
    return lines


@dataclass(frozen=True)
class Ruler:
    """Counts the instructions of child processes on one Redis, under one key prefix."""

    url: str
    prefix: str
    scratch: Path
    quick: bool

    def per_operation(self, kind: str, variant: str) -> float:
        """The instructions of one more ``kind`` ("send" or "run") of ``variant``."""
        counts = Counts.for_kind(kind, quick=self.quick)
        low = self._instructions(kind, variant, counts.low, "low")
        high = self._instructions(kind, variant, counts.high, "high")
        return (high - low) / (counts.high - counts.low)

    def bytecodes(self, kind: str, variant: str) -> dict[str, float]:
        """The bytecodes one more ``kind`` of ``variant`` executes, by part of the code."""
        counts = Counts.for_kind(kind, quick=self.quick)
        parts = _parts()
        low = self._traced(kind, variant, counts.low, "low", parts)
        high = self._traced(kind, variant, counts.high, "high", parts)
        return {
            part: (high.get(part, 0) - low.get(part, 0)) / (counts.high - counts.low)
            for part in high.keys() | low.keys()
        }

    def _traced(
        self, kind: str, variant: str, count: int, tag: str, parts: list[tuple[str, str]]
    ) -> dict[str, int]:
        """The bytecodes a child doing ``count`` of ``kind`` executes, by part."""
        output = self.scratch / f"bytecodes.{kind}.{variant}.{tag}.json"
        self._run_child(kind, variant, count, f"traced-{tag}", trace_to=output)
        by_part: dict[str, int] = {}
        for source, executed in json.loads(output.read_text()).items():
            part = _part_of(source, parts)
            by_part[part] = by_part.get(part, 0) + executed
        return by_part

    def _instructions(self, kind: str, variant: str, count: int, tag: str) -> int:
        """The instructions of a child process that does ``count`` of ``kind``."""
        output = self.scratch / f"callgrind.{kind}.{variant}.{tag}"
        self._run_child(kind, variant, count, tag, callgrind_to=output)
        found = _TOTAL.search(output.read_bytes())
        if found is None:
            msg = f"no instruction total in {output}"
            raise RuntimeError(msg)
        return int(found.group(1))

    def _run_child(
        self,
        kind: str,
        variant: str,
        count: int,
        tag: str,
        *,
        callgrind_to: Path | None = None,
        trace_to: Path | None = None,
    ) -> None:
        """Run one child (after filling its queue, for a run), under callgrind or traced.

        The key prefix names the child by ``tag``, not by ``count``: the keys of
        the ``low`` and ``high`` children are as long as each other.
        """
        prefix = f"{self.prefix}{kind}:{variant}:{tag}:"
        child = [sys.executable, "-m", "tests.benchmarks.instructions", kind, variant]
        child += [self.url, str(count), prefix]
        environment = {**os.environ, "PYTHONHASHSEED": "0"}
        if kind == "run":  # the queue is filled outside valgrind, and untraced
            _run_to_end([*child, "fill"], environment)
        if trace_to is not None:
            environment[_TRACE_ENV] = str(trace_to)
        if callgrind_to is not None:
            child = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind_to}", *child]
        _run_to_end(child, environment)


def _run_to_end(command: list[str], environment: dict[str, str]) -> None:
    """Run a child to its end; if it fails, say so with the end of what it wrote."""
    try:
        subprocess.run(
            command,
            cwd=ROOT,
            env=environment,
            check=True,
            capture_output=True,
            text=True,
            timeout=_CHILD_TIMEOUT,
        )
    except subprocess.CalledProcessError as exc:
        msg = f"{shlex.join(command[-6:])} failed ({exc.returncode}): {exc.stderr[-3000:]}"
        raise RuntimeError(msg) from None


# The child processes


@contextlib.contextmanager
def _traced() -> Iterator[None]:
    """Count the bytecodes each source file executes inside, if the parent asked for it."""
    output = os.environ.get(_TRACE_ENV)
    if not output:
        yield
        return
    executed: Counter[str] = Counter()

    def opcodes(frame: FrameType, event: str, _arg: object) -> Any:
        if event == "opcode":
            executed[frame.f_code.co_filename] += 1
        return opcodes

    def calls(frame: FrameType, event: str, _arg: object) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return opcodes
        return None

    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(None)
        Path(output).write_text(json.dumps(executed))


async def _child_send(variant: str, url: str, count: int, prefix: str) -> None:
    """``count`` sequential ``kiq()``s (or bare ``EVALSHA``s), after 50 to warm up."""
    import redis.asyncio  # noqa: PLC0415 (in the child only)

    from taskiq_deduplication import RedisDeduplicationMiddleware  # noqa: PLC0415
    from tests.benchmarks.harness import NullBroker  # noqa: PLC0415

    if variant == "bare_evalsha":  # rt_limit.py's unit
        client = redis.asyncio.Redis.from_url(url)
        script = client.register_script(
            "local v=redis.call('GET',KEYS[1]) if v then return v end "
            "redis.call('SET',KEYS[1],ARGV[1],'PX',ARGV[2]) return false"
        )
        for n in range(-50, count):
            await script(keys=[f"{prefix}{n}"], args=["a", 10_000])
        await client.aclose()
        return
    broker: taskiq.AsyncBroker = NullBroker()
    if variant == "dedup":
        broker = broker.with_middlewares(RedisDeduplicationMiddleware(url, key_prefix=prefix))

    @broker.task(task_name="bench_send")
    async def task(n: int) -> None: ...

    await broker.startup()
    for n in range(-50, 0):
        await task.kiq(n)
    with _traced():
        for n in range(count):
            await task.kiq(n)
    await broker.shutdown()


async def _child_run(variant: str, url: str, count: int, prefix: str, *, fill: bool) -> None:
    """Fill the variant's queue with ``count`` tasks, or drain it as a worker does.

    Raises:
        SystemExit: Not every run ran its body, or something logged a warning
            (a middleware that failed a run, a lock call that timed out): the
            count would not be of ``count`` runs like the others.
    """
    from taskiq.receiver import Receiver  # noqa: PLC0415 (in the child only)
    from taskiq_redis import ListQueueBroker  # noqa: PLC0415

    from taskiq_deduplication import RedisDeduplicationMiddleware  # noqa: PLC0415

    middlewares: list[Any] = []
    if variant == "floor":
        middlewares.append(worker_app.Floor(url, prefix))
    elif variant in _OPTIONS:
        options = {"key_prefix": prefix, "default_ttl": 300, **_OPTIONS[variant]}
        middlewares.append(RedisDeduplicationMiddleware(url, **options))
    broker = ListQueueBroker(url, queue_name=f"{prefix}queue", socket_timeout=None)
    broker = broker.with_middlewares(*middlewares)

    bodies = [0]

    @broker.task(task_name="bench_sleep")
    async def sleep(n: int, seconds: float) -> int:
        await asyncio.sleep(seconds)
        bodies[0] += 1
        return n

    if fill:
        await broker.startup()
        for n in range(count):
            await sleep.kiq(n, 0.001)
        await broker.shutdown()
        return
    broker.is_worker_process = True
    await broker.startup()
    receiver = Receiver(broker, max_async_tasks=100, max_tasks_to_execute=count, run_startup=False)
    warnings = _Warnings()
    logging.getLogger().addHandler(warnings)
    with _traced():
        await receiver.listen(asyncio.Event())
    await broker.shutdown()
    if bodies[0] != count or warnings.said:
        said = "; ".join(warnings.said[:3])
        msg = f"{bodies[0]} of {count} runs ran their body; {len(warnings.said)} warning(s): {said}"
        raise SystemExit(msg)


class _Warnings(logging.Handler):
    """Keeps what was logged at WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(f"{record.name}: {record.getMessage()}")


def _child(argv: list[str]) -> None:
    kind, variant, url, count, prefix, *rest = argv
    if kind == "send":
        asyncio.run(_child_send(variant, url, int(count), prefix))
    else:
        asyncio.run(_child_run(variant, url, int(count), prefix, fill=rest == ["fill"]))


if __name__ == "__main__":
    _child(sys.argv[1:])
