"""The cost of a checkpoint commit (make_cut) against the size of the sessions in scope.

    .venv/bin/python benchmarks/commit.py [--episodes 1000] [--repeats 5] [--validate-repeats 3]
                                          [--sizes 1kb,1mb] [--out PATH]

The design says commit copies no session state, so its cost must grow with the number of
episodes in scope, never with their size. Two worlds of `--episodes` episodes each, one with 1 KB
sessions and one with 1 MB sessions, are built in their own fresh, migrated databases on a
throwaway embedded PostgreSQL (adapters.embedded.throwaway, deleted at the end). Each episode is:

    attempt_started (rollout:eN, attempt 0)
    session_opened + 4 x mutation_applied on session:eN:0, whose data totals the session size
        (4 x 256 B or 4 x 256 KB of random base64: incompressible, so TOAST cannot shrink it;
        each event stays under the 1 MiB payload limit)
    agent_boundary (calls [], revisions {session:eN:0: 4}): the resume boundary

Events are loaded with batched appends (one atomic AppendRequest of many episodes, awaited one
after the other so no transaction exceeds ~16 MB). Then, with every episode in scope:

Both worlds are loaded first (each then VACUUM ANALYZEd and CHECKPOINTed, so no background work
is pending), and the timed calls alternate between them, so a noisy moment on a shared machine
does not land on one world only.

- make_cut (the commit's work: head, attempt rows, latest boundaries, each scoped rollout's
  chain heads at P): one untimed warm-up, then `--repeats` timed calls; the median is reported.
- validate_cut (restore's validation: re-reads every event up to the boundary, re-hashes it and
  checks lineage, so it reads the data and is expected to grow with it): `--validate-repeats`
  timed calls, median reported.

One JSON object goes to stdout and to benchmarks/results/commit.json; progress goes to stderr.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from adapters import embedded  # noqa: E402
from adapters.database import drop_database, libpq_dsn, scratch_database  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from engine.attempts import ATTEMPT_STARTED  # noqa: E402
from engine.checkpoint import make_cut, validate_cut  # noqa: E402
from engine.events import AppendRequest, NewEvent, canonical_json  # noqa: E402
from engine.identity import agent_stream, rollout_stream, session_stream  # noqa: E402

SIZES = {"1kb": 1024, "1mb": 1024 * 1024}
MUTATIONS = 4  # per session; their data totals the session size
BATCH_BYTES = 16 * 1024 * 1024  # data per append request


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Blobs:
    """Incompressible strings of a given length, cut at random offsets from one random pool."""

    def __init__(self, rng: random.Random, pool_bytes: int = 3 * 1024 * 1024) -> None:
        self.rng = rng
        self.pool = base64.b64encode(rng.randbytes(pool_bytes)).decode()

    def take(self, n: int) -> str:
        at = self.rng.randrange(len(self.pool) - n)
        return self.pool[at : at + n]


def mutation_data(revision: int, target: int, blobs: Blobs) -> dict[str, Any]:
    """{"blob": ..., "revision": n} whose canonical JSON is exactly `target` bytes."""
    overhead = len(canonical_json({"blob": "", "revision": revision}).encode())
    data = {"blob": blobs.take(target - overhead), "revision": revision}
    assert len(canonical_json(data).encode()) == target
    return data


def episode_events(i: int, session_bytes: int, blobs: Blobs) -> list[NewEvent]:
    r = f"e{i:05d}"
    ses = session_stream(r, 0)
    return [
        NewEvent(rollout_stream(r), ATTEMPT_STARTED, {"parent_attempt": None}, r, 0),
        NewEvent(ses, "session_opened", {"env": "bench"}, r, 0),
        *(
            NewEvent(ses, "mutation_applied", mutation_data(n, session_bytes // MUTATIONS, blobs), r, 0)
            for n in range(1, MUTATIONS + 1)
        ),
        NewEvent(agent_stream(r, 0), "agent_boundary", {"calls": [], "revisions": {ses: MUTATIONS}}, r, 0),
    ]


async def load(store: PostgresEventStore, episodes: int, session_bytes: int, seed: int) -> dict[str, Any]:
    blobs = Blobs(random.Random(seed))
    per_request = max(1, min(250, BATCH_BYTES // session_bytes))
    t0 = time.perf_counter()
    events = 0
    for start in range(0, episodes, per_request):
        batch = [
            e
            for i in range(start, min(episodes, start + per_request))
            for e in episode_events(i, session_bytes, blobs)
        ]
        events += len(await store.append(AppendRequest(tuple(batch))))
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "events": events,
        "episodes_per_request": per_request,
    }


async def elapsed_ms(call: Awaitable[Any]) -> float:
    t0 = time.perf_counter()
    await call
    return (time.perf_counter() - t0) * 1000


async def build(
    admin_dsn: str, size: str, args: argparse.Namespace
) -> tuple[str, PostgresEventStore, dict[str, Any]]:
    url = scratch_database(admin_dsn, f"rollbook_commit_{size}")
    store = PostgresEventStore.connect(url, writer="bench")
    progress(f"{size}: loading {args.episodes} episodes")
    loaded = await load(store, args.episodes, SIZES[size], seed=len(size) + SIZES[size])
    # Settle before timing, the same way for both worlds: statistics fresh, nothing left for
    # autovacuum or the checkpointer to do in the middle of a measurement.
    with psycopg.connect(libpq_dsn(url), autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) rollbook.events")
        conn.execute("CHECKPOINT")
        loaded["database_bytes"] = int(
            conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
        )
    progress(f"{size}: loaded in {loaded['seconds']} s, database {loaded['database_bytes'] / 2**20:.0f} MiB")
    return url, store, loaded


async def measure(admin_dsn: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both worlds exist at once; the repeats go round-robin over them so noise hits neither alone."""
    worlds: dict[str, tuple[str, PostgresEventStore, dict[str, Any]]] = {}
    scope = [(f"e{i:05d}", 0) for i in range(args.episodes)]
    runs: dict[str, dict[str, Any]] = {}
    try:
        for size in args.sizes:
            worlds[size] = await build(admin_dsn, size, args)
        cuts = {}
        for size, (_, store, loaded) in worlds.items():
            cuts[size] = await make_cut(store, "warmup", scope, [])  # untimed: connections and plans warm
            assert len(cuts[size].scope) == args.episodes and not cuts[size].fresh
            runs[size] = {"load": loaded, "make_cut_ms": [], "validate_cut_ms": []}
        for _ in range(args.repeats):
            for size, (_, store, _) in worlds.items():
                runs[size]["make_cut_ms"].append(await elapsed_ms(make_cut(store, "bench", scope, [])))
        for size in worlds:
            progress(f"{size}: make_cut ms {[round(x, 1) for x in runs[size]['make_cut_ms']]}")
        for _ in range(args.validate_repeats):
            for size, (_, store, _) in worlds.items():
                runs[size]["validate_cut_ms"].append(await elapsed_ms(validate_cut(store, cuts[size])))
        for size in worlds:
            progress(f"{size}: validate_cut ms {[round(x, 1) for x in runs[size]['validate_cut_ms']]}")
        return runs
    finally:
        for url, store, _ in worlds.values():
            await store.close()
            drop_database(url)




def median_ms(values: list[float]) -> float:
    return round(statistics.median(values), 2)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    progress("starting a throwaway embedded PostgreSQL")
    admin, cleanup = embedded.throwaway("rbcommit-")
    began = time.perf_counter()
    try:
        runs = await measure(admin, args)
    finally:
        cleanup()
    commit = {size: median_ms(r["make_cut_ms"]) for size, r in runs.items()}
    validate = {size: median_ms(r["validate_cut_ms"]) for size, r in runs.items()}
    result: dict[str, Any] = {
        "episodes": args.episodes,
        **{f"session_{size}_ms": commit[size] for size in args.sizes},
    }
    if {"1kb", "1mb"} <= set(args.sizes):
        result["ratio"] = round(commit["1mb"] / commit["1kb"], 2)
    result["validate_cut"] = {
        **{f"session_{size}_ms": validate[size] for size in args.sizes},
        **(
            {"ratio": round(validate["1mb"] / validate["1kb"], 2)}
            if {"1kb", "1mb"} <= set(args.sizes)
            else {}
        ),
        "repeats": args.validate_repeats,
    }
    result["details"] = {
        "benchmark": "commit",
        "command": "benchmarks/commit.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "repeats": args.repeats,
        "warmup_calls": 1,
        "events_per_episode": MUTATIONS + 3,
        "mutation_bytes": {size: SIZES[size] // MUTATIONS for size in args.sizes},
        "runs_ms": {
            size: {
                "make_cut": [round(x, 2) for x in r["make_cut_ms"]],
                "validate_cut": [round(x, 2) for x in r["validate_cut_ms"]],
            }
            for size, r in runs.items()
        },
        "load": {size: r["load"] for size, r in runs.items()},
        "total_seconds": round(time.perf_counter() - began, 1),
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--validate-repeats", type=int, default=3)
    p.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "commit.json")
    args = p.parse_args(argv)
    unknown = set(args.sizes) - set(SIZES)
    if unknown:
        p.error(f"unknown size(s) {sorted(unknown)}; choose from {sorted(SIZES)}")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    out = asyncio.run(main(arguments))
    text = json.dumps(out, indent=2)
    print(text)
    if arguments.out:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_text(text + "\n")
