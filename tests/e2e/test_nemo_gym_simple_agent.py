"""NeMo Gym 0.7.0's own `simple_agent`, unchanged, as the agent of rollbook's rollouts: continued by
replay after everything is SIGKILLed, and restarted fresh when an agent asks something else.

The config names it in a `[nemo_gym_agent.simple]` table (continuation `replay`); the agent server
starts it with NeMo Gym's Python (the cached NeMo Gym environment) the way `ng_run` starts a server,
its model server and resources server being rollbook's. Rollouts are dispatched to the environment
server as a framework dispatches them (`POST /episodes`), each task naming the agent: the episode
seeds rollbook's workplace session, the agent server forwards the activation to simple_agent's
`/ng-rollout/<capture>/v1/responses`, and simple_agent asks the model at that path and calls each
tool as `POST /<tool>` with the capture's cookie. It names no call, so rollbook numbers them
(engine.agent_replay). The model is the fake vLLM in its own process, which counts what it generates.

One rollout runs uninterrupted: two reads, a change, an answer. A second, with the same task, has its
upstream stalled after the change, its last model call in flight, then every rollbook server (the
agent server's simple_agent with it) is SIGKILLed. Dispatched again on fresh processes, the agent
server finds the activation cut off after it made calls: the rollout goes on under attempt 1 from all
of attempt 0 and simple_agent runs from the start, answered from the log. Its reward, conversation and
tool calls equal the uninterrupted run's; the upstream generated each recorded call once; the change
was applied once. The same again with NeMo Gym's own collector (`ng_collect_rollouts`) dispatching a
row of NeMo Gym's own Workplace Assistant server (relayed, and SIGKILLed with the rest), the
collector retrying on its own across the kill.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import apps.config as cfg
from apps.nemo_gym_install import WORKPLACE, install
from apps.processes import free_port
from participants.environments.tasks import make_task
from testkit.nemo_gym_collector import gym_venv, spawn, stop, wait_http
from tests.e2e.conftest import Cluster
from tests.e2e.test_nemo_gym import ROLLBOOK_HOST, gym_env
from tests.e2e.test_nemo_gym_resources import TWICE_IN_ONE_LIVE_SESSION, example_tasks
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(900)
SEED = 11
GYM_SERVERS = Path(__file__).resolve().parents[1] / "gym_servers"


def agent(module: str = "responses_api_agents.simple_agent.app", paths: list[str] | None = None) -> cfg.NemoGymAgentConfig:
    return cfg.NemoGymAgentConfig(module=module, continuation="replay", python=str(gym_venv() / "bin" / "python"),
                                  paths=paths or [])


async def dispatch(cluster: Cluster, rollout: str, task: dict[str, Any]) -> dict[str, Any]:
    """A framework's dispatch: the reply comes when the episode is over."""
    body = {"rollout_id": rollout, "task": task, "seed": SEED, "max_steps": 12}
    async with cluster.session.post(cluster.config.url("environment") + "/episodes", json=body,
                                    headers={"Authorization": f"Bearer {cluster.config.data_token}"}) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        return dict(json.loads(text))


async def generated(cluster: Cluster) -> int:
    async with cluster.session.get(f"{cluster.upstream}/fake/requests") as resp:
        return int((await resp.json())["requests"])


async def crash_with_a_call_in_flight(cluster: Cluster, rollout: str, *driver: asyncio.Task[Any], answered: int = 3) -> None:
    """After the rollout's first change, its upstream stalled and the call after its `answered` ones in
    flight: SIGKILL every rollbook server (simple_agent in the agent server's process group, a NeMo Gym
    resources server in the resources server's)."""
    await eventually("the crashing run's change applied", lambda: cluster.scalar(
        "SELECT count(*) = 1 FROM rollbook.events WHERE rollout_id LIKE :r AND kind = 'mutation_applied'", r=rollout))
    await cluster.upstream_stall(True)
    await eventually("its next call in flight", lambda: cluster.scalar(
        "SELECT count(*) FILTER (WHERE kind = 'call_accepted') = :n + 1 AND count(*) FILTER (WHERE kind = 'call_completed') = :n "
        "FROM rollbook.events WHERE rollout_id LIKE :r", r=rollout, n=answered))
    await cluster.crash(*driver)
    await cluster.upstream_stall(False)


async def same_run(cluster: Cluster, clean: str, crashed: str, clean_calls: int, generated_since: int) -> None:
    """The crashed rollout continued by replay ends as the clean one did, nothing generated or applied twice."""
    assert await conversation(cluster, crashed) == await conversation(cluster, clean)
    recovered = await cluster.rows("SELECT attempt, data->>'disposition', data->>'boundary' FROM rollbook.events "
                                   "WHERE rollout_id = :r AND kind = 'rollout_recovered'", r=crashed)
    assert [tuple(r) for r in recovered] == [(0, "continue", None)]  # from all of attempt 0
    # Each recorded call generated once: the one in flight at the kill, never recorded, was asked again.
    assert generated_since == clean_calls + 1
    replayed = await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = :r AND attempt = 1 "
                                    "AND kind = 'call_completed' AND data->>'disposition' = 'linked'", r=crashed)
    assert replayed == 3
    # The change was applied once, by attempt 0; attempt 1's same call got its recorded answer.
    assert await cluster.scalar("SELECT string_agg(attempt || ':' || (data->>'tool_call'), ',') FROM rollbook.events "
                                "WHERE rollout_id = :r AND kind = 'mutation_applied'", r=crashed) == "0:a0.s2"


async def conversation(cluster: Cluster, rollout: str) -> list[tuple[Any, ...]]:
    """The finished attempt's conversation as the model and the tools saw it, less the calls' ids."""
    messages = await cluster.scalar(
        "SELECT data->'messages' FROM rollbook.events WHERE rollout_id = :r AND kind = 'agent_boundary' "
        "AND attempt = (SELECT attempt FROM rollbook.attempts WHERE rollout_id = :r AND status = 'finished') "
        "ORDER BY position DESC LIMIT 1", r=rollout)
    return [(m["role"], m.get("content"), [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []])
            for m in messages]


async def test_simple_agent_killed_mid_episode_with_every_server_is_continued_by_replay(
        cluster_factory: Callable[..., Awaitable[Cluster]]) -> None:
    # 50 ms a token: a reply takes about two seconds, time to stall the upstream between two calls.
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05, nemo_gym_agent={"simple": agent()})
    task = replace(make_task("workplace", SEED), agent="simple").to_json()
    before = await generated(cluster)
    clean = await dispatch(cluster, "sa-clean", task)
    clean_calls = await generated(cluster) - before
    changes = await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'sa-clean' "
                                   "AND kind = 'mutation_applied'")
    assert clean_calls == 4 and changes == 1 and clean["reward"] == 1.0, clean  # two reads, a change, the answer

    before = await generated(cluster)
    first = asyncio.create_task(dispatch(cluster, "sa-crash", task))
    await crash_with_a_call_in_flight(cluster, "sa-crash", first)
    await cluster.start()
    continued = await dispatch(cluster, "sa-crash", task)

    assert (continued["attempt"], continued["reward"]) == (1, clean["reward"]), continued
    await same_run(cluster, "sa-clean", "sa-crash", clean_calls, await generated(cluster) - before)


def collector_config(cluster: Cluster, head_port: int) -> str:
    """A NeMo Gym config whose tasksets rollbook's environment server runs (docs/nemo-gym.md)."""
    return f"""
head_server:
  host: 127.0.0.1
  port: {head_port}
rollbook_environment:
  environment_servers:
    rollbook:
      host: {ROLLBOOK_HOST}
      port: {cluster.config.servers['environment'].port}
environment_server_routes:
  "sa:clean": rollbook_environment
  "sa:crash": rollbook_environment
"""


async def test_ng_collect_rollouts_drives_simple_agent_on_nemo_gyms_workplace_through_a_sigkill_of_everything(
        cluster_factory: Callable[..., Awaitable[Cluster]], tmp_path: Path) -> None:
    """NeMo Gym's own collector, `ng_collect_rollouts`, sends a row of NeMo Gym's own Workplace Assistant
    (its first example: search the mail, reply) naming the agent `simple` to rollbook's environment
    server; the Workplace server runs unchanged behind the relay (`[nemo_gym.gym_workplace]`, replay).
    Mid-episode every rollbook server, simple_agent and the Workplace server are SIGKILLed; the crashing
    collection retries on its own. The continued rollout ends with the uninterrupted one's reward and
    conversation; the upstream generated each recorded call once; the search, relayed before the kill,
    was replayed into the fresh Workplace session rather than sent twice to one live session."""
    python = install()[0]
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / "workplace.log")
    workplace = cfg.NemoGymConfig(module=WORKPLACE, state="replay", python=str(python), port=free_port())
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05, nemo_gym_agent={"simple": agent()},
                                    nemo_gym={"gym_workplace": workplace})
    task = example_tasks(python, "gym_workplace")[0]
    venv, head_port = gym_venv(), free_port()
    (tmp_path / "gym.yaml").write_text(collector_config(cluster, head_port))
    env = gym_env(cluster, tmp_path)
    overrides = [f"+config_paths=[{tmp_path / 'gym.yaml'}]"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        head = spawn([str(venv / "bin" / "python"), str(Path(__file__).with_name("nemo_gym_head.py")), *overrides],
                     tmp_path / "head.log", tmp_path, env)
        procs.append(head)
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{head_port}/global_config_dict_yaml", head,
                                tmp_path / "head.log", 300)

        def collect(taskset: str) -> subprocess.Popen[bytes]:
            rows = tmp_path / f"{taskset[3:]}.jsonl"
            task_input = {"env": task.env, "prompt": task.prompt, "params": task.params, "agent": "simple"}
            rows.write_text(json.dumps({"task_id": {"taskset": taskset, "task_id": "w0"}, "task_input": task_input}) + "\n")
            proc = spawn([str(venv / "bin" / "ng_collect_rollouts"), *overrides, f"+input_jsonl_fpath={rows}",
                          f"+output_jsonl_fpath={tmp_path / taskset[3:] / 'out.jsonl'}"],
                         tmp_path / f"collector-{taskset[3:]}.log", tmp_path, env)
            procs.append(proc)
            return proc

        async def collected(proc: subprocess.Popen[bytes], taskset: str) -> dict[str, Any]:
            rc = await asyncio.to_thread(proc.wait, 600)
            assert rc == 0, (tmp_path / f"collector-{taskset[3:]}.log").read_text()[-4000:]
            [row] = [json.loads(line) for line in (tmp_path / taskset[3:] / "out.jsonl").read_text().splitlines()]
            return dict(row)

        before = await generated(cluster)
        clean = await collected(collect("sa:clean"), "sa:clean")
        clean_calls = await generated(cluster) - before
        assert clean_calls == 3 and clean["reward"] == 1.0, clean  # a search, a reply, the answer
        before = await generated(cluster)
        crashing = collect("sa:crash")
        await crash_with_a_call_in_flight(cluster, "sa_crash.%", answered=1)  # the search relayed, the reply asked
        await asyncio.sleep(2.0)  # the collector keeps asking a closed port
        await cluster.start()
        continued = await collected(crashing, "sa:crash")

        assert continued["reward"] == clean["reward"], (clean, continued)
        [clean_id, crash_id] = [await cluster.scalar("SELECT DISTINCT rollout_id FROM rollbook.attempts WHERE rollout_id LIKE :p",
                                                     p=f"{prefix}.%") for prefix in ("sa_clean", "sa_crash")]
        assert await conversation(cluster, crash_id) == await conversation(cluster, clean_id)
        recovered = await cluster.rows("SELECT attempt, data->>'disposition', data->>'boundary' FROM rollbook.events "
                                       "WHERE rollout_id = :r AND kind = 'rollout_recovered'", r=crash_id)
        assert [tuple(r) for r in recovered] == [(0, "continue", None)]
        assert await generated(cluster) - before == clean_calls + 1  # the call in flight at the kill, asked again
        assert await cluster.scalar("SELECT string_agg(attempt || ':' || (data->>'tool_call'), ',' ORDER BY position) "
                                    "FROM rollbook.events WHERE rollout_id = :r AND kind = 'mutation_applied'",
                                    r=crash_id) == "0:a0.s0,1:a0.s1"
        assert not await cluster.rows(TWICE_IN_ONE_LIVE_SESSION, p="sa_crash.%")
        replayed = await cluster.rows("SELECT data->'tool_calls' AS calls FROM rollbook.events WHERE rollout_id = :r "
                                      "AND kind = 'session_replayed'", r=crash_id)
        assert [r.calls for r in replayed] == [["a0.s0"]], replayed  # the search, into the fresh Workplace session
    finally:
        for proc in reversed(procs):
            stop(proc)


async def test_simple_agents_calls_wait_while_a_checkpoint_holds_admission_closed_then_go_on(
        cluster_factory: Callable[..., Awaitable[Cluster]]) -> None:
    """A paused checkpoint closes admission on the model and resources servers. rollbook's own agent
    waits a refusal out; simple_agent does not: a refused model call fails its run, a refused tool call
    reaches its model as the tool's output. So a call rollbook numbers waits, unrecorded, until resume.
    Held here with the servers' own control plane: the resources server while simple_agent's change
    comes in, then the model server while its last call comes in. The rollout ends exactly as an
    uninterrupted one, and nothing was refused."""
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05, nemo_gym_agent={"simple": agent()})
    task = replace(make_task("workplace", SEED), agent="simple").to_json()
    clean = await dispatch(cluster, "hold-clean", task)
    held = asyncio.create_task(dispatch(cluster, "hold", task))

    def count(kind: str) -> Awaitable[Any]:
        return cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'hold' AND kind = :k", k=kind)

    await cluster.wait_for("its two reads answered", lambda: _equals(count("call_completed"), 2), timeout=120)
    await cluster.upstream_stall(True)  # the call that decides the change, in flight
    await cluster.control("resources", "prepare", "hold-r")
    await cluster.upstream_stall(False)
    await asyncio.sleep(4.0)  # the reply comes; simple_agent's change arrives at the held resources server
    assert await count("mutation_applied") == 0 and not held.done()
    await cluster.control("model", "prepare", "hold-m")
    await cluster.control("resources", "resume", "hold-r")  # the change is applied; simple_agent asks its model
    await cluster.wait_for("the change applied", lambda: _equals(count("mutation_applied"), 1), timeout=30)
    await asyncio.sleep(2.0)
    assert await count("call_accepted") == 3 and not held.done()  # its last call waits at the held model server
    await cluster.control("model", "resume", "hold-m")
    result = await asyncio.wait_for(held, 120)

    assert result["reward"] == clean["reward"] == 1.0, result
    assert await conversation(cluster, "hold") == await conversation(cluster, "hold-clean")
    assert not await cluster.rows("SELECT 1 FROM rollbook.events WHERE rollout_id = 'hold' AND kind = 'call_excluded'")
    assert await cluster.scalar("SELECT count(*) FROM rollbook.attempts WHERE rollout_id = 'hold'") == 1


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)


async def test_an_agent_that_asks_something_else_after_a_crash_restarts_its_rollout_fresh(
        cluster_factory: Callable[..., Awaitable[Cluster]]) -> None:
    """tests/gym_servers/clock_agent: simple_agent with the current time in its instructions, as many
    agents put the date in their system prompt. Run again after a crash, its first call is not the
    recorded one: the rollout starts over from its input under a new attempt, reason
    `agent_divergence` in the log, and finishes once."""
    clock = agent("clock_agent.app", [str(GYM_SERVERS)])
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05, nemo_gym_agent={"clock": clock})
    task = replace(make_task("workplace", SEED), agent="clock").to_json()
    first = asyncio.create_task(dispatch(cluster, "clock", task))
    await eventually("its first call answered", lambda: cluster.scalar(
        "SELECT count(*) >= 1 FROM rollbook.events WHERE rollout_id = 'clock' AND kind = 'call_completed'"))
    await cluster.crash(first)
    await cluster.start()
    result = await dispatch(cluster, "clock", task)

    assert result["reward"] == 1.0, result
    # Attempt 0 was cut off: attempt 1 continued it by replay and diverged at its first call; attempt 2 started fresh.
    recovered = await cluster.rows("SELECT attempt, data->>'disposition', data->>'reason' FROM rollbook.events "
                                   "WHERE rollout_id = 'clock' AND kind = 'rollout_recovered' ORDER BY position")
    assert [tuple(r)[:2] for r in recovered] == [(0, "continue"), (1, "fresh_dispatch")], recovered
    assert recovered[1][2] == "agent_divergence"
    excluded = await cluster.rows("SELECT data->>'call_id', data->>'diverges_from' FROM rollbook.events "
                                  "WHERE rollout_id = 'clock' AND kind = 'call_excluded' AND data->>'reason' = 'agent_divergence'")
    assert [tuple(r) for r in excluded] == [("clock.1.a0.m0", "clock.0.a0.m0")]
    assert await cluster.scalar("SELECT string_agg(attempt || ':' || status, ',' ORDER BY attempt) FROM rollbook.attempts "
                                "WHERE rollout_id = 'clock'") == "0:fenced,1:fenced,2:finished"
