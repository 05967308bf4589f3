"""A NeMo Gym agent as the agent of the tasks that name it (participants/agent/external.py): the
rules that decide how a cut-off activation goes on, and the `[nemo_gym_agent.NAME]` table.

The agent itself, NeMo Gym's simple_agent in its own process through a SIGKILL of everything, is
tests/e2e/test_nemo_gym_simple_agent.py; these are the edges it leaves out, on an in-memory log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import apps.config as cfg
from adapters.memory_store import MemoryEventStore
from apps.processes import free_port
from engine import catalog as ev
from engine.agent_replay import calls_made, divergence
from engine.errors import AttemptLost, GymServerFailed
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import agent_stream, call_stream, rollout_stream, server_call_id, session_stream
from participants.agent.external import ExternalAgents, GymAgent, final_text, gym_drivers
from participants.agent.server import AgentParticipant, RunRequest
from participants.environments.nemo_gym_relay import GymServer
from participants.environments.tasks import make_task
from testkit.nemo_gym_collector import gym_venv


def recorded(position: int, kind: str, stream: str, attempt: int = 0, **data: Any) -> RecordedEvent:
    return RecordedEvent(position, stream, position, kind, dict(data), "r", attempt, 1, "test", b"")


def test_calls_made_counts_the_activations_own_numbered_calls_of_this_attempt_only() -> None:
    events = [recorded(1, ev.CALL_ACCEPTED, call_stream(server_call_id("r", 1, 0, 0)), 1),
              recorded(2, ev.CALL_ACCEPTED, call_stream(server_call_id("r", 1, 0, 0)), 1),  # the same call asked again
              recorded(3, ev.CALL_ACCEPTED, call_stream(server_call_id("r", 1, 0, 1)), 1),
              recorded(4, ev.CALL_ACCEPTED, call_stream(server_call_id("r", 1, 1, 0)), 1),  # another activation
              recorded(5, ev.CALL_ACCEPTED, call_stream(server_call_id("r", 0, 0, 0)), 0),  # the origin's
              recorded(6, ev.CALL_ACCEPTED, call_stream("r.1.t0"), 1)]  # a call rollbook's own agent named
    assert calls_made(events, "r", 1, 0) == 2
    assert calls_made(events, "r", 1, 1) == 1
    assert calls_made(events, "r", 2, 0) == 0


def test_divergence_is_the_excluded_call_of_that_activation_with_reason_agent_divergence() -> None:
    cut = recorded(1, ev.CALL_EXCLUDED, call_stream("r.1.a0.m0"), 1, call_id="r.1.a0.m0", reason="admission_closed")
    other = recorded(2, ev.CALL_EXCLUDED, call_stream("r.1.a1.m0"), 1, call_id="r.1.a1.m0", reason="agent_divergence")
    diverged = recorded(3, ev.CALL_EXCLUDED, call_stream("r.1.a0.m2"), 1, call_id="r.1.a0.m2", reason="agent_divergence",
                        diverges_from="r.0.a0.m2")
    assert divergence([cut, other, diverged], "r", 1, 0) is diverged
    assert divergence([cut, other], "r", 1, 0) is None
    tool = recorded(4, ev.TOOL_CALL_DIVERGED, "session:r:1", 1, tool_call="a0.s1", reason="agent_divergence")
    elsewhere = recorded(5, ev.TOOL_CALL_DIVERGED, "session:r:1", 1, tool_call="a1.s0", reason="agent_divergence")
    assert divergence([cut, elsewhere, tool], "r", 1, 0) is tool
    assert divergence([cut, tool], "r", 2, 0) is None  # another attempt's
    rebuilt = recorded(6, ev.SESSION_REPLAY_FAILED, "session:r:1", 1, reason="replay_divergence", detail="call 0")
    assert divergence([cut, rebuilt], "r", 1, 3) is rebuilt  # the attempt's session, whichever activation asks
    assert divergence([cut, rebuilt], "r", 2, 0) is None


def gym_agents(continuation: str) -> ExternalAgents:
    # An address nothing listens on: none of these cases may reach the agent.
    server = GymServer("simple", "responses_api_agents.simple_agent.app", url="http://127.0.0.1:9")
    return ExternalAgents(gym_drivers({"simple": GymAgent(server, continuation)}))  # type: ignore[arg-type]


def run_request() -> RunRequest:
    return RunRequest.model_validate({"task": {**make_task("workplace", 3).to_json(), "agent": "simple"}})


async def started(store: MemoryEventStore) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream("r"), ev.ATTEMPT_STARTED, {"parent_attempt": None}, "r", 0),)))


@pytest.mark.parametrize(("continuation", "lost"), [("replay", "agent"), ("restart_only", "session")])
async def test_an_activation_asked_again_after_it_made_calls_is_never_run_again_under_that_attempt(
        memory_store: MemoryEventStore, continuation: str, lost: str) -> None:
    await started(memory_store)
    call_id = server_call_id("r", 0, 0, 0)
    await memory_store.append(AppendRequest((NewEvent(call_stream(call_id), ev.CALL_ACCEPTED, {"call_id": call_id}, "r", 0),)))
    with pytest.raises(AttemptLost) as raised:
        await gym_agents(continuation).activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
    assert raised.value.context["lost"] == lost


@pytest.mark.parametrize(("continuation", "lost"), [("replay", "agent"), ("restart_only", "session")])
async def test_an_activation_claimed_under_the_attempt_and_cut_off_before_its_first_model_call_is_not_run_again_there(
        memory_store: MemoryEventStore, continuation: str, lost: str) -> None:
    """Input: a claim of activation 0 by an instance that is gone, no model call accepted. Its run may have
    made tool calls (gymnasium_agent's /reset) that took the numbers the resources server gives in arrival
    order; run again under the same attempt, its reset would take the next number and be applied anew."""
    await started(memory_store)
    await memory_store.append(AppendRequest((NewEvent(agent_stream("r", 0), ev.ACTIVATION_CLAIMED,
                                                      {"index": 0, "instance": "agent-gone-1"}, "r", 0),)))
    with pytest.raises(AttemptLost) as raised:
        await gym_agents(continuation).activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
    assert raised.value.context["lost"] == lost


async def test_a_completed_activation_is_answered_from_the_log(memory_store: MemoryEventStore) -> None:
    await started(memory_store)
    boundary = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "done"}]}
    reply = {"final_answer": "done", "usage": {}, "turns": 1}
    await memory_store.append(AppendRequest((
        NewEvent(agent_stream("r", 0), ev.AGENT_BOUNDARY, boundary, "r", 0),
        NewEvent(agent_stream("r", 0), ev.ACTIVATION_COMPLETED, {"index": 0, "reply": reply}, "r", 0))))
    out = await gym_agents("replay").activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
    assert out == {**reply, "messages": boundary["messages"]}


def test_the_final_answer_is_the_last_messages_text_or_none() -> None:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    call = {"type": "function_call", "name": "add", "arguments": "{}", "call_id": "c"}
    assert final_text([call, message]) == "4"
    assert final_text([message, call]) is None
    assert final_text([]) is None


def test_the_table_round_trips_and_points_the_agent_at_rollbooks_servers(tmp_path: Path) -> None:
    """`[nemo_gym_agent.simple]`: written and read back the same; the agent is told its model and
    resources servers are rollbook's, each address carrying the data credential."""
    servers = {k: cfg.ServerConfig(port=9100 + i) for i, k in enumerate(cfg.KINDS)}
    config = cfg.Config(control_token="c" * 16, data_token="d" * 16, servers=servers,
                        nemo_gym_agent={"simple": cfg.NemoGymAgentConfig(continuation="replay", python="/py",
                                                                          config={"max_steps": 4})})
    cfg.write(config, tmp_path / "rollbook.toml")
    assert cfg.load(tmp_path / "rollbook.toml").nemo_gym_agent == config.nemo_gym_agent
    agent = config.gym_agents(lambda: 9200)["simple"]
    assert agent.continuation == "replay" and agent.server.port == 9200
    overrides, named = json.loads(agent.server.overrides), json.loads(agent.server.servers)
    assert overrides["max_steps"] == 4
    assert overrides["model_server"] == {"type": "responses_api_models", "name": "rollbook_model"}
    model = named["rollbook_model"]["responses_api_models"]["rollbook"]
    assert (model["host"], model["port"]) == (f"rollbook:{'d' * 16}@127.0.0.1", servers["model"].port)


@pytest.mark.parametrize(("table", "says"), [
    ({"bad.name": {}}, "nemo_gym_agent.bad.name"),
    ({"simple": {"continuation": "resume"}}, "continuation"),
    ({"simple": {"module": "../evil"}}, "module"),
])
def test_a_wrong_table_is_refused_naming_what_is_wrong(table: dict[str, Any], says: str) -> None:
    servers = {k: cfg.ServerConfig(port=9100 + i) for i, k in enumerate(cfg.KINDS)}
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        cfg.Config(control_token="c" * 16, data_token="d" * 16, servers=servers, nemo_gym_agent=table)


async def stub_agent(answers: web.Response) -> TestServer:
    """An HTTP server in the NeMo Gym agent's place that answers every activation with `answers`."""
    async def responses(request: web.Request) -> web.Response:
        return answers

    app = web.Application()
    app.router.add_post("/ng-rollout/{capture}/v1/responses", responses)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def at(server: TestServer) -> ExternalAgents:
    agent = GymAgent(GymServer("simple", "responses_api_agents.simple_agent.app", url=str(server.make_url("")).rstrip("/")))
    return ExternalAgents(gym_drivers({"simple": agent}))


@pytest.mark.parametrize("body", ["<html>502</html>", "[]", '{"output": "text"}', '{"id": "r"}'],
                         ids=["not-json", "a-list", "output-not-a-list", "no-output"])
async def test_an_agent_answering_200_without_a_responses_object_ends_the_attempt_failed_saying_so(
        memory_store: MemoryEventStore, body: str) -> None:
    """Input: the agent's 200 reply is not JSON, a JSON list, an object whose output is no list, an object
    with no output. The activation fails with gym_server_failed and the body, and records no completion."""
    server = await stub_agent(web.Response(text=body, content_type="application/json"))
    try:
        await started(memory_store)
        with pytest.raises(GymServerFailed, match="without a Responses object"):
            await at(server).activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
        assert not [e for e in await memory_store.read_rollout("r") if e.kind == ev.ACTIVATION_COMPLETED]
    finally:
        await server.close()


async def test_items_with_no_chat_form_are_left_out_of_the_recorded_conversation(memory_store: MemoryEventStore) -> None:
    """Input: a reasoning item (a reasoning model's, through simple_agent) before the answer."""
    output = [{"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "think"}]},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    server = await stub_agent(web.json_response({"output": output, "usage": {"input_tokens": 3, "output_tokens": 1}}))
    try:
        await started(memory_store)
        reply = await at(server).activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
        assert reply["final_answer"] == "done" and reply["usage"] == {"input_tokens": 3, "output_tokens": 1}
        assert [m["role"] for m in reply["messages"]] == ["user", "assistant"]
        completed = [e for e in await memory_store.read_rollout("r") if e.kind == ev.ACTIVATION_COMPLETED]
        assert len(completed) == 1 and completed[0].data["reply"]["final_answer"] == "done"
    finally:
        await server.close()


async def test_an_agent_whose_table_its_config_class_refuses_says_so_naming_the_table(
        memory_store: MemoryEventStore) -> None:
    """Input: `[nemo_gym_agent.bad] config = { bonnus = 1 }`, a field simple_agent's config class does not
    declare. NeMo Gym's own launcher run refuses it before the agent starts; the line names the table a
    person fixes and the class's fields, and an activation of a task naming it fails with it, once."""
    servers = {k: cfg.ServerConfig(port=9100 + i) for i, k in enumerate(cfg.KINDS)}
    config = cfg.Config(control_token="c" * 16, data_token="d" * 16, servers=servers, nemo_gym_agent={
        "bad": cfg.NemoGymAgentConfig(python=str(gym_venv() / "bin" / "python"), config={"bonnus": 1})})
    drivers = gym_drivers(config.gym_agents(free_port))
    process = drivers["bad"].process  # type: ignore[attr-defined]
    agents = ExternalAgents(drivers)
    try:
        said = process.check()
        assert said is not None and said.startswith("nemo_gym_agent.bad.config: bonnus is no field of SimpleAgentConfig"), said
        await started(memory_store)
        request = RunRequest.model_validate({"task": {**make_task("workplace", 3).to_json(), "agent": "bad"}})
        with pytest.raises(GymServerFailed, match="nemo_gym_agent.bad: .* cannot start: nemo_gym_agent.bad.config: bonnus"):
            await agents.activate(AgentParticipant(memory_store), ("r", 0), 0, request)
        assert process.starts == 1  # refused once, never started again
    finally:
        agents.stop()


async def test_an_agent_that_fails_after_one_of_its_tool_calls_diverged_loses_the_attempt_to_agent_divergence(
        memory_store: MemoryEventStore) -> None:
    """Input: the agent answers 500 after the resources server refused its tool call a0.s1 as not the
    recorded one (`tool_call_diverged`, which names the call by its key, not by a call_id): the
    rollout starts over from its input, and the error names that call."""
    await started(memory_store)
    await memory_store.append(AppendRequest((NewEvent(
        session_stream("r", 0), ev.TOOL_CALL_DIVERGED,
        {"tool_call": "a0.s1", "tool": "step", "reason": "agent_divergence", "diverges_from": {"tool": "step"}},
        "r", 0),)))
    server = await stub_agent(web.Response(status=500, text="Hit an exception calling an inner server"))
    try:
        with pytest.raises(AttemptLost, match="diverged from its lineage at a0.s1") as lost:
            await at(server).activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
        assert lost.value.context["reason"] == "agent_divergence"
    finally:
        await server.close()


async def test_an_agent_that_fails_after_its_session_could_not_be_rebuilt_starts_the_rollout_over(
        memory_store: MemoryEventStore) -> None:
    """Input: the agent answers 500 after the resources server could not rebuild its lost live session
    (a server that draws at random on reset replied otherwise than recorded: `session_replay_failed`).
    The rollout starts over from its input (`replay_divergence`), not failed as the agent's own error."""
    await started(memory_store)
    await memory_store.append(AppendRequest((NewEvent(
        session_stream("r", 0), ev.SESSION_REPLAY_FAILED,
        {"reason": "replay_divergence", "detail": "call 0 (reset, key a0.s0) replied 1a2b, the log recorded 3c4d"},
        "r", 0),)))
    server = await stub_agent(web.Response(status=500, text="Hit an exception calling an inner server"))
    try:
        with pytest.raises(AttemptLost, match="session could not be rebuilt .*call 0 \\(reset") as lost:
            await at(server).activate(AgentParticipant(memory_store), ("r", 0), 0, run_request())
        assert (lost.value.context["lost"], lost.value.context["reason"]) == ("divergence", "replay_divergence")
    finally:
        await server.close()
