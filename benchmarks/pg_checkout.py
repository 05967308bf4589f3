"""What a process pays, client side, to take a pooled connection and read one row, against SQLAlchemy's way.

    .venv/bin/python -m benchmarks.pg_checkout [--n 2000] [--rounds 5]

On a fresh database of its own (the embedded PostgreSQL, or ROLLBOOK_TEST_DSN), in one process, the
ways alternated round by round, medians of the rounds, this process's CPU per operation:

- checkout: `PostgresEventStore._driver_connection(autocommit=True)`, what every append and the log's
  reads take (a pool's psycopg connection, put in autocommit and back), against the way it was taken
  until 2026-12-07: an SQLAlchemy `Connection` with `execution_options(isolation_level="AUTOCOMMIT")`
  and its raw connection unwrapped;
- a read: the fence position (`fence_position`, which every data request's attempt check may ask),
  against the same statement through `adapters.pg_pool.reading` and `text()` (how it was read until then).

Client CPU only: the server's work is the same statement both ways. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402
from sqlalchemy import text  # noqa: E402

from adapters.pg_pool import reading  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from testkit import pg  # noqa: E402

FENCE = "SELECT fence_position FROM rollbook.log_head WHERE id = 1"


@contextlib.asynccontextmanager
async def sqlalchemy_connection(store: PostgresEventStore) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The reference: the psycopg connection under an SQLAlchemy Connection in AUTOCOMMIT."""
    async with store.engine.connect() as pooled:
        pooled = await pooled.execution_options(isolation_level="AUTOCOMMIT")
        raw = await pooled.get_raw_connection()
        yield raw.driver_connection  # type: ignore[misc]


async def run(dsn: str, n: int, rounds: int) -> dict[str, Any]:
    store = PostgresEventStore.connect(dsn, "bench")

    async def checkout_now() -> None:
        async with store._driver_connection(autocommit=True):
            pass

    async def checkout_before() -> None:
        async with sqlalchemy_connection(store):
            pass

    async def read_now() -> None:
        await store.fence_position()

    async def read_before() -> None:
        async with reading(store.engine) as conn:
            int((await conn.execute(text(FENCE))).scalar() or 0)

    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "checkout: driver connection (now)": checkout_now, "checkout: SQLAlchemy Connection (before)": checkout_before,
        "read fence_position (now)": read_now, "read through reading() and text() (before)": read_before}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for way in ways.values():  # warm: the pool's connections, statement caches
            for _ in range(200):
                await way()
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for name in order:
                c0 = time.process_time()
                for _ in range(n):
                    await ways[name]()
                cpu[name].append(1e6 * (time.process_time() - c0) / n)
            print(f"[pg_checkout] round {r + 1}/{rounds}", file=sys.stderr)
    finally:
        await store.close()
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"n": n, "rounds": rounds, "client_cpu_us_per_op": {k: round(v, 1) for k, v in med.items()},
            "ratio_checkout_now_to_before": round(med["checkout: driver connection (now)"]
                                                  / med["checkout: SQLAlchemy Connection (before)"], 3),
            "ratio_read_now_to_before": round(med["read fence_position (now)"]
                                              / med["read through reading() and text() (before)"], 3),
            "rounds_us": {k: [round(x, 1) for x in v] for k, v in cpu.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    server = pg.primary_server()
    try:
        print(json.dumps(asyncio.run(run(server.new_database(), args.n, args.rounds)), indent=1))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
