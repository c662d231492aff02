"""The soak's ledger in PostgreSQL: one schema per run, dropped at the end.

``runs``    one row per execution of the task, written by the worker that ran it,
            with the delivery it ran in (``delivery``, set by the observer middleware)
``hooks``   what the observer middleware after deduplication saw go wrong: every
            ``on_error`` call, and every ``pre_execute`` that could not read the
            arguments; each with its delivery
``results`` one row per result stored (the soak's result backend), by task id
``kiqs``    one row per send, written by the client (or by the ``chain`` task in a
            worker, ``source = 'worker'``): outcome and latency
``faults``  one row per fault the soak injected, with its start and end
``procs``   every process the soak watched: role, first and last sight, fate
``rss``     resident memory samples of those processes
``notes``   odd facts (sends the client skipped to stay bounded, ...)

Times are Unix seconds (``time.time()`` of the process that wrote them; all
processes run on one machine).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

DSN = "host=127.0.0.1 port=5432 dbname=test user=postgres"

_TABLES = """
CREATE TABLE runs (id bigserial PRIMARY KEY, fp text NOT NULL, task_id text NOT NULL,
    broker text NOT NULL, attempt int NOT NULL, pid int NOT NULL,
    started double precision NOT NULL, ended double precision, outcome text, delivery text);
CREATE TABLE hooks (id bigserial PRIMARY KEY, task_id text NOT NULL, broker text NOT NULL,
    pid int NOT NULL, at double precision NOT NULL, hook text NOT NULL, delivery text,
    error text NOT NULL);
CREATE TABLE results (id bigserial PRIMARY KEY, task_id text NOT NULL, broker text NOT NULL,
    pid int NOT NULL, at double precision NOT NULL, is_err boolean NOT NULL, error text,
    body text NOT NULL);
CREATE INDEX results_task_id ON results (task_id);
CREATE TABLE kiqs (id bigserial PRIMARY KEY, fp text NOT NULL, task_id text NOT NULL,
    broker text NOT NULL, started double precision NOT NULL, ended double precision NOT NULL,
    latency double precision NOT NULL, lock_latency double precision NOT NULL,
    outcome text NOT NULL, holder text, error text, source text NOT NULL DEFAULT 'client');
CREATE TABLE faults (id bigserial PRIMARY KEY, kind text NOT NULL, target text NOT NULL,
    started double precision NOT NULL, ended double precision NOT NULL, detail text);
CREATE TABLE procs (pid int NOT NULL, role text NOT NULL, broker text,
    first_seen double precision NOT NULL, last_seen double precision NOT NULL,
    fate text NOT NULL);
CREATE TABLE rss (pid int NOT NULL, role text NOT NULL, at double precision NOT NULL,
    kb bigint NOT NULL);
CREATE TABLE notes (name text NOT NULL, value text NOT NULL);
CREATE TABLE send_failures (task_id text NOT NULL, broker text NOT NULL,
    at double precision NOT NULL, error text NOT NULL);
"""


def create(dsn: str, schema: str) -> None:
    """Create the run's schema and its tables."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        conn.execute(f'SET search_path TO "{schema}"'.encode())
        conn.execute(_TABLES.encode())


def drop(dsn: str, schema: str) -> None:
    """Drop the run's schema and everything in it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())


def insert(dsn: str, schema: str, table: str, rows: list[dict[str, Any]]) -> None:
    """Insert ``rows`` (dicts with the same keys) into ``table``."""
    if not rows:
        return
    columns = list(rows[0])
    sql = (
        f'INSERT INTO "{schema}".{table} ({", ".join(columns)}) '
        f"VALUES ({', '.join(['%s'] * len(columns))})"
    )
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cursor:
        cursor.executemany(sql.encode(), [tuple(row[c] for c in columns) for row in rows])


def load(dsn: str, schema: str, table: str) -> list[dict[str, Any]]:
    """Every row of ``table``, as dicts."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return list(conn.execute(f'SELECT * FROM "{schema}".{table} ORDER BY 1'.encode()))


def scalar(dsn: str, schema: str, sql: str) -> Any:
    """The first column of the first row of ``sql``, run in the run's schema."""
    with psycopg.connect(dsn, options=f"-c search_path={schema}") as conn:
        row = conn.execute(sql.encode()).fetchone()
        return row[0] if row else None
