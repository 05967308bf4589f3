"""Online checkpoints: the cut comes from the log alone while every server keeps running, and a
restore of it after SIGKILL finishes every rollout exactly once, on the four servers as real processes.

An online checkpoint asks no participant anything: no prepare, no closed admission, no parked work.
Work done after a rollout's boundary and before the cut is done again under the new attempt; work
done before the boundary never is (the invariants of conftest.assert_invariants).
"""

from __future__ import annotations

import asyncio

from engine.checkpoint import load_cut
from participants.environments.tasks import make_tasks

from .conftest import assert_invariants, finish

ENVS = ["workplace", "blackjack", "math", "sandbox"]


async def test_online_checkpoints_pause_no_one_and_restore_after_sigkill(cluster_factory, rng) -> None:
    c = await cluster_factory(token_latency_s=0.02)
    coll = c.collection("onl", make_tasks(12, rng.randrange(1 << 20), ENVS), seed=rng.randrange(1000))
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("onl", "attempt_started", len(coll.tasks))
    taken = []
    for i in range(3):  # several cuts in a row, each with calls and tool rounds in flight
        await c.wait_count("onl", "mutation_applied", 2 * (i + 1))
        await c.call_in_flight("onl")
        taken.append(await coll.checkpoint_online(c.session, f"onl-ck{i + 1}"))
    last = taken[-1]
    assert all(t["published"] for t in taken)
    assert last["continued"] > 0, last

    # No participant took part: no phase event of any server, no admission ever closed.
    assert await c.scalar("SELECT count(*) FROM rollbook.events WHERE stream LIKE 'participant:%' "
                          "AND data->>'checkpoint_id' LIKE 'onl-ck%'") == 0
    assert await c.scalar("SELECT count(*) FROM rollbook.model_calls WHERE rollout_id LIKE 'onl-%' "
                          "AND status = 'excluded'") == 0
    # Sandbox sessions hold a live process: the log says so, and no cut continues one from a boundary
    # where its session was open (it restarts from its input).
    cut, phase = await load_cut(c.store, last["checkpoint_id"])
    assert phase == "published"
    for entry in cut.scope:  # (the resources server's restore refuses such a scope: restart_in_scope)
        assert not await c.rows(
            "SELECT 1 FROM rollbook.events o WHERE o.rollout_id = :r AND o.attempt = :a AND o.kind = 'session_opened' "
            "AND o.data->>'state_mode' = 'restart_only' AND o.position <= :b AND NOT EXISTS (SELECT 1 FROM "
            "rollbook.events x WHERE x.rollout_id = :r AND x.attempt = :a AND x.kind = 'session_closed' "
            "AND x.position <= :b)", r=entry.rollout_id, a=entry.attempt, b=entry.boundary), entry

    # The run goes on past the cut; then every server is SIGKILLed and the last online cut restored.
    await c.wait_count("onl", "agent_boundary", 1, after=last["position"])
    await c.crash(run)
    await c.start()
    restored = await coll.restore(c.session, last["checkpoint_id"])
    assert restored["continued"] == last["continued"]
    await finish(c, coll)
    print(await assert_invariants(c, coll))


async def test_an_online_checkpoint_with_a_used_id_is_refused_and_changes_nothing(cluster_factory, rng) -> None:
    c = await cluster_factory()
    coll = c.collection("dup", make_tasks(2, rng.randrange(1 << 20), ["math"]), seed=1)
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("dup", "attempt_started", 2)
    await coll.checkpoint_online(c.session, "dup-ck1")
    before = await c.store.head()
    try:
        await coll.checkpoint_online(c.session, "dup-ck1")
        raise AssertionError("a second checkpoint under a used id was accepted")
    except Exception as exc:  # noqa: BLE001 - the code is what matters
        assert getattr(exc, "code", None) == "stale_checkpoint", exc
    kinds = [r.kind for r in await c.rows("SELECT kind FROM rollbook.events WHERE stream = 'checkpoint:dup-ck1' "
                                          "ORDER BY position")]
    assert kinds == ["checkpoint_started", "checkpoint_prepared", "checkpoint_committed", "checkpoint_published"]
    late = await c.rows("SELECT stream, kind FROM rollbook.events WHERE position > :p AND stream LIKE 'checkpoint:%'",
                        p=before)
    assert not late, late
    await run
