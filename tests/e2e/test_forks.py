"""Forks as a person uses them: `rollbook fork` against the four servers as real processes.

- K forks of a mid-episode boundary each finish, and each one's shared prefix is its origin's events
  up to the boundary, event for event (read through the public views);
- a fork of a fork goes back through both origins;
- forks SIGKILLed mid-episode finish exactly once after the servers restart and the same command is
  run again; forks in a checkpoint's scope are restored from it after a SIGKILL and finish once;
- every refusal (unknown rollout or attempt, a position that is no boundary, a count out of range,
  a session no snapshot holds, a group holding other forks) writes nothing;
- forks of a sandbox boundary each continue in a jail of their own, rebuilt from the boundary's snapshot;
- `rollbook export` carries each fork's origin and masks the turns it did not generate.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from adapters.export import read
from engine import catalog
from engine.boundaries import with_messages
from engine.coordinator import Coordinator
from engine.lineage import effective_history
from participants.environments.tasks import make_tasks

from .conftest import ROOT, Cluster, finish


def rollbook(c: Cluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


async def fork(c: Cluster, rollout_id: str, attempt: int, position: int, count: int, *extra: str) -> dict[str, Any]:
    done = await asyncio.to_thread(rollbook, c, "fork", rollout_id, "--attempt", str(attempt), "--at", str(position),
                                   "--count", str(count), "--config", str(c.work / "rollbook.toml"), *extra)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return dict(json.loads(done.stdout))


async def origin_rollout(c: Cluster, run_id: str, env: str = "workplace", seed: int = 11) -> str:
    """One rollout of `env` run to its end; its id."""
    coll = c.collection(run_id, make_tasks(1, seed, [env]), seed=seed)
    await finish(c, coll)
    return coll.rollout_id(0)


async def boundaries(c: Cluster, rollout_id: str, attempt: int = 0) -> list[Any]:
    return await c.rows("SELECT position, data->>'state' AS state, (data->>'turn')::int AS turn FROM rollbook.episode_history "
                        "WHERE rollout_id = :r AND attempt = :a AND kind = 'agent_boundary' ORDER BY position",
                        r=rollout_id, a=attempt)


async def mid_episode(c: Cluster, rollout_id: str, attempt: int = 0) -> int:
    """The after_turn boundary of the first turn: a conversation and a session behind it, turns ahead."""
    rows = await boundaries(c, rollout_id, attempt)
    return int(next(r.position for r in rows if r.state == "after_turn"))


async def check_shared_prefix(c: Cluster, fork_id: str) -> None:
    """The fork's shared prefix is its origin's events up to the boundary, event for event, and the fork
    goes on from exactly there: the same conversation, the session at the same revision, the next model
    call a child of the origin's last, no turn of the origin generated again."""
    (f,) = await c.rows("SELECT * FROM rollbook.forks WHERE rollout_id = :f", f=fork_id)
    origin = await c.rows("SELECT position, kind, data FROM rollbook.episode_history WHERE rollout_id = :r AND "
                          "attempt = :a AND position <= :p ORDER BY position", r=f.origin_rollout_id, a=f.origin_attempt,
                          p=f.origin_position)
    shared = [e for e in with_messages(await effective_history(c.store, fork_id, 0)) if e.rollout_id != fork_id]
    # the origin attempt's events up to the boundary end the prefix; before them, a forked origin's own prefix
    assert [(e.position, e.kind, e.data) for e in shared][-len(origin):] == [(r.position, r.kind, r.data) for r in origin]
    origin_is_fork = await c.scalar("SELECT count(*) FROM rollbook.forks WHERE rollout_id = :r", r=f.origin_rollout_id)
    assert origin_is_fork or len(shared) == len(origin)
    boundary = next(r for r in reversed(origin) if r.kind == "agent_boundary")
    first = await c.rows("SELECT data FROM rollbook.episode_history WHERE rollout_id = :f AND kind = 'agent_boundary' "
                         "ORDER BY position LIMIT 1", f=fork_id)
    assert first and first[0].data["messages"][:len(boundary.data["messages"])] == boundary.data["messages"]
    assert first[0].data["turn"] == boundary.data["turn"] + (1 if boundary.data["state"] == "after_turn" else 0)
    revisions = [e.data.get("revision", 0) for e in shared if e.kind in ("mutation_applied", "session_opened")]
    opened = await c.rows("SELECT data FROM rollbook.episode_history WHERE rollout_id = :f AND kind = 'session_opened' "
                          "ORDER BY position LIMIT 1", f=fork_id)
    if opened:  # the fork used a tool: its session was rebuilt from the origin's mutations
        reopened = opened[0].data.get("recovered") or opened[0].data.get("restored_from")  # never a fresh session
        assert opened[0].data["revision"] == (revisions[-1] if revisions else 0) and reopened, opened[0].data
    calls = await c.rows("SELECT call_id, parent_call_id FROM rollbook.model_calls WHERE rollout_id = :f "
                         "ORDER BY accepted_position", f=fork_id)
    assert calls and calls[0].parent_call_id == boundary.data["last_call_id"]
    turns = [int(r.call_id.rsplit(".t", 1)[1]) for r in calls]
    assert min(turns) == first[0].data["turn"]


async def log_size(c: Cluster) -> tuple[int, int, int]:
    # Every event but the servers' membership renewals (instance streams), which go on whatever a fork does.
    return (int(await c.scalar("SELECT count(*) FROM rollbook.events WHERE stream NOT LIKE 'instance:%'")), await c.head(),
            int(await c.scalar("SELECT count(*) FROM rollbook.forks")))


async def test_k_forks_of_a_mid_episode_boundary_each_finish_sharing_the_origins_prefix_and_export_marks_it(
        cluster_factory, tmp_path) -> None:
    c = await cluster_factory()
    origin = await origin_rollout(c, "fk")
    at = await mid_episode(c, origin)
    out = await fork(c, origin, 0, at, 4)
    ids = [f["rollout_id"] for f in out["forks"]]
    assert out["group"] == f"{origin}.f{at}" and not out["existing"] and out["launched"] == 4
    assert [f["status"] for f in out["forks"]] == ["finished"] * 4, out
    rows = await c.rows("SELECT rollout_id, origin_rollout_id, origin_attempt, origin_position, seed FROM rollbook.forks "
                        "ORDER BY fork_index")
    assert [(r.rollout_id, r.origin_rollout_id, r.origin_attempt, r.origin_position) for r in rows] == \
        [(i, origin, 0, at) for i in ids]
    assert len({r.seed for r in rows}) == 4
    ended = await c.rows("SELECT rollout_id, attempt, status, reward FROM rollbook.attempts WHERE rollout_id = ANY(:i)", i=ids)
    assert sorted((r.rollout_id, r.attempt, r.status) for r in ended) == [(i, 0, "finished") for i in ids]
    assert all(r.reward is not None for r in ended)
    # each fork sampled with its own seed
    seeds = await c.rows("SELECT e.rollout_id, (e.data->'sampling'->>'seed')::bigint AS seed, f.seed AS own FROM "
                         "rollbook.episode_history e JOIN rollbook.forks f USING (rollout_id) WHERE e.kind = 'call_accepted'")
    assert seeds and all(r.seed == r.own for r in seeds)
    for i in ids:
        await check_shared_prefix(c, i)
    written = await c.store.read_rollouts(ids)
    assert written and not [p for e in written for p in catalog.problems(e)]  # every fork event is as the catalog says
    replayed = await asyncio.to_thread(rollbook, c, "replay", ids[0], "--attempt", "0", "--json", "--dsn", c.config.dsn)
    assert replayed.returncode == 0, replayed.stderr  # the log alone rebuilds a fork: its origin's prefix, then its own
    rebuilt = json.loads(replayed.stdout)
    positions = [s["position"] for s in rebuilt["steps"]]
    assert min(positions) < at and at in positions and max(positions) > at
    assert rebuilt["reward"] == next(f["reward"] for f in out["forks"] if f["rollout_id"] == ids[0])
    # asked again, the same command names the same forks and writes nothing
    before = await log_size(c)
    again = await fork(c, origin, 0, at, 4, "--no-wait")
    assert again["existing"] and [f["rollout_id"] for f in again["forks"]] == ids and again["launched"] == 0
    assert await log_size(c) == before

    done = await asyncio.to_thread(rollbook, c, "export", "--run", "fk", "--out", str(tmp_path / "fk.jsonl"),
                                   "--dsn", c.config.dsn)
    assert done.returncode == 0, done.stderr
    records = {r["rollout_id"]: r for r in read(tmp_path / "fk.jsonl")}
    assert set(records) == {origin, *ids}
    assert records[origin]["origin"] is None and records[origin]["shared_prefix"]["turns"] == 0
    origin_turns = [t["call_id"] for t in records[origin]["turns"]]
    for i in ids:
        r = records[i]
        assert r["origin"] == {"rollout_id": origin, "attempt": 0, "position": at} and r["fork_group"] == out["group"]
        shared = [t for t in r["turns"] if t["shared"]]
        assert [t["call_id"] for t in shared] == origin_turns[:len(shared)] and shared == r["turns"][:len(shared)]
        assert r["shared_prefix"] == {"turns": len(shared), "tokens": sum(len(t["token_ids"]) for t in shared)}
        assert shared and all(set(t["loss_mask"]) == {0} for t in shared)
        own = r["turns"][len(shared):]
        assert own and all(1 in t["loss_mask"] and t["call_id"].startswith(i) for t in own)
    done = await asyncio.to_thread(rollbook, c, "export", "--run", "fk", "--out", str(tmp_path / "fk.parquet"),
                                   "--dsn", c.config.dsn)
    assert done.returncode == 0, done.stderr
    marks = ("rollout_id", "origin", "fork_group", "shared_prefix")
    assert [{k: r[k] for k in marks} | {"shared": [t["shared"] for t in r["turns"]]} for r in read(tmp_path / "fk.parquet")] \
        == [{k: r[k] for k in marks} | {"shared": [t["shared"] for t in r["turns"]]} for r in read(tmp_path / "fk.jsonl")]


async def test_a_fork_of_a_fork_goes_back_through_both_origins(cluster_factory) -> None:
    c = await cluster_factory()
    origin = await origin_rollout(c, "ff", seed=12)
    first = (await fork(c, origin, 0, await mid_episode(c, origin), 1))["forks"][0]["rollout_id"]
    own = await boundaries(c, first)
    assert own, "the fork recorded no boundary of its own"
    at = int(own[0].position)
    out = await fork(c, first, 0, at, 2)
    assert [f["status"] for f in out["forks"]] == ["finished"] * 2, out
    tree = await c.rows("WITH RECURSIVE t AS (SELECT rollout_id, origin_rollout_id, 1 AS depth FROM rollbook.forks "
                        "WHERE origin_rollout_id = :o UNION ALL SELECT f.rollout_id, f.origin_rollout_id, t.depth + 1 "
                        "FROM rollbook.forks f JOIN t ON f.origin_rollout_id = t.rollout_id) SELECT * FROM t ORDER BY depth, "
                        "rollout_id", o=origin)
    assert [(r.rollout_id, r.origin_rollout_id, r.depth) for r in tree] == \
        [(first, origin, 1)] + [(f["rollout_id"], first, 2) for f in out["forks"]]
    for f in out["forks"]:
        await check_shared_prefix(c, f["rollout_id"])
        history = await effective_history(c.store, f["rollout_id"], 0)
        assert [e.rollout_id for e in history if e.rollout_id != f["rollout_id"]] == \
            [e.rollout_id for e in history if e.rollout_id == origin] + \
            [e.rollout_id for e in history if e.rollout_id == first]  # the origin's prefix, then the first fork's


async def wait_each_has_a_boundary(c: Cluster, ids: list[str]) -> None:
    async def probe() -> bool:
        n = await c.scalar("SELECT count(DISTINCT rollout_id) FROM rollbook.episode_history WHERE rollout_id = ANY(:i) "
                           "AND kind = 'agent_boundary'", i=ids)
        return int(n) == len(ids)
    await c.wait_for("a boundary of each fork", probe, timeout=60)


async def exactly_once(c: Cluster, ids: list[str]) -> None:
    rows = await c.rows("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') AS finished, "
                        "count(*) FILTER (WHERE status = 'live') AS live, max(attempt) AS latest, "
                        "max(attempt) FILTER (WHERE status = 'finished') AS finished_attempt FROM rollbook.attempts "
                        "WHERE rollout_id = ANY(:i) GROUP BY rollout_id", i=ids)
    assert sorted((r.rollout_id, r.finished, r.live) for r in rows) == [(i, 1, 0) for i in sorted(ids)], rows
    assert all(r.finished_attempt == r.latest for r in rows)
    finishes = await c.rows("SELECT e.rollout_id, count(*) AS n FROM rollbook.episode_history e JOIN rollbook.attempts a "
                            "USING (rollout_id, attempt) WHERE e.kind = 'attempt_finished' AND a.status <> 'fenced' "
                            "AND e.rollout_id = ANY(:i) GROUP BY 1", i=ids)
    assert sorted((r.rollout_id, r.n) for r in finishes) == [(i, 1) for i in sorted(ids)]
    late = await c.rows("SELECT e.rollout_id FROM rollbook.episode_history f JOIN rollbook.episode_history e ON "
                        "e.rollout_id = f.rollout_id AND e.attempt = f.attempt AND e.position > f.position "
                        "WHERE f.kind = 'attempt_fenced' AND f.rollout_id = ANY(:i)", i=ids)
    assert not late, f"events after a fence: {late}"


async def test_forks_sigkilled_mid_episode_finish_exactly_once_when_the_same_command_runs_again(cluster_factory) -> None:
    c = await cluster_factory(token_latency_s=0.03)  # slow enough that the forks are mid-episode at the kill
    origin = await origin_rollout(c, "fx", seed=13)
    at = await mid_episode(c, origin)
    started = await fork(c, origin, 0, at, 3, "--no-wait")
    ids = [f["rollout_id"] for f in started["forks"]]
    await wait_each_has_a_boundary(c, ids)
    unfinished = await c.scalar("SELECT count(*) FROM rollbook.attempts WHERE rollout_id = ANY(:i) AND status = 'live'", i=ids)
    assert unfinished > 0, "every fork finished before the kill"
    await c.kill()
    await c.start()
    # A framework dispatches one fork as any rollout (its origin's task); the same command drives the rest.
    task = await c.scalar("SELECT data->'task' FROM rollbook.episode_history WHERE rollout_id = :r AND "
                          "kind = 'episode_started'", r=origin)
    async def dispatch() -> dict[str, Any]:
        async with c.session.post(c.config.url("environment") + "/episodes", json={"rollout_id": ids[0], "task": task},
                                  headers={"Authorization": f"Bearer {c.config.data_token}"}) as resp:
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())
    dispatched = asyncio.create_task(dispatch())
    again = await fork(c, origin, 0, at, 3)
    assert again["existing"] and again["launched"] <= unfinished  # the dispatched one may be running already
    assert [f["status"] for f in again["forks"]] == ["finished"] * 3, again
    result = await asyncio.wait_for(dispatched, 60)
    assert (result["rollout_id"], result["attempt"], result["reward"]) == next(
        (f["rollout_id"], f["attempt"], f["reward"]) for f in again["forks"] if f["rollout_id"] == ids[0])
    await exactly_once(c, ids)
    for i in ids:
        await check_shared_prefix(c, i)


async def test_forks_in_a_checkpoints_scope_are_restored_after_a_sigkill_and_finish_once(cluster_factory) -> None:
    # Slow enough tokens that a fork is still generating when prepare closes the servers, on a loaded machine too.
    c = await cluster_factory(token_latency_s=0.07)
    origin = await origin_rollout(c, "fr", seed=14)
    at = await mid_episode(c, origin)
    ids = [f["rollout_id"] for f in (await fork(c, origin, 0, at, 2, "--no-wait"))["forks"]]
    await wait_each_has_a_boundary(c, ids)
    coordinator = Coordinator(c.store, list(c.participants().values()))
    deadline = time.time() + 30
    prepared = await coordinator.prepare("fr-ck1", deadline)
    assert prepared["ready"], prepared
    live = [(r.rollout_id, r.attempt) for r in await c.rows(
        "SELECT rollout_id, attempt FROM rollbook.attempts WHERE rollout_id = ANY(:i) AND status = 'live'", i=ids)]
    assert live, "every fork finished before the checkpoint"
    cut = await coordinator.commit("fr-ck1", deadline, live)  # the forks are all that is live
    await coordinator.resume("fr-ck1")
    await c.kill()
    await c.start()
    restored = await Coordinator(c.store, list(c.participants().values())).restore("fr-ck1", time.time() + 60)
    assert restored["continued"] == len(cut.scope), restored
    await Coordinator(c.store, list(c.participants().values())).resume("fr-ck1")
    again = await fork(c, origin, 0, at, 2)
    assert [f["status"] for f in again["forks"]] == ["finished"] * 2, again
    await exactly_once(c, ids)
    from_ck = await c.rows("SELECT rollout_id FROM rollbook.attempts WHERE rollout_id = ANY(:i) AND "
                           "restored_from_checkpoint = 'fr-ck1' AND status = 'finished'", i=ids)
    assert {r.rollout_id for r in from_ck} == {r for r, _ in live}
    for i in ids:
        await check_shared_prefix(c, i)


async def test_forks_of_a_sandbox_boundary_each_continue_from_its_snapshot_in_a_jail_of_their_own(cluster_factory) -> None:
    c = await cluster_factory()
    origin = await origin_rollout(c, "fb", env="sandbox", seed=15)
    at = await mid_episode(c, origin)  # after the first command: a folder, a file and an exported variable
    out = await fork(c, origin, 0, at, 2)
    ids = [f["rollout_id"] for f in out["forks"]]
    assert [f["status"] for f in out["forks"]] == ["finished"] * 2, out
    # Each fork ran the episode's later commands (its script, its edit, its check) against the origin's
    # tree, directory and environment, and got the origin's answer.
    (reward,) = [r.reward for r in await c.rows("SELECT reward FROM rollbook.attempts WHERE rollout_id = :r", r=origin)]
    assert reward == 1.0 and all(f["reward"] == reward for f in out["forks"]), out
    for i in ids:
        await check_shared_prefix(c, i)
        own = await c.rows("SELECT data FROM rollbook.episode_history WHERE rollout_id = :f AND kind = 'mutation_applied' "
                           "ORDER BY position", f=i)
        assert [r.data["revision"] for r in own] == [2, 3, 4] and all(r.data["effect"]["snapshot"] for r in own)
        assert own[-1].data["output"]["exit_code"] == 0


async def test_every_refused_fork_writes_nothing(cluster_factory) -> None:
    c = await cluster_factory()
    origin = await origin_rollout(c, "fn", seed=15)
    # Its scripted episode keeps a watcher in the background from its first command: no snapshot after it.
    boxed = await origin_rollout(c, "fs", env="sandbox", seed=11)
    at = await mid_episode(c, origin)
    first = await fork(c, origin, 0, at, 1, "--group", "taken")
    start = await c.scalar("SELECT position FROM rollbook.episode_history WHERE rollout_id = :r AND "
                           "kind = 'attempt_started'", r=origin)
    call = await c.scalar("SELECT max(position) FROM rollbook.episode_history WHERE rollout_id = :r AND "
                          "kind = 'call_completed'", r=origin)
    close = await c.scalar("SELECT position FROM rollbook.episode_history WHERE rollout_id = :r AND kind = 'episode_step' "
                           "AND data->>'step' = 'close'", r=origin)
    sandboxed = await mid_episode(c, boxed)
    before = await log_size(c)
    cases = [
        ((origin, "1", str(at), "2"), "unknown_rollout"),
        (("no-such-rollout", "0", str(at), "2"), "unknown_rollout"),
        ((origin, "0", str(start), "2"), "not_a_boundary"),
        ((origin, "0", str(call), "2"), "not_a_boundary"),
        ((origin, "0", str(close), "2"), "not_a_boundary"),
        ((origin, "0", str(at), "0"), "invalid_request"),
        ((origin, "0", str(at), "257"), "invalid_request"),
        ((boxed, "0", str(sandboxed), "2"), "restart_only_boundary"),
        ((origin, "0", str(at), "3", "--group", "taken"), "conflict"),
        ((origin, "0", str(start + 1), "1", "--group", "taken"), "not_a_boundary"),
    ]
    for (rid, attempt, position, count, *extra), code in cases:
        done = await asyncio.to_thread(rollbook, c, "fork", rid, "--attempt", attempt, "--at", position, "--count", count,
                                       "--config", str(c.work / "rollbook.toml"), *extra)
        assert done.returncode == 2, (rid, position, count, done.stdout, done.stderr)
        assert json.loads(done.stderr.strip().splitlines()[-1])["error"]["code"] == code, (code, done.stderr)
        assert await log_size(c) == before, f"a refused fork ({code}) wrote to the log"
    assert first["forks"][0]["status"] == "finished"
    # the fork is a control operation: the data credential does not open it
    async with c.session.post(c.config.url("environment") + "/rollbook/v1/control/fork",
                              json={"rollout_id": origin, "attempt": 0, "position": at, "count": 2},
                              headers={"Authorization": f"Bearer {c.config.data_token}"}) as resp:
        assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
    assert await log_size(c) == before
