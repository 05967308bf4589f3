"""The crash check of one NeMo Gym resources server: its example rows through a SIGKILL of everything.

The sweep (apps/nemo_gym_sweep.py) runs it on every server that seeds. The server's first ROWS example
rows become tasks of a `[nemo_gym.<env>]` table holding only its module and `state = "replay"`
(gymnasium-style servers run with NeMo Gym's `gymnasium_agent`, a server whose rows only its own agent
can play with that agent, each driving the server through its `/run`), on a scratch database beside the
given one, with rollbook's scripted model playing them (it calls whatever tools a row offers, with
arguments built from their schemas). They run twice through rollbook's four servers as processes and
`rollbook run`: once uninterrupted; once killed, `rollbook run` and every server's process group
(the NeMo Gym server with the resources server's) SIGKILLed when the run has logged half the model
calls (accepted, completed) and relayed calls the uninterrupted one did, then the servers started again and the run again
with the same run_id, to its end. The server conforms when every rollout of both runs finished once,
each with the uninterrupted run's reward and tool-call sequence (name and arguments, a value an
earlier reply handed out named by its place, over the lineage that finished it), and no call was
applied twice in one live NeMo Gym session. Where a killed run's rollouts all finished once and yet
one ends otherwise, with no replay refused to say why, the rows run again uninterrupted (up to
AGAIN_RUNS times): a server whose own two runs differ (it deals at random) is the cause.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg

from adapters.database import drop_database, libpq_dsn, scratch_database
from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.nemo_gym_tasks import convert
from apps.processes import ServerProcesses, free_port
from engine.catalog import MUTATION_APPLIED
from engine.lineage import effective_history
from participants.environments.gymnasium import GYMNASIUM_AGENT
from participants.environments.nemo_gym_launcher import strings

ROWS = 3
# The scripted model's pace: a reply of tens of tokens takes a second or so, so the kill lands while
# calls are in flight rather than after a run that a fast model finished before it was looked at.
TOKEN_S = 0.03
_MIGRATING = threading.Lock()  # Alembic's migration context is one per process: one scratch database at a time
RUN_TIMEOUT_S = 300.0
AGAIN_RUNS = 4  # uninterrupted runs after a difference no replay explains, until one differs from the first
DRIVER = "driver"  # the `[nemo_gym_agent]` table of the agent that drives the server, where one does
# A relayed call applied twice in one live session: a relayed call and the replays that sent it again.
TWICE = """
WITH applied AS (
  SELECT rollout_id, data->>'live' AS live, data->>'tool_call' AS tool_call FROM rollbook.episode_history
  WHERE kind = 'mutation_applied'
  UNION ALL
  SELECT rollout_id, data->>'live', jsonb_array_elements_text(data->'tool_calls') FROM rollbook.episode_history
  WHERE kind = 'session_replayed')
SELECT rollout_id, tool_call FROM applied GROUP BY rollout_id, live, tool_call HAVING count(*) > 1"""
# What the kill is timed by: model calls accepted and completed, relayed calls applied. Half of the
# uninterrupted run's count falls while calls are in flight (rows of one model call each, all sent at
# once, complete within milliseconds of each other: timed by completions alone, the kill came after them).
LOGGED = ("SELECT count(*) FROM rollbook.events WHERE rollout_id LIKE %s AND "
          "kind IN ('call_accepted', 'call_completed', 'mutation_applied')")


def conformance(name: str, python: Path, rows: list[dict[str, Any]], driver: str | None, dsn: str,
                work: Path, cohort: int = 1, models: dict[str, str] | None = None) -> tuple[str, str]:
    """(verdict, reason): `conforms`, `differs` (what differs) or `failed` (why a run did not finish).
    `driver`: the NeMo Gym agent that drives the server through its `/run` (gymnasium_agent for a
    gymnasium-style server, a server's own agent), or None for rollbook's own agent. `cohort`: how many
    rollouts of one row the server compares at verify (its `num_rollouts_per_prompt`): then one row runs
    that many times, all at once, tagged as NeMo Gym's collector tags repeats. `models`: model servers
    its config names at URLs given (the table's `models`)."""
    env = f"gym_{name}"
    tasks = convert([json.dumps(r) for r in rows[:ROWS if cohort == 1 else 1]], "example.jsonl", env, cohort)
    gymnasium = f"responses_api_agents.{driver}.app" == GYMNASIUM_AGENT  # its steps' rewards are compared
    if driver is not None:
        tasks = [replace(t, agent=DRIVER) for t in tasks]
    work.mkdir(parents=True, exist_ok=True)
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    with _MIGRATING:
        db = scratch_database(dsn, f"rollbook_sweep_{name}"[:63])
    try:
        base = _config(work, db, name, env, python, driver, "ref", models)
        procs = ServerProcesses(cfg.load(base), base, work, name="ref-")
        with _servers(procs):
            if (code := _to_end(base, db, "ref")) != 0:
                return "failed", f"the uninterrupted run exited {code}: " + (_fences(db, "ref") or _said(base))
        logged = _count(db, "ref")
        path = _config(work, db, name, env, python, driver, "crash", models)
        procs = ServerProcesses(cfg.load(path), path, work, name="crash-")
        with _servers(procs):
            run = _run(path)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while _count(db, "crash") < max(1, logged // 2) and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            killed, at = run.poll() is None, _count(db, "crash")
            run.send_signal(signal.SIGKILL)
            run.wait()
            procs.kill()
            procs.start()
            if (code := _to_end(path, db, "crash")) != 0:
                return "failed", f"the run after the SIGKILL exited {code}: " + (_fences(db, "crash") or _said(path))
        if not killed or at >= logged:
            return "failed", f"the kill came after the run's last call ({at} of {logged}): nothing was cut"
        ref, crash = (asyncio.run(_outcomes(db, run, len(tasks), gymnasium)) for run in ("ref", "crash"))
        verdict, why, chance = _compare(db, ref, crash)
        # Is it the server's own? Its rows run again, uninterrupted, a few times: a server whose own runs
        # differ (it deals at random) gives nothing a killed run can be held to. One run alone may deal
        # the same three hands by chance (a blackjack hand ends in one of three rewards).
        for n in range(AGAIN_RUNS if chance else 0):
            again = _config(work, db, name, env, python, driver, f"again{n}", models)
            with _servers(ServerProcesses(cfg.load(again), again, work, name=f"again{n}-")):
                if (code := _to_end(again, db, f"again{n}")) != 0:
                    return "failed", f"an uninterrupted run again exited {code}: " + (_fences(db, f"again{n}") or _said(again))
            if (own := _unlike(ref, asyncio.run(_outcomes(db, f"again{n}", len(tasks), gymnasium)))) is not None:
                return "does not replay", (f"two uninterrupted runs of its rows differ ({own}): its outcomes are its "
                                           "own; in the killed run every rollout finished once and no call was "
                                           "applied twice in one live session")[:600]
        return verdict, why or _what_happened(db, at, logged)
    except _Hung as exc:
        return "failed", str(exc)
    finally:
        drop_database(db)


def _config(work: Path, dsn: str, name: str, env: str, python: Path, driver: str | None, run_id: str,
            models: dict[str, str] | None) -> Path:
    tasks = sum(1 for _ in (work / "tasks.jsonl").open())
    agents = {DRIVER: cfg.NemoGymAgentConfig(module=f"responses_api_agents.{driver}.app", continuation="replay",
                                             drive="run", python=str(python), port=free_port())} if driver else {}
    config = cfg.Config(dsn=dsn, control_token="sweep-c0ntrol", data_token="sweep-d4ta",
                        servers={k: cfg.ServerConfig(port=free_port(), token_latency_s=TOKEN_S if k == "model" else 0.0)
                                 for k in cfg.KINDS},
                        nemo_gym={env: cfg.NemoGymConfig(module=f"resources_servers.{name}.app", state="replay",
                                                         python=str(python), port=free_port(), models=models or {})},
                        nemo_gym_agent=agents,
                        run=cfg.RunConfig(run_id=run_id, tasks=str(work / "tasks.jsonl"), checkpoint_every_s=3600,
                                          concurrency=tasks))
    path = work / f"{run_id}.toml"
    cfg.write(config, path)
    return path


class _servers:
    """The four servers for the length of a block, stopped however it ends."""

    def __init__(self, procs: ServerProcesses) -> None:
        self.procs = procs

    def __enter__(self) -> ServerProcesses:
        self.procs.start(timeout=120)
        return self.procs

    def __exit__(self, *_: object) -> None:
        self.procs.stop()


def _run(config: Path) -> subprocess.Popen[bytes]:
    log = open(config.with_suffix(".run.log"), "ab")  # noqa: SIM115 - the child holds it
    return subprocess.Popen([sys.executable, "-m", "apps.cli", "run", "--config", str(config)], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


class _Hung(Exception):
    """A `rollbook run` that went on past RUN_TIMEOUT_S: killed, and where its rollouts were left."""


def _to_end(config: Path, dsn: str, run_id: str) -> int:
    """Run `config`'s run to its end: its exit code. One past RUN_TIMEOUT_S is killed (left running, it would
    go on against servers about to stop) and raises _Hung naming the run and its rollouts' last events."""
    run = _run(config)
    try:
        return run.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        raise _Hung(f"the {run_id} run took over {RUN_TIMEOUT_S:.0f} s and was killed; {_stuck(dsn, run_id)}") from None


def _stuck(dsn: str, run_id: str) -> str:
    """The run's rollouts not finished, each with its last event: where a hung run waits."""
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        rows = conn.execute(
            "SELECT a.rollout_id, (SELECT h.kind || ' on ' || h.stream FROM rollbook.episode_history h WHERE "
            "h.rollout_id = a.rollout_id ORDER BY h.position DESC LIMIT 1) FROM rollbook.attempts a WHERE "
            "a.rollout_id LIKE %s GROUP BY a.rollout_id HAVING bool_and(a.status <> 'finished') ORDER BY 1",
            (f"{run_id}-%",)).fetchall()
    if not rows:
        return "no rollout of it was left unfinished in the log"
    return "unfinished, with the last event of each: " + "; ".join(f"{rid}: {last}" for rid, last in rows)[:600]


def _count(dsn: str, run_id: str) -> int:
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        row = conn.execute(LOGGED, (f"{run_id}-%",)).fetchone()
    return int(row[0]) if row else 0


def _fences(dsn: str, run_id: str) -> str:
    """Why the run's rollouts that failed failed, from their fences (the first few)."""
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        rows = conn.execute("SELECT DISTINCT data->>'code', coalesce(data->'context'->>'stage', ''), "
                            "coalesce(data->'context'->>'status', ''), left(coalesce(data->'context'->>'body', "
                            "data->>'detail'), 500) FROM rollbook.episode_history WHERE rollout_id LIKE %s AND "
                            "kind = 'attempt_fenced' AND data->>'reason' = 'failed' LIMIT 3", (f"{run_id}-%",)).fetchall()
    return "; ".join(f"{code} ({stage} {status}): {said}".replace(" ()", "") for code, stage, status, said in rows)


def _said(config: Path) -> str:
    """The last line `rollbook run` printed (where no rollout failed: it could not start the run)."""
    lines = config.with_suffix(".run.log").read_text(errors="replace").strip().splitlines()
    return lines[-1][:400] if lines else "it printed nothing"


def _what_happened(dsn: str, at: int, logged: int) -> str:
    """How the killed run went on: where it was killed, the sessions rebuilt by replay, the rollouts that
    went on under a new attempt (a call cut off by the kill) and those that started over (a server that
    did not replay)."""
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE kind = 'rollout_recovered' AND data->>'disposition' = 'continue'), "
            "count(*) FILTER (WHERE kind = 'session_replayed'), count(*) FILTER (WHERE kind = 'rollout_recovered' "
            "AND data->>'disposition' = 'fresh_dispatch') FROM rollbook.episode_history WHERE rollout_id LIKE 'crash-%'"
        ).fetchone()
    continued, replayed, restarted = row if row else (0, 0, 0)
    return (f"killed at {at} of {logged} model and relayed call events; {replayed} sessions rebuilt, {continued} rollouts "
            f"continued under a new attempt, {restarted} started over")


def _compare(dsn: str, ref: list[Any], crash: list[Any]) -> tuple[str, str, bool]:
    """`conforms`; `differs` and the first difference rollbook is answerable for; or `does not replay`: the
    only differences are rollouts whose lost live session the server would not rebuild (a replayed call
    answered otherwise than recorded), which started over from their input and finished once, as they
    must: the server's own promise broken, not rollbook's. The flag: a difference that may yet be the
    server's own chance (every rollout finished once, none applied a call twice), which only further
    uninterrupted runs can tell."""
    tasks, own = len(ref), []
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        if twice := conn.execute(TWICE).fetchall():
            return "differs", f"a call applied twice in one live session: {twice[:3]}", False
        unfinished = [i for i in range(tasks) if "reward" not in crash[i]]
        for i in unfinished or [i for i in range(tasks) if ref[i] != crash[i]]:
            replay = conn.execute("SELECT data->>'detail' FROM rollbook.events WHERE kind = 'session_replay_failed' "
                                  "AND rollout_id = %s LIMIT 1", (f"crash-{i:04d}",)).fetchone()
            if replay is None or unfinished:
                return "differs", f"task {i}: uninterrupted {json.dumps(ref[i], default=str)[:300]}, " \
                                  f"killed {json.dumps(crash[i], default=str)[:300]}", not unfinished
            own.append(f"task {i}: {replay[0]}"[:300])
    if own:
        return "does not replay", "; ".join(own) + " (each started over from its input and finished once)", False
    return "conforms", "", False


def _handles(arguments: Any, earlier: list[dict[str, Any]]) -> Any:
    """A call's arguments with each value an earlier reply handed out (toolsandbox's `env_id`, a fresh
    uuid each seed) named by that reply's place: what the call asks, not which run it asked in."""
    given = {v: n for n, d in enumerate(earlier) for v in strings(d.get("output")) if len(v) >= 8}

    def named(value: Any) -> Any:
        if isinstance(value, str) and value in given:
            return f"<a value reply {given[value]} gave>"
        if isinstance(value, dict):
            return {k: named(v) for k, v in value.items()}
        return [named(v) for v in value] if isinstance(value, list) else value
    return named(arguments) if given else arguments


def _unlike(a: list[Any], b: list[Any]) -> str | None:
    """The first task on which two runs (their `_outcomes`) ended otherwise, said in a line; None when
    every task agrees."""
    i = next((i for i in range(len(a)) if a[i] != b[i]), None)
    return None if i is None else \
        f"task {i}: {json.dumps(a[i], default=str)[:200]} against {json.dumps(b[i], default=str)[:200]}"


async def _outcomes(dsn: str, run_id: str, tasks: int, gymnasium: bool) -> list[Any]:
    """Each task's reward and the relayed calls of the lineage that finished it: name and arguments, or
    for a gymnasium server name and reward (a step's arguments hold the model's response, whose ids
    name the run)."""
    store = PostgresEventStore.connect(dsn, writer="sweep")
    try:
        out: list[Any] = []
        with psycopg.connect(libpq_dsn(dsn)) as conn:
            for i in range(tasks):
                rid = f"{run_id}-{i:04d}"
                finished = conn.execute("SELECT attempt, reward FROM rollbook.attempts WHERE rollout_id = %s "
                                        "AND status = 'finished'", (rid,)).fetchall()
                if len(finished) != 1:
                    out.append({"finished attempts": len(finished), "why": _fences(dsn, rid) or "no fence"})
                    continue
                attempt, reward = finished[0]
                events = await effective_history(store, rid, attempt)
                applied = [e.data for e in events if e.kind == MUTATION_APPLIED]
                out.append({"reward": reward, "calls": [
                    (d["tool"], d["effect"].get("reward") if gymnasium else _handles(d["arguments"], applied[:n]))
                    for n, d in enumerate(applied)]})
        return out
    finally:
        await store.close()


__all__ = ["ROWS", "conformance"]
