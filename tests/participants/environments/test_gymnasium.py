"""NeMo Gym's gymnasium protocol as the relay and the agent server read it (participants.environments.gymnasium)."""

from __future__ import annotations

import math

import pytest

from apps import config as cfg
from participants.environments import ToolError, gymnasium
from tests.participants.environments.test_nemo_gym_config import SERVERS


def test_a_server_that_steps_and_has_no_session_to_seed_speaks_gymnasium() -> None:
    assert gymnasium.speaks(frozenset({"/reset", "/step", "/aggregate_metrics"}))
    assert not gymnasium.speaks(frozenset({"/seed_session", "/verify", "/step"}))  # a classic server with a tool named step
    assert not gymnasium.speaks(frozenset())  # no OpenAPI document: seeded and verified as before


@pytest.mark.parametrize("reply", [{"reward": math.nan}, {"reward": math.inf}, {"reward": "1"}, {"reward": True},
                                   [1.0], None])
def test_a_step_without_a_finite_reward_is_the_servers_error(reply: object) -> None:
    """Input: a /step reply whose reward is NaN, infinite, text, a boolean, or that is no object."""
    with pytest.raises(ToolError) as caught:
        gymnasium.step_reward(reply)
    assert caught.value.code == "gym_bad_reply"


def test_a_steps_reward_is_read_and_a_reply_that_names_none_gave_zero() -> None:
    assert gymnasium.step_reward({"observation": "x", "reward": 1}) == 1.0
    assert gymnasium.step_reward({"observation": "x", "terminated": False}) == 0.0  # the protocol's default


def test_a_run_reply_gives_the_conversation_past_the_rows_input_observations_included() -> None:
    row = {"responses_create_params": {"input": "Guess the word."}, "secret": "crane"}
    body = gymnasium.run_body(row, "r1.0.0")
    assert body == {**row, "_ng_rollout_id": "r1.0.0"}
    reply = {"responses_create_params": {"input": [{"role": "user", "content": "Guess the word."},
                                                   {"role": "user", "content": "Five letters."}]},
             "response": {"output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "CRANE"}]},
                                     {"role": "user", "content": "Solved."}]},
             "reward": 1.0}
    assert gymnasium.run_output(row, reply) == [
        {"type": "message", "role": "user", "content": "Five letters."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "CRANE"}]},
        {"type": "message", "role": "user", "content": "Solved."}]
    assert gymnasium.run_output(row, {"reward": 1.0}) is None  # not a run response


def test_nemo_gyms_gymnasium_agent_is_driven_through_its_run_with_observability_on() -> None:
    gym = cfg.NemoGymAgentConfig(module=gymnasium.GYMNASIUM_AGENT, python="/usr/bin/python3", port=9100)
    simple = cfg.NemoGymAgentConfig(python="/usr/bin/python3", port=9101)
    forced = cfg.NemoGymAgentConfig(module="my_agents.stepper.app", drive="run", python="/usr/bin/python3", port=9102)
    assert (gym.drives, simple.drives, forced.drives) == ("run", "responses", "run")
    config = cfg.Config(control_token="control-t0k", data_token="data-t0ken", servers=SERVERS,
                        nemo_gym_agent={"g": gym, "s": simple})
    agents = config.gym_agents()
    assert (agents["g"].drive, agents["s"].drive) == ("run", "responses")
    assert '"observability_enabled": true' in agents["g"].server.servers
    assert "observability_enabled" not in agents["s"].server.servers  # simple_agent's tool calls stay on /<tool>


def step(text: str, call: str, when: int, key: str | None = None) -> dict[str, object]:
    """A gymnasium_agent step body: the row and the model's response as NeMo Gym dumps it."""
    body: dict[str, object] = {"responses_create_params": {"input": "What is 7 + 5?"}, "expected_answer": "12", "response": {
        "id": f"resp_{call}", "created_at": when, "model": "rollbook", "rollbook": {"call_id": call, "disposition": "x"},
        "output": [{"type": "message", "id": f"msg_{call}", "role": "assistant",
                    "content": [{"type": "output_text", "text": text}]},
                   {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}]}}
    return body if key is None else {**body, "_ng_step_request_id": key}


def test_a_step_is_compared_by_what_it_asks_not_by_the_names_of_its_try() -> None:
    """Input: the same step under another call id, time and per-try key (a reply the model server answered
    from its record); then steps whose text, tool call or row differ."""
    first = gymnasium.step_as_recorded(step("12", "r.0.a0.m0", 100, "k1"))
    assert gymnasium.step_as_recorded(step("12", "r.1.a0.m0", 200, "k2")) == first
    assert gymnasium.step_as_recorded(step("13", "r.0.a0.m0", 100, "k1")) != first
    other_call = step("12", "r.0.a0.m0", 100, "k1")
    other_call["response"]["output"][1]["arguments"] = '{"x": 1}'  # type: ignore[index]
    assert gymnasium.step_as_recorded(other_call) != first
    assert gymnasium.step_as_recorded({**step("12", "r.0.a0.m0", 100), "expected_answer": "13"}) != first
    assert gymnasium.step_as_recorded(None) is None  # a record without arguments compares as it is
