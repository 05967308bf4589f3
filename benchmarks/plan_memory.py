"""What planning an append from memory saves: one writer, appends one at a time, with and without it.

    .venv/bin/python -m benchmarks.plan_memory [--rounds 4] [--appends 600] [--tasks 1]

A throwaway embedded PostgreSQL. Per round, two writers (two stores, fresh each round) append the same
workload, with adapters.pg_plan_inputs switched off (every append reads what it plans from, as
before) and on, the order alternating round by round: `--tasks` tasks, each its own rollout with one attempt, each appending pairs of
events to a new stream (as a model server's call_accepted then call_completed). With one task nothing
is grouped, so each append is a transaction of its own, as a lightly loaded server's are. Reported:
PostgreSQL's CPU (postmaster and backends), client CPU (this process) and wall per append, medians
of the rounds. Never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from adapters import database, embedded
from adapters.postgres import PostgresEventStore
from benchmarks.scaling import postgres_cpu_s, postmaster_pid
from engine.catalog import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream


async def one_writer(dsn: str, memory: bool, tag: str, tasks: int, appends: int) -> tuple[float, float, float]:
    store = PostgresEventStore.connect(dsn, writer=f"w{tag}")
    if not memory:
        store.plan_inputs.rows = lambda inputs: None  # type: ignore[method-assign]
    for t in range(tasks):
        await store.append(AppendRequest((NewEvent(rollout_stream(f"{tag}-{t}"), ATTEMPT_STARTED,
                                                   {"parent_attempt": None}, f"{tag}-{t}", 0),)))
    pm = postmaster_pid(dsn)
    c0, p0, w0 = time.process_time(), postgres_cpu_s(pm), time.perf_counter()

    async def task(t: int) -> None:
        for i in range(appends // tasks // 2):
            for pad in ("x" * 200, "y" * 400):
                await store.append(AppendRequest((NewEvent(f"s:{tag}-{t}-{i}", "noted", {"i": i, "pad": pad},
                                                           f"{tag}-{t}", 0),)))
    await asyncio.gather(*(task(t) for t in range(tasks)))
    c1, p1, w1 = time.process_time(), postgres_cpu_s(pm), time.perf_counter()
    await store.close()
    n = appends // tasks // 2 * 2 * tasks
    return (p1 - p0) / n * 1000, (c1 - c0) / n * 1000, (w1 - w0) / n * 1000


Writer = Callable[[str, str, str], Awaitable[tuple[float, float, float]]]


async def two_ways(name: str, ways: tuple[str, str], writer: Writer, rounds: int) -> None:
    """Per round, `writer(dsn, way, tag)` once each way (the order alternating round by round) on one
    throwaway database; prints the medians of PostgreSQL CPU, client CPU and wall per append."""
    admin, stop = embedded.throwaway()
    try:
        dsn = database.scratch_database(admin, name)
        runs: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
        for r in range(rounds):
            for i, way in enumerate(ways if r % 2 == 0 else ways[::-1]):
                runs[way].append(await writer(dsn, way, f"r{r}{i}"))
            print(f"[{name}] round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        print(f"| ms per append (median) | {ways[0]} | {ways[1]} | ratio |\n|---|--:|--:|--:|")
        for i, what in enumerate(("PostgreSQL CPU", "client CPU", "wall")):
            a, b = (statistics.median(x[i] for x in runs[w]) for w in ways)
            print(f"| {what} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
        print("rounds (PostgreSQL CPU):", {w: [round(x[0], 3) for x in v] for w, v in runs.items()})
    finally:
        stop()


def arguments(doc: str, tasks: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--appends", type=int, default=600)
    parser.add_argument("--tasks", type=int, default=tasks)
    return parser.parse_args()


if __name__ == "__main__":
    args = arguments(__doc__, tasks=1)
    asyncio.run(two_ways("plan_memory", ("read every time", "from memory"),
                         lambda dsn, way, tag: one_writer(dsn, way == "from memory", tag, args.tasks, args.appends),
                         args.rounds))
