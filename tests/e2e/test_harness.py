"""A real third-party harness, unchanged: smolagents's own command line (`smolagent`, run as
`python -m smolagents.cli`, from PyPI's smolagents 1.26.0) as the agent of rollbook's rollouts, in a
sandbox session, continued by replay after everything is SIGKILLed.

The config names it in a `[harness.smol]` table (continuation `replay`): the agent server installs
smolagents once (pip --target, for its own Python), and for each activation opens a jail (its own
uid, namespaces, root, cgroups) with that install bound read-only, and runs the command line there
with the task's prompt and one model address, the egress relay on the jail's own loopback. Its
tool-calling agent asks the model, runs the Python it is given in its own interpreter in the jail,
and answers with `final_answer`; its "Final answer:" line is the activation's answer, which the math
environment verifies. The model is the fake vLLM in its own process, counting what it generates.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

import apps.config as cfg
from participants.agent.harness import install
from participants.environments.sandbox import SandboxLimits
from participants.environments.tasks import make_task
from tests.e2e.conftest import Cluster
from tests.e2e.test_nemo_gym_simple_agent import conversation, dispatch, generated
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(900)
SEED = 5
SMOLAGENTS = "smolagents[openai]==1.26.0"
CLI = ["{python}", "-m", "smolagents.cli", "{prompt}", "--model-type", "OpenAIModel", "--model-id", "{model}",
       "--api-base", "{base_url}", "--api-key", "none", "--action-type", "tool_calling", "--tools", "python_interpreter"]
# What a harness in the jail can reach: the relay's own routes, a route outside them, the model
# server's real address, and what it was given to hold.
PROBE = """
import json, os, socket, sys, urllib.request, urllib.error
base, port = sys.argv[1], int(sys.argv[2])
def ask(url, body=None):
    try:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return [e.code, json.loads(e.read())["error"]["code"]]
    except OSError as e:
        return type(e).__name__
def connect(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError as e:
        return type(e).__name__
print(json.dumps({"model": ask(base + "/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}),
                  "outside": ask(base.rsplit("/v1", 1)[0] + "/admin/checkpoints"),
                  "database": connect("127.0.0.1", port), "off_machine": connect("192.0.2.1", 80), "uid": os.getuid(),
                  "credential": [k for k, v in os.environ.items() if "rollbook" in v.lower() or "token" in k.lower()]}))
"""


@pytest.fixture(scope="module")
def smolagents() -> str:
    """smolagents installed where the agent server looks for it, before any server starts."""
    return install((SMOLAGENTS,), str(Path.home() / ".cache" / "rollbook"), lambda line: print(line, file=sys.stderr))


def smol() -> cfg.HarnessConfig:
    return cfg.HarnessConfig(command=CLI, requirements=[SMOLAGENTS], env={"HF_HUB_OFFLINE": "1"},
                             answer=r"^Final answer: (.*)$", continuation="replay")


async def test_smolagents_killed_mid_episode_with_every_server_is_continued_by_replay(
        smolagents: str, cluster_factory: Callable[..., Awaitable[Cluster]]) -> None:
    # 50 ms a token: a reply takes about a second, time to stall the upstream under the second call.
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05, harness={"smol": smol()})
    task = replace(make_task("math", SEED), agent="smol").to_json()
    before = await generated(cluster)
    clean = await dispatch(cluster, "smol-clean", task)
    clean_calls = await generated(cluster) - before
    assert clean_calls == 2 and clean["reward"] == 1.0, clean  # run the Python, then final_answer
    answer = await cluster.scalar("SELECT data->'reply'->>'final_answer' FROM rollbook.events WHERE rollout_id = 'smol-clean' "
                                  "AND kind = 'agent_activation_completed'")
    assert answer == str(task["params"]["answer"]), answer  # type: ignore[index]

    before = await generated(cluster)
    first = asyncio.create_task(dispatch(cluster, "smol-crash", task))
    await crash_under_its_second_call(cluster, "smol-crash", first)
    continued = await dispatch(cluster, "smol-crash", task)

    assert (continued["attempt"], continued["reward"]) == (1, 1.0), continued
    assert await conversation(cluster, "smol-crash") == await conversation(cluster, "smol-clean")
    recovered = await cluster.rows("SELECT attempt, data->>'disposition', data->>'boundary' FROM rollbook.events "
                                   "WHERE rollout_id = 'smol-crash' AND kind = 'rollout_recovered'")
    assert [tuple(r) for r in recovered] == [(0, "continue", None)]
    # The first call came from the log; the one in flight at the kill, never recorded, was generated again.
    # The same model calls, in order, as the uninterrupted run's: attempt 1 asked what attempt 0 had.
    assert await requests(cluster, "smol-crash", 1) == await requests(cluster, "smol-clean", 0)
    # Asked again from its start, it asked what it asked before: nothing excluded as a divergence.
    assert await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'smol-crash' "
                                "AND kind = 'call_excluded'") == 0
    assert await generated(cluster) - before == clean_calls + 1
    assert await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'smol-crash' AND attempt = 1 "
                                "AND kind = 'call_completed' AND data->>'disposition' = 'linked'") == 1
    # Each model call of the finished attempt answered once, and no call generated for it twice.
    assert await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'smol-crash' AND attempt = 1 "
                                "AND kind = 'call_completed'") == 2


async def requests(cluster: Cluster, rollout: str, attempt: int) -> list[str]:
    """The request digests of an attempt's model calls, in order."""
    rows = await cluster.rows("SELECT data->>'request_digest' FROM rollbook.events WHERE rollout_id = :r AND attempt = :a "
                              "AND kind = 'call_accepted' ORDER BY position", r=rollout, a=attempt)
    return [r[0] for r in rows]


async def crash_under_its_second_call(cluster: Cluster, rollout: str, driver: asyncio.Task[Any]) -> None:
    """Its first call answered and its second in flight, the upstream stalled: SIGKILL every rollbook
    server (the harness's jail dies with the agent server), then start them again."""
    await eventually("its first call answered", lambda: cluster.scalar(
        "SELECT count(*) = 1 FROM rollbook.events WHERE rollout_id = :r AND kind = 'call_completed'", r=rollout))
    await cluster.upstream_stall(True)
    await eventually("its second call in flight", lambda: cluster.scalar(
        "SELECT count(*) FILTER (WHERE kind = 'call_accepted') = 2 AND count(*) FILTER (WHERE kind = 'call_completed') = 1 "
        "FROM rollbook.events WHERE rollout_id = :r", r=rollout))
    await cluster.crash(driver)
    await cluster.upstream_stall(False)
    await cluster.start()


async def test_a_harness_that_asks_something_else_after_a_crash_goes_on_live_with_the_divergence_in_sql(
        smolagents: str, cluster_factory: Callable[..., Awaitable[Cluster]]) -> None:
    """Input: smolagents's command line given the task with the time it started appended, as a harness
    that dates its task would: run again after a crash, its first call differs from the recorded one."""
    dated = ["/bin/sh", "-c", 'p="$1"; shift; exec "$0" -m smolagents.cli "$p (asked at $(date +%s%N))" "$@"', "{python}", "{prompt}",
             *CLI[4:]]
    cluster = await cluster_factory(upstream=True, token_latency_s=0.05, harness={"dated": cfg.HarnessConfig(
        command=dated, requirements=[SMOLAGENTS], env={"HF_HUB_OFFLINE": "1"}, answer=r"^Final answer: (.*)$",
        continuation="replay")})
    task = replace(make_task("math", SEED), agent="dated").to_json()
    before = await generated(cluster)
    first = asyncio.create_task(dispatch(cluster, "dated", task))
    await crash_under_its_second_call(cluster, "dated", first)
    out = await dispatch(cluster, "dated", task)

    assert (out["attempt"], out["reward"]) == (1, 1.0), out
    excluded = await cluster.rows("SELECT data->>'call_id', data->>'reason', data->>'diverges_from' FROM rollbook.events "
                                  "WHERE rollout_id = 'dated' AND kind = 'call_excluded'")
    assert [tuple(r) for r in excluded] == [("dated.1.a0.m0", "agent_divergence", "dated.0.a0.m0")]
    # Refused, its OpenAI client asked again (it retries a 409), and from there on it ran live: nothing
    # of attempt 0 answered it, and every call it made was generated for it.
    calls = await cluster.rows("SELECT data->>'disposition' FROM rollbook.events WHERE rollout_id = 'dated' "
                               "AND attempt = 1 AND kind = 'call_completed'")
    assert [r[0] for r in calls] == ["generated", "generated"]
    assert await generated(cluster) - before == 4  # attempt 0's two (one cut by the kill), attempt 1's two


async def test_a_harness_in_its_jail_reaches_its_model_route_through_the_relay_and_nothing_else(
        dsn: str, cluster_factory: Callable[..., Awaitable[Cluster]]) -> None:
    """Input: a harness (plain Python, no requirements) that asks the model through the relay, asks the relay
    for a control route, connects to PostgreSQL's port on 127.0.0.1 and to an address off the machine, and
    lists what it holds that looks like a credential."""
    port = make_url(dsn).port or 5432
    probe = cfg.HarnessConfig(command=["{python}", "-c", PROBE, "{base_url}", str(port)])
    cluster = await cluster_factory(harness={"probe": probe})
    task = replace(make_task("math", SEED), agent="probe").to_json()
    out = await dispatch(cluster, "probe", task)
    said = json.loads(await cluster.scalar("SELECT data->'reply'->>'final_answer' FROM rollbook.events WHERE rollout_id = 'probe' "
                                           "AND kind = 'agent_activation_completed'"))
    assert said["model"] == 200, said  # the attempt's own model route, reached through the relay
    assert await cluster.scalar("SELECT count(*) FROM rollbook.events WHERE rollout_id = 'probe' "
                                "AND kind = 'call_completed'") == 1  # and recorded there as the attempt's call
    assert said["outside"] == [404, "relay_refused"], said
    assert said["database"] == "ConnectionRefusedError", said  # its loopback is the jail's own
    assert said["off_machine"] == "OSError", said  # no route: the jail has no interface but its loopback
    assert said["uid"] >= SandboxLimits.uid_base and said["credential"] == [], said
    assert out["reward"] == 0.0, out  # it answered no number: the environment scored what it said
