"""SIGKILL at every step of the checkpoint protocol, then restore, resume and finish.

Each test runs the four servers as real processes (apps.processes), dispatches a handful of
rollouts the way a framework does (apps.collection), kills the servers' process groups at one
point of the protocol, starts fresh processes, restores, dispatches every unfinished rollout again
and then checks every invariant through the public SQL views (conftest.assert_invariants). Where a
crash point is a race (a model call or a tool call in flight), the test waits for it and checks
afterwards that the crash really landed there; where it is a protocol step, a Gate holds the
coordinator's call to one participant so the crash lands exactly between two steps.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from apps.collection import Collection
from apps.config import KINDS
from engine.checkpoint import load_cut
from engine.coordinator import PREPARE_ORDER, Coordinator, abort_expired
from engine.errors import InvalidCheckpointState
from participants.environments.base import Task
from participants.environments.tasks import make_tasks

from .conftest import Cluster, assert_invariants, finish

ENVS = ["workplace", "blackjack", "workplace", "math"]
N = 8


async def launch(c: Cluster, rng, run_id: str, n: int = N, envs: list[str] = ENVS,
                 tasks: list[Task] | None = None) -> tuple[Collection, asyncio.Task]:
    """Dispatch every rollout and wait until all of them are live (each is then in every cut)."""
    coll = c.collection(run_id, tasks or make_tasks(n, rng.randrange(1 << 20), envs), seed=rng.randrange(1000))
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count(run_id, "attempt_started", len(coll.tasks))
    return coll, run


async def published(c: Cluster, coll: Collection, checkpoint_id: str) -> dict:
    result = await coll.checkpoint(c.session, checkpoint_id)
    assert result["published"], result
    return result


async def published_paused(c: Cluster, coll: Collection, checkpoint_id: str) -> dict:
    """Prepare, commit and publish, but leave every participant paused (the test resumes them)."""
    result = await coll.checkpoint(c.session, checkpoint_id, resume=False)
    assert result["published"], result
    return result


def past_cut(rng, lo: int, hi: int, checkpoint: dict) -> int:
    """How many boundaries to wait for after a cut: a random number, but never more than the rollouts
    still running can write. Each continued rollout writes at least one (the turn it was parked in);
    asking for more could wait for rollouts that have all finished."""
    return min(rng.randint(lo, hi), checkpoint["continued"])


async def restored_attempts(c: Cluster, prefix: str, checkpoint_id: str) -> list:
    return await c.rows("SELECT rollout_id, attempt, status, origin_position FROM rollbook.attempts "
                        "WHERE rollout_id LIKE :p AND restored_from_checkpoint = :c ORDER BY rollout_id, attempt",
                        p=f"{prefix}-%", c=checkpoint_id)


# ---- 1. during a model call ----------------------------------------------------------------------

@pytest.mark.parametrize("upstream", [False, True], ids=["scripted", "vllm-upstream"])
async def test_kill_during_a_model_call_restores_the_earlier_checkpoint(cluster_factory, rng, upstream: bool) -> None:
    # Slow tokens: a call lasts hundreds of ms, so the kill that follows its detection lands inside it.
    c = await cluster_factory(token_latency_s=0.025, upstream=upstream)
    coll, run = await launch(c, rng, "call")
    await c.wait_count("call", "mutation_applied", rng.randint(1, 3))  # sessions have state to restore
    ck = await published(c, coll, "call-ck1")
    assert ck["continued"] > 0, ck
    # The rollouts run on past the cut; the crash comes while a later call is being generated.
    await c.wait_count("call", "call_completed", rng.randint(0, 1), after=ck["position"])
    if upstream:
        # A call the probe finds may be at its last token and complete before the kill (half a second
        # after the stall was not always enough on a loaded machine). A stream the stalled upstream holds
        # before its next step cannot complete: once one waits there, a call is in flight until the kill.
        await c.upstream_stall(True)
        await c.stalled_call()
    await c.call_in_flight("call", after=ck["position"])
    await asyncio.sleep(rng.uniform(0, 0.02))
    await c.crash(run)
    if upstream:
        await c.upstream_stall(False)
    cut_off = await c.rows("SELECT call_id FROM rollbook.model_calls WHERE rollout_id LIKE 'call-%' "
                           "AND status = 'accepted' AND accepted_position > :a", a=ck["position"])
    assert cut_off, "the crash did not land during a model call"

    await c.start()
    restored = await coll.restore(c.session, "call-ck1")
    assert restored["continued"] == ck["continued"]
    await finish(c, coll)
    print(await assert_invariants(c, coll), f"calls cut off: {len(cut_off)}")


# ---- 2. mid tool call ------------------------------------------------------------------------------

# Replies asking for tools whose tool round never reached its after_turn boundary in that attempt.
OPEN_TOOL_ROUNDS = """
SELECT c.rollout_id, c.data->>'call_id' AS call_id FROM rollbook.episode_history c
WHERE c.rollout_id LIKE :p AND c.kind = 'call_completed' AND c.attempt = 0
  AND jsonb_typeof(c.data->'reply'->'tool_calls') = 'array'
  AND NOT EXISTS (SELECT 1 FROM rollbook.episode_history b WHERE b.rollout_id = c.rollout_id AND b.attempt = c.attempt
                  AND b.kind = 'agent_boundary' AND b.data->>'state' = 'after_turn' AND b.position > c.position)
"""
# Mutations applied whose tool round never reached its boundary: the agent never saw them.
UNSEEN_MUTATIONS = """
SELECT m.rollout_id, (m.data->>'revision')::int AS revision FROM rollbook.episode_history m
WHERE m.rollout_id LIKE :p AND m.kind = 'mutation_applied' AND m.attempt = 0 AND m.position > :a
  AND NOT EXISTS (SELECT 1 FROM rollbook.episode_history b WHERE b.rollout_id = m.rollout_id AND b.attempt = m.attempt
                  AND b.kind = 'agent_boundary' AND b.data->>'state' = 'after_turn' AND b.position > m.position)
"""


async def test_kill_the_resources_server_mid_tool_call_then_all_others(cluster_factory, rng) -> None:
    """The replies a checkpoint held are released together at resume, and their tool calls reach the
    resources server at once: it is SIGKILLed in the middle of that burst, the others a little later."""
    c = await cluster_factory(token_latency_s=0.004)
    coll, run = await launch(c, rng, "tool", n=9, envs=["workplace", "workplace", "blackjack"])
    # Past their first (reading) turn, most agents' next reply asks for a change (send_email, hit...);
    # the calls in flight when prepare starts complete during it and their replies are held.
    later, flying, changed = rng.randint(3, 6), rng.randint(3, 5), rng.randint(1, 3)
    await c.wait_for("agents past their first turn, waiting on the model", lambda: c.scalar(
        "SELECT (SELECT count(*) FROM rollbook.episode_history WHERE rollout_id LIKE 'tool-%' AND kind = 'agent_boundary' "
        "AND data->>'state' = 'before_model' AND (data->>'turn')::int >= 1) >= :n AND (SELECT count(*) FROM "
        "rollbook.model_calls WHERE rollout_id LIKE 'tool-%' AND status = 'accepted') >= :f AND (SELECT count(*) FROM "
        "rollbook.episode_history WHERE rollout_id LIKE 'tool-%' AND kind = 'mutation_applied') >= :m",
        n=later, f=flying, m=changed))
    ck = await published_paused(c, coll, "tool-ck1")
    for kind in ("resources", "agent"):  # the coordinator's resume order, up to the model
        await c.control(kind, "resume", "tool-ck1")
    await c.control("model", "resume", "tool-ck1")  # the held replies go out; their tool calls follow
    await c.wait_count("tool", "mutation_applied", 1, after=ck["position"])  # the burst has reached resources
    await c.kill(["resources"])
    await c.control("environment", "resume", "tool-ck1")
    # The others carry on against a dead resources server until some agent's tool round is cut off
    # (usually one of the burst; else the next agent that asks for a tool), then die too.
    await c.wait_for("a tool round cut off", lambda: c.rows(OPEN_TOOL_ROUNDS, p="tool-%"))
    await asyncio.sleep(rng.uniform(0, 0.1))
    await c.crash(run)
    open_rounds = await c.rows(OPEN_TOOL_ROUNDS, p="tool-%")
    unseen = await c.rows(UNSEEN_MUTATIONS, p="tool-%", a=ck["position"])

    await c.start()
    await coll.restore(c.session, "tool-ck1")
    await finish(c, coll)
    print(await assert_invariants(c, coll),
          f"tool rounds cut off: {len(open_rounds)}, mutations applied but never seen by the agent: {len(unseen)}")


# ---- 3. during prepare ------------------------------------------------------------------------------

async def test_kill_during_prepare_restores_the_previous_published_checkpoint(cluster_factory, rng) -> None:
    c = await cluster_factory(token_latency_s=0.01)
    coll, run = await launch(c, rng, "prep")
    await c.wait_count("prep", "agent_boundary", rng.randint(4, 12))
    ck1 = await published(c, coll, "prep-ck1")
    await c.wait_count("prep", "agent_boundary", past_cut(rng, 2, 8, ck1), after=ck1["position"])
    await c.call_in_flight("prep", after=ck1["position"])  # so the model has a call to drain in prepare
    # Prepare runs participant by participant; the crash lands at the k-th: just before it is
    # told, or while it prepares. Those after it are never told.
    k = rng.randrange(len(PREPARE_ORDER))
    during = rng.random() < 0.5
    print(f"crash {'while' if during else 'before'} {PREPARE_ORDER[k]} prepares")
    coord, gates = c.gated("prepare", held=PREPARE_ORDER[k:])
    prepare = asyncio.create_task(coord.prepare("prep-ck2", time.time() + 30))
    await asyncio.wait_for(gates[PREPARE_ORDER[k]].reached.wait(), 30)
    if during:
        gates[PREPARE_ORDER[k]].opened.set()
        await asyncio.sleep(rng.uniform(0, 0.05))
    await c.crash(run, prepare)  # the coordinator dies too: nobody aborts ck2
    # 'prepared' only when the last participant was let through and answered before the kill.
    assert await c.phase("prep-ck2") in (("started", "prepared") if during and k == len(PREPARE_ORDER) - 1 else ("started",))
    assert await coll.latest_published() == "prep-ck1"

    await c.start()
    with pytest.raises(InvalidCheckpointState):
        await coll.restore(c.session, "prep-ck2")  # never committed: refused before anything is staged
    restored = await coll.restore(c.session, "prep-ck1")
    assert restored["continued"] == ck1["continued"]
    await finish(c, coll)
    print(await assert_invariants(c, coll))


# ---- 4. during commit ---------------------------------------------------------------------------------

async def test_kill_during_commit_leaves_no_committed_record_and_restores_the_previous_checkpoint(cluster_factory, rng) -> None:
    """Some participants have acknowledged the commit, the others not yet, when everything dies.

    The commit is recorded only once every participant accepted it (it used to be logged
    first), so the log still says `prepared`: the checkpoint cannot be restored, whoever notices its
    lease ran out aborts it, and the framework restores its previous published checkpoint."""
    c = await cluster_factory(token_latency_s=0.008)
    coll, run = await launch(c, rng, "commit")
    await c.wait_count("commit", "agent_boundary", rng.randint(4, 12))
    ck1 = await published(c, coll, "commit-ck1")
    await c.wait_count("commit", "agent_boundary", past_cut(rng, 2, 8, ck1), after=ck1["position"])
    acknowledged = rng.sample(KINDS, rng.randint(0, len(KINDS) - 1))
    print(f"participants that acknowledge the commit before the crash: {acknowledged}")
    coord, gates = c.gated("commit", held=[k for k in KINDS if k not in acknowledged])
    prepared = await coord.prepare("commit-ck2", time.time() + 30)
    assert prepared["ready"], prepared
    commit = asyncio.create_task(coord.commit("commit-ck2", time.time() + 30))

    async def fanned_out() -> bool:
        return all(g.answered.is_set() if k in acknowledged else g.reached.is_set() for k, g in gates.items())

    await c.wait_for("the commit fan-out", fanned_out)
    await c.crash(run, commit)
    assert await c.phase("commit-ck2") == "prepared"
    with pytest.raises(InvalidCheckpointState, match="never committed"):
        await load_cut(c.store, "commit-ck2")
    assert await abort_expired(c.store, now=time.time() + 60) == ["commit-ck2"]  # its lease has run out by then
    assert await c.phase("commit-ck2") == "aborted"

    await c.start()
    restored = await coll.restore(c.session, await coll.latest_published())
    assert restored["checkpoint_id"] == "commit-ck1" and restored["continued"] == ck1["continued"]
    await finish(c, coll)
    print(await assert_invariants(c, coll))


# ---- 5. during restore --------------------------------------------------------------------------------

async def test_kill_during_restore_then_restore_again_installs_once(cluster_factory, rng) -> None:
    c = await cluster_factory(token_latency_s=0.006)
    coll, run = await launch(c, rng, "rest")
    await c.wait_count("rest", "mutation_applied", rng.randint(2, 5))
    ck = await published(c, coll, "rest-ck1")
    await c.wait_count("rest", "agent_boundary", past_cut(rng, 1, 4, ck), after=ck["position"])
    await c.crash(run)

    # (a) Crash while the fresh processes stage the cut: one of them has not been told yet.
    await c.start()
    held = rng.choice(KINDS)
    print(f"restore crashes before {held} is told")
    coord, gates = c.gated("restore", held=[held])
    restore = asyncio.create_task(coord.restore("rest-ck1", time.time() + 60))

    async def staged() -> bool:
        return all(g.reached.is_set() if k == held else g.answered.is_set() for k, g in gates.items())

    await c.wait_for("the other participants to stage", staged)
    await c.crash(restore)
    assert not await restored_attempts(c, "rest", "rest-ck1"), "a restore that never finished installed attempts"

    # (b) Crash after the install, before resume: the installed attempts never ran.
    await c.start()
    installed = await Coordinator(c.store, list(c.participants().values())).restore("rest-ck1", time.time() + 60)
    first = await restored_attempts(c, "rest", "rest-ck1")
    assert len(first) == installed["continued"] + installed["fresh_dispatch"] > 0
    await c.crash()

    # (c) Fresh processes again: the same checkpoint restores, installs once more, and finishes.
    await c.start()
    final = await coll.restore(c.session, "rest-ck1")
    assert final["continued"] == installed["continued"] == ck["continued"]
    await finish(c, coll)
    print(await assert_invariants(c, coll))

    after = await restored_attempts(c, "rest", "rest-ck1")
    per_rollout: dict[str, list] = {}
    for a in after:
        per_rollout.setdefault(a.rollout_id, []).append(a)
    assert {r: len(v) for r, v in per_rollout.items()} == {a.rollout_id: 2 for a in first}, \
        "each completed restore installs exactly one attempt per rollout of the cut"
    for a in first:
        kinds = [k for (k,) in await c.rows("SELECT kind FROM rollbook.episode_history WHERE rollout_id = :r "
                                            "AND attempt = :a ORDER BY position", r=a.rollout_id, a=a.attempt)]
        assert kinds == ["attempt_started", "attempt_fenced"], (a.rollout_id, a.attempt, kinds)
        second = per_rollout[a.rollout_id][1]
        assert second.attempt == a.attempt + 1 and second.origin_position == a.origin_position


# ---- 6. twice in a row --------------------------------------------------------------------------------

async def test_crash_again_before_the_replacements_finish(cluster_factory, rng) -> None:
    c = await cluster_factory(token_latency_s=0.006)
    coll, run = await launch(c, rng, "twice", n=10)
    await c.wait_count("twice", "mutation_applied", rng.randint(1, 4))
    ck1 = await published(c, coll, "twice-ck1")
    await c.wait_count("twice", "agent_boundary", past_cut(rng, 1, 4, ck1), after=ck1["position"])
    await c.crash(run)

    # Crash 2: the attempts restored from ck1 are still running; restore the same checkpoint again.
    await c.start()
    await coll.restore(c.session, "twice-ck1")
    head = await c.head()
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("twice", "agent_boundary", rng.randint(1, 2), after=head, attempt=1)
    await c.crash(run)
    live = [a for a in await restored_attempts(c, "twice", "twice-ck1") if a.status == "live"]
    assert live, "every replacement had finished before the second crash"

    await c.start()
    await coll.restore(c.session, "twice-ck1")
    head = await c.head()
    run = asyncio.create_task(coll.dispatch(c.session))
    # Crash 3: a newer checkpoint is taken while the second replacements run, then everything dies.
    await c.wait_count("twice", "agent_boundary", rng.randint(0, 2), after=head, attempt=2)
    ck2 = await published(c, coll, "twice-ck2")
    await c.wait_count("twice", "agent_boundary", rng.randint(0, 2), after=ck2["position"])
    await c.crash(run)

    await c.start()
    assert await coll.latest_published() == "twice-ck2"
    await coll.restore(c.session, "twice-ck2")
    await finish(c, coll)
    print(await assert_invariants(c, coll))
    depth = await c.scalar("SELECT max(attempt) FROM rollbook.attempts WHERE rollout_id LIKE 'twice-%' "
                           "AND restored_from_checkpoint = 'twice-ck2' AND origin_position IS NOT NULL")
    print(f"deepest continued attempt: {depth}")


# ---- 7. an episode that finishes during prepare -------------------------------------------------------

async def test_an_episode_finishing_during_a_checkpoint_is_neither_lost_nor_redone(cluster_factory, rng) -> None:
    """Episodes whose last request (verify, which closes the session with it) is under way when a
    checkpoint is taken.

    Prepare waits for no step, so a verify in flight finishes during the checkpoint: at or before P
    (the cut has the rollout completed) or after it (the cut continues it from its boundary before
    verify, and the reply waits for resume). A verify is refused (and retried) while the resources
    server's admission is closed: we hold it with its own control plane, let the math episodes into
    verify, release it and take the real checkpoint while their retries come in. Either way, after a
    crash and a restore of that checkpoint each ends finished once, with its result."""
    c = await cluster_factory(token_latency_s=0.01)
    base = make_tasks(N, rng.randrange(1 << 20), ["math", "workplace", "math", "blackjack"])
    # A non-integer answer that integer arithmetic never produces: every math verify fails (reward 0).
    tasks = [Task(t.env, t.task_id, t.prompt, {**t.params, "answer": 0.5}) if t.env == "math" else t for t in base]
    # The model is held from the start, so no episode gets past its seed (the agent's first call
    # waits) until the resources server is held too: every math episode then stops at verify, however
    # slowly this test's probes run. Each hold is a prepare on a server's own control plane.
    await c.control("model", "prepare", "fin-hold-m")
    coll, run = await launch(c, rng, "fin", tasks=tasks)
    math = [coll.rollout_id(i) for i, t in enumerate(tasks) if t.env == "math"]

    async def steps(want: tuple[str, ...]) -> bool:
        eps = [await c.episode(r) for r in math]
        return all(e.get("step") in want and e.get("status") == "running" for e in eps)

    async def seeded() -> bool:
        return await c.scalar("SELECT count(*) FROM rollbook.episode_history WHERE rollout_id LIKE 'fin-%' "
                              "AND kind = 'episode_step' AND data->>'step' = 'seed'") == N

    await c.wait_for("every session open", seeded)
    await c.control("resources", "prepare", "fin-hold-r1")  # verify and mutations now wait
    await c.control("model", "resume", "fin-hold-m")  # the agents' turns run, up to verify
    await c.wait_for("math episodes in verify", lambda: steps(("verify",)))
    await c.control("resources", "resume", "fin-hold-r1")  # each verify goes through at its next retry...
    ck = await coll.checkpoint(c.session, "fin-ck1", resume=False)  # ...while this checkpoint is taken
    assert ck["published"], ck
    cut, _ = await load_cut(c.store, "fin-ck1")
    ended = {r.rollout_id: r for r in await c.rows(
        "SELECT rollout_id, attempt, status, ended_position FROM rollbook.attempts WHERE rollout_id LIKE 'fin-%'")}
    scoped = {s.rollout_id for s in cut.scope}
    before, after = [], []
    for rid in math:
        a = ended[rid]
        if a.status == "finished" and a.ended_position <= cut.position:
            assert rid not in scoped | {r for r, _ in cut.fresh}, (rid, a)  # complete at P: neither continued nor restarted
            before.append(rid)
        else:  # still in verify at P: continued from its boundary before verify
            assert rid in scoped, (rid, a, cut.position)
            after.append(rid)
    print(f"math episodes finished at or before P: {len(before)}, after it: {len(after)}")
    assert cut.scope, "nothing was live at the cut: the test lost its other rollouts"

    await c.crash(run)
    await c.start()
    assert await coll.latest_published() == "fin-ck1"
    await coll.restore(c.session, "fin-ck1")
    await finish(c, coll)
    print(await assert_invariants(c, coll))
    for rid in math:  # asked again, each answers its recorded result, not a second run
        async with c.session.post(c.config.url("environment") + "/episodes", json={
                "rollout_id": rid, "task": coll.tasks[int(rid.rsplit("-", 1)[1])].to_json()},
                headers={"Authorization": f"Bearer {c.config.data_token}"}) as resp:
            assert resp.status == 200 and (await resp.json())["attempt"] == (0 if rid in before else 1)
    rows = await c.rows("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') AS finished, "
                        "max(attempt) AS last, max(reward) AS reward FROM rollbook.attempts "
                        "WHERE rollout_id = ANY(:r) GROUP BY rollout_id", r=math)
    # One finish each in the lineage a restore keeps: attempt 0's after P is history, fenced by the restore.
    assert {r.rollout_id: (r.last, r.reward) for r in rows} == {r: (0 if r in before else 1, 0.0) for r in math}
    late = await c.scalar("SELECT count(*) FROM rollbook.episode_history WHERE rollout_id = ANY(:r) AND position > :p",
                          r=before, p=cut.position)
    assert late == 0, "a rollout finished by the cut was touched after it"


# ---- regressions: bugs this suite found ---------------------------------------------------------

async def test_a_newer_cut_before_the_replacing_call_was_admitted_still_links_the_reply(cluster_factory, rng) -> None:
    # The continued agent's replacing call is refused (model admission closed) and a newer cut is
    # taken at the same boundary: the next restore must still link the reply of attempt 0's call.
    c = await cluster_factory(token_latency_s=0.006)
    coll, run = await launch(c, rng, "chain", n=6, envs=["workplace"])
    await c.wait_count("chain", "agent_boundary", rng.randint(4, 8))
    await published(c, coll, "chain-ck1")  # each agent is held at a before_model boundary, its reply completed
    await c.crash(run)
    await c.start()
    await Coordinator(c.store, list(c.participants().values())).restore("chain-ck1", time.time() + 60)
    for kind in ("resources", "agent", "model"):  # resume in the coordinator's order, but keep the model closed
        await c.control(kind, "resume", "chain-ck1")
    await c.control("model", "prepare", "chain-hold")
    await c.control("environment", "resume", "chain-ck1")  # the continued agents ask to replace their calls

    async def refused() -> bool:  # every continued agent has been refused a few times and is backing off
        row = (await c.rows(
            "SELECT count(*) AS agents, count(*) FILTER (WHERE n < 3) AS pending FROM (SELECT b.rollout_id, "
            "(SELECT count(*) FROM rollbook.episode_history x WHERE x.rollout_id = b.rollout_id AND x.attempt = 1 "
            "AND x.kind = 'call_excluded') AS n FROM (SELECT DISTINCT rollout_id FROM rollbook.episode_history "
            "WHERE rollout_id LIKE 'chain-%' AND attempt = 1 AND kind = 'agent_boundary') b) t"))[0]
        return row.agents > 0 and row.pending == 0

    await c.wait_for("the replacing calls to be refused", refused)
    await c.control("model", "resume", "chain-hold")
    await published(c, coll, "chain-ck2")  # the agents are still at their first boundary: that is the cut
    await c.crash()
    await c.start()
    await coll.restore(c.session, "chain-ck2")
    await finish(c, coll)
    await assert_invariants(c, coll)


async def test_a_rollout_dispatched_after_the_cut_finishes_after_restore(cluster_factory, rng) -> None:
    # An attempt the cut never saw must be fenced and started afresh by the restore.
    c = await cluster_factory(token_latency_s=0.006)
    tasks = make_tasks(6, rng.randrange(1 << 20), ["workplace", "blackjack"])
    # As a framework with a concurrency limit does: all six are its rollouts (the checkpoint names
    # them all), the first four are dispatched before the cut, the last two only after it.
    first, run = await launch(c, rng, "late", tasks=tasks[:4])
    coll = c.collection("late", tasks, seed=first.seed)
    await c.wait_count("late", "agent_boundary", rng.randint(2, 6))
    ck = await published(c, coll, "late-ck1")
    later = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("late", "episode_started", 2, after=ck["position"])
    await c.crash(run, later)
    await c.start()
    await coll.restore(c.session, "late-ck1")
    await finish(c, coll, timeout=60)
    await assert_invariants(c, coll)
