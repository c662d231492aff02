"""What the run found, for people: the machine, the median of the runs, the table, the targets."""

from __future__ import annotations

import datetime as dt
import operator
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import redis.utils

Results = dict[str, Any]


def machine(server_version: str, *, own_server: bool) -> Results:
    """The machine, the software and the date the figures belong to."""
    cpu_model = "?"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.partition(":")[2].strip()
                break
    packages = ("taskiq", "taskiq-redis", "redis", "taskiq-dedup", "hiredis")
    versions = {package: _version(package) for package in packages}
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "hiredis_parser": bool(redis.utils.HIREDIS_AVAILABLE),
        "redis_server": server_version,
        "own_server": own_server,
        "load_average_start": list(os.getloadavg()),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty_src": bool(_git("status", "--porcelain", "--", "src")),
    }


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return ""
    return done.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def summarize(runs: list[Results]) -> Results:
    """Median, minimum and maximum of every number across the runs (same shape as a run)."""
    first = runs[0]
    summary: Results = {}
    for key, value in first.items():
        values = [run.get(key) for run in runs]
        if isinstance(value, dict):
            summary[key] = summarize([v for v in values if isinstance(v, dict)])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers = [float(v) for v in values if isinstance(v, (int, float))]
            summary[key] = {
                "median": statistics.median(numbers),
                "min": min(numbers),
                "max": max(numbers),
            }
    return summary


def lookup(summary: Results, path: str) -> dict[str, float] | None:
    """The ``{"median", "min", "max"}`` at a dotted ``path``, or ``None`` if not measured."""
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) and "median" in node else None


#: The comparisons a target's goal may make.
_COMPARISONS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, "==": operator.eq}


@dataclass(frozen=True)
class Target:
    """One goal of issue 5."""

    name: str
    path: str
    goal: str
    """A comparison and a number, as the report shows it: ``">= 0.8"``, ``"== 1"``."""

    def met(self, figure: float) -> bool:
        """Whether ``figure`` meets the goal."""
        comparison, bound = self.goal.split()
        return bool(_COMPARISONS[comparison](figure, float(bound)))


TARGETS = (
    Target("sequential kiq, null broker: with / without", "send_path.null.1.ratio", ">= 0.10"),
    Target(
        "sequential kiq, ListQueueBroker: with / without", "send_path.list_queue.1.ratio", ">= 0.6"
    ),
    Target(
        "heartbeat, 10,000 tasks: round trips per interval",
        "heartbeat.10000.round_trips_per_interval",
        "<= 2",
    ),
    Target(
        "heartbeat, 10,000 tasks: share of one core", "heartbeat.10000.cpu_share_of_core", "< 0.05"
    ),
    *(
        Target(f"{what} ({pin}): added time in bare EVALSHAs", f"overhead.{pin}.{figure}", goal)
        for pin in ("same_core", "other_core", "unpinned")
        for what, figure, goal in (
            ("sequential kiq, null broker", "kiq_added_round_trips", "<= 1.25"),
            ("life cycle, finished", "life_finished_added_round_trips", "<= 3"),
            ("life cycle, failed", "life_failed_added_round_trips", "<= 3"),
        )
    ),
    Target(
        "ListQueueBroker, 64 callers: with / without", "send_path.list_queue.64.ratio", ">= 0.8"
    ),
    Target("taskiq worker drain, 2 processes: with / without", "workers.drain.ratio", ">= 0.85"),
    Target("Redis memory per held lock (bytes)", "memory.bytes_per_lock", "<= 200"),
    Target(
        "round trips on an accepted kiq's critical path",
        "round_trips.succeeded.critical_path_round_trips",
        "== 1",
    ),
    *(
        Target(f"round trips {what}", f"round_trips.{case}.round_trips", "== 1")
        for case, what in (
            ("rejected", "per rejected duplicate"),
            ("joined", "of a duplicate that joins its holder (kiq_or_join)"),
            ("merged", "of a duplicate that merges its arguments"),
        )
    ),
)


def targets(summary: Results) -> list[Results]:
    """Each target with its median figure and whether the median meets it."""
    rows: list[Results] = []
    for target in TARGETS:
        figure = lookup(summary, target.path)
        if figure is None and ".unpinned." in target.path:
            continue
        rows.append(
            {
                "target": target.name,
                "figure": target.path,
                "goal": target.goal,
                "median": None if figure is None else figure["median"],
                "met": None if figure is None else bool(target.met(figure["median"])),
            }
        )
    for case, what in (
        ("failed", "a failed task"),
        ("succeeded_with_a_fence", "a task with a fence"),
    ):
        row = _no_dearer(summary, case, what)
        if row is not None:
            rows.append(row)
    return rows


def _no_dearer(summary: Results, case: str, what: str) -> Results | None:
    """The target row "round trips of ``case`` / of a task that succeeded: <= 1"."""
    dearer = lookup(summary, f"round_trips.{case}.round_trips")
    succeeded = lookup(summary, "round_trips.succeeded.round_trips")
    if dearer is None or succeeded is None:
        return None
    return {
        "target": f"round trips of {what} / of a successful one",
        "figure": f"round_trips.{case}.round_trips / round_trips.succeeded.round_trips",
        "goal": "<= 1",
        "median": dearer["median"] / succeeded["median"],
        "met": dearer["median"] <= succeeded["median"],
    }


def _number(value: float) -> str:
    magnitude = abs(value)
    if float(value).is_integer():
        return f"{int(value):,}"
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def show(figure: dict[str, float] | None) -> str:
    """``median [min-max]``, or just the median when all runs agree."""
    if figure is None:
        return "-"
    text = _number(figure["median"])
    low, high = _number(figure["min"]), _number(figure["max"])
    return text if low == high else f"{text} [{low}-{high}]"


def _rows(summary: Results) -> list[tuple[str, ...]]:  # noqa: C901, PLR0912, PLR0915 (one table, section by section)
    rows: list[tuple[str, ...]] = []

    def add(*cells: str) -> None:
        rows.append(cells)

    def at(path: str) -> str:
        return show(lookup(summary, path))

    paths = summary.get("scripts", {})
    if paths:
        add("## scripts in Redis (commandstats)", "scripts/task", "us/call", "us/task")
        for path, figures in paths.items():
            add(
                f"{path}",
                at(f"scripts.{path}.scripts_per_task"),
                at(f"scripts.{path}.us_per_call"),
                at(f"scripts.{path}.us_per_task"),
            )
            for name in figures:
                if name not in ("scripts_per_task", "us_per_task", "us_per_call"):
                    add(f"  {name}", at(f"scripts.{path}.{name}.calls_per_task"), "", "")
    limit = summary.get("limit", {})
    if limit:
        add("## limit: acquire script through redis.asyncio", "", "", "")
        add("EVALSHA sequential /s", at("limit.evalsha_sequential_per_s"), "", "")
        add("EVALSHA sequential us", at("limit.evalsha_sequential_us"), "", "")
        add("EVALSHA in pipelines of 100 /s", at("limit.pipeline_100_calls_per_s"), "", "")
    for broker, title in (("null", "null broker"), ("list_queue", "ListQueueBroker")):
        section = summary.get("send_path", {}).get(broker, {})
        if not section:
            continue
        add(f"## send path, {title}: kiq/s", "without", "with", "with/without")
        for callers in section:
            base = f"send_path.{broker}.{callers}"
            add(
                f"{callers} caller(s)",
                at(f"{base}.none_per_s"),
                at(f"{base}.dedup_per_s"),
                at(f"{base}.ratio"),
            )
            add(
                "  ... with / EVALSHA limit, with / ideal",
                at(f"{base}.limit_per_s"),
                at(f"{base}.ratio_to_limit"),
                at(f"{base}.ratio_to_ideal"),
            )
    for name, title, columns in (
        ("rejected", "## rejected duplicates /s", ("kiq without", "rejected", "rejected/without")),
        (
            "lifecycle",
            "## lifecycle on InMemoryBroker, tasks/s",
            ("without", "with", "with/without"),
        ),
    ):
        section = summary.get(name, {})
        if section:
            add(title, *columns)
        for callers in (c for c in section if c.isdigit()):
            base = f"{name}.{callers}"
            first, second = (
                ("none_kiq_per_s", "rejected_per_s")
                if name == "rejected"
                else (
                    "none_per_s",
                    "dedup_per_s",
                )
            )
            add(
                f"{callers} caller(s)",
                at(f"{base}.{first}"),
                at(f"{base}.{second}"),
                at(f"{base}.ratio"),
            )
    if "lifecycle" in summary:
        add("locks left after the runs", at("lifecycle.locks_left"), "", "")
    for pin, section in summary.get("overhead", {}).items():
        base = f"overhead.{pin}"
        add(
            f"## sequential, added time in bare EVALSHAs ({pin})",
            "us without / with",
            "added (EVALSHAs)",
            "tasks/s",
        )
        add("EVALSHA alone (us)", at(f"{base}.evalsha_us"), "", "")
        add(
            "kiq, null broker",
            f"{at(base + '.null_none_us')} / {at(base + '.null_dedup_us')}",
            at(f"{base}.kiq_added_round_trips"),
            "",
        )
        for policy in (p.removeprefix("life_").removesuffix("_us") for p in section):
            if f"life_{policy}_added_round_trips" not in section:
                continue
            add(
                f"life cycle (await_inplace), {policy}",
                f"{at(base + '.life_none_us')} / {at(f'{base}.life_{policy}_us')}",
                at(f"{base}.life_{policy}_added_round_trips"),
                at(f"{base}.life_{policy}_per_s"),
            )
    trips = summary.get("round_trips", {})
    if trips:
        add(
            "## round trips per task (alone)",
            "in kiq: trips / writes",
            "total: trips / writes",
            "EVALSHA (server)",
        )
        cases = [c for c in trips if c.startswith("succeeded")]
        extra = [c for c in ("joined", "merged") if c in trips]
        for case in (*cases, "failed", "retried_once", "rejected", *extra):
            base = f"round_trips.{case}"
            add(
                case,
                f"{at(base + '.critical_path_round_trips')} / {at(base + '.critical_path_writes')}",
                f"{at(base + '.round_trips')} / {at(base + '.writes')}",
                at(f"{base}.server_script_calls"),
            )
        base = "round_trips.under_load_64_callers"
        add(
            "lifecycle, 64 callers (per task)",
            "",
            at(f"{base}.round_trips_per_task"),
            at(f"{base}.server_script_calls_per_task"),
        )
    beats = summary.get("heartbeat", {})
    if beats:
        add("## heartbeat (interval 1 s)", "round trips/interval", "CPU share", "Redis CPU")
        for tasks in beats:
            base = f"heartbeat.{tasks}"
            add(
                f"{int(tasks):,} running tasks",
                at(f"{base}.round_trips_per_interval"),
                at(f"{base}.cpu_share_of_core"),
                at(f"{base}.server_cpu_share_of_core"),
            )
    drain = summary.get("workers", {}).get("drain", {})
    if drain:
        add("## taskiq worker, 2 processes, drain", "without", "with", "with/without")
        add(
            f"{at('workers.drain.tasks')} tasks of 1 ms, tasks/s",
            at("workers.drain.none_per_s"),
            at("workers.drain.dedup_per_s"),
            at("workers.drain.ratio"),
        )
        add(
            "worker CPU per task (us)",
            at("workers.drain.worker_cpu_us_per_task_none"),
            at("workers.drain.worker_cpu_us_per_task_dedup"),
            "",
        )
        if "floor_ratio" in drain:  # results written before the floor was measured have none
            add(
                "floor (two awaited scripts a run, nothing else), tasks/s",
                at("workers.drain.none_per_s"),
                at("workers.drain.floor_per_s"),
                at("workers.drain.floor_ratio"),
            )
            add(
                "floor: worker CPU per task (us)",
                at("workers.drain.worker_cpu_us_per_task_none"),
                at("workers.drain.worker_cpu_us_per_task_floor"),
                "",
            )
            add("with / floor", "", "", at("workers.drain.dedup_of_floor"))
        add("locks left after the drains", at("workers.drain.locks_left"), "", "")
    held = summary.get("workers", {}).get("held", {})
    if held:
        add("## taskiq worker, held tasks", "round trips/interval", "CPU share", "Redis CPU")
        add(
            f"{at('workers.held.tasks')} running tasks",
            at("workers.held.round_trips_per_interval"),
            at("workers.held.cpu_share_of_core"),
            at("workers.held.server_cpu_share_of_core"),
        )
    if "limits" in summary:
        rows += _limit_rows(summary)
    if "memory" in summary:
        add("## Redis memory", "bytes per lock", "MEMORY USAGE", "locks held")
        add(
            "used_memory delta",
            at("memory.bytes_per_lock"),
            at("memory.memory_usage_command_bytes"),
            at("memory.locks_held"),
        )
    for broker in summary.get("latency", {}):
        if broker == "limit":
            add(
                "EVALSHA alone, p50 / p99 us",
                at("latency.limit.p50_us"),
                at("latency.limit.p99_us"),
                "",
            )
            continue
        add(
            f"## latency per kiq, {broker} (us)",
            "p50 without/with",
            "p99 without/with",
            "added p50/p99",
        )
        for callers in summary["latency"][broker]:
            base = f"latency.{broker}.{callers}"
            add(
                f"{callers} caller(s)",
                f"{at(base + '.none_p50_us')} / {at(base + '.dedup_p50_us')}",
                f"{at(base + '.none_p99_us')} / {at(base + '.dedup_p99_us')}",
                f"{at(base + '.added_p50_us')} / {at(base + '.added_p99_us')}",
            )
    return rows


def _limit_rows(summary: Results) -> list[tuple[str, ...]]:
    """The rows of the ``limits`` section (issue 34): limited beside unlimited."""
    limits = summary["limits"]

    def at(path: str) -> str:
        return show(lookup(summary, f"limits.{path}"))

    rows = _limit_drain_rows(limits, at)
    if "round_trips" in limits:
        rows.append(
            ("## limits: per task alone", "trips / writes", "commands", "EVALSHA: calls / us")
        )
        for case in limits["round_trips"]:
            base = f"round_trips.{case}"
            rows.append(
                (
                    case,
                    f"{at(base + '.round_trips')} / {at(base + '.writes')}",
                    at(f"{base}.commands"),
                    f"{at(base + '.server_script_calls')} / {at(base + '.evalsha_us')}",
                )
            )
    for pin in limits.get("overhead", {}):
        base = f"overhead.{pin}"
        rows.append((f"## limits: life cycle ({pin})", "us", "added (EVALSHAs)", ""))
        rows.append(("EVALSHA alone", at(f"{base}.evalsha_us"), "", ""))
        rows.append(("unlimited", at(f"{base}.unlimited_us"), "", ""))
        rows.append(("limited", at(f"{base}.limited_us"), at(f"{base}.added_evalshas"), ""))
    if "memory" in limits:
        rows.append(("## limits: Redis memory per limit", "used_memory", "MEMORY USAGE", ""))
        for state, figure, usage in (
            ("2 slots held", "bytes_per_busy_limit", "memory_usage_busy"),
            ("each run waiting in line", "bytes_per_waiter", None),
            ("every slot freed", "bytes_per_idle_limit", "memory_usage_idle"),
        ):
            total = ""
            if usage is not None:
                parts = limits["memory"][usage]
                total = _number(sum(part["median"] for part in parts.values()))
            rows.append((state, at(f"memory.{figure}"), total, ""))
    return rows


def _limit_drain_rows(limits: Results, at: Any) -> list[tuple[str, ...]]:
    """The drain's rows: unlimited beside limited, on 100 keys and on 10."""
    rows: list[tuple[str, ...]] = []
    for variant in ("limited", "limited_10_keys"):
        if variant not in limits.get("drain", {}):
            continue
        hot = variant == "limited_10_keys"
        keys, ratio = (
            at(f"drain.{'hot_keys' if hot else 'keys'}"),
            at(f"drain.{'ratio_10_keys' if hot else 'ratio'}"),
        )

        def both(figure: str, ratio: str = "", variant: str = variant) -> tuple[str, str, str]:
            return at(f"drain.unlimited.{figure}"), at(f"drain.{variant}.{figure}"), ratio

        title = (
            f"## limits: taskiq worker x{at('drain.processes')}, drain, "
            f"{keys} keys at N = {at('drain.concurrency')}"
        )
        rows.append((title, "unlimited", "limited", "limited/unlimited"))
        rows += [
            (f"{at('drain.tasks')} tasks of 1-5 ms, tasks/s", *both("per_s", ratio)),
            ("worker CPU per task (us)", *both("worker_cpu_us_per_task")),
            ("Redis CPU per task (us)", *both("redis_cpu_us_per_task")),
            ("EVALSHA per task (us in Redis)", *both("evalsha_us_per_task")),
            ("Redis read events per task", *both("redis_read_events_per_task")),
            ("bytes to Redis per task", *both("redis_input_bytes_per_task")),
            *(
                (f"{command} per task", *both(f"commands_per_task.{command}"))
                for command in ("evalsha", "brpop", "lpush", "subscribe", "unsubscribe", "publish")
            ),
            ("sent back to the broker per task", *both("requeued_per_task")),
            ("share of runs that waited", *both("waited_share")),
            ("release -> next start, p50 (us)", *both("release_to_start_p50_us")),
            ("release -> next start, p99 (us)", *both("release_to_start_p99_us")),
            ("waited for the slot, p50 (us)", *both("waited_p50_us")),
            ("waited for the slot, p99 (us)", *both("waited_p99_us")),
            ("waits over a second", *both("waits_over_1s")),
            ("most runs of one key at once", *both("peak_runs_of_a_key")),
        ]
    return rows


def table(summary: Results, target_rows: list[Results]) -> str:
    """The whole report as plain text."""
    rows = _rows(summary)
    widths = [max(len(row[i]) for row in rows) for i in range(4)] if rows else [0] * 4
    lines = []
    for row in rows:
        if row[0].startswith("## "):
            lines.append("")
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    lines.append("")
    lines.append("## targets (median of the runs)")
    for goal in target_rows:
        verdict = "not measured" if goal["met"] is None else ("met" if goal["met"] else "MISSED")
        value = "-" if goal["median"] is None else _number(goal["median"])
        lines.append(f"{goal['target']}: {value} (goal {goal['goal']}): {verdict}")
    return "\n".join(lines) + "\n"
