"""What planning an append's statements once per connection saves PostgreSQL, against planning them on every call.

    .venv/bin/python -m benchmarks.generic_plans [--rounds 4] [--appends 600] [--tasks 8] [--before every-call]

A throwaway embedded PostgreSQL. Per round, two writers (two stores, fresh each round) append the same
workload, the two ways alternated: as the append path did before, then as it does now (prepared at first
use, planned once per connection, generically: the read of the log's position or its lock sets the
transaction's planning mode, `adapters.postgres.GENERICALLY`). Before, with `--before every-call` (until
2026-12-07): its reads and its write planned by PostgreSQL on every call, unless psycopg had prepared one
after five runs on a connection and PostgreSQL then chose a generic plan for it; with `--before
mode-statement` (until the fifteenth session): the planning mode set by a statement of its own at the
head of every append. `--tasks` tasks, each appending in turn a new rollout's `attempt_started` with an
event of that rollout (a write that upserts the attempt projections), then one event alone (a write
that upserts none): the two shapes of write a server makes. Reported: PostgreSQL's CPU (postmaster and
backends), this process's CPU and wall per append, medians of the rounds. Never asserted.
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
def without_the_mode() -> Iterator[None]:
    """The append's statements without the setting of the planning mode in them."""
    kept = {name: getattr(pg_append, name) for name in ("READ", "LOCK_AND_READ", "LOCK")}
    for name, sql in kept.items():
        setattr(pg_append, name, sql.replace(pg_append.GENERICALLY, "NULL::text"))
    try:
        yield
    finally:
        for name, sql in kept.items():
            setattr(pg_append, name, sql)


@contextlib.contextmanager
def planned_every_call() -> Iterator[None]:
    """The append path as it was until 2026-12-07: no planning mode set, nothing prepared on request."""
    execute = psycopg.AsyncConnection.execute

    async def unprepared(self: psycopg.AsyncConnection[Any], query: Any, params: Any = None, *,
                         prepare: bool | None = None, binary: bool = False) -> Any:
        return await execute(self, query, params, binary=binary)

    psycopg.AsyncConnection.execute = unprepared  # type: ignore[method-assign]
    try:
        with without_the_mode():
            yield
    finally:
        psycopg.AsyncConnection.execute = execute  # type: ignore[method-assign]


@contextlib.contextmanager
def mode_in_a_statement() -> Iterator[None]:
    """The append path as it was until the fifteenth session: the planning mode set by a statement of
    its own at the head of every append's transaction."""
    carried = PostgresEventStore._write_carried

    async def mode_first(self: PostgresEventStore, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(f"SELECT {pg_append.GENERICALLY}", prepare=True)
        await carried(self, conn)

    PostgresEventStore._write_carried = mode_first  # type: ignore[method-assign]
    try:
        with without_the_mode():
            yield
    finally:
        PostgresEventStore._write_carried = carried  # type: ignore[method-assign]


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


BEFORE = {"every-call": ("planned every call (before)", planned_every_call),
          "mode-statement": ("the mode in a statement of its own (before)", mode_in_a_statement)}
NOW = "planned once per connection, the mode set by the read or the lock (now)"

if __name__ == "__main__":
    args = arguments(__doc__, tasks=8, before=tuple(BEFORE))
    before, old_way = BEFORE[args.before]

    async def writer(dsn: str, way: str, tag: str) -> tuple[float, float, float]:
        with old_way() if way == before else contextlib.nullcontext():
            return await one_writer(dsn, tag, args.tasks, args.appends)

    asyncio.run(two_ways("generic_plans", (before, NOW), writer, args.rounds))
