"""Append throughput and latency of PostgresEventStore, next to the raw COPY rate of the same server.

    .venv/bin/python benchmarks/append.py [--dsn DSN] [--seconds S] [--repeats R] [--warmup W]
                                          [--no-multiprocess] [--only WRITERS:MODE[,...]] [--out PATH]

Without --dsn a throwaway embedded PostgreSQL is started in a temporary folder and deleted at the
end. With --dsn the DSN's user must be allowed to CREATE DATABASE: every case gets a fresh database
(named rollbook_bench_<pid>_<n>), which is dropped at the end.

Cases (each writer an asyncio task appending 1 KB JSON events to its own stream):
  writers in {1, 8, 64} x mode in {single: 1 event per append call, batched: 100 events per call}
  all writers of a case share ONE PostgresEventStore in ONE process (as a server does), plus
  "64 writers, single, 4 processes": 4 processes, each its own store and 16 writer tasks.
The raw limit: COPY ... FROM STDIN of the same rows into a plain table without indexes, 100 rows
per transaction, with 1, 8 and 64 concurrent connections.

Every case runs `--seconds` after `--warmup`, `--repeats` times (the repeats go round-robin over
the cases, so a noisy moment hurts no single case); the median of each figure is reported. One JSON
object goes to stdout and to benchmarks/results/append.json; progress goes to stderr. Nothing here
asserts a time: the targets are reported, met or not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from adapters import embedded  # noqa: E402
from adapters.database import drop_database, libpq_dsn, scratch_database  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from engine.events import AppendRequest, NewEvent, canonical_json  # noqa: E402

WRITERS = (1, 8, 64)
MODES = {"single": 1, "batched": 100}
COPY_BATCH = 100
PAD = "x" * 1000  # {"i":n,"pad":"xxx..."} is about 1 KB of canonical JSON
KIND = "bench_event"  # no projection derives from it: the append writes events + stream_heads + log_head
MP_PROCESSES = 4
TARGET_BATCHED_RATIO = 0.5
TARGET_SINGLE_64 = 5000
COPY_TABLE = "bench_copy"
COPY_PREBUILT_BATCHES = 40  # per connection, cycled
COPY_COLUMNS = "position, stream, stream_version, kind, data, schema_version, rollout_id, attempt, writer, hash"
_dbcounter = itertools.count()


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- servers and databases --------------------------------------------------------------------


@dataclass
class Server:
    admin_dsn: str
    cleanup: Any = None
    databases: list[str] = field(default_factory=list)

    def new_database(self, migrate: bool = True) -> str:
        name = f"rollbook_bench_{os.getpid()}_{next(_dbcounter)}"
        with contextlib.redirect_stdout(sys.stderr):
            url = scratch_database(self.admin_dsn, name, migrate=migrate)
        self.databases.append(url)
        return url

    def drop_database(self, url: str) -> None:
        if url in self.databases:  # one made elsewhere on this server (benchmarks/commit.py) is dropped too
            self.databases.remove(url)
        drop_database(url)

    def close(self) -> None:
        for url in self.databases:
            try:
                drop_database(url)
            except psycopg.Error as exc:
                progress(f"could not drop {url}: {exc}")
        if self.cleanup is not None:
            self.cleanup()


def start_server(dsn: str | None) -> Server:
    if dsn:
        return Server(dsn)
    progress("starting a throwaway embedded PostgreSQL")
    admin, cleanup = embedded.throwaway("rbbench-")
    return Server(admin, cleanup=cleanup)


def machine_info(admin_dsn: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],  # the machine may be shared: noise shows here
    }
    with contextlib.suppress(Exception), open("/proc/cpuinfo") as f:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    with psycopg.connect(libpq_dsn(admin_dsn), autocommit=True) as conn:
        info["postgres"] = conn.execute("SHOW server_version").fetchone()[0]
        info["postgres_settings"] = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]
            for name in ("fsync", "synchronous_commit", "wal_sync_method", "shared_buffers", "max_connections")
        }
    return info


# ---- measuring --------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


class Window:
    """Warmup, then a measured window; writers check `stop` between calls."""

    def __init__(self) -> None:
        self.start = float("inf")
        self.end = float("inf")
        self.stop = False

    async def run(self, warmup: float, seconds: float) -> None:
        await asyncio.sleep(warmup)
        self.start = time.perf_counter()
        await asyncio.sleep(seconds)
        self.end = time.perf_counter()
        self.stop = True


@dataclass
class Tally:
    events: int = 0  # events of calls that ended inside the window
    latencies: list[float] = field(default_factory=list)  # seconds, calls that started inside the window
    txns: int = 0  # append transactions (groups) that ended inside the window
    txn_events: int = 0
    txn_seconds: float = 0.0


def _instrument(store: PostgresEventStore, win: Window, tally: Tally) -> None:
    """Count the store's transactions (its groups) without touching its code: wrap the bound method."""
    inner = store._commit_group

    async def timed(requests):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = await inner(requests)
        t1 = time.perf_counter()
        if win.start <= t1 <= win.end:
            tally.txns += 1
            tally.txn_events += sum(len(r.events) for r in requests)
            tally.txn_seconds += t1 - t0
        return out

    store._commit_group = timed  # type: ignore[method-assign]


async def _append_writers(
    url: str, tasks: int, batch: int, warmup: float, seconds: float, tag: str
) -> tuple[Tally, float]:
    store = PostgresEventStore.connect(url, writer="bench")
    win, tally = Window(), Tally()
    _instrument(store, win, tally)

    async def writer(w: int) -> None:
        stream = f"{tag}-w{w}"
        n = 0
        while not win.stop:
            events = tuple(NewEvent(stream, KIND, {"pad": PAD, "i": n + j}) for j in range(batch))
            n += batch
            t0 = time.perf_counter()
            await store.append(AppendRequest(events))
            t1 = time.perf_counter()
            if win.start <= t0 < win.end:
                tally.latencies.append(t1 - t0)
            if win.start <= t1 <= win.end:
                tally.events += batch

    try:
        await asyncio.gather(win.run(warmup, seconds), *(writer(w) for w in range(tasks)))
    finally:
        await store.close()
    return tally, win.end - win.start


def _summary(tallies: list[tuple[Tally, float]]) -> dict[str, Any]:
    lat = sorted(x for t, _ in tallies for x in t.latencies)
    txns = sum(t.txns for t, _ in tallies)
    window = max(w for _, w in tallies)
    return {
        "events_per_s": sum(t.events / w for t, w in tallies),
        "p50_ms": percentile(lat, 50) * 1000 if lat else None,
        "p99_ms": percentile(lat, 99) * 1000 if lat else None,
        "calls": len(lat),
        "txns_per_s": txns / window,
        "events_per_txn": sum(t.txn_events for t, _ in tallies) / txns if txns else None,
        "txn_ms_mean": sum(t.txn_seconds for t, _ in tallies) / txns * 1000 if txns else None,
    }


def run_append(url: str, writers: int, mode: str, warmup: float, seconds: float, tag: str) -> dict[str, Any]:
    tally = asyncio.run(_append_writers(url, writers, MODES[mode], warmup, seconds, tag))
    return _summary([tally])


def _mp_child(url: str, tasks: int, batch: int, warmup: float, seconds: float, tag: str, barrier: Any, results: Any) -> None:
    barrier.wait()  # every process imported and ready: the windows line up within milliseconds
    tally, window = asyncio.run(_append_writers(url, tasks, batch, warmup, seconds, tag))
    results.put((tally.__dict__, window))


def run_append_mp(url: str, writers: int, mode: str, warmup: float, seconds: float, tag: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # no forked event loop, connection or server handle in the children
    barrier, results = ctx.Barrier(MP_PROCESSES), ctx.Queue()
    per = writers // MP_PROCESSES
    procs = [
        ctx.Process(target=_mp_child, args=(url, per, MODES[mode], warmup, seconds, f"{tag}-p{i}", barrier, results))
        for i in range(MP_PROCESSES)
    ]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            d, window = results.get(timeout=warmup + seconds + 120)
            out.append((Tally(**d), window))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return _summary(out)


async def _copy_writers(url: str, writers: int, warmup: float, seconds: float) -> float:
    conns = [await psycopg.AsyncConnection.connect(libpq_dsn(url)) for _ in range(writers)]
    win = Window()
    rows_done = 0
    positions = itertools.count(1)

    def prebuilt(w: int) -> list[list[tuple[Any, ...]]]:
        """The rows an append writes, built the same way (canonical JSON, sha256 chain) but before the
        timer starts: COPY is the raw limit, so it must not pay for building its rows in the window."""
        stream, version, prev, batches = f"copy-w{w}", 0, b"\x00" * 32, []
        for _ in range(COPY_PREBUILT_BATCHES):
            rows = []
            for _ in range(COPY_BATCH):
                version += 1
                payload = canonical_json({"pad": PAD, "i": version})
                prev = hashlib.sha256(prev + payload.encode()).digest()
                rows.append((next(positions), stream, version, KIND, payload, 1, None, None, "bench", prev))
            batches.append(rows)
        return batches

    ready = [prebuilt(w) for w in range(writers)]

    async def writer(conn: psycopg.AsyncConnection, w: int) -> None:
        nonlocal rows_done
        for n in itertools.count():  # the same prebuilt batches again once used up: the table has no index
            if win.stop:
                break
            rows = ready[w][n % len(ready[w])]
            async with conn.cursor() as cur:
                async with cur.copy(f"COPY {COPY_TABLE} ({COPY_COLUMNS}) FROM STDIN") as copy:
                    for row in rows:
                        await copy.write_row(row)
            await conn.commit()  # one transaction per 100 rows
            if win.start <= time.perf_counter() <= win.end:
                rows_done += COPY_BATCH

    try:
        await asyncio.gather(win.run(warmup, seconds), *(writer(c, w) for w, c in enumerate(conns)))
    finally:
        for c in conns:
            await c.close()
    return rows_done / (win.end - win.start)


def copy_database(server: Server) -> str:
    url = server.new_database(migrate=False)
    with psycopg.connect(libpq_dsn(url), autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {COPY_TABLE} (position bigint, stream text, stream_version int, kind text, data jsonb, "
            "schema_version smallint, rollout_id text, attempt int, writer text, hash bytea, "
            "recorded_at timestamptz DEFAULT now())"
        )
    return url


# ---- the run ----------------------------------------------------------------------------------


def _median(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", help="a server whose user may CREATE DATABASE (default: a throwaway embedded one)")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per case and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.75, help="unmeasured seconds before each window")
    ap.add_argument("--no-multiprocess", action="store_true", help="skip the 64 writers / 4 processes case")
    ap.add_argument("--only", help="comma list of WRITERS:MODE append cases, e.g. 64:single (COPY always runs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "append.json"), help="'' to not save")
    args = ap.parse_args(argv)

    cases: list[tuple[int, str, int]] = [(w, m, 1) for w in WRITERS for m in MODES]
    if not args.no_multiprocess:
        cases.append((64, "single", MP_PROCESSES))
    if args.only:
        wanted = {tuple(x.split(":")) for x in args.only.split(",")}
        cases = [c for c in cases if (str(c[0]), c[1]) in wanted]

    started = time.perf_counter()
    server = start_server(args.dsn)
    try:
        machine = machine_info(server.admin_dsn)
        progress(f"PostgreSQL {machine['postgres']}, {machine['nproc']} CPUs; creating databases")
        append_urls = {c: server.new_database(migrate=True) for c in cases}
        copy_urls = {w: copy_database(server) for w in WRITERS}

        raw: dict[Any, list[dict[str, Any]]] = {c: [] for c in cases}
        copy_raw: dict[int, list[float]] = {w: [] for w in WRITERS}
        for rep in range(args.repeats):
            for w in WRITERS:
                rate = asyncio.run(_copy_writers(copy_urls[w], w, args.warmup, args.seconds))
                copy_raw[w].append(rate)
                progress(f"repeat {rep + 1}/{args.repeats} COPY {w:>2} connections: {rate:,.0f} rows/s")
            for c in cases:
                w, mode, procs = c
                tag = f"r{rep}"
                if procs == 1:
                    r = run_append(append_urls[c], w, mode, args.warmup, args.seconds, tag)
                else:
                    r = run_append_mp(append_urls[c], w, mode, args.warmup, args.seconds, tag)
                raw[c].append(r)
                progress(
                    f"repeat {rep + 1}/{args.repeats} append {w:>2} writers {mode:<7} x{procs} proc: "
                    f"{r['events_per_s']:,.0f} events/s, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
                    f"{r['txns_per_s']:,.0f} txn/s of {r['events_per_txn'] or 0:.0f} events, "
                    f"{r['txn_ms_mean'] or 0:.2f} ms/txn"
                )
    finally:
        server.close()
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]

    copy = [{"writers": w, "rows_per_s": round(_median(copy_raw[w]), 1), "runs": [round(x, 1) for x in copy_raw[w]]}
            for w in WRITERS]
    copy_rate = {c["writers"]: c["rows_per_s"] for c in copy}
    out_cases = []
    for c in cases:
        w, mode, procs = c
        med = {k: _median([r[k] for r in raw[c]]) for k in raw[c][0]}
        eps = med["events_per_s"]
        out_cases.append({
            "writers": w,
            "mode": mode,
            "processes": procs,
            "events_per_call": MODES[mode],
            "events_per_s": round(eps, 1),
            "p50_ms": round(med["p50_ms"], 3),
            "p99_ms": round(med["p99_ms"], 3),
            "ratio_to_copy": round(eps / copy_rate[w], 4) if copy_rate.get(w) else None,
            "txns_per_s": round(med["txns_per_s"], 1),
            "events_per_txn": round(med["events_per_txn"], 1) if med["events_per_txn"] else None,
            "txn_ms_mean": round(med["txn_ms_mean"], 3) if med["txn_ms_mean"] else None,
            "runs_events_per_s": [round(r["events_per_s"], 1) for r in raw[c]],
        })

    met: dict[str, Any] = {}
    for case in out_cases:
        if case["mode"] == "batched" and case["processes"] == 1 and case["ratio_to_copy"] is not None:
            met[f"batched_vs_copy_{case['writers']}_writers"] = case["ratio_to_copy"] >= TARGET_BATCHED_RATIO
        if case["mode"] == "single" and case["writers"] == 64:
            key = "single_64_events_per_s" + ("" if case["processes"] == 1 else f"_{case['processes']}_processes")
            met[key] = case["events_per_s"] >= TARGET_SINGLE_64
    result = {
        "benchmark": "append",
        "command": "benchmarks/append.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "event_bytes": len(canonical_json({"pad": PAD, "i": 0}).encode()),
        "seconds": args.seconds,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "cases": out_cases,
        "copy": copy,
        "targets": {
            "batched_vs_copy_min_ratio": TARGET_BATCHED_RATIO,
            "single_64_min_events_per_s": TARGET_SINGLE_64,
            "met": met,
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        progress(f"saved {args.out}")
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
