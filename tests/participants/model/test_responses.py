"""`/v1/responses` on an attempt's routes, and the ids the server gives calls that name none.

A stranger's agent (NeMo Gym's simple_agent, the OpenAI SDK's `responses.create`) sends no rollbook
header: each test here calls the model server the way such an agent does, on real HTTP servers and a
log in memory, and reads what was recorded from the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from adapters.memory_store import MemoryEventStore
from adapters.token_store import MemoryTokenStore
from engine.attempts import ATTEMPT_STARTED
from engine.calls import CallNumbering
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, rollout_stream
from participants.base.app import PARTICIPANT
from participants.base.guard import Credentials
from participants.model.app import build_model_app
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from participants.model.backends.scripted import ScriptedBackend
from testkit.fake_vllm import FakeVLLM
from tests.waiting import eventually

CREDS = Credentials(control="responses-control", data="responses-data")
DATA = {"Authorization": f"Bearer {CREDS.data}"}
TOOLS = [{"type": "function", "name": n, "description": f"{n} once", "parameters": {"type": "object", "properties": {}}}
         for n in ("look", "hit", "stand")]
HAND = "Play a hand of blackjack."


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    """What is tested here is the server's numbering and wire, not durability: a log in memory."""
    return memory_store


@pytest.fixture
def tokens(memory_tokens: MemoryTokenStore) -> MemoryTokenStore:
    return memory_tokens


async def start(store: MemoryEventStore, rollout: str) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream(rollout), ATTEMPT_STARTED, {"parent_attempt": None}, rollout, 0),)))


@contextlib.asynccontextmanager
async def served(store: MemoryEventStore, backend: Any, tokens: MemoryTokenStore):
    server = TestServer(build_model_app(store, backend, tokens, CREDS))
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def sdk(server: TestServer, rollout: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url(f"/rollouts/{rollout}/attempts/0/v1")), api_key=CREDS.data,
                              max_retries=0)


async def kinds(store: MemoryEventStore, call_id: str) -> list[str]:
    return [e.kind for e in await store.read_stream(call_stream(call_id))]


async def test_the_sdks_responses_create_is_a_model_call_with_custody_numbered_by_the_server(store, tokens) -> None:
    """Two turns of a tool-using agent through `responses.create`, no rollbook header: each turn is one
    call, numbered m0 and m1, recorded like a chat call, its token ids on its last output item."""
    await start(store, "rs1")
    async with served(store, ScriptedBackend(), tokens) as server:
        client = sdk(server, "rs1")
        first = await client.responses.create(model="scripted", input=HAND, tools=TOOLS, temperature=0.5)  # type: ignore[arg-type]
        call = first.output[-1]
        assert call.type == "function_call" and call.name == "look"
        turn = [{"role": "user", "content": HAND}, *[o.model_dump(exclude_none=True) for o in first.output],
                {"type": "function_call_output", "call_id": call.call_id, "output": '{"hand": [10, 7]}'}]
        second = await client.responses.create(model="scripted", input=turn, tools=TOOLS)  # type: ignore[arg-type]
        await client.close()
    assert await kinds(store, "rs1.0.a0.m0") == await kinds(store, "rs1.0.a0.m1") == ["call_accepted", "call_completed"]
    accepted = (await store.read_stream(call_stream("rs1.0.a0.m0")))[0].data
    assert accepted["sampling"]["temperature"] == 0.5
    done = (await store.read_stream(call_stream("rs1.0.a0.m0")))[1].data
    stored = await tokens.get(done["receipt"]["blob_id"])
    extra = call.model_extra or {}
    assert extra["generation_token_ids"] == list(stored.ids) and len(extra["generation_log_probs"]) == len(stored.ids)
    assert first.id == "resp_rs1.0.a0.m0" and second.id == "resp_rs1.0.a0.m1"
    assert first.usage is not None and first.usage.output_tokens == len(stored.ids)
    assert second.status == "completed" and second.output[-1].type in ("function_call", "message")


async def test_the_upstream_gets_the_turn_as_chat_messages_and_no_empty_tools(store, tokens) -> None:
    """What a vLLM receives for a Responses turn: the instructions and a leading system message as one
    system message, the function call and its output as an assistant tool call and a tool message,
    `max_output_tokens` as `max_tokens`, and no `"tools": []` (vLLM answers that with a 400)."""
    await start(store, "rs2")
    async with FakeVLLM() as fake:
        backend = OpenAICompatibleBackend(fake.url, model="fake-policy")
        async with served(store, backend, tokens) as server:
            client = sdk(server, "rs2")
            reply = await client.responses.create(
                model="fake-policy", instructions="Be brief.", tools=[], max_output_tokens=40, input=[  # type: ignore[arg-type]
                    {"role": "system", "content": "You add numbers."},
                    {"role": "user", "content": [{"type": "input_text", "text": "What is"}, {"type": "input_text", "text": "2 + 3?"}]},
                    {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                    {"type": "function_call_output", "call_id": "c1", "output": "5"}])
            await client.close()
        await backend.close()
    sent = fake.requests[-1]
    assert "tools" not in sent and sent["max_tokens"] == 40
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief.\n\nYou add numbers."},
        {"role": "user", "content": "What is\n2 + 3?"},
        {"role": "assistant",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    assert reply.status == "completed" and reply.output[-1].type == "message"


@pytest.mark.parametrize("extra,needle", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f1"}]}]}, "input_file"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}]}, "file_id"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input_image"),
    ({"input": [{"type": "reasoning", "summary": "thought"}]}, "reasoning"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"stream": True}, "stream"),
    ({"tool_choice": "required"}, "needs at least one tool"),
])
async def test_what_has_no_chat_form_is_a_400_and_nothing_is_recorded(store, tokens, extra, needle) -> None:
    await start(store, "rs3")
    async with served(store, ScriptedBackend(), tokens) as server, aiohttp.ClientSession() as http:
        head = await store.head()
        resp = await http.post(str(server.make_url("/rollouts/rs3/attempts/0/v1/responses")),
                               json={"input": "What is 1 + 1?", **extra}, headers=DATA)
        body = await resp.json()
        assert await store.head() == head
    assert (resp.status, body["error"]["code"]) == (400, "unsupported_parameter") and needle in body["error"]["message"]


async def test_the_same_request_before_its_reply_was_delivered_is_the_same_call(store, tokens) -> None:
    """An agent whose connection dropped asks again with the same body: the server gives it the same
    number and the reply of the one generation; once delivered, the same body is a new call."""
    await start(store, "rs4")
    backend = ScriptedBackend(latency_s=0.3)
    body = {"model": "scripted", "input": "What is 12 + 30?"}
    async with served(store, backend, tokens) as server, aiohttp.ClientSession() as http:
        url = str(server.make_url("/rollouts/rs4/attempts/0/v1/responses"))
        with pytest.raises(asyncio.TimeoutError):
            await http.post(url, json=body, headers=DATA, timeout=aiohttp.ClientTimeout(total=0.1))
        again = await (await http.post(url, json=body, headers=DATA)).json()
        new = await (await http.post(url, json=body, headers=DATA)).json()
    assert (again["id"], new["id"]) == ("resp_rs4.0.a0.m0", "resp_rs4.0.a0.m1")
    assert backend.generations == 2  # m0 once, though asked twice; m1 once
    assert again["output"] == [{**o, "id": o["id"].replace("m1", "m0")} for o in new["output"]]


async def test_a_restarted_server_reads_the_numbering_back_from_the_log(store, tokens) -> None:
    """The numbering is in memory; a new process over the same log goes on from it: the last call's
    request again is that call (its stored reply, no generation), another request the next number."""
    await start(store, "rs5")
    questions = [{"model": "scripted", "input": f"What is {n} + 1?"} for n in range(5)]
    async with served(store, ScriptedBackend(), tokens) as server, aiohttp.ClientSession() as http:
        url = str(server.make_url("/rollouts/rs5/attempts/0/v1/responses"))
        for q in questions[:4]:
            assert (await http.post(url, json=q, headers=DATA)).status == 200
    backend = ScriptedBackend()
    async with served(store, backend, tokens) as server, aiohttp.ClientSession() as http:
        url = str(server.make_url("/rollouts/rs5/attempts/0/v1/responses"))
        repeat = await (await http.post(url, json=questions[3], headers=DATA)).json()
        nxt = await (await http.post(url, json=questions[4], headers=DATA)).json()
        later = await (await http.post(url, json=questions[4], headers={**DATA, "X-Rollbook-Activation": "1"})).json()
    assert (repeat["id"], nxt["id"], later["id"]) == ("resp_rs5.0.a0.m3", "resp_rs5.0.a0.m4", "resp_rs5.0.a1.m0")
    assert backend.generations == 2  # the repeat was answered from the log; m4 and a1.m0 were generated


async def test_a_numbered_call_cut_by_a_checkpoint_goes_on_from_its_cut_at_resume(store, tokens) -> None:
    """A cut ends a call without delivering it. An agent that names no call cannot ask again (NeMo Gym's
    simple_agent fails on the refusal), so the server asks again for it at resume: the waiting request
    gets the reply, whose generation went on from the cut instead of starting over."""
    await start(store, "rs6")
    backend = ScriptedBackend(token_latency_s=0.05)
    body = {"model": "scripted", "input": "What is 12 + 30?"}
    async with served(store, backend, tokens) as server, aiohttp.ClientSession() as http:
        url = str(server.make_url("/rollouts/rs6/attempts/0/v1/responses"))
        first = asyncio.create_task(http.post(url, json=body, headers=DATA))
        model = server.app[PARTICIPANT]
        await eventually("three tokens generated", lambda: any(len(c.ids) >= 3 for c in model.calls.values()))
        await model.progress.save()
        for op in ("prepare", "resume"):
            control = {"Authorization": f"Bearer {CREDS.control}"}
            resp = await http.post(str(server.make_url(f"/rollbook/v1/control/{op}")), headers=control,
                                   json={"checkpoint_id": "ck-rs6", "deadline": time.time() + 5})
            assert resp.status == 200, await resp.text()
        answered = await first
        assert answered.status == 200, await answered.text()
        again = await answered.json()
    assert again["id"] == "resp_rs6.0.a0.m0" and again["status"] == "completed"
    assert await kinds(store, "rs6.0.a0.m0") == ["call_accepted", "call_cut", "call_accepted", "call_completed"]
    events = await store.read_stream(call_stream("rs6.0.a0.m0"))
    assert events[2].data["continues"]["call_id"] == "rs6.0.a0.m0"
    assert events[3].data["prefix_tokens"] >= 3  # generated once: the continuation began where the cut ended


def test_call_numbering_repeats_only_an_undelivered_call_with_the_same_request() -> None:
    n = CallNumbering()
    assert [n.number("a", False), n.number("a", False), n.number("a", True), n.number("b", False), n.number("a", False)] \
        == [0, 0, 1, 2, 3]


async def test_a_nemo_gym_call_outside_any_rollout_is_told_it_needs_one_not_unauthorized(store, tokens) -> None:
    """Input: `POST /v1/responses` with the data credential as NeMo Gym's client sends it (basic auth from
    the host in its config), no rollout in the path: genrm_compare's judge calls from a task of no rollout."""
    async with served(store, ScriptedBackend(), tokens) as server, aiohttp.ClientSession() as http:
        async with http.post(server.make_url("/v1/responses"), json={"input": "judge these"},
                             headers={"Authorization": aiohttp.encode_basic_auth("rollbook", CREDS.data)}) as resp:
            status, error = resp.status, (await resp.json())["error"]
    assert (status, error["code"]) == (400, "rollout_id_required")
    assert "/ng-rollout/<capture>/" in error["detail"] and "models" in error["detail"]
    assert await store.read_all() == []  # nothing recorded
