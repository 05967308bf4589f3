"""What planning an append from memory saves: one writer, appends one at a time, with and without it.

    .venv/bin/python -m benchmarks.plan_memory [--rounds 4] [--appends 600] [--tasks 1]

A throwaway embedded PostgreSQL. Per round, two writers (two stores, fresh each round) append the same
workload, first with adapters.pg_plan_inputs switched off (every append reads what it plans from,
as before), then on: `--tasks` tasks, each its own rollout with one attempt, each appending pairs of
events to a new stream (as a model server's call_accepted then call_completed). With one task nothing
is grouped, so each append is a transaction of its own, as a lightly loaded server's are. Reported:
client CPU (this process), PostgreSQL's CPU (postmaster and backends) and wall per append, medians
of the rounds. Never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

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
    return (c1 - c0) / n * 1000, (p1 - p0) / n * 1000, (w1 - w0) / n * 1000


async def main(args: argparse.Namespace) -> None:
    admin, stop = embedded.throwaway()
    try:
        dsn = database.scratch_database(admin, "plan_memory")
        runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for r in range(args.rounds):
            for memory in (False, True):
                runs[memory].append(await one_writer(dsn, memory, f"r{r}{int(memory)}", args.tasks, args.appends))
        print("| ms per append (median) | read every time | from memory |\n|---|--:|--:|")
        for i, what in enumerate(("client CPU", "PostgreSQL CPU", "wall")):
            a, b = (statistics.median(x[i] for x in runs[m]) for m in (False, True))
            print(f"| {what} | {a:.3f} | {b:.3f} |")
    finally:
        stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--appends", type=int, default=600)
    parser.add_argument("--tasks", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
