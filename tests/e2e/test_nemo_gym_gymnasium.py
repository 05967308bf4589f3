"""NeMo Gym 0.7.0's gymnasium-style servers (`/reset`, `/step`), unchanged, driven by NeMo Gym's own
`gymnasium_agent`, unchanged, under rollbook, through a SIGKILL of everything.

The resources server relays NeMo Gym's `example_multi_turn_gymnasium` (a scripted user: each step
answers with the row's next follow-up, the last one scores the model's answer); the agent server runs
`gymnasium_agent` (a `[nemo_gym_agent.gymnasium]` table naming only its module and `continuation`),
sent each task's row on its `/run`. The agent resets the server and steps it once a model turn, each
call on rollbook's routes under the activation's capture path: every model call, reset and step is in
the log, the session is never seeded (the server has no `/seed_session`), and the reward is the sum of
the recorded steps' rewards (the server has no `/verify`).

Killed mid-episode and dispatched again, each rollout ends with the reward and the steps of an
uninterrupted run, no call applied twice in any live session, read through SQL. The
rows are the server's five example rows and two of ours that rollbook's scripted model answers right
(it computes the first user message's arithmetic), so a reward of 1 is seen to travel. A task of such a
server run by rollbook's own agent, which never steps it, fails with a reason instead of scoring 0.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from apps.collection import Collection
from apps.nemo_gym_install import install
from apps.nemo_gym_tasks import convert
from apps.processes import free_port
from participants.environments import Task
from participants.environments.gymnasium import GYMNASIUM_AGENT
from tests.e2e.conftest import Cluster, effective, history
from tests.e2e.test_nemo_gym_resources import TWICE_IN_ONE_LIVE_SESSION, example_tasks, gym
from tests.e2e.test_nemo_gym_simple_agent import agent

pytestmark = pytest.mark.timeout(900)

SERVER = "example_multi_turn_gymnasium"
OURS = ['{"responses_create_params": {"input": [{"role": "user", "content": "What is 15 * 8?"}]}, '
        '"follow_ups": ["Show your working."], "expected_answer": "120"}',
        '{"responses_create_params": {"input": "What is 7 + 5?"}, "follow_ups": [], "expected_answer": "12"}']


@pytest.fixture(scope="module")
def gym_python() -> Path:
    return install()[0]


def tasks(python: Path) -> list[Task]:
    rows = example_tasks(python, "gym_turns", SERVER) + convert(OURS, "ours.jsonl", "gym_turns")
    return [replace(t, task_id=f"{i}-{t.task_id}", agent="gymnasium") for i, t in enumerate(rows)]


async def steps(c: Cluster, coll: Collection) -> dict[int, tuple[float, list[tuple[str, Any]]]]:
    """Each task's reward, and the calls the finishing lineage relayed: reset, then each step's reward."""
    events = await history(c, coll.run_id)
    out = {}
    for i in range(len(coll.tasks)):
        rid = coll.rollout_id(i)
        row = (await c.rows("SELECT attempt, reward FROM rollbook.attempts WHERE rollout_id = :r AND status = 'finished'",
                            r=rid))[0]
        calls = [(e.data["tool"], e.data["effect"].get("reward")) for e in effective(events.get(rid, []), row.attempt)
                 if e.kind == "mutation_applied"]
        out[i] = (float(row.reward), calls)
    return out


async def gymnasium_cluster(cluster_factory: Callable[..., Awaitable[Cluster]], python: Path, tmp_path: Path,
                            server: str = SERVER) -> Cluster:
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / "gym.log")
    return await cluster_factory(token_latency_s=0.02, nemo_gym={
        "gym_turns": gym(python, "replay", free_port(), module=f"resources_servers.{server}.app")},
        nemo_gym_agent={"gymnasium": agent(GYMNASIUM_AGENT)})


async def test_gymnasium_agent_on_a_gymnasium_server_is_continued_through_a_sigkill_with_the_same_rewards(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    c = await gymnasium_cluster(cluster_factory, gym_python, tmp_path)
    work = tasks(gym_python)
    base = c.collection("uninterrupted", work, seed=3)
    await asyncio.wait_for(base.dispatch(c.session), 300)
    uninterrupted = await steps(c, base)
    for reward, calls in uninterrupted.values():
        assert calls[0] == ("reset", None) and [name for name, _ in calls[1:]] == ["step"] * (len(calls) - 1), calls
        assert reward == sum(r for _, r in calls[1:]), (reward, calls)
    assert {len(calls) for _, calls in uninterrupted.values()} == {2, 3, 4}  # follow-ups: none, one, two
    assert [r for r, _ in uninterrupted.values()][-2:] == [1.0, 1.0], uninterrupted  # our two rows, answered right
    models = await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE "
                            "'uninterrupted-%'")
    assert models == sum(len(calls) - 1 for _, calls in uninterrupted.values())  # one model call a step, each recorded

    coll = c.collection("killed", work, seed=3)
    first = asyncio.create_task(coll.dispatch(c.session))
    async def stepped() -> bool:  # some rollouts have a step recorded and more to come: the kill meets them there
        return await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind = 'mutation_applied' AND rollout_id "
                              "LIKE 'killed-%' AND data->>'tool' = 'step'") >= 3
    await c.wait_for("3 steps of the killed run", stepped, 120)
    await c.crash(first)  # every server's process group: gymnasium_agent and the NeMo Gym server with them
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    # The rewards, and each rollout's reset and steps (name, reward) in order: an activation cut off by the
    # kill runs again only under a new attempt, where its reset is answered from the record.
    killed = await steps(c, coll)
    assert killed == uninterrupted, (killed, uninterrupted)
    finished = await c.rows("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') AS n FROM rollbook.attempts "
                            "WHERE rollout_id LIKE 'killed-%' GROUP BY 1")
    assert len(finished) == len(work) and all(r.n == 1 for r in finished), finished
    assert not await c.rows("SELECT stream FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE "
                            "'killed-%' GROUP BY stream HAVING count(*) > 1")  # no model call completed twice
    continued = await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind = 'rollout_recovered' AND rollout_id "
                               "LIKE 'killed-%' AND data->>'disposition' = 'continue'")
    assert continued >= 1  # the kill met rollouts mid-episode, and they went on from their log
    # gymnasium_agent, run again from its start, steps with the model's recorded replies, which the model
    # server delivers under the new calls' ids: each step still asks what the record holds at its place,
    # so it is answered from there, and no rollout starts over on a divergence.
    assert not await c.rows("SELECT data FROM rollbook.events WHERE kind = 'tool_call_diverged' AND rollout_id LIKE "
                            "'killed-%'")
    replayed = await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE "
                              "'killed-%' AND data->>'disposition' = 'linked'")
    assert replayed >= 1  # a step was asked again with a reply delivered from the record
    assert not await c.rows(TWICE_IN_ONE_LIVE_SESSION, p="killed-%")


async def test_a_gymnasium_server_under_rollbooks_own_agent_fails_with_its_reason_not_a_zero(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    """Input: a task of the gymnasium server with no `agent`: rollbook's own agent answers and never steps it."""
    c = await gymnasium_cluster(cluster_factory, gym_python, tmp_path)
    task = replace(tasks(gym_python)[-1], agent=None)
    coll = c.collection("own", [task], seed=3)
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    fence = await c.rows("SELECT data FROM rollbook.episode_history WHERE kind = 'attempt_fenced' AND rollout_id LIKE 'own-%'")
    assert fence and fence[0].data["code"] == "gym_server_failed", fence
    assert "gymnasium_agent" in fence[0].data["detail"] and fence[0].data["context"]["stage"] == "verify", fence[0].data
    assert not await c.rows("SELECT 1 FROM rollbook.attempts WHERE rollout_id LIKE 'own-%' AND status = 'finished'")


async def test_a_gymnasium_server_that_deals_at_random_starts_its_rollouts_over_after_a_sigkill(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    """NeMo Gym's `blackjack` deals from an unseeded generator at `/reset`, so a live session lost to the
    kill cannot be rebuilt by sending its reset again. Each rollout the kill met mid-hand records why
    (`session_replay_failed`) and starts over from its input; gymnasium_agent's own failure (a 500 on its
    `/run`, after its step was refused) is not taken as the agent's error, and every rollout finishes once."""
    c = await gymnasium_cluster(cluster_factory, gym_python, tmp_path, server="blackjack")
    work = [replace(t, task_id=f"{i}-{t.task_id}", agent="gymnasium")
            for i, t in enumerate(example_tasks(gym_python, "gym_turns", "blackjack"))]
    coll = c.collection("dealt", work, seed=3)
    first = asyncio.create_task(coll.dispatch(c.session))

    async def dealt() -> bool:  # hands dealt and not all played: the kill meets some mid-hand
        return await c.scalar("SELECT count(*) FROM rollbook.events WHERE kind = 'mutation_applied' AND rollout_id "
                              "LIKE 'dealt-%' AND data->>'tool' = 'reset'") >= 2
    await c.wait_for("2 hands dealt", dealt, 120)
    await c.crash(first)
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    failed = await c.rows("SELECT rollout_id, data FROM rollbook.events WHERE kind = 'attempt_fenced' AND rollout_id "
                          "LIKE 'dealt-%' AND data->>'reason' = 'failed'")
    assert not failed, failed
    rebuilds = await c.rows("SELECT DISTINCT rollout_id, attempt FROM rollbook.events WHERE kind = 'session_replay_failed' "
                            "AND rollout_id LIKE 'dealt-%'")
    assert rebuilds  # the kill met a hand in play, and its reset dealt other cards when sent again
    over = {(r.rollout_id, r.attempt) for r in await c.rows(
        "SELECT rollout_id, attempt FROM rollbook.events WHERE kind = 'rollout_recovered' AND rollout_id LIKE 'dealt-%' "
        "AND data->>'disposition' = 'fresh_dispatch' AND data->>'reason' = 'replay_divergence'")}
    assert {(r.rollout_id, r.attempt) for r in rebuilds} <= over, (rebuilds, over)
    finished = await c.rows("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') AS n FROM rollbook.attempts "
                            "WHERE rollout_id LIKE 'dealt-%' GROUP BY 1")
    assert len(finished) == len(work) and all(r.n == 1 for r in finished), finished
