"""The charts of docs/performance.md, drawn from the summary (medians, with the spread)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib as mpl

mpl.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

from tests.benchmarks.report import lookup

Results = dict[str, Any]


def _series(summary: Results, paths: list[str]) -> tuple[list[float], list[float], list[float]]:
    medians, lows, highs = [], [], []
    for path in paths:
        figure = lookup(summary, path) or {"median": float("nan"), "min": 0.0, "max": 0.0}
        medians.append(figure["median"])
        lows.append(figure["median"] - figure["min"])
        highs.append(figure["max"] - figure["median"])
    return medians, lows, highs


def _send_path(summary: Results, path: Path) -> Path | None:
    send = summary.get("send_path", {})
    if not send:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, (broker, title) in zip(
        axes,
        (("null", "null broker (kick does nothing)"), ("list_queue", "ListQueueBroker")),
        strict=True,
    ):
        callers = [int(c) for c in send.get(broker, {})]
        lines = (
            ("none_per_s", "taskiq, no middleware", "tab:gray", "o"),
            ("dedup_per_s", "with RedisDeduplicationMiddleware", "tab:blue", "s"),
            ("limit_per_s", "one EVALSHA via redis.asyncio (limit)", "tab:orange", "^"),
        )
        for key, label, color, marker in lines:
            medians, lows, highs = _series(
                summary, [f"send_path.{broker}.{c}.{key}" for c in callers]
            )
            style = "--" if key == "limit_per_s" else "-"
            axis.errorbar(
                callers,
                medians,
                yerr=[lows, highs],
                label=label,
                color=color,
                marker=marker,
                linestyle=style,
                capsize=3,
            )
        axis.set_xscale("log", base=4)
        axis.set_yscale("log")
        axis.set_xticks(callers, [str(c) for c in callers])
        axis.set_xlabel("concurrent callers")
        axis.set_title(title)
        axis.grid(visible=True, which="both", alpha=0.3)
    axes[0].set_ylabel("kiq per second")
    axes[0].legend(loc="lower right", fontsize="small")
    figure.suptitle("Send path: kiq/s against concurrency (median of the runs, bars: spread)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _heartbeat(summary: Results, path: Path) -> Path | None:
    beats = summary.get("heartbeat", {})
    if not beats:
        return None
    tasks = [int(t) for t in beats]
    figure, (trips, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    medians, lows, highs = _series(
        summary, [f"heartbeat.{t}.round_trips_per_interval" for t in tasks]
    )
    trips.errorbar(tasks, medians, yerr=[lows, highs], marker="s", capsize=3, label="round trips")
    medians, lows, highs = _series(
        summary, [f"heartbeat.{t}.script_calls_per_interval" for t in tasks]
    )
    trips.errorbar(
        tasks, medians, yerr=[lows, highs], marker="o", capsize=3, label="EVALSHA commands (server)"
    )
    trips.axhline(2, color="tab:red", linestyle=":", label="target: at most 2 round trips")
    trips.set_xscale("log")
    trips.set_yscale("log")
    trips.set_xlabel("running tasks")
    trips.set_ylabel("per heartbeat interval (1 s)")
    trips.set_title("Redis traffic per interval")
    trips.legend(fontsize="small")
    trips.grid(visible=True, which="both", alpha=0.3)
    for key, label, marker in (
        ("cpu_share_of_core", "worker process (heartbeat on - off)", "s"),
        ("server_cpu_share_of_core", "Redis server (on - off)", "o"),
    ):
        medians, lows, highs = _series(summary, [f"heartbeat.{t}.{key}" for t in tasks])
        cpu.errorbar(
            tasks,
            [m * 100 for m in medians],
            yerr=[[v * 100 for v in lows], [v * 100 for v in highs]],
            marker=marker,
            capsize=3,
            label=label,
        )
    cpu.axhline(5, color="tab:red", linestyle=":", label="target: under 5% of one core")
    cpu.set_xscale("log")
    cpu.set_ylim(bottom=0)
    cpu.set_xlabel("running tasks")
    cpu.set_ylabel("% of one core")
    cpu.set_title("CPU used by the heartbeat")
    cpu.legend(fontsize="small")
    cpu.grid(visible=True, which="both", alpha=0.3)
    figure.suptitle("Heartbeat against running tasks (median of the runs, bars: spread)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def draw(summary: Results, directory: Path) -> list[Path]:
    """Draw every chart the summary has data for; return the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    drawn = (
        _send_path(summary, directory / "perf-send-path.png"),
        _heartbeat(summary, directory / "perf-heartbeat.png"),
    )
    return [path for path in drawn if path is not None]
