"""What rebuilding a NeMo Gym Workplace Assistant session by replay costs, per recorded tool call.

    .venv/bin/python -m benchmarks.nemo_gym_replay [--calls 1,8,32,128] [--repeats 3] [--out PATH]

NeMo Gym's own `resources_servers.workplace_assistant.app`, unchanged, runs in the environment
`rollbook nemo-gym install` builds, started by rollbook's own process handling
(participants.environments.nemo_gym_relay.GymProcess). For each session length N it records a session of N tool
calls through the relay (a mix of Workplace's reads and writes: search, create event, send email,
update customer), then times `revive`: seed a fresh session and send the N calls again, each reply
checked against its recorded digest (engine.tool_replay), the way the resources server rebuilds a
lost live session. It also sizes what rollbook keeps per call (the record) against the state the
server holds per session (Workplace's tables: its CSV data, which every session loads). It prints
JSON and never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from apps.nemo_gym_install import WORKPLACE, install
from apps.processes import free_port
from participants.environments import ENVIRONMENTS, Task
from participants.environments.gym_http import close_all
from participants.environments.nemo_gym_relay import GymServer, register


def calls_for(n: int) -> list[tuple[str, dict[str, Any]]]:
    """N Workplace calls, reads and writes in turn (every write grows the session's tables)."""
    kinds = [
        lambda i: ("email_search_emails", {"query": "Task Update"}),
        lambda i: ("calendar_create_event", {"event_name": f"Sync {i}", "participant_email": "carlos.rodriguez@atlas.com",
                                             "event_start": "2023-12-01 10:00:00", "duration": "30"}),
        lambda i: ("email_send_email", {"recipient": "carlos.rodriguez@atlas.com", "subject": f"Note {i}",
                                        "body": "Thanks for the update."}),
        lambda i: ("customer_relationship_manager_search_customers", {"customer_name": "Lena"}),
    ]
    return [kinds[i % len(kinds)](i) for i in range(n)]


async def timed(env: Any, task: Task, n: int, repeats: int) -> tuple[float, list[float], list[dict[str, Any]]]:
    """A live session of n tool calls (seconds), then `repeats` rebuilds of it by replay (seconds each)."""
    try:
        live = await env.open_live(task)
        record: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for i, (name, arguments) in enumerate(calls_for(n)):
            record = env.apply(record, (await env.call_live(live, name, arguments, f"a0.t{i}.0")).effect)
        live_s = time.perf_counter() - t0
        replays = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await env.revive(task, record)
            replays.append(time.perf_counter() - t0)
        return live_s, replays, record
    finally:
        await close_all()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", default="1,8,32,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    python, built_s = install()
    register([GymServer("bench_workplace", WORKPLACE, "replay", python=str(python), port=free_port())])
    env = ENVIRONMENTS["bench_workplace"]()
    task = Task("bench_workplace", "0", "", {"row": {"responses_create_params": {"input": "", "tools": []}}})
    site = next(python.parent.parent.glob("lib/python3.13/site-packages"))
    csv = site / "resources_servers" / "workplace_assistant" / "csv_data" / "processed"
    state_bytes = sum(f.stat().st_size for f in csv.glob("*.csv"))
    t0 = time.perf_counter()
    asyncio.run(env.open_live(task))  # starts the server: not part of any replay below
    start_s = time.perf_counter() - t0
    rows = []
    try:
        for n in [int(x) for x in args.calls.split(",")]:
            live_s, replays, record = asyncio.run(timed(env, task, n, args.repeats))
            replay_s = statistics.median(replays)
            rows.append({"calls": n, "live_s": round(live_s, 4), "replay_s": round(replay_s, 4),
                         "replay_per_call_ms": round(1000 * replay_s / n, 2),
                         "live_per_call_ms": round(1000 * live_s / n, 2),
                         "record_bytes": len(json.dumps(record)), "record_bytes_per_call": len(json.dumps(record)) // n})
    finally:
        env.process.stop()
    out = {"server": WORKPLACE, "server_start_s": round(start_s, 2), "install_built_s": round(built_s),
           "workplace_state_bytes_per_session": state_bytes, "repeats": args.repeats, "sessions": rows,
           "load_average": os.getloadavg()[0]}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
