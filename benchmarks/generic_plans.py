"""What planning an append's statements once per connection saves PostgreSQL, against planning them on every call.

    .venv/bin/python -m benchmarks.generic_plans [--rounds 4] [--appends 600] [--tasks 8]

A throwaway embedded PostgreSQL. Per round, two writers (two stores, fresh each round) append the same
workload, the two ways alternated: as the append path did until 2026-12-07 (its reads and its write
planned by PostgreSQL on every call, unless psycopg had prepared one after five runs on a connection and
PostgreSQL then chose a generic plan for it), then as it does now (prepared at first use, planned once
per connection, generically: `adapters.postgres.GENERIC_PLANS` before a read, or the lock, `LOCK`, sets
the mode). `--tasks` tasks, each appending in
turn a new rollout's `attempt_started` with an event of that rollout (a write that upserts the
attempt projections), then one event alone (a write that upserts none): the two shapes of write a
server makes. Reported: PostgreSQL's CPU (postmaster and backends), this process's CPU and wall per
append, medians of the rounds. Never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import psycopg

import adapters.postgres as pg_append
from adapters.postgres import PostgresEventStore
from benchmarks.plan_memory import arguments, two_ways
from benchmarks.scaling import postgres_cpu_s, postmaster_pid
from engine.catalog import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream


@contextlib.contextmanager
def planned_every_call() -> Iterator[None]:
    """The append path as it was: no statement setting the planning mode, nothing prepared on request."""
    execute, mode, lock = psycopg.AsyncConnection.execute, pg_append.GENERIC_PLANS, pg_append.LOCK

    async def unprepared(self: psycopg.AsyncConnection[Any], query: Any, params: Any = None, *,
                         prepare: bool | None = None, binary: bool = False) -> Any:
        return await execute(self, query, params, binary=binary)

    psycopg.AsyncConnection.execute = unprepared  # type: ignore[method-assign]
    pg_append.GENERIC_PLANS, pg_append.LOCK = "SELECT 1", lock.replace(pg_append.GENERICALLY, "NULL::text")
    try:
        yield
    finally:
        psycopg.AsyncConnection.execute = execute  # type: ignore[method-assign]
        pg_append.GENERIC_PLANS, pg_append.LOCK = mode, lock


async def one_writer(dsn: str, tag: str, tasks: int, appends: int) -> tuple[float, float, float]:
    store = PostgresEventStore.connect(dsn, writer=f"w{tag}")
    await store.fence_position()  # the pool's first connection made before the clocks start
    pm = postmaster_pid(dsn)
    c0, p0, w0 = time.process_time(), postgres_cpu_s(pm), time.perf_counter()
    per_task = appends // tasks // 2

    async def task(t: int) -> None:
        for i in range(per_task):
            rid = f"{tag}-{t}-{i}"
            await store.append(AppendRequest((
                NewEvent(rollout_stream(rid), ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),
                NewEvent(f"s:{rid}", "noted", {"i": i, "pad": "x" * 200}, rid, 0))))
            await store.append(AppendRequest((NewEvent(f"s:{rid}", "noted", {"i": i, "pad": "y" * 400}, rid, 0),)))
    await asyncio.gather(*(task(t) for t in range(tasks)))
    c1, p1, w1 = time.process_time(), postgres_cpu_s(pm), time.perf_counter()
    await store.close()
    n = per_task * 2 * tasks
    return (p1 - p0) / n * 1000, (c1 - c0) / n * 1000, (w1 - w0) / n * 1000


EVERY_CALL, ONCE = "planned every call (before)", "planned once per connection (now)"

if __name__ == "__main__":
    args = arguments(__doc__, tasks=8)

    async def writer(dsn: str, way: str, tag: str) -> tuple[float, float, float]:
        with planned_every_call() if way == EVERY_CALL else contextlib.nullcontext():
            return await one_writer(dsn, tag, args.tasks, args.appends)

    asyncio.run(two_ways("generic_plans", (EVERY_CALL, ONCE), writer, args.rounds))
