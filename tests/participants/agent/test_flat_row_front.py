"""NeMo Gym's legacy agent `/run` on the agent server (participants.agent.nemo_gym.AgentFront) passes a
row on as it came: the reply is the row as sent, and the row is never dumped back from its model (on a
NeMo Gym row, with its tool schemas, that dump cost several times the row's validation)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.http_client import JsonClient
from participants.agent.nemo_gym import AgentFront
from participants.base.nemo_gym_rows import FlatRow, flat_row_episode


async def test_the_front_sends_the_row_back_as_it_came_without_dumping_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: a flat row with fields in no sorted order, a field NeMo Gym's own, a null and a nested
    tool schema, to a front whose environment server (a recorder here) answers the episode."""
    row: dict[str, Any] = {
        "_ng_task_index": 3, "_ng_rollout_index": 1, "zeta": [1, None, {"b": 2.5, "a": "x"}],
        "responses_create_params": {"input": [{"role": "user", "content": "Reverse 'ab'"}], "tools": [
            {"type": "function", "name": "noop", "strict": None, "parameters": {"type": "object", "properties": {}}}]},
        "expected_answer": "ba", "agent_ref": {"name": "rollbook_agent"}}
    episodes: list[Any] = []

    async def environment(request: web.Request) -> web.Response:
        episode = await request.json()
        episodes.append(episode)
        return web.json_response({"episode_id": episode["episode_id"], "task_id": episode["task"]["task_id"],
                                  "result": {"response": {"output": []}, "reward": 1.0, "rollbook": {"attempt": 0}}})

    env_app = web.Application()
    env_app.router.add_post("/run", environment)
    env = TestServer(env_app, host="127.0.0.1")
    await env.start_server()
    client = JsonClient()
    participant = SimpleNamespace(environment_url=str(env.make_url("")), client=client)
    app = web.Application()
    app.add_routes([r.mount() for r in AgentFront(participant).routes()])  # type: ignore[arg-type]
    front = TestServer(app, host="127.0.0.1")
    await front.start_server()

    def refuse(*_a: object, **_k: object) -> Any:
        raise AssertionError("the row was dumped back from its model")

    monkeypatch.setattr(FlatRow, "model_dump", refuse)
    try:
        async with aiohttp.ClientSession() as http, http.post(front.make_url("/run"), data=json.dumps(row),
                                                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
            reply = json.loads(await resp.read())
    finally:
        await client.close()
        await front.close()
        await env.close()
    assert list(reply)[:len(row)] == list(row)
    assert {k: reply[k] for k in row} == row
    assert (reply["reward"], reply["rollbook"]) == (1.0, {"attempt": 0})
    assert episodes == [flat_row_episode(row)]
