"""A session of ``taskiq dedup``: the shop's tasks hold their locks while we look at them.

Run as a script, it sends three tasks that keep running, then runs the command
the way an operator would, and prints each command line with what it printed.
Imported (as ``taskiq dedup key operations:broker`` does), it is the shop's app.
It uses database 5 of ``REDIS_URL``'s server, so that the default key prefix is
the shop's alone.
"""

import asyncio
import os
import re
import shlex
import sys
from pathlib import Path

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = re.sub(r"/\d*$", "", os.environ.get("REDIS_URL", "redis://localhost:6379")) + "/5"

# record_task_name: each lock records its task's name, for `list` and `show` to tell.
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(redis_url=REDIS_URL, record_task_name=True)
)
finish = asyncio.Event()


@broker.task(task_name="shop.monthly_report")
async def monthly_report(month: str) -> None:
    print(f"building the report of {month}")
    await finish.wait()


@broker.task(task_name="shop.nightly_export", deduplication_key="nightly-export")
async def nightly_export() -> None:
    print("exporting")
    await finish.wait()


async def run(command: str, answer: str = "") -> str:
    """Run one ``taskiq dedup`` command line; the command and what it printed."""
    args = shlex.split(command.rpartition("| ")[2])
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *args,
        cwd=Path(__file__).parent,
        env={**os.environ, "REDIS_URL": REDIS_URL},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate(answer.encode())
    # A terminal would show the answer typed after the question; a pipe does not echo it.
    printed = out.decode().replace("[y/N] ", f"[y/N] {answer}")
    return f"$ {command}\n{printed}(exit status {process.returncode})\n"


async def session(*commands: str, answer: str = "") -> None:
    """Run commands that do not change anything at once; print them in order."""
    for transcript in await asyncio.gather(*(run(command, answer) for command in commands)):
        print(transcript)


async def main() -> None:
    await broker.startup()
    await monthly_report.kiq("2024-05")
    await monthly_report.kiq("2024-06")
    await nightly_export.kiq()
    await asyncio.sleep(0.1)  # the three have started
    print()

    await session(
        "taskiq dedup list",
        "taskiq dedup key operations:broker shop.monthly_report --args '[\"2024-06\"]'",
        "taskiq dedup key operations:broker shop.monthly_report --args '[\"2024-07\"]'",
        "taskiq dedup show nightly-export --json",
    )
    await session("echo y | taskiq dedup release nightly-export", answer="y\n")
    await session("taskiq dedup show nightly-export")

    finish.set()
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
