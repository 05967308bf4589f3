"""Checkpoint lifecycle scenarios that once broke, each as the scenario that found it, on the four servers as real processes.

- a retire ends an attempt: the next checkpoint leaves it out, and restoring that checkpoint works;
- commit is recorded only once every participant accepted it, else the checkpoint is aborted;
- a checkpoint whose coordinator died after prepare is aborted in the log when its lease runs out,
  by the servers, or by `rollbook checkpoint status` when no server is left to notice;
- the cut's digest covers every event of each scoped rollout up to P and the cut's own lists, so an
  edited reply between a boundary and the cut, or an edited list, is refused at restore with
  nothing installed;
- a NaN or past deadline is refused before any participant changes phase.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable

import pytest
from sqlalchemy import text

from apps.config import KINDS
from engine.coordinator import Coordinator
from engine.errors import InvalidCheckpointState, InvalidPhase, StaleCheckpoint
from participants.environments.tasks import make_tasks
from tests.waiting import NeverHappened

from .conftest import Cluster, assert_invariants, finish

ENVS = ["workplace", "blackjack", "workplace", "math"]


async def launch(c: Cluster, run_id: str, n: int = 6, seed: int = 5):
    coll = c.collection(run_id, make_tasks(n, seed, ENVS), seed=seed)
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count(run_id, "attempt_started", n)
    return coll, run


async def phases(c: Cluster) -> dict[str, str]:
    return {k: (await c.control_status(k))["phase"] for k in KINDS}


async def installed(c: Cluster, prefix: str) -> list:
    """Everything a restore would have written: fences and new attempts."""
    return await c.rows("SELECT position, kind FROM rollbook.episode_history WHERE rollout_id LIKE :p AND "
                        "(kind = 'attempt_fenced' OR (kind = 'attempt_started' AND attempt > 0))", p=f"{prefix}-%")


async def test_a_retired_attempt_leaves_later_cuts_and_a_checkpoint_after_a_retire_restores(cluster_factory) -> None:
    c = await cluster_factory()
    coll, run = await launch(c, "ret")
    victim = coll.rollout_id(0)
    await Coordinator(c.store, list(c.participants().values())).retire("ret-retire", [(victim, 0)])
    ck = await coll.checkpoint(c.session, "ret-ck1")
    assert ck["published"], ck
    cut = (await c.rows("SELECT data FROM rollbook.events WHERE kind = 'checkpoint_committed' "
                        "AND data->>'checkpoint_id' = 'ret-ck1'"))[0].data
    # The cut lists what it continues and restarts; the view adds the attempts complete at P, from the log.
    completed = {r.rollout_id for r in await c.rows("SELECT rollout_id FROM rollbook.checkpoint_rollouts "
                                                      "WHERE checkpoint_id = 'ret-ck1' AND disposition = 'completed'")}
    named = {r for r, _ in cut["fresh_dispatch"]} | {s["rollout_id"] for s in cut["scope"]} | completed
    assert victim not in named
    await c.crash(run)
    await c.start()
    restored = await coll.restore(c.session, "ret-ck1")  # was: stale_attempt, fencing the retired attempt
    assert restored["continued"] + restored["fresh_dispatch"] + len(completed) == len(coll.tasks) - 1
    status = await c.scalar("SELECT status FROM rollbook.attempts WHERE rollout_id = :r AND attempt = 0", r=victim)
    live = await c.scalar("SELECT count(*) FROM rollbook.attempt_state WHERE rollout_id = :r AND status = 'live'", r=victim)
    assert (status, live) == ("retired", 0)


async def test_commit_refused_by_one_participant_is_aborted_in_the_log_and_cannot_be_restored(cluster_factory) -> None:
    c = await cluster_factory()
    coll, run = await launch(c, "cmt")
    coordinator = Coordinator(c.store, list(c.participants().values()))
    prepared = await coordinator.prepare("cmt-ck1", time.time() + 30)
    assert prepared["ready"], prepared
    await c.control("agent", "resume", "cmt-ck1")  # the agent lets go (as an expired lease would)
    with pytest.raises(StaleCheckpoint):
        await coordinator.commit("cmt-ck1", time.time() + 30)
    assert await c.phase("cmt-ck1") == "aborted"
    assert await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind = 'checkpoint_committed' "
                          "AND data->>'checkpoint_id' = 'cmt-ck1'") == 0
    assert await phases(c) == dict.fromkeys(KINDS, "idle")  # everyone reopened
    with pytest.raises(InvalidCheckpointState):
        await coordinator.restore("cmt-ck1", time.time() + 30)
    await finish(c, coll)
    await run
    await assert_invariants(c, coll)


async def test_a_coordinator_killed_after_prepare_leaves_an_aborted_checkpoint_not_a_prepared_one(cluster_factory) -> None:
    c = await cluster_factory()
    coll, run = await launch(c, "kil")
    coordinator = Coordinator(c.store, list(c.participants().values()))
    prepared = await coordinator.prepare("kil-ck1", time.time() + 4.0)
    assert prepared["ready"] and await c.phase("kil-ck1") == "prepared", prepared
    # the coordinator is gone; the servers' leases run out (deadline + 2 s grace) and they say so in the log
    await c.wait_for("the checkpoint aborted in the log", lambda: _is(c, "kil-ck1", "aborted"), timeout=20)
    with pytest.raises(InvalidPhase):  # a late coordinator cannot commit it any more
        await coordinator.commit("kil-ck1", time.time() + 30)
    await c.wait_for("every server reopened", lambda: _all_idle(c), timeout=10)
    await finish(c, coll)
    await run


async def test_checkpoint_status_aborts_an_expired_checkpoint_when_no_server_is_left(cluster_factory) -> None:
    c = await cluster_factory()
    coordinator = Coordinator(c.store, list(c.participants().values()))
    deadline = time.time() + 5.0  # room for a loaded machine to prepare all four
    prepared = await coordinator.prepare("gone-ck1", deadline)
    assert prepared["ready"], prepared
    await c.kill()  # coordinator and servers all gone before the lease ran out
    await asyncio.sleep(max(0.0, deadline + 2.5 - time.time()))  # past the deadline and its 2 s grace
    assert await c.phase("gone-ck1") == "prepared"
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "apps.cli", "checkpoint", "status",
                                                   "--dsn", c.config.dsn or ""], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["aborted_expired"] == ["gone-ck1"]
    assert await c.phase("gone-ck1") == "aborted"


async def _all_idle(c: Cluster) -> bool:
    return await phases(c) == dict.fromkeys(KINDS, "idle")


async def _is(c: Cluster, checkpoint_id: str, phase: str) -> bool:
    return await c.phase(checkpoint_id) == phase


# ---- tampering ---------------------------------------------------------------------------------

REPLY_AFTER_BOUNDARY = """
SELECT e.position FROM rollbook.events e
JOIN LATERAL jsonb_to_recordset(:scope) AS s(rollout_id text, attempt int, boundary bigint)
  ON s.rollout_id = e.rollout_id AND s.attempt = e.attempt
WHERE e.kind IN ('call_completed', 'call_cut') AND e.position > s.boundary AND e.position <= :p
ORDER BY e.position LIMIT 1
"""


async def checkpoint_with_a_reply_after_a_boundary(c: Cluster, prefix: str):
    """A checkpoint taken while a model call is in flight: prepare cuts it, so its custody event
    (call_cut) lands after its agent's before_model boundary and before P.

    In flight for sure: the upstream (a fake vLLM) is stalled first, and the call awaited is one
    accepted after that, which therefore cannot complete before prepare cuts it. If every rollout
    was already waiting on the model when the stall came, no call is accepted after it: then any
    call still in flight will do (the stall holds its stream before its next step)."""
    coll, run = await launch(c, prefix, n=8)
    await c.wait_count(prefix, "call_completed", 3)
    await c.upstream_stall(True)
    stalled_at = await c.head()
    try:
        await c.call_in_flight(prefix, after=stalled_at, timeout=10)
    except NeverHappened:
        await c.call_in_flight(prefix)
    # Prepare cuts only a call with tokens saved (participants.model.server); on a loaded machine the
    # saver can lag the stall, and a call with none runs on through the checkpoint, uncut.
    await c.wait_for("a stalled model call with tokens saved", lambda: _some(c.cuttable_calls()), timeout=20)
    try:
        ck = await coll.checkpoint(c.session, f"{prefix}-ck1")
    finally:
        await c.upstream_stall(False)
    assert ck["published"], ck
    cut = (await c.rows("SELECT data FROM rollbook.events WHERE kind = 'checkpoint_committed' "
                        "AND data->>'checkpoint_id' = :c", c=f"{prefix}-ck1"))[0].data
    await c.crash(run)
    return coll, cut


async def _some(count: Awaitable[float]) -> bool:
    return await count >= 1


async def refused_with_nothing_installed(c: Cluster, coll, checkpoint_id: str, edit: str, **params) -> None:
    async with c.store.engine.begin() as conn:
        assert (await conn.execute(text(edit), params)).rowcount == 1
    before = await installed(c, coll.run_id)
    await c.start()
    coordinator = Coordinator(c.store, list(c.participants().values()))
    with pytest.raises(InvalidCheckpointState):
        await coordinator.restore(checkpoint_id, time.time() + 30)
    assert await installed(c, coll.run_id) == before
    assert await phases(c) == dict.fromkeys(KINDS, "idle")


async def test_an_edited_reply_between_a_boundary_and_the_cut_is_refused_at_restore(cluster_factory) -> None:
    c = await cluster_factory(token_latency_s=0.02, upstream=True)
    coll, cut = await checkpoint_with_a_reply_after_a_boundary(c, "tam")
    victim = await c.scalar(REPLY_AFTER_BOUNDARY, scope=json.dumps(cut["scope"]), p=cut["position"])
    assert victim is not None, "no call completed or was cut between a boundary and the cut in this run"
    await refused_with_nothing_installed(  # both custody events carry the token count of their receipt
        c, coll, "tam-ck1", "UPDATE rollbook.events SET data = jsonb_set(data, '{tokens}', '999') WHERE position = :v",
        v=victim)


# Naming another run (this run's rollouts started after P would be left running), or the finished
# rollouts in `fresh_dispatch` (they would run again).
FINISHED = ("(SELECT jsonb_agg(jsonb_build_array(rollout_id, attempt)) FROM rollbook.attempt_state "
            "WHERE status = 'finished' AND rollout_id LIKE 'lst-%')")


@pytest.mark.parametrize("field, value", [("run", "'\"other\"'"), ("fresh_dispatch", FINISHED)])
async def test_an_edited_list_of_the_committed_cut_is_refused_at_restore(cluster_factory, field: str, value: str) -> None:
    c = await cluster_factory()
    coll, run = await launch(c, "lst", n=8)
    await c.wait_count("lst", "attempt_finished", 2, timeout=60)
    ck = await coll.checkpoint(c.session, "lst-ck1")
    assert ck["published"], ck
    await c.crash(run)
    await refused_with_nothing_installed(
        c, coll, "lst-ck1",
        f"UPDATE rollbook.events SET data = jsonb_set(data, '{{{field}}}', {value}) "
        "WHERE kind = 'checkpoint_committed' AND data->>'checkpoint_id' = 'lst-ck1'")


# ---- deadlines -----------------------------------------------------------------------------------

@pytest.mark.parametrize("deadline", ["NaN", "Infinity", "-Infinity", "1.0"])
async def test_a_non_finite_or_past_deadline_is_refused_before_any_phase_changes(cluster_factory, deadline: str) -> None:
    c = await cluster_factory()
    for kind in KINDS:
        body = '{"checkpoint_id": "dl-ck1", "deadline": ' + deadline + '}'  # NaN as Python's json.dumps writes it
        async with c.session.post(c.config.url(kind) + "/rollbook/v1/control/prepare", data=body,
                                  headers={"Authorization": f"Bearer {c.config.control_token}",
                                           "Content-Type": "application/json"}) as resp:
            reply = await resp.json()
            assert resp.status in (400, 408), reply
            assert reply["error"]["code"] in ("invalid_deadline", "deadline_exceeded", "invalid_json")  # NaN is not JSON
    assert await phases(c) == dict.fromkeys(KINDS, "idle")
    assert await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind LIKE 'participant_%'") == 0
    # and a well-formed checkpoint goes through at once (was: 409 until someone resumed dl-ck1)
    coordinator = Coordinator(c.store, list(c.participants().values()))
    assert (await coordinator.prepare("dl-ck2", time.time() + 30))["ready"]
    await coordinator.resume("dl-ck2")
    with pytest.raises(Exception) as err:
        await coordinator.prepare("dl-ck3", float("nan"))
    assert getattr(err.value, "code", None) == "invalid_deadline"
    assert await c.phase("dl-ck3") is None  # nothing written for it
