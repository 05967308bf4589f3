"""What a durable append costs at its floor: the same rows as a bare INSERT and commit, against rollbook's append.

    .venv/bin/python -m benchmarks.append_floor [--rounds 4] [--appends 600] [--tasks 8]

A throwaway embedded PostgreSQL. Per round, the same workload written two ways, the order alternated: `--tasks` tasks, each appending
rollout after rollout its `attempt_started` with an event of it, then three events alone (the two
shapes of write a server makes, and most of a server's appends planned from memory), once through
rollbook's append (`PostgresEventStore`: the plan, the check of what it was planned from, the stream
heads, the idempotency key, the projections, the log head) and once as the floor under it: the same
rows, positions counted in the process, INSERTed into a copy of `rollbook.events` (its keys and
indexes) by one prepared statement in one transaction per append, each task on a connection of its
own, with psycopg in pipeline mode and the columns packed (adapters.pg_arrays) as the append sends them. Nothing is checked on the floor's way: it is
what any durable record of these rows costs this machine, the part of an append no design removes
while every append commits before it is acknowledged. Reported: PostgreSQL's CPU (postmaster and
backends), this process's CPU and wall per append, medians of the rounds. Never asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Coroutine
from typing import Any

import psycopg

from adapters.database import libpq_dsn
from adapters.pg_arrays import byteas, int2s, int4s_or_null, int8s, texts
from adapters.postgres import PostgresEventStore
from benchmarks.plan_memory import arguments, two_ways
from benchmarks.scaling import postgres_cpu_s, postmaster_pid
from engine.catalog import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent, canonical_json
from engine.identity import rollout_stream

FLOOR_TABLE = "append_floor"
INSERT = (f"INSERT INTO {FLOOR_TABLE} (position, stream, stream_version, kind, data, schema_version, rollout_id, "
          "attempt, writer, hash) SELECT * FROM unnest(%(p)b::bigint[], %(s)b::text[], %(v)b::int[], %(k)b::text[], "
          "%(j)b::text[]::jsonb[], %(sv)b::smallint[], %(r)b::text[], %(a)b::int[], %(w)b::text[], %(h)b::bytea[])")


PER_ROLLOUT = 4  # appends: a rollout's start with an event, then events alone, as a server writes a rollout's


def workload(tag: str, t: int, appends: int) -> list[list[NewEvent]]:
    """One task's `appends` appends, in order: the events of each."""
    out: list[list[NewEvent]] = []
    for i in range(appends):
        rid, n = f"{tag}-{t}-{i // PER_ROLLOUT}", i % PER_ROLLOUT
        out.append([NewEvent(f"s:{rid}", "noted", {"i": i, "pad": "y" * 400}, rid, 0)] if n else
                   [NewEvent(rollout_stream(rid), ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),
                    NewEvent(f"s:{rid}", "noted", {"i": i, "pad": "x" * 200}, rid, 0)])
    return out


Clocks = tuple[float, float, float]  # PostgreSQL CPU, this process's CPU, wall: seconds


async def timed(dsn: str, work: Coroutine[Any, Any, Any]) -> Clocks:
    pm = postmaster_pid(dsn)
    c0, p0, w0 = time.process_time(), postgres_cpu_s(pm), time.perf_counter()
    await work
    return postgres_cpu_s(pm) - p0, time.process_time() - c0, time.perf_counter() - w0


async def through_rollbook(dsn: str, tag: str, tasks: int, per_task: int) -> Clocks:
    store = PostgresEventStore.connect(dsn, writer=f"w{tag}")
    await store.fence_position()  # the pool's first connection made before the clocks start

    async def task(t: int) -> None:
        for events in workload(tag, t, per_task):
            await store.append(AppendRequest(tuple(events)))

    clocks = await timed(dsn, asyncio.gather(*(task(t) for t in range(tasks))))
    await store.close()
    return clocks


async def floor(dsn: str, tag: str, tasks: int, per_task: int) -> Clocks:
    positions = itertools.count(1 + int(time.time() * 1000) * 10_000)  # unique across rounds
    conns = [await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) for _ in range(tasks)]

    async def task(t: int) -> None:
        conn, versions = conns[t], dict[str, int]()
        for events in workload(tag, t, per_task):
            rows = []
            for e in events:
                versions[e.stream] = versions.get(e.stream, 0) + 1
                rows.append((next(positions), e.stream, versions[e.stream], e.kind, canonical_json(e.data),
                             e.schema_version, e.rollout_id, e.attempt, f"w{tag}", b"\0" * 32))
            p, st, v, k, j, sv, r, a, w, h = [list(c) for c in zip(*rows, strict=True)]
            async with conn.pipeline():  # its Sync commits the implicit transaction
                await conn.execute(INSERT, {"p": int8s(p), "s": texts(st), "v": int4s_or_null(v), "k": texts(k),
                                            "j": texts(j), "sv": int2s(sv), "r": texts(r), "a": int4s_or_null(a),
                                            "w": texts(w), "h": byteas(h)}, prepare=True)

    clocks = await timed(dsn, asyncio.gather(*(task(t) for t in range(tasks))))
    for c in conns:
        await c.close()
    return clocks


async def setup(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} "
                           "(LIKE rollbook.events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)")


BARE, ROLLBOOK = "a bare INSERT and commit (the floor)", "rollbook's append"

if __name__ == "__main__":
    args = arguments(__doc__, tasks=8)

    async def writer(dsn: str, way: str, tag: str) -> tuple[float, float, float]:
        await setup(dsn)
        per_task = args.appends // args.tasks
        n = per_task * args.tasks
        clocks = await (floor if way == BARE else through_rollbook)(dsn, tag, args.tasks, per_task)
        return clocks[0] / n * 1000, clocks[1] / n * 1000, clocks[2] / n * 1000

    asyncio.run(two_ways("append_floor", (BARE, ROLLBOOK), writer, args.rounds))
