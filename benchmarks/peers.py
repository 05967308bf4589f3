"""The peers rollbook is compared with, run in the same process against the same server.

- raw single-row autocommit INSERTs (psycopg 3, one connection per writer): the database's own limit
  for one-event transactions;
- the `eventsourcing` library's PostgreSQL application recorder (its exclusive table lock gives it
  gap-free notification ids, as rollbook's log-head lock does): one event per `insert_events`;
- DBOS Transact durable steps: workflows whose every step's output is recorded in its system
  database before the next step runs;
- a file export of the seeds' kind: N sessions of 350 KB of JSON written to one records file,
  fsynced, renamed into place, and a manifest (each record's offset, size and sha256) written last.

`eventsourcing` and `dbos` live in the `bench` extra (`pip install -e '.[bench]'`); a peer whose
package is missing is reported as such, never faked. Each peer gets its own fresh database on the
server the rest of the benchmark uses. Every function returns figures; none asserts a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from adapters.database import libpq_dsn

PAD = "x" * 1000  # the 1 KB payload of benchmarks/append.py


def _missing(package: str, exc: BaseException) -> dict[str, Any]:
    return {"skipped": f"{package} is not installed ({exc}); pip install -e '.[bench]'"}


# ---- raw inserts ------------------------------------------------------------------------------


async def raw_inserts(url: str, writers: int, warmup: float, seconds: float) -> dict[str, Any]:
    """Single-row autocommit INSERTs of a 1 KB JSONB row, one connection per writer."""
    dsn = libpq_dsn(url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_raw (id bigserial PRIMARY KEY, stream text, data jsonb)")
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(writers)]
    stop, start, done = False, float("inf"), 0

    async def writer(conn: psycopg.AsyncConnection[Any], w: int) -> None:
        nonlocal done
        n = 0
        while not stop:
            await conn.execute("INSERT INTO bench_raw (stream, data) VALUES (%s, %s::jsonb)",
                               (f"raw-{w}", json.dumps({"i": n, "pad": PAD})))
            n += 1
            if time.perf_counter() >= start:
                done += 1

    async def window() -> float:
        nonlocal stop, start
        await asyncio.sleep(warmup)
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        stop = True
        return time.perf_counter() - start

    try:
        out = await asyncio.gather(window(), *(writer(c, w) for w, c in enumerate(conns)))
    finally:
        for c in conns:
            await c.close()
    return {"events_per_s": done / out[0], "writers": writers}


# ---- eventsourcing ----------------------------------------------------------------------------


def _threads(writers: int, warmup: float, seconds: float, one: Any) -> float:
    """`writers` threads each calling one(w, n) in a loop; returns calls/s inside the window."""
    stop = threading.Event()
    counts = [0] * writers
    start = [float("inf")]

    def loop(w: int) -> None:
        n = 0
        while not stop.is_set():
            one(w, n)
            n += 1
            if time.perf_counter() >= start[0]:
                counts[w] += 1

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(writers)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    start[0] = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    window = time.perf_counter() - start[0]
    for t in threads:
        t.join(timeout=30)
    return sum(counts) / window


def eventsourcing_recorder(url: str, writers: int, warmup: float, seconds: float) -> dict[str, Any]:
    """One event per transaction through eventsourcing's PostgresApplicationRecorder, `writers` threads."""
    try:
        from eventsourcing.persistence import StoredEvent
        from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
    except ImportError as exc:
        return _missing("eventsourcing", exc)
    c = conninfo_to_dict(libpq_dsn(url))
    datastore = PostgresDatastore(str(c["dbname"]), str(c.get("host", "")), str(c.get("port", "5432")),
                                  str(c.get("user", "")), str(c.get("password", "")),
                                  pool_size=writers, max_overflow=0, max_waiting=writers)
    recorder = PostgresApplicationRecorder(datastore, events_table_name="bench_stored_events")
    recorder.create_table()
    ids = [uuid.uuid4() for _ in range(writers)]
    state = json.dumps({"pad": PAD}).encode()

    def one(w: int, n: int) -> None:
        recorder.insert_events([StoredEvent(ids[w], n + 1, "bench:Event", state)])

    try:
        rate = _threads(writers, warmup, seconds, one)
    finally:
        datastore.close()
    return {"events_per_s": rate, "writers": writers}


# ---- DBOS -------------------------------------------------------------------------------------


def dbos_steps(url: str, workflows: int, warmup: float, seconds: float) -> dict[str, Any]:
    """DBOS durable steps: `workflows` workflows at once, each running steps (a 1 KB output each,
    recorded before the next step starts) until the window closes."""
    try:
        from dbos import DBOS
    except ImportError as exc:
        return _missing("dbos", exc)
    c = conninfo_to_dict(libpq_dsn(url))
    from urllib.parse import quote

    host = str(c.get("host") or "localhost")
    # A socket directory cannot sit in the URL's host part; libpq takes it as a query parameter.
    sa_url = (f"postgresql://{quote(str(c.get('user', '')))}:{quote(str(c.get('password', '')))}@/{c['dbname']}"
              f"?host={quote(host)}&port={c.get('port', 5432)}")
    stop = threading.Event()
    window_start = [float("inf")]
    counts: list[int] = []
    lock = threading.Lock()

    DBOS(config={"name": "rollbook-bench", "system_database_url": sa_url, "run_admin_server": False,
                 "max_executor_threads": workflows + 8, "sys_db_pool_size": workflows + 16})  # type: ignore[typeddict-unknown-key]

    @DBOS.step()
    def step(i: int) -> str:
        return PAD + str(i)

    @DBOS.workflow()
    def work(w: int) -> int:
        n = 0
        while not stop.is_set():
            step(n)
            n += 1
            if time.perf_counter() >= window_start[0]:
                with lock:
                    counts.append(1)
        return n

    try:
        DBOS.launch()
        handles = [DBOS.start_workflow(work, w) for w in range(workflows)]
        time.sleep(warmup)
        window_start[0] = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        window = time.perf_counter() - window_start[0]
        for h in handles:
            h.get_result()
        return {"steps_per_s": len(counts) / window, "workflows": workflows}
    finally:
        DBOS.destroy()


# ---- file export ------------------------------------------------------------------------------


def file_export(sessions: int, session_bytes: int = 350 * 1024, root: Path | None = None) -> dict[str, Any]:
    """The seeds' checkpoint: every session's state (JSON) into one records file, fsync, rename, then a
    manifest of each record's offset, size and sha256, fsynced and renamed last. The state is built
    before the timer starts; the timer covers serializing, hashing, writing and the fsyncs."""
    rng = random.Random(7)
    pool = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789 ", k=session_bytes * 4))
    states = []
    for i in range(sessions):
        at = rng.randrange(len(pool) - session_bytes)
        states.append({"session": f"s{i:05d}", "revision": i, "state": pool[at: at + session_bytes - 60]})
    folder = Path(tempfile.mkdtemp(prefix="rb-export-", dir=root))
    try:
        t0 = time.perf_counter()
        records, manifest, offset = folder / "records.jsonl", [], 0
        tmp = folder / ".records.tmp"
        with open(tmp, "wb") as f:
            for st in states:
                line = (json.dumps(st, separators=(",", ":")) + "\n").encode()
                f.write(line)
                manifest.append({"session": st["session"], "offset": offset, "bytes": len(line),
                                 "sha256": hashlib.sha256(line).hexdigest()})
                offset += len(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, records)
        mtmp = folder / ".manifest.tmp"
        with open(mtmp, "w") as f:
            json.dump({"records": records.name, "bytes": offset, "entries": manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(mtmp, folder / "manifest.json")
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the renames themselves are durable
        finally:
            os.close(dfd)
        ms = (time.perf_counter() - t0) * 1000
        return {"ms": ms, "sessions": sessions, "bytes": offset}
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
