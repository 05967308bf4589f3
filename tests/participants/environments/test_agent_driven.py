"""A NeMo Gym server its task's own agent drives (`GymServer.driven_by`: NeMo Gym's toolsandbox, driven
by its toolsandbox_agent through its `/run`): the agent seeds, steps, closes and verifies it, so rollbook
neither seeds it nor asks its verify; the agent's calls of the server's own routes are relayed under the
activation's path like any call; the reward is what the recorded verify gave. A task that names no
such agent keeps every one of the server's own routes out of the model's reach."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from engine.errors import GymServerFailed
from participants.environments import ENVIRONMENTS, ToolError
from participants.environments.nemo_gym_relay import (
    GymServer,
    NemoGymEnvironment,
    register,
    relayed_verify,
    task_from_row,
)
from tests.participants.environments.test_gym_http import Recorder  # its `recorder` fixture: conftest.py

ROW = {"responses_create_params": {"input": []}, "task_idx": 3}  # toolsandbox's: only its agent writes a prompt


def environment(recorder: Recorder) -> NemoGymEnvironment:
    url = f"http://127.0.0.1:{recorder.server_address[1]}"
    register([GymServer("driven_test", "resources_servers.toolsandbox.app", state="replay", url=url, driven_by=("own",))])
    try:
        env = ENVIRONMENTS["driven_test"]()
    finally:
        del ENVIRONMENTS["driven_test"]
    assert isinstance(env, NemoGymEnvironment)
    return env


async def test_the_agent_seeds_steps_and_verifies_a_server_it_drives_its_calls_under_the_activations_path(
        recorder: Recorder) -> None:
    env = environment(recorder)
    task = replace(task_from_row("driven_test", ROW, 0), agent="own")
    assert env.task_messages(task) == []  # the agent writes the prompt from the row's task_idx
    live = await env.open_live(task)
    seed = await env.call_live(live, "seed_session", {"task_idx": 3}, "a0.s0", "r.0.0")
    verify = await env.call_live(live, "verify", {"task_idx": 3, "response": {}}, "a0.s1", "r.0.0")
    assert [c.output["path"] for c in (seed, verify)] == ["/ng-rollout/r.0.0/seed_session", "/ng-rollout/r.0.0/verify"]
    # Nothing went to the server but the agent's two calls: rollbook seeded nothing.
    assert len(recorder.cookies) == 2
    assert seed.effect["tool"] == "seed_session" and "reward" not in seed.effect
    assert verify.effect["reward"] == 0.0  # the verify's reply is the record's reward (this one names none)


async def test_a_task_that_names_no_such_agent_is_seeded_by_rollbook_and_its_model_never_reaches_the_servers_routes(
        recorder: Recorder) -> None:
    """Input: a tool call named `verify`, then `seed_session`, on a session rollbook's own agent plays."""
    env = environment(recorder)
    task = task_from_row("driven_test", {**ROW, "responses_create_params": {"input": "hi"}}, 0)
    live = await env.open_live(task)
    assert len(recorder.cookies) == 1  # rollbook's own seed, with the row
    for name in ("verify", "seed_session"):
        with pytest.raises(ToolError) as refused:
            await env.call_live(live, name, {}, "a0.s0", "r.0.0")
        assert refused.value.code == "unknown_tool"
    assert len(recorder.cookies) == 1
    with pytest.raises(ToolError) as empty:
        env.task_messages(replace(task, params={"row": ROW}))
    assert empty.value.code == "bad_row"  # only an agent that writes the prompt plays a row without one


def test_the_reward_of_a_session_its_agent_drives_is_its_last_recorded_verify_and_none_without_one(
        recorder: Recorder) -> None:
    """Input: records of seed, verify 1.0, verify 0.0 (an agent that verified again), and of seed alone."""
    env = environment(recorder)
    task = replace(task_from_row("driven_test", ROW, 0), agent="own")
    calls = [{"tool": "seed_session"}, {"tool": "verify", "reward": 1.0}, {"tool": "verify", "reward": 0.0}]

    def verified(state: list[dict[str, Any]]) -> float:
        s = SimpleNamespace(env=env, task=task, state=state)
        return asyncio.run(relayed_verify(s, None, None, "r.0.0"))  # type: ignore[arg-type]
    assert verified(calls) == 0.0  # the session as its last verify found it, not the sum of the two
    with pytest.raises(GymServerFailed, match="never verified") as failed:
        verified(calls[:1])
    assert failed.value.context["stage"] == "verify"
