"""Restore of a rollout with a long history of its own, with and without a session snapshot.

    .venv/bin/python benchmarks/restore_own_history.py [--sizes 10000,100000] [--repeats 3]
                                                       [--tool update_deal|send_email] [--dsn ADMIN_DSN] [--out PATH]

For each size N, a fresh database on a throwaway embedded PostgreSQL (or the server --dsn names)
gets one rollout of N events of its own, appended through the store in batches of 1,000: a
workplace session, then turns of ten events (a mutation, `--tool`: `update_deal` keeps the state's
size, `send_email` grows it by a row; two model calls accepted and
completed, an agent boundary naming the session's revision, four episode steps), and a cut at its
last boundary. Timed, median of `--repeats`, in the same run:

- `validate_ms`: the coordinator's restore check (engine.checkpoint.validate_cut), which snapshots
  do not change (it re-derives every hash; shown for scale);
- `restore_without_ms`: the resources server's restore (ResourcesParticipant.restore: one read of
  the scope, the session folded from the start) with the snapshot table emptied before each run;
- `first_restore_ms`: one restore that folds from the start and writes the snapshot;
- `restore_with_ms`: the same restore once the snapshot is there (read, check it, fold the tail);
- `ratio`: restore_without_ms / restore_with_ms.
The workplace reducer copies its state on every mutation, so a fold costs per mutation what the
state's size does (with `send_email`, quadratic in the history): that is what a snapshot saves. The
read of the scope's events (and restore's checks over them) stays, linear in the history. Prints a table and writes one JSON object to
benchmarks/results/restore_own_history.json; it never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from adapters import database  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from benchmarks.restore_history import progress, server  # noqa: E402
from engine import snapshots  # noqa: E402
from engine.checkpoint import Cut, make_cut, validate_cut  # noqa: E402
from engine.events import AppendRequest, NewEvent  # noqa: E402
from engine.identity import agent_stream, call_stream, episode_stream, rollout_stream, session_stream  # noqa: E402
from participants.environments import get_environment  # noqa: E402
from participants.environments.tasks import make_task  # noqa: E402
from participants.resources.server import ResourcesParticipant  # noqa: E402

ROLLOUT = "long"
TURN = 10  # events per turn


TOOLS = {  # the mutation of each turn: a deal updated (the state keeps its size) or an email sent (it grows)
    "update_deal": lambda turn: {"deal_id": "D-103", "seats": turn % 50 + 1},
    "send_email": lambda turn: {"to": "a@example.com", "subject": f"s{turn}", "body": "b"},
}


def history(n: int, tool: str) -> list[NewEvent]:
    r, ses = ROLLOUT, session_stream(ROLLOUT, 0)
    env, task = get_environment("workplace"), make_task("workplace", 11)
    state = env.initial_state(task)
    events = [NewEvent(rollout_stream(r), "attempt_started", {"parent_attempt": None}, r, 0),
              NewEvent(ses, "session_opened", {"env": "workplace", "task": task.to_json(), "state_mode": "exported"}, r, 0)]
    revision = 0
    while len(events) + TURN <= n:
        revision += 1
        outcome = env.call_tool(state, tool, TOOLS[tool](revision))
        state = env.apply(state, outcome.effect)
        calls = [f"{r}-c{revision}-{k}" for k in (0, 1)]
        events.append(NewEvent(ses, "mutation_applied", {"revision": revision, "tool": tool,
                                                          "effect": outcome.effect, "output": outcome.output}, r, 0))
        for c in calls:
            events += [NewEvent(call_stream(c), "call_accepted", {"call_id": c}, r, 0),
                       NewEvent(call_stream(c), "call_completed", {"call_id": c, "tokens": 12}, r, 0)]
        events.append(NewEvent(agent_stream(r, 0), "agent_boundary", {"calls": calls, "revisions": {ses: revision},
                                                                      "turn": revision}, r, 0))
        events += [NewEvent(episode_stream(r, 0), "episode_step", {"step": "agent", "turn": revision}, r, 0)] * 4
    return events


async def restore_ms(store: PostgresEventStore, cut: Cut) -> float:
    participant = ResourcesParticipant(store, "resources-bench")
    t = time.perf_counter()
    reply = await participant.restore(cut)
    elapsed = (time.perf_counter() - t) * 1000
    assert reply["staged"] == 1, reply
    return elapsed


def empty_snapshots(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM rollbook.stream_snapshots")


async def measure(dsn: str, n: int, repeats: int, tool: str) -> dict[str, Any]:
    store = PostgresEventStore.connect(dsn, writer="bench-own-history")
    try:
        started = time.perf_counter()
        events = history(n, tool)
        for i in range(0, len(events), 1000):
            await store.append(AppendRequest(tuple(events[i:i + 1000])))
        fill_s = time.perf_counter() - started
        cut = await make_cut(store, "ck-bench", [(ROLLOUT, 0)], [])
        t = time.perf_counter()
        await validate_cut(store, cut)
        validate = (time.perf_counter() - t) * 1000
        without, with_ = [], []
        saved = snapshots.SNAPSHOT_AFTER
        snapshots.SNAPSHOT_AFTER = 1 << 62  # no reader writes one while the runs without are timed
        try:
            for _ in range(repeats):
                empty_snapshots(dsn)
                without.append(await restore_ms(store, cut))
                progress(f"{n}: restore without a snapshot {without[-1]:.0f} ms")
        finally:
            snapshots.SNAPSHOT_AFTER = saved
        first = await restore_ms(store, cut)
        for _ in range(repeats):
            with_.append(await restore_ms(store, cut))
        used = snapshots.COUNTS.used
        assert used >= repeats, "the restores after the first did not use the snapshot"
        return {"own_events": len(events), "mutations": sum(e.kind == "mutation_applied" for e in events),
                "fill_s": round(fill_s, 1), "validate_ms": round(validate, 1),
                "restore_without_ms": round(statistics.median(without), 1), "first_restore_ms": round(first, 1),
                "restore_with_ms": round(statistics.median(with_), 1),
                "ratio": round(statistics.median(without) / statistics.median(with_), 1), "cut_position": cut.position}
    finally:
        await store.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin, stop = server(args.dsn)
    rows = []
    try:
        for n in [int(x) for x in args.sizes.split(",")]:
            dsn = database.scratch_database(admin, f"rollbook_own_{n}_{int(time.time())}")
            row = await measure(dsn, n, args.repeats, args.tool)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            database.drop_database(dsn)
    finally:
        stop()
    return {"benchmark": "restore of a rollout with a long own history, with and without a session snapshot",
            "events_per_turn": TURN, "tool": args.tool, "repeats": args.repeats, "rows": rows,
            "command": " ".join(["benchmarks/restore_own_history.py", *sys.argv[1:]]), "python": platform.python_version()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tool", choices=sorted(TOOLS), default="update_deal")
    parser.add_argument("--dsn", default=None, help="an admin DSN of the server to use")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "restore_own_history.json"))
    args = parser.parse_args()
    out = asyncio.run(main(args))
    w = 12
    print(" ".join(f"{h:>{w}}" for h in ("own events", "mutations", "validate ms", "without ms", "first ms", "with ms", "ratio")))
    for r in out["rows"]:
        print(" ".join(f"{r[k]:>{w}}" for k in ("own_events", "mutations", "validate_ms", "restore_without_ms",
                                                 "first_restore_ms", "restore_with_ms", "ratio")))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
