"""NeMo Gym 0.7.0's own `simple_agent`, unchanged, continued by replay after everything is SIGKILLed.

simple_agent runs its own app.py with NeMo Gym's Python (the cached NeMo Gym environment), started by
rollbook's launcher the way `ng_run` starts a server: its model server is rollbook's model server, its
resources server rollbook's resources server, each address carrying the data credential (HTTP Basic,
the only way NeMo Gym's client sends one). The test plays the part rollbook's agent
server will play: it starts an attempt, opens the attempt's session (rollbook's workplace
environment), and calls simple_agent's `/ng-rollout/<activation id>/v1/responses` with the task and
the activation's cookie. simple_agent then asks the model at that same path and calls each tool as
`POST /<tool>` with that cookie: it names no call, so rollbook numbers them (engine.agent_replay).
The model is the fake vLLM in its own process, which counts what it generates.

One rollout runs uninterrupted: two reads, a change, an answer. A second, with the same task, has its
upstream stalled after the change, its last model call in flight, then simple_agent and all four
rollbook servers are SIGKILLed; after fresh processes
start, its next attempt continues from all of the first (as a recovery records it) and simple_agent
is called again from the start. Its answer, its tool calls and the session's final state equal the
uninterrupted run's; the upstream generated each recorded call once; every change was applied once.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from apps.processes import free_port
from engine.attempts import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent, canonical_json
from engine.identity import rollout_stream
from engine.recovery import Recovery, recovery_request
from participants.base.wire import CAPTURE_COOKIE, capture_id
from participants.environments.nemo_gym_relay import LAUNCHER
from participants.environments.tasks import make_task
from testkit.nemo_gym_collector import gym_venv, spawn, stop, wait_http
from tests.e2e.conftest import Cluster
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(900)
SEED = 11


def agent_config(cluster: Cluster) -> dict[str, str]:
    """What the launcher (participants/environments/nemo_gym_launcher.py) gives simple_agent: its
    model and resources servers are rollbook's, each address carrying the data credential."""
    host = f"rollbook:{cluster.config.data_token}@127.0.0.1"
    servers = {
        "policy_model": {"responses_api_models": {"rollbook": {
            "entrypoint": "rollbook", "host": host, "port": cluster.config.servers["model"].port}}},
        "rollbook_resources": {"resources_servers": {"rollbook": {
            "entrypoint": "rollbook", "domain": "other", "host": host, "port": cluster.config.servers["resources"].port}}},
    }
    overrides = {"model_server": {"type": "responses_api_models", "name": "policy_model"},
                 "resources_server": {"type": "resources_servers", "name": "rollbook_resources"}}
    return {"ROLLBOOK_GYM_SERVERS": json.dumps(servers), "ROLLBOOK_GYM_OVERRIDES": json.dumps(overrides)}


class SimpleAgent:
    """NeMo Gym's simple_agent in its own process group, as `ng_run` starts it."""

    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.venv, self.cluster, self.work = gym_venv(), cluster, work
        self.port = free_port()
        self.proc: Any = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        log = self.work / f"simple_agent-{self.starts}.log"
        env = {**os.environ, **agent_config(self.cluster), "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)
        self.proc = spawn([str(self.venv / "bin" / "python"), str(LAUNCHER), "responses_api_agents.simple_agent.app",
                           "simple_agent", str(self.port)], log, self.work, env)
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{self.port}/health", self.proc, log, 120)

    def kill(self) -> None:
        os.killpg(self.proc.pid, 9)
        self.proc.wait()

    async def episode(self, rollout: str, attempt: int, task: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any]:
        """What rollbook's agent server sends an agent of NeMo Gym's for one activation."""
        capture = capture_id(rollout, attempt)
        body = {"input": [{"role": "user", "content": task["prompt"]}],
                "tools": [{"type": "function", "strict": False, **t["function"]} for t in tools]}
        async with self.cluster.session.post(f"http://127.0.0.1:{self.port}/ng-rollout/{capture}/v1/responses", json=body,
                                             cookies={CAPTURE_COOKIE: capture}) as resp:
            text = await resp.text()
            assert resp.status == 200, text
            return json.loads(text)


async def data(cluster: Cluster, method: str, path: str, body: Any = None) -> Any:
    url = cluster.config.url("resources") + path
    async with cluster.session.request(method, url, json=body,
                                       headers={"Authorization": f"Bearer {cluster.config.data_token}"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def generated(cluster: Cluster) -> int:
    async with cluster.session.get(f"{cluster.upstream}/fake/requests") as resp:
        return int((await resp.json())["requests"])


def comparable(response: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The episode as the model and the tools saw it: every output item but its ids."""
    return [(o["type"], o.get("name"), o.get("arguments"), o.get("output"),
             [c.get("text") for c in o.get("content") or []]) for o in response["output"]]


async def test_simple_agent_killed_mid_episode_with_every_server_is_continued_by_replay(
        cluster_factory: Callable[..., Awaitable[Cluster]], tmp_path: Path) -> None:
    # 50 ms a token: a reply takes about two seconds, time to stall the upstream between two calls.
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05)
    agent = SimpleAgent(cluster, tmp_path)
    await agent.start()
    task = make_task("workplace", SEED)
    for rollout in ("sa-clean", "sa-crash"):
        await cluster.store.append(AppendRequest((
            NewEvent(rollout_stream(rollout), ATTEMPT_STARTED, {"parent_attempt": None}, rollout, 0),)))
    tools = (await data(cluster, "POST", "/rollouts/sa-clean/attempts/0/session",
                        {"env": "workplace", "task": task.to_json()}))["tools"]
    before = await generated(cluster)
    clean = await agent.episode("sa-clean", 0, task.to_json(), tools)
    clean_calls = await generated(cluster) - before
    changes = await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'sa-clean' "
                                   "AND kind = 'mutation_applied'")
    assert clean_calls == 4 and changes == 1, clean  # two reads, a change, the answer: the kill comes after the change

    await data(cluster, "POST", "/rollouts/sa-crash/attempts/0/session", {"env": "workplace", "task": task.to_json()})
    before = await generated(cluster)
    first = asyncio.create_task(agent.episode("sa-crash", 0, task.to_json(), tools))
    await eventually("the crashing run's change applied", lambda: cluster.scalar(
        "SELECT count(*) = 1 FROM rollbook.events WHERE rollout_id = 'sa-crash' AND kind = 'mutation_applied'"))
    await cluster.upstream_stall(True)
    await eventually("its last call in flight", lambda: cluster.scalar(
        "SELECT count(*) FILTER (WHERE kind = 'call_accepted') = 4 AND count(*) FILTER (WHERE kind = 'call_completed') = 3 "
        "FROM rollbook.events WHERE rollout_id = 'sa-crash'"))
    agent.kill()
    await cluster.crash(first)
    await cluster.upstream_stall(False)
    await cluster.store.append(recovery_request(Recovery("sa-crash", 0, "continue", None, True, "everything was killed")))
    await cluster.start()
    await agent.start()
    continued = await agent.episode("sa-crash", 1, task.to_json(), tools)

    assert comparable(continued) == comparable(clean)
    states = [await data(cluster, "GET", path) for path in ("/rollouts/sa-clean/attempts/0/state",
                                                            "/rollouts/sa-crash/attempts/1/state")]
    assert canonical_json(states[0]["state"]) == canonical_json(states[1]["state"])
    # Each recorded call generated once: the one in flight at the kill, never recorded, was asked again.
    assert await generated(cluster) - before == clean_calls + 1
    replayed = await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'sa-crash' AND attempt = 1 "
                                    "AND kind = 'call_completed' AND data->>'disposition' = 'linked'")
    assert replayed == 3
    # The change was applied once, by attempt 0; attempt 1's same call got its recorded answer.
    assert await cluster.scalar("SELECT string_agg(attempt || ':' || (data->>'tool_call'), ',') FROM rollbook.events "
                                "WHERE rollout_id = 'sa-crash' AND kind = 'mutation_applied'") == "0:a0.s2"
    stop(agent.proc)
