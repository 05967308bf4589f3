"""`rollbook demo`: four server processes, rollouts checkpointed mid-turn, SIGKILL, restore, finish.

The demo starts the environment, model, agent and resources servers as separate processes (each
its own process group) on the embedded PostgreSQL, dispatches the rollouts, takes a checkpoint
while they are mid-turn, SIGKILLs every server, starts fresh processes, restores, resumes and
finishes. Then it runs the same tasks uninterrupted with checkpointing off and prints both side
by side, with the invariants read back from the public SQL views.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from sqlalchemy import text

from adapters import database
from adapters.database import like_prefix
from adapters.http_client import unpooled_session
from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.collection import Collection
from apps.processes import ServerProcesses, free_port
from engine import catalog as ev
from participants.base.observability import METRICS_PATH
from participants.environments.tasks import make_tasks

DEMO_ENVS = ["workplace", "blackjack", "math", "sandbox"]
SANDBOX_WAIT_S = 20.0  # how long the checkpoint waits for sandbox sessions to have files


class Progress:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet, self.label, self.done = total, quiet, "", 0

    def phase(self, label: str, done: int = 0) -> None:
        self.label, self.done = label, done
        self.draw()

    def tick(self, _rid: str = "") -> None:
        self.done += 1
        self.draw()

    def draw(self) -> None:
        if self.quiet:
            return
        filled = int(30 * self.done / max(1, self.total))
        print(f"\r{self.label:<34} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}", end="", file=sys.stderr,
              flush=True)

    def note(self, text_: str) -> None:
        if not self.quiet:
            print(f"\n  {text_}", file=sys.stderr, flush=True)


async def run_demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    dsn = database.prepare_database(args.dsn)
    # Without --keep (and without a DSN of the user's), the demo's rows go to a scratch database
    # that is dropped at the end; with --keep they stay in the default one for SQL, history and replay.
    scratch = args.dsn is None and not os.environ.get("ROLLBOOK_DSN") and not args.keep
    if scratch:
        dsn = database.scratch_database(dsn, f"rollbook_demo_{os.getpid()}")
    work = Path(tempfile.mkdtemp(prefix="rollbook-demo-"))
    # Replies of a quarter second, their tokens saved every 50 ms: the checkpoint finds some calls
    # mid-generation with tokens saved, and cuts them there (docs/model-calls.md).
    servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=0.01 if k == "model" else 0.0, progress_s=0.05)
               for k in cfg.KINDS}
    # The sandbox drops each shell to an unprivileged user, which only a server started as root can do.
    sandbox = cfg.SandboxConfig() if os.geteuid() == 0 else None
    config = cfg.Config(dsn=dsn, control_token=secrets.token_hex(16), data_token=secrets.token_hex(16), servers=servers,
                        sandbox=sandbox)
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(config, work / "rollbook.toml", work)
    store = PostgresEventStore.connect(dsn, writer="demo-driver")
    run = f"demo{args.seed}-{int(time.time())}"
    tasks = make_tasks(args.rollouts, args.seed, [e for e in DEMO_ENVS if e in config.environments()])
    progress = Progress(len(tasks), args.json)
    try:
        procs.start()
        async with unpooled_session() as session:  # rollouts in flight are the bound, not aiohttp's 100
            crashed = await _checkpointed(session, config, store, procs, f"{run}-c", tasks, args.seed, progress)
            plain = Collection(config, store, f"{run}-u", tasks, seed=args.seed, on_finish=progress.tick)
            progress.phase("uninterrupted run")
            await plain.dispatch(session)
        summary = await _summary(store, run, crashed, len(tasks))
    finally:
        procs.stop()
        await store.close()
        if scratch:
            database.drop_database(dsn)
    summary["dsn"] = database.libpq_dsn(dsn) if not scratch else None
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    if not args.json:
        print(file=sys.stderr)
    ok = (summary["repeated_model_calls"] == 0 and summary["repeated_mutations"] == 0 and summary["unfinished"] == 0
          and summary["finished_twice"] == 0 and summary["repeated_mutations_within_attempt"] == 0)
    print(json.dumps(summary) if args.json else _table(summary))
    if not args.json:
        print("all invariants hold" if ok else "INVARIANT FAILED: see the figures above")
    return 0 if ok else 1


async def _checkpointed(session: aiohttp.ClientSession, config: cfg.Config, store: PostgresEventStore,
                        procs: ServerProcesses, run: str, tasks: list[Any], seed: int, progress: Progress) -> dict[str, Any]:
    collection = Collection(config, store, run, tasks, seed=seed, on_finish=progress.tick)
    progress.phase("checkpointed run")
    dispatch = asyncio.create_task(collection.dispatch(session))
    # Take the checkpoint while rollouts are mid-turn: once a quarter has finished and the others
    # have changed their environments often enough that continuing (not restarting) matters.
    # Sandbox sessions are waited for until each has run a command or two (a few seconds at most), so
    # what continues is a tree, a directory and an environment, not an empty jail.
    deadline = time.monotonic() + SANDBOX_WAIT_S
    while not dispatch.done():
        if (len(collection.finished) >= max(1, len(tasks) // 4) and await _mutations(store, run) >= len(tasks) // 4
                and (time.monotonic() > deadline or not await _sandboxes_without_files(store, run))):
            break
        await asyncio.sleep(0.05)
    await _a_call_to_cut(session, config)
    completed_before = len(collection.finished)
    ck = f"{run}-ck1"
    result = await collection.checkpoint(session, ck, resume=False)
    progress.note(f"checkpoint {ck}: {'published' if result['published'] else 'NOT ready'}; "
                  f"{result.get('continued')} to continue, {result.get('fresh_dispatch')} restart-only; SIGKILL all servers")
    procs.kill()
    await asyncio.gather(dispatch, return_exceptions=True)
    procs.start()
    restored = await collection.restore(session, ck)
    progress.note(f"fresh processes restored {restored['continued']} rollouts and re-dispatch the rest")
    progress.phase("checkpointed run (restored)", len(collection.finished))
    await collection.dispatch(session)
    timings = {**result.get("timings_ms", {}), **{k: v for k, v in restored["timings_ms"].items() if k in ("restore", "resume")}}
    return {"checkpoint_id": ck, "completed_before": completed_before, "continued": result.get("continued", 0),
            "restarted": result.get("fresh_dispatch", 0), "timings_ms": timings}


async def _a_call_to_cut(session: aiohttp.ClientSession, config: cfg.Config, wait_s: float = 5.0) -> None:
    """Wait (a few seconds at most) until the model server holds a call its prepare would cut, so that
    the demo shows a generation cut and continued (its metric `rollbook_model_calls_cuttable`)."""
    url = config.servers["model"].base_url + METRICS_PATH
    headers = {"Authorization": f"Bearer {config.credentials.control}"}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        async with session.get(url, headers=headers) as resp:
            if any(line.startswith("rollbook_model_calls_cuttable ") and float(line.split()[1]) > 0
                   for line in (await resp.text()).splitlines()):
                return
        await asyncio.sleep(0.01)


async def _sandboxes_without_files(store: PostgresEventStore, run: str) -> int:
    """Sandbox rollouts of the run, unfinished, whose session has run fewer than two commands."""
    async with store.engine.connect() as conn:
        return int((await conn.execute(text(
            "SELECT count(*) FROM rollbook.events o WHERE o.kind = :opened AND o.data->>'env' = 'sandbox' "
            "AND o.rollout_id LIKE :p AND NOT EXISTS (SELECT 1 FROM rollbook.attempts a WHERE a.rollout_id = o.rollout_id "
            "AND a.status = 'finished') AND (SELECT count(*) FROM rollbook.events m WHERE m.stream = o.stream "
            "AND m.kind = :mutation) < 2"),
            {"p": like_prefix(f"{run}-"), "opened": ev.SESSION_OPENED, "mutation": ev.MUTATION_APPLIED})).scalar_one())


async def _mutations(store: PostgresEventStore, run: str) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(text(
            "SELECT count(*) FROM rollbook.events WHERE kind = :mutation AND rollout_id LIKE :p"),
            {"p": like_prefix(f"{run}-"), "mutation": ev.MUTATION_APPLIED})).scalar_one())


async def _summary(store: PostgresEventStore, run: str, crashed: dict[str, Any], n: int) -> dict[str, Any]:
    async with store.engine.connect() as conn:
        async def scalar(sql: str, **p: Any) -> Any:
            return (await conn.execute(text(sql), p)).scalar()

        async def rewards(prefix: str) -> list[float]:
            rows = await conn.execute(text(
                "SELECT rollout_id, reward FROM rollbook.attempts WHERE status = 'finished' AND rollout_id LIKE :p "
                "ORDER BY rollout_id"), {"p": like_prefix(prefix + "-")})
            return [float(r.reward or 0.0) for r in rows]

        c, u = await rewards(f"{run}-c"), await rewards(f"{run}-u")
        repeated_calls = await scalar(REPEATED_CALLS, p=like_prefix(f"{run}-c-"))
        repeated_mutations = await scalar(REPEATED_MUTATIONS, p=like_prefix(f"{run}-c-"))
        repeated_within = await scalar(REPEATED_MUTATIONS_WITHIN, p=like_prefix(f"{run}-"))
        completed_before = await scalar(
            "SELECT count(*) FROM rollbook.attempts a JOIN rollbook.checkpoints c ON c.checkpoint_id = :ck "
            "WHERE a.rollout_id LIKE :p AND a.status = 'finished' AND a.ended_position <= c.log_position",
            ck=crashed["checkpoint_id"], p=like_prefix(f"{run}-c-"))
        sandbox = dict((await conn.execute(text(SANDBOX_DISPOSITIONS), {"ck": crashed["checkpoint_id"]})).all())
        twice = await scalar("SELECT count(*) FROM (SELECT rollout_id FROM rollbook.attempts WHERE status = 'finished' "
                             "AND rollout_id LIKE :p GROUP BY rollout_id HAVING count(*) > 1) t", p=like_prefix(f"{run}-"))
    return {
        "rollouts": n,
        "completed_before_checkpoint": completed_before,
        "continued": crashed["continued"],
        "restarted": crashed["restarted"],
        "sandbox_continued": int(sandbox.get("continue", 0)),
        "sandbox_restarted": int(sandbox.get("fresh_dispatch", 0)),
        "mean_reward_checkpointed": round(statistics.fmean(c), 4) if c else None,
        "mean_reward_uninterrupted": round(statistics.fmean(u), 4) if u else None,
        "repeated_model_calls": int(repeated_calls),
        "repeated_mutations": int(repeated_mutations),
        "repeated_mutations_within_attempt": int(repeated_within),
        "unfinished": 2 * n - len(c) - len(u),
        "finished_twice": int(twice),
        "timings_ms": crashed["timings_ms"],
        "checkpoint_id": crashed["checkpoint_id"],
        "run_id": run,
    }


# The checkpoint's continued and restarted rollouts that held a sandbox session: a continued one goes on in
# a fresh jail rebuilt from its snapshot; a restarted one had a process running in the background.
SANDBOX_DISPOSITIONS = f"""
SELECT r.disposition, count(*) FROM rollbook.checkpoint_rollouts r
WHERE r.checkpoint_id = :ck AND r.disposition IN ('continue', 'fresh_dispatch') AND EXISTS (
  SELECT 1 FROM rollbook.events e WHERE e.rollout_id = r.rollout_id AND e.kind = '{ev.SESSION_OPENED}'
  AND e.data->>'env' = 'sandbox')
GROUP BY r.disposition
"""
# A generated model call of a later attempt whose turn an earlier attempt had already completed
# before the boundary the later one continued from.
REPEATED_CALLS = f"""
SELECT count(*) FROM rollbook.episode_history b
JOIN rollbook.attempts t ON t.rollout_id = b.rollout_id AND t.attempt = b.attempt AND t.origin_position IS NOT NULL
JOIN rollbook.episode_history a ON a.rollout_id = b.rollout_id AND a.attempt < b.attempt AND a.kind = '{ev.CALL_COMPLETED}'
  AND a.position <= t.origin_position AND split_part(a.data->>'call_id', '.t', 2) = split_part(b.data->>'call_id', '.t', 2)
WHERE b.rollout_id LIKE :p AND b.kind = '{ev.CALL_COMPLETED}' AND coalesce(b.data->>'disposition', 'generated') = 'generated'
"""
# A mutation of a later attempt at a revision an earlier attempt had already applied before its boundary.
REPEATED_MUTATIONS = f"""
SELECT count(*) FROM rollbook.episode_history b
JOIN rollbook.attempts t ON t.rollout_id = b.rollout_id AND t.attempt = b.attempt AND t.origin_position IS NOT NULL
JOIN rollbook.episode_history a ON a.rollout_id = b.rollout_id AND a.attempt < b.attempt AND a.kind = '{ev.MUTATION_APPLIED}'
  AND a.position <= t.origin_position AND (a.data->>'revision') = (b.data->>'revision')
WHERE b.rollout_id LIKE :p AND b.kind = '{ev.MUTATION_APPLIED}'
"""
# A tool call applied a second time within one attempt: the agent names every tool call (activation,
# turn, index in the reply), so two mutations of one attempt with one name are one call done twice.
REPEATED_MUTATIONS_WITHIN = f"""
SELECT coalesce(sum(n - 1), 0) FROM (
  SELECT count(*) AS n FROM rollbook.episode_history
  WHERE rollout_id LIKE :p AND kind = '{ev.MUTATION_APPLIED}' AND data->>'tool_call' IS NOT NULL
  GROUP BY rollout_id, attempt, data->>'tool_call' HAVING count(*) > 1) t
"""


def _table(s: dict[str, Any]) -> str:
    rows = [
        ("", "checkpointed + SIGKILL", "uninterrupted"),
        ("rollouts", s["rollouts"], s["rollouts"]),
        ("finished before the checkpoint", s["completed_before_checkpoint"], "-"),
        ("continued from their boundary", s["continued"], "-"),
        ("  of them sandbox sessions, in a fresh jail", s["sandbox_continued"], "-"),
        ("restarted (fresh_dispatch)", s["restarted"], "-"),
        ("  of them sandbox sessions (a background process)", s["sandbox_restarted"], "-"),
        ("mean reward", s["mean_reward_checkpointed"], s["mean_reward_uninterrupted"]),
        ("model calls repeated after restore", s["repeated_model_calls"], "-"),
        ("mutations repeated after restore", s["repeated_mutations"], "-"),
        ("mutations repeated within an attempt", s["repeated_mutations_within_attempt"], "-"),
        ("rollouts unfinished / finished twice", f"{s['unfinished']} / {s['finished_twice']}", ""),
        *((f"{k} ms", v, "") for k, v in s["timings_ms"].items()),
    ]
    w0 = max(len(str(r[0])) for r in rows)
    w1 = max(len(str(r[1])) for r in rows)
    lines = [f"{str(a):<{w0}}  {str(b):>{w1}}  {c}" for a, b, c in rows]
    where = s["dsn"] or "a scratch database, dropped (use --keep to query it afterwards)"
    lines.append(f"database: {where}  (run {s['run_id']}, {s['wall_s']} s)")
    return "\n".join(lines)
