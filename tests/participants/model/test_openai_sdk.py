"""The model server as the official `openai` SDK sees it, on real HTTP servers and a real log.

Each test points `openai.AsyncOpenAI` at a rollout attempt's base URL, the way a user would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Literal

import openai
import pytest
from aiohttp.test_utils import TestServer

from adapters.memory_store import MemoryEventStore
from adapters.token_store import MemoryTokenStore
from engine.attempts import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, rollout_stream
from participants.base.app import PARTICIPANT
from participants.base.guard import Credentials
from participants.base.wire import CONTROL
from participants.model.app import build_model_app
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from participants.model.backends.scripted import ScriptedBackend
from testkit.fake_vllm import FakeVLLM

CREDS = Credentials(control="sdk-control-secret", data="sdk-data-secret")
TOKEN = CREDS.control  # the control plane's; the SDK's api_key is the data credential
MATH = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    """This module's rules promise no durability: its log is in memory (docs/testing.md)."""
    return memory_store


@pytest.fixture
def tokens(memory_tokens: MemoryTokenStore) -> MemoryTokenStore:
    return memory_tokens


@contextlib.asynccontextmanager
async def sdk(store: MemoryEventStore, backend: Any, tokens: Any, rollout: str):
    """A model server, an attempt to call it under, and an SDK client for that attempt."""
    await store.append(AppendRequest((NewEvent(rollout_stream(rollout), ATTEMPT_STARTED, {"parent_attempt": None}, rollout, 0),)))
    server = TestServer(build_model_app(store, backend, tokens, CREDS))
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=str(server.make_url(f"/rollouts/{rollout}/attempts/0/v1")), api_key=CREDS.data,
                                max_retries=0)
    try:
        yield client, server
    finally:
        await client.close()
        await server.close()


def call(call_id: str) -> dict[str, Any]:
    return {"extra_headers": {"X-Rollbook-Call-Id": call_id}}


async def test_sampling_parameters_pass_through_to_the_upstream_and_logprobs_come_back(store, tokens) -> None:
    async with FakeVLLM() as fake:
        backend = OpenAICompatibleBackend(fake.url, model="fake-policy")
        async with sdk(store, backend, tokens, "s1") as (client, _):
            reply = await client.chat.completions.create(
                model="fake-policy", messages=MATH, max_tokens=5, temperature=0.3, top_p=0.9, stop=["zzz"], seed=7,
                logprobs=True, top_logprobs=2, response_format={"type": "text"}, **call("s1.0.t0"))
            capped = await client.chat.completions.create(model="fake-policy", messages=MATH, max_completion_tokens=3,
                                                          **call("s1.0.t1"))
        await backend.close()
    sent = fake.requests[0]
    assert {k: sent[k] for k in ("max_tokens", "temperature", "top_p", "stop", "seed", "top_logprobs", "response_format")} == {
        "max_tokens": 5, "temperature": 0.3, "top_p": 0.9, "stop": ["zzz"], "seed": 7, "top_logprobs": 2,
        "response_format": {"type": "text"}}
    assert fake.requests[1]["max_completion_tokens"] == 3
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage is not None and reply.usage.completion_tokens == 5
    assert choice.logprobs is not None and choice.logprobs.content is not None and len(choice.logprobs.content) == 5
    assert all(e.token.startswith("token_id:") and len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert capped.choices[0].finish_reason == "length" and capped.usage is not None and capped.usage.completion_tokens == 3
    accepted = (await store.read_stream(call_stream("s1.0.t0")))[0].data
    assert accepted["sampling"]["temperature"] == 0.3 and accepted["sampling"]["max_tokens"] == 5


async def test_the_scripted_backend_honours_max_tokens_and_stop(store, tokens) -> None:
    async with sdk(store, ScriptedBackend(), tokens, "s2") as (client, _):
        two = await client.chat.completions.create(model="scripted", messages=MATH, max_tokens=2, **call("s2.0.t0"))
        stopped = await client.chat.completions.create(model="scripted", messages=MATH, stop=[" ="], **call("s2.0.t1"))
    assert two.choices[0].finish_reason == "length" and two.usage is not None and two.usage.completion_tokens == 2
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == "12 + 30"


@pytest.mark.parametrize("kwargs,needle", [
    ({"n": 3}, "n=3"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),  # no schema
    ({"response_format": {"type": "grammar", "grammar": "root ::= 'a'"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs")])
async def test_a_parameter_that_cannot_be_honoured_is_a_400_that_says_so(store, tokens, kwargs, needle) -> None:
    async with sdk(store, ScriptedBackend(), tokens, "s3") as (client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="scripted", messages=MATH, **kwargs, **call("s3.0.t0"))
    assert needle in info.value.message and info.value.code == "unsupported_parameter"
    assert await store.read_stream(call_stream("s3.0.t0")) == []  # refused before anything was recorded


async def test_a_judge_asking_for_structured_output_gets_a_value_of_its_schema(store, tokens) -> None:
    """Input: the SDK's `parse` with a pydantic model whose schema has a nested model ($defs/$ref), an
    enum in an anyOf and a nullable field (the shape of NeMo Gym's bbq judge), then json_object."""
    from pydantic import BaseModel

    class Evidence(BaseModel):
        quote: str
        certain: bool

    class Judgment(BaseModel):
        selected_answer: Literal["uncertain", "the doctor"] | None
        evidence: Evidence
        score: int

    async with sdk(store, ScriptedBackend(), tokens, "s5") as (client, _):
        parsed = await client.beta.chat.completions.parse(model="scripted", messages=MATH, response_format=Judgment,
                                                          **call("s5.0.t0"))
        anything = await client.chat.completions.create(model="scripted", messages=MATH,
                                                        response_format={"type": "json_object"}, **call("s5.0.t1"))
    judged = parsed.choices[0].message.parsed
    assert isinstance(judged, Judgment) and judged.selected_answer == "uncertain" and judged.score == 12
    assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)


async def test_a_stream_sends_deltas_as_they_are_generated_and_usage_when_asked(store, tokens) -> None:
    backend = ScriptedBackend(token_latency_s=0.02)
    async with sdk(store, backend, tokens, "s4") as (client, _):
        stream = await client.chat.completions.create(model="scripted", messages=MATH, stream=True,
                                                      stream_options={"include_usage": True}, **call("s4.0.t0"))
        pieces, generated_at_first, usage = [], None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if generated_at_first is None:
                    generated_at_first = backend.tokens_generated
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    total = backend.tokens_generated
    assert "".join(pieces) == backend.reply({"messages": MATH})["content"] and len(pieces) > 5
    assert generated_at_first is not None and generated_at_first < total  # the first delta came before the last token
    assert usage is not None and usage.completion_tokens == total


async def test_models_list_names_the_served_model_and_errors_carry_a_message(store, tokens) -> None:
    async with sdk(store, ScriptedBackend(), tokens, "s5") as (client, _):
        models = await client.models.list()
        wrong = openai.AsyncOpenAI(base_url=str(client.base_url).replace("/attempts/0/", "/attempts/5/"), api_key=CREDS.data,
                                   max_retries=0)
        with pytest.raises(openai.ConflictError) as stale:
            await wrong.chat.completions.create(model="scripted", messages=MATH, **call("s5.5.t0"))
        await wrong.close()
    assert [m.id for m in models.data] == ["scripted"]
    assert "attempt" in stale.value.message and stale.value.code in ("unknown_attempt", "stale_attempt")


async def test_a_stream_cut_by_a_checkpoint_raises_in_the_sdk(store, tokens) -> None:
    backend = ScriptedBackend(token_latency_s=0.05)
    async with sdk(store, backend, tokens, "s6") as (client, server):
        stream = await client.chat.completions.create(model="scripted", messages=MATH, stream=True, **call("s6.0.t0"))
        got: list[str] = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got.append(chunk.choices[0].delta.content)
                    if len(got) == 3:
                        await server.app[PARTICIPANT].progress.save()  # a prepare cuts a call with tokens saved
                        async with __import__("aiohttp").ClientSession() as http:
                            for op in ("prepare", "resume"):  # the cut's end goes out at resume
                                resp = await http.post(str(server.make_url(f"{CONTROL}/{op}")),
                                                       json={"checkpoint_id": "ck-sdk", "deadline": time.time() + 5},
                                                       headers={"Authorization": f"Bearer {TOKEN}"})
                                assert resp.status == 200, await resp.text()
    assert "cut" in info.value.message and len(got) >= 3
    await asyncio.sleep(0)
    assert [e.kind for e in await store.read_stream(call_stream("s6.0.t0"))] == ["call_accepted", "call_cut"]


async def test_the_sdk_needs_the_data_credential_as_its_api_key_and_shows_the_refusal(store, tokens) -> None:
    async with sdk(store, ScriptedBackend(), tokens, "s7") as (client, _):
        head = await store.head()
        outcomes = {}
        for name, key in (("wrong", "not-a-credential"), ("control", CREDS.control)):
            other = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=key, max_retries=0)
            with pytest.raises(openai.APIStatusError) as refused:
                await other.chat.completions.create(model="scripted", messages=MATH, **call("s7.0.t0"))
            await other.close()
            outcomes[name] = (type(refused.value), refused.value.code, refused.value.message)
        assert await store.head() == head  # refused before anything was written
    assert outcomes["wrong"][:2] == (openai.AuthenticationError, "unauthorized") and "credential" in outcomes["wrong"][2]
    assert outcomes["control"][:2] == (openai.PermissionDeniedError, "forbidden") and "data" in outcomes["control"][2]
