"""The benchmark table in one command: what a checkpoint costs the run, next to honest baselines.

    .venv/bin/python -m benchmarks [--quick] [--out PATH]

Everything runs on one throwaway embedded PostgreSQL (fsync on), each part in a fresh migrated
database, the peers in this same process (benchmarks/peers.py; `pip install -e '.[bench]'`):

- a rollout collection on the four servers as real processes (the demo's setup, apps/demo.py):
  rollouts/s with a checkpoint every 5 s and every 1 s against none, paused and online; each paused checkpoint's prepare
  (with the collection's rollouts in flight) and publish, by its index in the run;
- a full restore of 20 episodes in fresh server processes, against one SELECT of their events
  plus one round trip per server;
- restore's check (engine.checkpoint.validate_cut) against one SELECT of the same events, with
  1 KB and 1 MB sessions (the worlds of benchmarks/commit.py);
- batched append (100 x 1 KB per request, 8 writers) against COPY of rows built before the timer;
- single-event append with 64 writers against raw INSERTs, eventsourcing's recorder and DBOS steps;
- a file export of the seeds' kind (sessions x 350 KB, fsync, rename, manifest last) against
  rollbook's commit of the same number of sessions (make_cut).

Figures are medians over `--repeats` (the cases interleaved, so a noisy moment does not land on one
case, and odd repeats in reverse, so no case always runs last); ratios are what to read on a shared
machine, and each repeat's own ratio beside the ratio of medians. It prints the table and writes every figure,
the raw runs and the machine's load to benchmarks/results/issue14.json. It never asserts a time.
`--quick` shrinks every part so the whole command takes a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import psycopg  # noqa: E402

from adapters.database import libpq_dsn  # noqa: E402
from adapters.http_client import unpooled_session  # noqa: E402
from adapters.postgres import _COLUMNS, PostgresEventStore  # noqa: E402
from apps import config as cfg  # noqa: E402
from apps.collection import Collection  # noqa: E402
from apps.processes import ServerProcesses, free_port  # noqa: E402
from benchmarks import append as bappend  # noqa: E402
from benchmarks import commit as bcommit  # noqa: E402
from benchmarks import cpu, peers  # noqa: E402
from benchmarks.stats import median_interval  # noqa: E402
from engine.checkpoint import load_cut, make_cut, validate_cut  # noqa: E402
from participants.environments.tasks import make_tasks  # noqa: E402
from participants.model.progress import PROGRESS_S  # noqa: E402

DEMO_ENVS = ["workplace", "blackjack", "math", "sandbox"]


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))], 2)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ---- a collection on the four servers ---------------------------------------------------------------


async def _select_ms(url: str, rollouts: list[str], position: int) -> float:
    """One SELECT of the events restore reads, fetched into Python: the baseline of a restore."""
    async with await psycopg.AsyncConnection.connect(libpq_dsn(url)) as conn:
        t0 = time.perf_counter()
        cur = await conn.execute(f"SELECT {_COLUMNS} FROM rollbook.events WHERE rollout_id = ANY(%s) AND position <= %s "
                                 "ORDER BY position", (rollouts, position))
        await cur.fetchall()
        return (time.perf_counter() - t0) * 1000


async def _postmaster(url: str) -> int:
    """The PostgreSQL server's main process: the parent of a backend."""
    async with await psycopg.AsyncConnection.connect(libpq_dsn(url)) as conn:
        backend = (await (await conn.execute("SELECT pg_backend_pid()")).fetchone())[0]  # type: ignore[index]
        stat = Path(f"/proc/{backend}/stat").read_text()  # while connected: the backend exits with its connection
    return int(stat[stat.rindex(")") + 2:].split()[1])


async def _round_trip_ms(session: aiohttp.ClientSession, config: cfg.Config) -> float:
    """One control-plane round trip to each server (status), summed: what 'one round trip per server' costs."""
    total = 0.0
    for kind in cfg.KINDS:
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            async with session.get(config.url(kind) + "/rollbook/v1/control/status",
                                   headers={"Authorization": f"Bearer {config.control_token}"}) as resp:
                await resp.read()
            samples.append((time.perf_counter() - t0) * 1000)
        total += statistics.median(samples)
    return total


async def collection_part(server: bappend.Server, args: argparse.Namespace) -> dict[str, Any]:
    url = server.new_database()
    work = Path(tempfile.mkdtemp(prefix="rb-bench-"))
    servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=args.token_ms / 1000 if k == "model" else 0.0,
                                   progress_s=args.progress_s) for k in cfg.KINDS}
    config = cfg.Config(dsn=url, control_token=secrets.token_hex(16), data_token=secrets.token_hex(16), servers=servers)
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(config, work / "rollbook.toml", work)
    store = PostgresEventStore.connect(url, writer="bench-driver")
    # Paused checkpoints (prepare, commit, publish, resume) and online ones (a cut from the log, no pause),
    # interleaved with the run without checkpoints in every repeat.
    modes = [(m, e) for m, e in MODES if m in args.modes]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m, _ in modes}
    out: dict[str, Any] = {"tasks": args.tasks, "in_flight": args.in_flight, "progress_s": args.progress_s,
                           "token_ms": args.token_ms}
    try:
        procs.start()
        # Each run's CPU by process: the run is CPU-bound on a small machine, so a mode costs what it spends.
        groups = {kind: p.pid for kind, p in procs.procs.items()} | {"postgres": await _postmaster(url)}
        async with unpooled_session() as session:  # 500 in flight are 500 in flight
            # Unmeasured: the first run on an empty database was the fastest of 30, and it was always an off run.
            await Collection(config, store, "warmup", make_tasks(min(args.tasks, 2 * args.in_flight), 99, DEMO_ENVS),
                             seed=99, concurrency=args.in_flight).dispatch(session)
            progress("collection: warm-up run done")
            for rep in range(args.repeats):
                # A shared machine drifts over a quarter of an hour (one command's same mode took 29, 34 and
                # 42 s): odd repeats take the modes in reverse, so no mode always runs last.
                for mode, every in (modes if rep % 2 == 0 else modes[::-1]):
                    run_id = f"b{rep}{mode.replace('_', '')}"
                    coll = Collection(config, store, run_id, make_tasks(args.tasks, rep, DEMO_ENVS), seed=rep,
                                      concurrency=args.in_flight)
                    # A run with checkpoints gets at most `limit` times the run without: a checkpoint cycle
                    # longer than its interval can starve the rollouts, and the figure must still come back.
                    off = [r["seconds"] for r in runs["off"]]
                    limit = args.limit_factor * max(off) if off and every is not None and args.limit_factor else None
                    cpu_before = cpu.sample(groups)
                    t0 = time.perf_counter()
                    dispatch = asyncio.create_task(coll.dispatch(session))
                    checkpoints = []
                    while every is not None:
                        await asyncio.wait([dispatch], timeout=every)
                        if dispatch.done() or (limit is not None and time.perf_counter() - t0 > limit):
                            break
                        in_flight = min(args.in_flight, args.tasks - len(coll.finished))
                        take = coll.checkpoint_online if mode.startswith("online") else coll.checkpoint
                        ck = await take(session, f"{run_id}-ck{len(checkpoints) + 1}")
                        checkpoints.append({"in_flight": in_flight, "published": ck["published"],
                                            **ck.get("timings_ms", {})})
                    cut_off = None
                    if every is not None and not dispatch.done():  # over the limit: count what finished by now, let the rest end unpaused
                        cut_off = (time.perf_counter() - t0, len(coll.finished))
                    await dispatch
                    wall = time.perf_counter() - t0
                    cpu_s = cpu.spent(cpu_before, cpu.sample(groups))
                    seconds, done = cut_off or (wall, args.tasks)
                    runs[mode].append({"seconds": round(seconds, 2), "rollouts_per_s": round(done / seconds, 2),
                                       "finished_in_window": done, "hit_limit": cut_off is not None, "cpu_s": cpu_s,
                                       "checkpoints": checkpoints, **await _cuts(store, run_id)})
                    progress(f"collection {mode} #{rep}: {done} rollouts in {seconds:.1f} s, {len(checkpoints)} checkpoints"
                             + (" (hit the time limit)" if cut_off else "")
                             + (f"; started over: {runs[mode][-1]['regenerated_because']}" if runs[mode][-1]["cuts_regenerated"] else ""))
            out["demo_restore"] = await _demo_restore(session, config, store, procs, url, args)
    finally:
        procs.stop()
        await store.close()
        server.drop_database(url)
    rate = {m: med([r["rollouts_per_s"] for r in rs]) for m, rs in runs.items()}
    out["by_mode"] = {m: _mode_summary(rs) for m, rs in runs.items()}
    cks = [c for m in ("every_5s", "every_1s") for r in runs.get(m, []) for c in r["checkpoints"]]
    online = [c for m, rs in runs.items() if m.startswith("online") for r in rs for c in r["checkpoints"] if "commit" in c]
    prepare = [c["prepare"] for c in cks if "prepare" in c]
    per_participant = {k.split(":", 1)[1]: med([c[k] for c in cks if k in c])
                       for k in sorted({k for c in cks for k in c if k.startswith("prepare:")})}
    by_index: dict[int, list[float]] = {}
    for m in ("every_5s", "every_1s"):
        for r in runs.get(m, []):
            for i, c in enumerate(r["checkpoints"], start=1):
                if "publish" in c:
                    by_index.setdefault(i, []).append(c["publish"])
    last = max(by_index) if by_index else None
    out.update({
        "rollouts_per_s": rate,
        **{f"ratio_{m}": ratio(rate.get(m), rate.get("off")) for m, _ in MODES if m != "off"},
        # Each repeat's own ratio (its runs minutes apart, not a quarter of an hour): what a shared machine's
        # drift moves least.
        **{f"pair_ratios_{m}": [ratio(r["rollouts_per_s"], o["rollouts_per_s"]) for r, o in zip(rs, runs["off"], strict=False)]
           for m, rs in runs.items() if m != "off"},
        "online_ms": {"p50": pct([c["commit"] + c.get("publish", 0) for c in online], 50),
                      "p99": pct([c["commit"] + c.get("publish", 0) for c in online], 99),
                      # each step's median: the started append, the cut, the snapshot, its check, the commit's append
                      "median_steps": {k.split(":", 1)[1]: med([c[k] for c in online if k in c])
                                       for k in sorted({k for c in online for k in c if k.startswith("online:")})}},
        "prepare_ms": {"p50": pct(prepare, 50), "p99": pct(prepare, 99), "min": min(prepare, default=None),
                       "max": max(prepare, default=None), "n": len(prepare),
                       "median_per_participant": per_participant,
                       # the coordinator's steps in order: the started append, the read of the members, each
                       # stage's wall (its slowest participant), and the prepared append with the records
                       "median_coordinator": {k: med([c[f"prepare.{k}"] for c in cks if f"prepare.{k}" in c])
                                              for k in ("started", "members", "stage1", "stage2", "recorded")}},
        "publish_ms_by_index": {str(i): med(v) for i, v in sorted(by_index.items())},
        "publish_first_ms": med(by_index.get(1, [])), "publish_last_index": last,
        "publish_last_ms": med(by_index[last]) if last else None,
        "runs": runs,
    })
    out["publish_growth"] = ratio(out["publish_last_ms"], out["publish_first_ms"])
    return out


MODES = [("off", None), ("every_5s", 5.0), ("every_1s", 1.0), ("online_5s", 5.0), ("online_2s", 2.0), ("online_1s", 1.0)]

# The calls of a run cut by a checkpoint, each by what took it up (the same call asked again, or one
# that replaces it): a call that continues its durable prefix, one that generates it again from the
# start, or none yet. Tokens generated again: the prefixes of
# those started over, and what each cut received past the durable prefix it kept (participants.model.progress).
CUT_CALLS = """
WITH cut AS (
  SELECT c.data->>'call_id' AS call_id, (c.data->>'unsaved')::int AS unsaved,
         (SELECT r.data ? 'continues' FROM rollbook.events r WHERE r.rollout_id = c.rollout_id AND r.position > c.position
          AND r.kind = 'call_accepted' AND c.data->>'call_id' IN (r.data->>'call_id', r.data->>'replaces')
          ORDER BY r.position LIMIT 1) AS continued
  FROM rollbook.events c WHERE starts_with(c.rollout_id, :p) AND c.kind = 'call_cut')
SELECT (SELECT count(*) FROM cut) AS cuts,
       (SELECT count(*) FROM cut WHERE continued) AS continued,
       (SELECT count(*) FROM cut WHERE NOT continued) AS regenerated,
       (SELECT count(*) FROM cut WHERE continued IS NULL) AS not_taken_up,
       coalesce((SELECT sum((data->>'prefix_tokens')::int) FROM rollbook.events WHERE starts_with(rollout_id, :p)
                 AND kind = 'call_completed' AND data->'continuation'->>'mode' = 'regenerated'), 0)
       + coalesce((SELECT sum(unsaved) FROM cut), 0) AS tokens_again
"""


# Why the calls started over were not continued, most frequent first.
REGENERATED_BECAUSE = """
SELECT data->'continuation'->>'reason' AS reason, count(*) AS n FROM rollbook.events
WHERE starts_with(rollout_id, :p) AND kind = 'call_completed' AND data->'continuation'->>'mode' = 'regenerated'
GROUP BY 1 ORDER BY 2 DESC LIMIT 5
"""


async def _cuts(store: PostgresEventStore, run_id: str) -> dict[str, Any]:
    from sqlalchemy import text

    async with store.engine.connect() as conn:
        row = (await conn.execute(text(CUT_CALLS), {"p": f"{run_id}-"})).one()
        because = (await conn.execute(text(REGENERATED_BECAUSE), {"p": f"{run_id}-"})).all()
    counts = zip(("cuts", "cuts_continued", "cuts_regenerated", "cuts_not_taken_up", "tokens_generated_again"),
                 (int(x) for x in row), strict=True)
    return {**dict(counts), "regenerated_because": {r.reason: r.n for r in because}}


def _mode_summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's checkpoints: prepare and resume p50/p99 (and prepare's per participant), cuts."""
    cks = [c for r in rs for c in r["checkpoints"]]

    def spread(key: str) -> dict[str, float | None]:
        values = [c[key] for c in cks if key in c]
        return {"p50": pct(values, 50), "p99": pct(values, 99)}

    keys = sorted({k for c in cks for k in c if k.startswith("prepare:")})
    resumes = sorted({k for c in cks for k in c if k.startswith("resume:")})
    return {"checkpoints": len(cks), "prepare_ms": spread("prepare"), "resume_ms": spread("resume"),
            "commit_ms": spread("commit"), "prepare_ms_per_participant": {k.split(":", 1)[1]: spread(k) for k in keys},
            "resume_ms_per_participant": {k.split(":", 1)[1]: spread(k) for k in resumes},
            # Median CPU seconds of a run, by process ('idle': what the cores had left).
            "cpu_s": {k: med([r["cpu_s"].get(k) for r in rs if r.get("cpu_s")]) for k in sorted({k for r in rs for k in r.get("cpu_s") or {}})},
            **{k: sum(r.get(k, 0) for r in rs) for k in ("cuts", "cuts_continued", "cuts_regenerated", "cuts_not_taken_up",
                                                       "tokens_generated_again")}}


async def _demo_restore(session: aiohttp.ClientSession, config: cfg.Config, store: PostgresEventStore,
                        procs: ServerProcesses, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The demo's crash: 20 episodes, a checkpoint mid-run, every server SIGKILLed, a restore in fresh
    processes (coordinator's check plus every participant's restore, timed by the coordinator)."""
    samples: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        run_id = f"dr{rep}"
        coll = Collection(config, store, run_id, make_tasks(20, 100 + rep, DEMO_ENVS), seed=rep, concurrency=20)
        dispatch = asyncio.create_task(coll.dispatch(session))
        await asyncio.wait([dispatch], timeout=1.5)
        ck = f"{run_id}-ck1"
        result = await coll.checkpoint(session, ck, resume=False)
        if not result["published"]:  # nothing to restore: say what the prepare answered, not only that it failed
            raise RuntimeError(f"demo restore: checkpoint {ck} was not ready: {result['prepare']}")
        procs.kill()
        await asyncio.gather(dispatch, return_exceptions=True)
        procs.start()
        cut, _ = await load_cut(store, ck)
        restored = await coll.restore(session, ck)
        scope = sorted({s.rollout_id for s in cut.scope})
        select = [await _select_ms(url, scope, cut.position) for _ in range(3)]
        rtt = await _round_trip_ms(session, config)
        samples.append({"published": result["published"], "continued": restored["continued"],
                        "restore_ms": restored["timings_ms"].get("restore"), "select_ms": statistics.median(select),
                        "steps_ms": {k: v for k, v in restored["timings_ms"].items() if k.startswith("restore:")},
                        "round_trips_ms": round(rtt, 2)})
        progress(f"demo restore #{rep}: {samples[-1]}")
        await coll.dispatch(session)  # finish the run so the next one starts on quiet servers
    restore_ms, select_ms = med([s["restore_ms"] for s in samples]), med([s["select_ms"] for s in samples])
    rtt = med([s["round_trips_ms"] for s in samples])
    return {"episodes": 20, "restore_ms": restore_ms, "select_ms": select_ms, "round_trips_ms": rtt,
            "ratio": ratio(restore_ms, select_ms),
            "goal_ms": round(2 * select_ms + rtt, 2) if select_ms is not None and rtt is not None else None,
            "samples": samples}


# ---- restore's check against one SELECT -------------------------------------------------------------


async def restore_check_part(server: bappend.Server, args: argparse.Namespace) -> dict[str, Any]:
    ns = argparse.Namespace(episodes=args.episodes)
    worlds: dict[str, tuple[str, PostgresEventStore, dict[str, Any]]] = {}
    scope = [(f"e{i:05d}", 0) for i in range(args.episodes)]
    runs: dict[str, dict[str, list[float]]] = {}
    try:
        for size in ("1kb", "1mb"):
            worlds[size] = await bcommit.build(server.admin_dsn, size, ns)
        cuts = {size: await make_cut(store, "warmup", scope, []) for size, (_, store, _) in worlds.items()}
        for size in worlds:
            runs[size] = {"validate_ms": [], "select_ms": [], "make_cut_ms": []}
        for _ in range(args.repeats):
            for size, (url, store, _) in worlds.items():
                rollouts = [r for r, _ in scope]
                runs[size]["select_ms"].append(await _select_ms(url, rollouts, cuts[size].position))
                runs[size]["validate_ms"].append(await bcommit.elapsed_ms(validate_cut(store, cuts[size])))
                runs[size]["make_cut_ms"].append(await bcommit.elapsed_ms(make_cut(store, "bench", scope, [])))
            progress(f"restore check: { {s: {k: round(v[-1], 1) for k, v in r.items()} for s, r in runs.items()} }")
    finally:
        for url, store, _ in worlds.values():
            await store.close()
            server.drop_database(url)
    out: dict[str, Any] = {"episodes": args.episodes, "runs": runs}
    for size, r in runs.items():
        out[size] = {k: med(v) for k, v in r.items()}
        out[size]["ratio"] = ratio(out[size]["validate_ms"], out[size]["select_ms"])
    return out


# ---- appends and peers ------------------------------------------------------------------------------


def append_part(server: bappend.Server, args: argparse.Namespace) -> dict[str, Any]:
    w, s = args.warmup, args.seconds
    runs: dict[str, list[float]] = {k: [] for k in ("batched_8", "copy_8", "single_64", "raw_64", "eventsourcing_64", "dbos_64")}
    notes: dict[str, str] = {}
    for rep in range(args.repeats):
        url = server.new_database()
        runs["batched_8"].append(bappend.run_append(url, 8, "batched", w, s, f"b{rep}")["events_per_s"])
        runs["single_64"].append(bappend.run_append(url, 64, "single", w, s, f"s{rep}")["events_per_s"])
        server.drop_database(url)
        url = server.new_database()
        with psycopg.connect(libpq_dsn(url), autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {bappend.COPY_TABLE} (position bigint, stream text, stream_version int, kind text, "
                         "data jsonb, schema_version smallint, rollout_id text, attempt int, writer text, hash bytea, "
                         "recorded_at timestamptz DEFAULT now())")
        runs["copy_8"].append(asyncio.run(bappend._copy_writers(url, 8, w, s)))
        runs["raw_64"].append(asyncio.run(peers.raw_inserts(url, 64, w, s))["events_per_s"])
        server.drop_database(url)
        for name, fn, key in (("eventsourcing_64", peers.eventsourcing_recorder, "events_per_s"),
                              ("dbos_64", peers.dbos_steps, "steps_per_s")):
            url = server.new_database()
            try:
                got = fn(url, 64, w, s)
            except Exception as exc:  # a peer that cannot run here is reported, not faked
                got = {"skipped": f"{type(exc).__name__}: {exc}"}
            finally:
                server.drop_database(url)
            if "skipped" in got:
                notes[name] = got["skipped"]
            else:
                runs[name].append(got[key])
        progress(f"appends #{rep}: { {k: round(v[-1]) for k, v in runs.items() if v} }")
    m = {k: med(v) for k, v in runs.items()}
    return {
        "medians_per_s": m, "runs": runs, "notes": notes,
        "batched_vs_copy": ratio(m["batched_8"], m["copy_8"]),
        "single_vs_raw": ratio(m["single_64"], m["raw_64"]),
        "single_vs_eventsourcing": ratio(m["single_64"], m["eventsourcing_64"]),
        "single_vs_dbos": ratio(m["single_64"], m["dbos_64"]),
    }


def export_part(server: bappend.Server, args: argparse.Namespace, restore_check: dict[str, Any] | None) -> dict[str, Any]:
    runs = [peers.file_export(args.export_sessions)["ms"] for _ in range(args.repeats)]
    out = {"sessions": args.export_sessions, "session_bytes": 350 * 1024, "file_export_ms": med(runs), "runs_ms": runs}
    if restore_check and "1mb" in restore_check:
        out["rollbook_commit_ms"] = restore_check["1mb"]["make_cut_ms"]
        out["rollbook_commit_episodes"] = restore_check["episodes"]
    return out


# ---- the table --------------------------------------------------------------------------------------


def _f(x: Any, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        x = round(x, 2) if abs(x) < 100 else round(x)
    return f"{x:,}{unit}" if isinstance(x, int) else f"{x}{unit}"


def table(r: dict[str, Any]) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    c, rc, ap, ex = r.get("collection") or {}, r.get("restore_check") or {}, r.get("appends") or {}, r.get("export") or {}

    def row(measure: str, peer: str, ours: str, goal: str, met: bool | None) -> None:
        rows.append({"measure": measure, "peer / reference": peer, "rollbook": ours, "goal": goal,
                     "met": "n/a" if met is None else ("yes" if met else "no")})

    def ge(x: float | None, g: float) -> bool | None:
        return None if x is None else x >= g

    def le(x: float | None, g: float) -> bool | None:
        return None if x is None else x <= g

    if c:
        rate = c.get("rollouts_per_s", {})
        row(f"rollouts/s, checkpoint every 5 s (every 1 s) vs none ({c['tasks']} tasks, {c['in_flight']} in flight)",
            f"off {_f(rate.get('off'))} rollouts/s", f"{_f(c.get('ratio_every_5s'))} (every 1 s: {_f(c.get('ratio_every_1s'))})",
            ">= 0.97 every 5 s, >= 0.9 every 1 s",
            None if c.get("ratio_every_5s") is None else bool(ge(c["ratio_every_5s"], 0.97) and ge(c.get("ratio_every_1s"), 0.9)))
        row(f"rollouts/s, online checkpoint every 5 s (every 1 s) vs none ({c['tasks']} tasks, {c['in_flight']} in flight)",
            f"off {_f(rate.get('off'))} rollouts/s", f"{_f(c.get('ratio_online_5s'))} (every 1 s: {_f(c.get('ratio_online_1s'))}); "
            f"median of each repeat's own ratio {_f(med([x for x in c.get('pair_ratios_online_1s', []) if x is not None]))} "
            f"({', '.join(_f(x) for x in c.get('pair_ratios_online_1s', []))}); "
            f"cut + publish p50 {_f((c.get('online_ms') or {}).get('p50'), ' ms')}", ">= 0.98 every 1 s",
            None if c.get("ratio_online_1s") is None else bool(ge(c["ratio_online_1s"], 0.98)))
        for m, b in (c.get("by_mode") or {}).items():
            if m == "off":
                continue
            pm, rm = b.get("prepare_ms") or {}, b.get("resume_ms") or {}
            pairs = [x for x in c.get("pair_ratios_" + m, []) if x is not None]
            paired = "" if len(pairs) < 5 else "; median of the pairs' ratios {} (95 % bootstrap interval {} to {})".format(
                *(_f(x) for x in median_interval(pairs)))
            row(f"{m}: rollouts/s vs none; checkpoints; prepare, resume p50/p99 ({c['in_flight']} in flight)",
                f"off {_f(rate.get('off'))} rollouts/s",
                f"{_f(c.get('ratio_' + m))}{paired}; {b.get('checkpoints')} checkpoints; prepare {_f(pm.get('p50'))}/{_f(pm.get('p99'), ' ms')}, "
                f"resume {_f(rm.get('p50'))}/{_f(rm.get('p99'), ' ms')}; {b.get('cuts')} cuts, {b.get('cuts_continued')} continued, "
                f"{b.get('cuts_regenerated')} started over, {b.get('cuts_not_taken_up')} not taken up "
                f"({b.get('tokens_generated_again')} tokens generated again)",
                ">= 0.98 online every 1 s; no cut started over",
                None if not m.startswith("online_1") else ge(c.get("ratio_" + m), 0.98))
        groups = ("driver", "postgres", "environment", "agent", "model", "resources", "idle")
        row("CPU seconds of a run by process (" + ", ".join(groups) + "), median", "-",
            "; ".join(f"{m}: " + " / ".join(_f((b.get("cpu_s") or {}).get(g)) for g in groups)
                      for m, b in (c.get("by_mode") or {}).items()), "(where a mode's cost goes)", None)
        p = c.get("prepare_ms", {})
        row(f"prepare, {c['in_flight']} rollouts in flight (n={p.get('n')})", "NeMo Gym reports <= 8 ms",
            f"p50 {_f(p.get('p50'), ' ms')}, p99 {_f(p.get('p99'), ' ms')} ({_f(p.get('min'))}-{_f(p.get('max'))})",
            "<= 8 ms p50, <= 50 ms p99", None if p.get("p50") is None else bool(le(p["p50"], 8) and le(p.get("p99"), 50)))
        row(f"publish, checkpoint {c.get('publish_last_index')} of a run vs the 1st", "-",
            f"{_f(c.get('publish_last_ms'), ' ms')} vs {_f(c.get('publish_first_ms'), ' ms')} ({_f(c.get('publish_growth'))}x)",
            "constant in run length (<= 1.5x)", le(c.get("publish_growth"), 1.5))
        d = c.get("demo_restore") or {}
        row("full restore in the demo, 20 episodes", f"reading their events: {_f(d.get('select_ms'), ' ms')}; "
            f"one round trip per server: {_f(d.get('round_trips_ms'), ' ms')}",
            f"{_f(d.get('restore_ms'), ' ms')} ({_f(d.get('ratio'))}x the read)",
            f"<= 2x + one round trip per server ({_f(d.get('goal_ms'), ' ms')})",
            None if d.get("restore_ms") is None or d.get("goal_ms") is None else d["restore_ms"] <= d["goal_ms"])
    if rc:
        k, m = rc.get("1kb", {}), rc.get("1mb", {})
        row(f"restore check vs one SELECT of the same events, {rc['episodes']} episodes, 1 KB / 1 MB sessions",
            f"{_f(k.get('select_ms'), ' ms')} / {_f(m.get('select_ms'), ' ms')}",
            f"{_f(k.get('validate_ms'), ' ms')} / {_f(m.get('validate_ms'), ' ms')} ({_f(k.get('ratio'))}x / {_f(m.get('ratio'))}x)",
            "<= 2x", None if k.get("ratio") is None or m.get("ratio") is None else k["ratio"] <= 2 and m["ratio"] <= 2)
    if ap:
        mm = ap.get("medians_per_s", {})
        row("batched append (100 x 1 KB per request, 8 writers) vs COPY of rows built before the timer",
            f"{_f(mm.get('copy_8'))} rows/s", f"{_f(mm.get('batched_8'))} ev/s: {_f(ap.get('batched_vs_copy'))}", ">= 0.5",
            ge(ap.get("batched_vs_copy"), 0.5))
        row("single-event append, 64 writers, vs raw inserts / eventsourcing / DBOS steps",
            f"{_f(mm.get('raw_64'))} / {_f(mm.get('eventsourcing_64'))} / {_f(mm.get('dbos_64'))} per s",
            f"{_f(mm.get('single_64'))} ev/s: {_f(ap.get('single_vs_raw'))}x / {_f(ap.get('single_vs_eventsourcing'))}x / "
            f"{_f(ap.get('single_vs_dbos'))}x", "keep >= 2x / 13x / 25x",
            None if ap.get("single_vs_raw") is None else bool(ge(ap["single_vs_raw"], 2) and ge(ap.get("single_vs_eventsourcing"), 13)
                                                              and ge(ap.get("single_vs_dbos"), 25)))
    if ex:
        row(f"checkpoint of {ex['sessions']} sessions x 350 KB: file export (fsync, rename, manifest last) vs rollbook commit",
            f"{_f(ex.get('file_export_ms'), ' ms')}",
            f"{_f(ex.get('rollbook_commit_ms'), ' ms')} (make_cut, {ex.get('rollbook_commit_episodes')} episodes of 1 MB)",
            "(reference)", None)
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    head = list(rows[0]) if rows else ["measure"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r[h] for h in head) + " |" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="every part shrunk: a few minutes in all")
    p.add_argument("--only", default="", help="comma list of parts: collection,restore_check,appends,export")
    p.add_argument("--repeats", type=int, help="override the mode's number of repeats")
    p.add_argument("--tasks", type=int, help="override the collection's number of rollouts")
    p.add_argument("--in-flight", type=int, help="override how many rollouts the collection keeps in flight")
    p.add_argument("--modes", default=",".join(m for m, _ in MODES), help="comma list of the collection's modes")
    p.add_argument("--limit-factor", type=float,
                   help="a run with checkpoints stops checkpointing after this many times the run without (0: never)")
    p.add_argument("--progress-s", type=float, default=PROGRESS_S,
                   help="the model server's progress_s: tokens in flight saved this often, the most a paused cut loses")
    p.add_argument("--token-ms", type=float, default=4.0,
                   help="the scripted model's wait before each token: 4 keeps the 2-core machine busy; "
                        "a GPU-bound policy (40, vLLM-like) leaves the servers mostly waiting")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "issue14.json")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "off" not in args.modes or not set(args.modes) <= {m for m, _ in MODES}:
        p.error(f"--modes must name 'off' and only these: {', '.join(m for m, _ in MODES)}")
    overrides = {k: getattr(args, k) for k in ("repeats", "tasks", "in_flight", "limit_factor")
                 if getattr(args, k) is not None}
    full = {"tasks": 320, "in_flight": 80, "repeats": 3, "limit_factor": 3.0, "episodes": 1000, "seconds": 3.0, "warmup": 0.75,
            "export_sessions": 1000}
    quick = {"tasks": 120, "in_flight": 80, "repeats": 1, "limit_factor": 2.0, "episodes": 200, "seconds": 1.5, "warmup": 0.5,
             "export_sessions": 200}
    for k, v in (quick if args.quick else full).items():
        setattr(args, k, v)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    only = set(filter(None, args.only.split(","))) or {"collection", "restore_check", "appends", "export"}
    began = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    server = bappend.start_server(None)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def part(name: str, fn: Callable[[], Any]) -> None:
        if name not in only:
            return
        progress(f"part {name}")
        try:
            results[name] = fn()
        except Exception as exc:  # one part failing leaves the others' figures standing; the JSON says why
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    try:
        part("collection", lambda: asyncio.run(collection_part(server, args)))
        part("restore_check", lambda: asyncio.run(restore_check_part(server, args)))
        part("appends", lambda: append_part(server, args))
        part("export", lambda: export_part(server, args, results.get("restore_check")))
    finally:
        server.close()
    rows = table(results)
    out = {
        "table": rows, **results, "errors": errors,
        "details": {"command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
                    "quick": args.quick, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "total_seconds": round(time.perf_counter() - began, 1),
                    "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                                "loadavg_at_start": load_start, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}},
    }
    print(markdown(rows))
    print(f"machine: {os.cpu_count()} cores, load average {load_start} at start, "
          f"{out['details']['machine']['loadavg_at_end']} at end; {out['details']['total_seconds']} s")
    if errors:
        print(f"parts that failed: {errors}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
