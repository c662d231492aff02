"""The ledger of the limited tasks in PostgreSQL: every run's start and end, from the outside.

A test that launches its application with ``ledger=True`` gets a schema of its
own (dropped at its end) with two tables. In ``runs``, each run of a limited
task (``tests/e2e/app.py``) inserts its row as its body begins and stamps its
end as its body ends. The stamps are ``time.time()`` of the worker process (one
machine, one clock), taken inside the body: a body's interval lies within the
time its run held its slot, so the bodies that overlap in the ledger are at
most the slots held at once.

In ``stalls``, each worker process notes when its event loop woke up late (a
busy machine, a process not scheduled for a while): a start stamped then is
stamped late by as much, which the check of a rate must know.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import psycopg

DSN = os.environ.get("DEDUP_E2E_PG_DSN", "host=127.0.0.1 port=5432 dbname=test user=postgres")
#: A worker's event loop that wakes up this much later than it asked is stalled.
STALL = 0.02

_TABLES = """
CREATE TABLE runs (id bigserial PRIMARY KEY, task text NOT NULL, task_id text NOT NULL,
    limit_name text NOT NULL, n int NOT NULL, attempt int NOT NULL, pid int NOT NULL,
    started double precision NOT NULL, ended double precision, outcome text);
CREATE TABLE stalls (pid int NOT NULL, ended double precision NOT NULL,
    lag double precision NOT NULL);
"""


@dataclass(frozen=True)
class Run:
    """One run of a limited task as the ledger has it."""

    task: str
    task_id: str
    limit_name: str
    """The limit it counts against, as the test names it (``""``: none)."""
    n: int
    """The call's number, unique in its test."""
    attempt: int
    pid: int
    started: float
    ended: float | None
    outcome: str | None
    """``"ok"``, ``"failed"``, or ``None`` while it runs (or when its worker died)."""


@dataclass(frozen=True)
class Stall:
    """A worker process's event loop that woke up ``lag`` seconds late, at ``ended``."""

    pid: int
    ended: float
    lag: float


def create(dsn: str, schema: str) -> None:
    """Create the test's schema and its tables."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        conn.execute(f'SET search_path TO "{schema}"'.encode())
        conn.execute(_TABLES.encode())


def drop(dsn: str, schema: str) -> None:
    """Drop the test's schema and its tables."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())


async def runs(dsn: str, schema: str) -> list[Run]:
    """Every run written so far, in the order they started."""
    rows = await _select(
        dsn,
        schema,
        b"SELECT task, task_id, limit_name, n, attempt, pid, started, ended, outcome"
        b" FROM runs ORDER BY started, id",
    )
    return [Run(*row) for row in rows]


async def stalls(dsn: str, schema: str) -> list[Stall]:
    """Every stall the worker processes noted so far."""
    rows = await _select(dsn, schema, b"SELECT pid, ended, lag FROM stalls ORDER BY ended")
    return [Stall(*row) for row in rows]


async def _select(dsn: str, schema: str, sql: bytes) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(
        dsn, options=f"-c search_path={schema}"
    ) as conn:
        cursor = await conn.execute(sql)
        return await cursor.fetchall()


class Writer:
    """A worker process's connection to the ledger, made on first use; one write at a time."""

    def __init__(self, dsn: str, schema: str) -> None:
        """Write to ``schema``; nothing connects yet."""
        self.dsn = dsn
        self.schema = schema
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock: asyncio.Lock | None = None

    async def _execute(self, sql: bytes, params: tuple[Any, ...]) -> Any:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, options=f"-c search_path={self.schema}"
                )
            cursor = await self._conn.execute(sql, params)
            row = await cursor.fetchone() if cursor.description else None
            return row[0] if row else None

    async def start(
        self,
        *,
        task: str,
        task_id: str,
        limit_name: str,
        n: int,
        attempt: int,
        started: float,
    ) -> int:
        """Write the start of a run (stamped ``started`` by its body); return its row."""
        row = await self._execute(
            b"INSERT INTO runs (task, task_id, limit_name, n, attempt, pid, started)"
            b" VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (task, task_id, limit_name, n, attempt, os.getpid(), started),
        )
        return int(row)

    async def end(self, row: int, ended: float, outcome: str) -> None:
        """Stamp the end of the run of ``row`` (``ended``, taken by its body)."""
        await self._execute(
            b"UPDATE runs SET ended = %s, outcome = %s WHERE id = %s", (ended, outcome, row)
        )

    async def watch_stalls(self) -> None:
        """Note each time this process's event loop wakes up :data:`STALL` or more late."""
        asked = 0.01
        while True:
            before = time.monotonic()
            await asyncio.sleep(asked)
            lag = time.monotonic() - before - asked
            if lag >= STALL:
                await self._execute(
                    b"INSERT INTO stalls (pid, ended, lag) VALUES (%s, %s, %s)",
                    (os.getpid(), time.time(), lag),
                )
