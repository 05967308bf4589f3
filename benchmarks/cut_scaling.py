"""What an online checkpoint costs as the run, or the database, grows, with nothing in flight.

    .venv/bin/python -m benchmarks.cut_scaling [--sizes 1500,15000,60000] [--unnamed]

For each size N: a fresh database holding N finished attempts named `run-000001`... (inserted
directly, no servers), then seven online checkpoints of a framework naming their run, as `rollbook
run` names its own. Prints each checkpoint's p50 wall time, the driving process's CPU, and the size
of the committed event, or the refusal. A cut holds what is in flight at P, never what finished
before it, so none of the three should grow with N (benchmarks/README.md, "An online checkpoint
costs what the run has done" has the figures from when the cut listed every completed attempt).
With --unnamed the framework names no run, as a framework checkpointing over HTTP does (the paused
protocol's commit, NeMo Gym's): every rollout in the database is the cut's, so the N finished
attempts may as well be earlier runs'.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import psycopg
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.database import libpq_dsn  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from benchmarks import append as bappend  # noqa: E402
from engine.coordinator import Coordinator  # noqa: E402
from engine.errors import RollbookError  # noqa: E402


async def main(sizes: list[int], unnamed: bool) -> None:
    server = bappend.start_server(None)
    try:
        for n in sizes:
            url = server.new_database()
            with psycopg.connect(libpq_dsn(url), autocommit=True) as c:
                c.execute("INSERT INTO rollbook.attempt_state (rollout_id, attempt, status, started_position, ended_position) "
                          "SELECT 'run-'||lpad(g::text, 6, '0'), 0, 'finished', g, g FROM generate_series(1, %s) g", (n,))
                c.execute("UPDATE rollbook.log_head SET position = %s", (n + 1,))
                c.execute("ANALYZE")
            store = PostgresEventStore.connect(url, writer="scale")
            run = None if unnamed else "run"
            ts = []
            try:
                for i in range(7):
                    t, c0 = time.perf_counter(), time.process_time()
                    cut = await Coordinator(store, []).checkpoint_online(f"ck{i}", run, time.time() + 30)
                    ts.append(((time.perf_counter() - t) * 1000, (time.process_time() - c0) * 1000))
            except RollbookError as exc:
                print(f"{n} {'finished attempts in the database' if unnamed else 'finished attempts in the run'}: the online checkpoint is refused: {exc.code}: {exc.detail[:120]}", flush=True)
                await store.close()
                continue
            async with store.engine.connect() as conn:
                size = (await conn.execute(text(
                    "SELECT pg_column_size(data) FROM rollbook.events WHERE kind = 'checkpoint_committed' "
                    "ORDER BY position DESC LIMIT 1"))).scalar()
            print(f"{n} {'finished attempts in the database' if unnamed else 'finished attempts in the run'}, {len(cut.scope)} continued: online checkpoint p50 "
                  f"{statistics.median(t for t, _ in ts):.1f} ms wall, driver CPU {statistics.median(c for _, c in ts):.1f} ms; "
                  f"committed event {size} bytes stored", flush=True)
            await store.close()
    finally:
        server.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1500,15000,60000", help="comma list of run sizes (named rollouts)")
    p.add_argument("--unnamed", action="store_true", help="the framework names no rollouts: the cut is every one in the database")
    args = p.parse_args()
    asyncio.run(main([int(x) for x in args.sizes.split(",")], args.unnamed))
