"""What a sandbox snapshot costs per command, on a session holding a 50 MB checkout.

    .venv/bin/python -m benchmarks.sandbox_snapshots [--files 500] [--file-kb 100] [--commands 20] [--dsn ADMIN_DSN]

Needs root (the real jail). One session writes `--files` files of `--file-kb` KB each (random bytes,
20 folders), then runs `--commands` commands that each append a line to one file. For each command
it reports, as medians: the command alone (its round trip to the shell), the snapshot after it
(background check, shell state, tree walk, manifest) in wall and CPU time of this process, the bytes it
stored (new blobs) and the time to put them into PostgreSQL (a throwaway embedded server, or the
one --dsn names), and the same tree read with nothing known (every file read and hashed again, what a
snapshot that is not incremental costs) side by side. Also a fresh jail rebuilt from the last snapshot.
Prints a markdown table and writes benchmarks/results/sandbox_snapshots.json. Never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from adapters import database
from adapters.postgres import PostgresEventStore
from benchmarks.retention import server
from participants.environments import Task
from participants.environments.sandbox import SandboxEnvironment, SandboxLimits
from participants.environments.sandbox_snapshot import Known, read_tree

OUT = Path(__file__).parent / "results" / "sandbox_snapshots.json"


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--file-kb", type=int, default=100)
    parser.add_argument("--commands", type=int, default=20)
    parser.add_argument("--dsn", default=None, help="an admin DSN (default: a throwaway embedded PostgreSQL)")
    args = parser.parse_args()
    admin, stop = server(args.dsn)
    loop = asyncio.new_event_loop()
    db = PostgresEventStore.connect(database.scratch_database(admin, f"rollbook_sandbox_{int(time.time())}"), writer="bench")

    def put(blobs: Any) -> float:
        started = time.perf_counter()
        loop.run_until_complete(db.put_blobs(list(blobs)))
        return (time.perf_counter() - started) * 1000

    size_mb = args.files * args.file_kb / 1024
    env = SandboxEnvironment(SandboxLimits(disk_mb=int(size_mb * 2) + 64, memory_mb=int(size_mb * 3) + 256,
                                           timeout_s=120.0))
    store: dict[str, bytes] = {}
    timed: dict[str, float] = {}
    snapshot = env._snapshot

    def timed_snapshot(handle: Any, outcome: Any) -> Any:
        wall, cpu = clocks()
        out = snapshot(handle, outcome)
        timed["wall"], timed["cpu"] = time.perf_counter() - wall, time.process_time() - cpu
        return out

    env._snapshot = timed_snapshot  # type: ignore[method-assign]
    task = Task(env="sandbox", task_id="bench", prompt="", params={})
    handle = env.open_live(task)
    per_folder = max(1, args.files // 20)
    checkout = (f"for d in $(seq 20); do mkdir -p repo/d$d; for f in $(seq {per_folder}); do "
                f"head -c {args.file_kb * 1024} /dev/urandom > repo/d$d/f$f; done; done")
    rows: list[dict[str, float]] = []
    try:
        start, _ = clocks()
        first = env.call_live(handle, "run", {"command": checkout})
        first_call = time.perf_counter() - start
        stored = {b.digest: b.content for b in first.blobs}
        store.update(stored)
        first_row = {"call_ms": first_call * 1000, "snapshot_ms": timed["wall"] * 1000, "snapshot_cpu_ms": timed["cpu"] * 1000,
                     "stored_bytes": sum(len(c) for c in stored.values()), "put_ms": put(first.blobs)}
        for i in range(args.commands):
            start, _ = clocks()
            out = env.call_live(handle, "run", {"command": f"echo line {i} >> repo/d{i % 20 + 1}/f1"})
            call = time.perf_counter() - start
            assert out.effect is not None and out.effect["snapshot"], out.effect
            store.update({b.digest: b.content for b in out.blobs})
            put_ms = put(out.blobs)
            manifest = store[out.effect["snapshot"]]
            wall, cpu = clocks()
            read_tree(f"/proc/{handle.init}/root", Known())  # the same tree, nothing known: every file again
            full_wall, full_cpu = time.perf_counter() - wall, time.process_time() - cpu
            rows.append({"command_ms": (call - timed["wall"]) * 1000, "snapshot_ms": timed["wall"] * 1000,
                         "snapshot_cpu_ms": timed["cpu"] * 1000, "stored_bytes": sum(len(b.content) for b in out.blobs),
                         "manifest_bytes": len(manifest), "put_ms": put_ms, "full_read_ms": full_wall * 1000, "full_read_cpu_ms": full_cpu * 1000})
            print(f"\rcommand {i + 1}/{args.commands}", end="", flush=True)
        print()
        state = env.apply(env.initial_state(task), out.effect)
    finally:
        env.close_live(handle)
    wall, _ = clocks()
    rebuilt = env.open_live(task, state, lambda ds: loop.run_until_complete(db.get_blobs(ds)))
    rebuild_ms = (time.perf_counter() - wall) * 1000
    check = env.call_live(rebuilt, "run", {"command": "du -sk repo | cut -f1; wc -l < repo/d1/f1 >/dev/null; echo ok"})
    env.close_live(rebuilt)
    loop.run_until_complete(db.close())
    stop()
    med = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    result = {"files": args.files, "file_kb": args.file_kb, "tree_mb": round(size_mb, 1), "commands": args.commands,
              "first": {k: round(v, 2) for k, v in first_row.items()}, "median_per_command": med,
              "rebuild_ms": round(rebuild_ms, 1), "rebuilt_check": check.output}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.files} files x {args.file_kb} KB ({size_mb:.0f} MB); {args.commands} commands, each appending to one file\n")
    print("| per command (median) | incremental snapshot | the tree read again in full |")
    print("|:--|--:|--:|")
    print(f"| wall ms | {med['snapshot_ms']} | {med['full_read_ms']} |")
    print(f"| CPU ms (this process) | {med['snapshot_cpu_ms']} | {med['full_read_cpu_ms']} |")
    print(f"| bytes stored | {med['stored_bytes']:.0f} (manifest {med['manifest_bytes']:.0f}) | {size_mb * 1024 * 1024:.0f} |")
    print(f"| put into PostgreSQL, ms | {med['put_ms']} | {first_row['put_ms']:.0f} (the first, whole checkout) |")
    print(f"\nthe command alone: {med['command_ms']} ms; the first snapshot (the whole checkout): "
          f"{first_row['snapshot_ms']:.0f} ms, {first_row['stored_bytes'] / 1e6:.1f} MB stored; "
          f"a fresh jail rebuilt from the last snapshot, read from PostgreSQL: {rebuild_ms:.0f} ms ({check.output['output'].split()[0]} KB in repo)")
    print(f"written: {OUT}")


if __name__ == "__main__":
    main()
