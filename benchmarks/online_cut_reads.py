"""What an online cut's reads cost: one statement (PostgresEventStore.online_cut_reads) against the five
reads it replaced (engine.checkpoint.online_cut_reads), on one database, alternated.

    .venv/bin/python -m benchmarks.online_cut_reads [--live 120] [--finished 600] [--repeats 60]

The database holds `--live` attempts of one run in flight (each started, seeded, with an agent boundary
and an open resources session, one in ten of them restart-only) and `--finished` finished ones, written
through the store as servers write them. Each repeat times both ways in turn, the order alternating;
prints the medians of the wall time and of this process's CPU, and checks both read the same.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.postgres import PostgresEventStore  # noqa: E402
from benchmarks import append as bappend  # noqa: E402
from engine import catalog as ev  # noqa: E402
from engine.checkpoint import BOUNDARY_KINDS, online_cut_reads  # noqa: E402
from engine.events import AppendRequest, NewEvent  # noqa: E402
from engine.identity import agent_stream, episode_stream, rollout_stream, session_stream  # noqa: E402


def attempt_events(rollout: str, live: bool, restart_only: bool) -> list[NewEvent]:
    started = NewEvent(rollout_stream(rollout), ev.ATTEMPT_STARTED, {"parent_attempt": None}, rollout, 0)
    if not live:
        return [started, NewEvent(rollout_stream(rollout), ev.ATTEMPT_FINISHED, {"reward": 1.0}, rollout, 0)]
    return [started,
            NewEvent(episode_stream(rollout, 0), ev.EPISODE_STEP, {"step": "seed"}, rollout, 0),
            NewEvent(session_stream(rollout, 0), ev.SESSION_OPENED,
                     {"env": "sandbox", "state_mode": "restart_only" if restart_only else "exported"}, rollout, 0),
            NewEvent(agent_stream(rollout, 0), ev.AGENT_BOUNDARY, {"turn": 0}, rollout, 0)]


async def main(args: argparse.Namespace) -> None:
    server = bappend.start_server(None)
    try:
        store = PostgresEventStore.connect(server.new_database(), writer="bench")
        try:
            for i in range(args.finished):
                await store.append(AppendRequest(tuple(attempt_events(f"run-{i:06d}", False, False))))
            for i in range(args.finished, args.finished + args.live):
                await store.append(AppendRequest(tuple(attempt_events(f"run-{i:06d}", True, i % 10 == 0))))
            ways = {"one statement": lambda: store.online_cut_reads("run", BOUNDARY_KINDS),
                    "five reads": lambda: online_cut_reads(store, "run", BOUNDARY_KINDS)}
            got = {name: await read() for name, read in ways.items()}  # warm, and the same answer both ways
            assert got["one statement"] == got["five reads"], "the two ways read different cuts"
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
            for r in range(args.repeats):
                for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                    t, c = time.perf_counter(), time.process_time()
                    await ways[name]()
                    times[name].append(((time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000))
            reads = got["one statement"]
            print(f"{len(reads.attempts)} attempts in flight ({len(reads.restarts)} restart-only), {args.finished} finished; "
                  f"medians of {args.repeats}:")
            for name, ts in times.items():
                print(f"  {name}: {statistics.median(w for w, _ in ts):.2f} ms wall, "
                      f"{statistics.median(c for _, c in ts):.2f} ms CPU of this process")
        finally:
            await store.close()
    finally:
        server.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--live", type=int, default=120)
    p.add_argument("--finished", type=int, default=600)
    p.add_argument("--repeats", type=int, default=60)
    asyncio.run(main(p.parse_args()))
