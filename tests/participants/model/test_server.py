"""The policy model server on real aiohttp servers, its log in memory (adapters.memory_store).

The only fake is at the edge of the world: testkit/fake_vllm.py, a vLLM-style upstream for the
OpenAI-compatible backend, standing in for a model server we cannot run in a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import scripted_tokenizer as tok
from adapters.export import call_tokens
from adapters.memory_store import MemoryEventStore
from adapters.openai_wire import final_message, merge_delta
from adapters.token_store import MemoryTokenStore, token_digest
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_STARTED
from engine.checkpoint import committed_event, make_cut
from engine.errors import GenerationFailed, UpstreamInvalid
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, rollout_stream
from engine.install import install_request
from engine.tokens import TokenArray
from participants.base.app import PARTICIPANT
from participants.base.guard import Credentials
from participants.base.wire import CONTROL
from participants.model.app import build_model_app
from participants.model.backends import End, Prefix, Start, Step
from participants.model.backends.openai_compatible import OpenAICompatibleBackend, _integers
from participants.model.backends.scripted import ScriptedBackend
from testkit.fake_vllm import FakeVLLM
from tests.waiting import eventually

CREDS = Credentials(control="secret-control", data="secret-data")
TOKEN = CREDS.control
DATA = {"Authorization": f"Bearer {CREDS.data}"}
MATH = {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "seed": 3}
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("look", "hit", "stand")]
BLACKJACK = {"messages": [{"role": "user", "content": "Play a hand of blackjack."}], "tools": TOOLS, "seed": 1}


class HeldAfter(ScriptedBackend):
    """Its first generation stops after `steps` steps until `release` is set (a cut cancels the wait):
    a call the test knows is in flight, with a known prefix, for as long as it needs."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.holding, self.release = steps, asyncio.Event(), asyncio.Event()

    async def generate(self, request: dict[str, Any], prefix: Prefix | None):  # type: ignore[override]
        first, sent = self.generations == 0, 0
        async for event in super().generate(request, prefix):
            yield event
            if first and isinstance(event, Step):
                sent += 1
                if sent == self.steps:  # before the next step is even generated
                    self.holding.set()
                    await self.release.wait()


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    """This module's rules promise no durability: its log is in memory (docs/testing.md)."""
    return memory_store


@pytest.fixture
def tokens(memory_tokens: MemoryTokenStore) -> MemoryTokenStore:
    return memory_tokens


@contextlib.asynccontextmanager
async def model_server(store: MemoryEventStore, backend: Any, tokens: Any, instance: str = "model-0"):
    async with TestClient(TestServer(build_model_app(store, backend, tokens, CREDS, instance))) as client:
        yield client


async def start_attempt(store: MemoryEventStore, rollout: str, attempt: int = 0) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream(rollout), ATTEMPT_STARTED, {"parent_attempt": None}, rollout, attempt),)))


def url(rollout: str, attempt: int = 0) -> str:
    return f"/rollouts/{rollout}/attempts/{attempt}/v1/chat/completions"


def call_headers(call_id: str, replaces: str | None = None) -> dict[str, str]:
    headers = {"X-Rollbook-Call-Id": call_id, **DATA}
    if replaces:
        headers["X-Rollbook-Replaces-Call-Id"] = replaces
    return headers


async def control(client: TestClient, op: str, checkpoint_id: str) -> dict[str, Any]:
    resp = await client.post(f"{CONTROL}/{op}", json={"checkpoint_id": checkpoint_id, "deadline": time.time() + 5},
                             headers={"Authorization": f"Bearer {TOKEN}"})
    body = await resp.json()
    assert resp.status == 200, body
    return body


async def save_progress(client: Any) -> None:
    """Save the tokens of the calls in flight now, as the saver does every PROGRESS_S: a prepare cuts
    only a call with tokens of its own saved."""
    await client.server.app[PARTICIPANT].progress.save()


async def kinds(store: MemoryEventStore, call_id: str) -> list[str]:
    return [e.kind for e in await store.read_stream(call_stream(call_id))]


async def sse_events(resp: Any) -> list[Any]:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


async def stream_all(client: TestClient, path: str, body: dict[str, Any], headers: dict[str, str]) -> list[Any]:
    return await sse_events(await client.post(path, json=body, headers=headers))


def streamed_ids(events: list[Any]) -> list[int]:
    """The token ids a streamed reply reported in its logprobs (asked with logprobs: true)."""
    return [int(e["token"].removeprefix("token_id:")) for ev in events if isinstance(ev, dict) and ev.get("choices")
            for e in ((ev["choices"][0].get("logprobs") or {}).get("content") or [])]


def streamed_message(events: list[Any]) -> dict[str, Any]:
    message: dict[str, Any] = {}
    for ev in events:
        if isinstance(ev, dict) and ev.get("choices"):
            merge_delta(message, ev["choices"][0]["delta"])
    return final_message(message)


def planned(backend: ScriptedBackend, request: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    prompt, steps, _ = backend.plan(request)
    return prompt, [i for s in steps for i in s.ids], [x for s in steps for x in s.logprobs]


# ---- backends ---------------------------------------------------------------------------------


async def events_of(gen: Any) -> tuple[Start, list[Step], End]:
    out = [e async for e in gen]
    assert isinstance(out[0], Start) and isinstance(out[-1], End)
    return out[0], out[1:-1], out[-1]


def joined(steps: list[Step]) -> tuple[list[int], list[float], dict[str, Any]]:
    message: dict[str, Any] = {}
    for s in steps:
        merge_delta(message, s.delta)
    return [i for s in steps for i in s.ids], [x for s in steps for x in s.logprobs], final_message(message)


async def test_scripted_backend_emits_integer_ids_and_logprobs_and_continues_any_prefix_exactly() -> None:
    backend = ScriptedBackend()
    for request in (MATH, BLACKJACK):
        start, steps, end = await events_of(backend.generate(request, None))
        ids, lps, message = joined(steps)
        assert message == backend.reply(request) and end.finish_reason in ("stop", "tool_calls")
        assert all(isinstance(i, int) and 0 <= i < tok.VOCAB_SIZE for i in ids) and ids[-1] == tok.EOS
        assert all(x < 0 for x in lps) and start.prompt_token_ids == tuple(tok.prompt_ids(request["messages"], request.get("tools")))
        for k in (1, len(steps) // 2, len(steps)):
            head_ids, head_lps, head_msg = joined(steps[:k])
            prefix = Prefix(start.prompt_token_ids, tuple(head_ids), tuple(head_lps), head_msg)
            again, rest, _ = await events_of(backend.generate(request, prefix))
            assert again.continuation == {"mode": "continued", "prefix_tokens": len(head_ids)}
            assert head_ids + joined(rest)[0] == ids and head_lps + joined(rest)[1] == lps


async def test_openai_backend_reads_vllm_token_ids_logprobs_and_prompt_ids_from_the_stream() -> None:
    async with FakeVLLM() as fake:
        backend = OpenAICompatibleBackend(fake.url, api_key="k", model="m1")
        try:
            for request in (MATH, BLACKJACK):
                start, steps, end = await events_of(backend.generate({**request, "temperature": 0.7}, None))
                prompt, ids, lps = planned(fake.model, request)
                assert start.prompt_token_ids == tuple(prompt)
                assert joined(steps)[:2] == (ids, lps)
                assert joined(steps)[2] == fake.model.reply(request)
                assert end.usage == {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        finally:
            await backend.close()
    sent = fake.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True} and sent["model"] == "m1"
    assert sent["logprobs"] is True and sent["return_tokens_as_token_ids"] is True and sent["return_token_ids"] is True
    assert sent["temperature"] == 0.7


async def test_openai_backend_reads_nemo_gyms_generation_token_ids_and_log_probs_from_a_whole_reply() -> None:
    """NeMo Gym's vLLM shape (message.generation_token_ids / generation_log_probs / prompt_token_ids),
    answered whole although the backend asked for a stream: the same ids and logprobs as vLLM's entries."""
    async with FakeVLLM(shape="nemo_gym") as fake:
        backend = OpenAICompatibleBackend(fake.url, api_key="k", model="m1")
        try:
            for request in (MATH, BLACKJACK):
                start, steps, end = await events_of(backend.generate(request, None))
                prompt, ids, lps = planned(fake.model, request)
                assert start.prompt_token_ids == tuple(prompt)
                assert joined(steps) == (ids, lps, fake.model.reply(request))
                assert end.usage == {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        finally:
            await backend.close()


async def test_openai_backend_refuses_generation_log_probs_that_do_not_match_the_ids() -> None:
    """Bad input tried: one logprob short of the generated ids."""
    fake = FakeVLLM(shape="nemo_gym")

    async def short(request):  # the fake's reply, one logprob dropped
        reply = json.loads((await FakeVLLM.completions(fake, request)).text)
        reply["choices"][0]["message"]["generation_log_probs"].pop()
        return web.json_response(reply)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", short)
    async with TestServer(app) as server:
        backend = OpenAICompatibleBackend(str(server.make_url("/v1")), api_key="k", model="m1")
        try:
            with pytest.raises(GenerationFailed, match="one logprob per generation_token_ids"):
                await events_of(backend.generate(MATH, None))
        finally:
            await backend.close()


async def test_openai_backend_continues_a_tool_less_cut_prefix_exactly_as_token_ids_on_the_completions_route() -> None:
    async with FakeVLLM() as fake:
        backend = OpenAICompatibleBackend(fake.url, model="m1")
        try:
            start, steps, _ = await events_of(backend.generate(MATH, None))
            head_ids, head_lps, head_msg = joined(steps[:4])
            prefix = Prefix(start.prompt_token_ids, tuple(head_ids), tuple(head_lps), head_msg)
            again, rest, end = await events_of(backend.generate({**MATH, "max_tokens": 100}, prefix))
        finally:
            await backend.close()
    assert again.continuation == {"mode": "continued", "prefix_tokens": len(head_ids), "via": "completions"}
    assert again.prompt_token_ids == start.prompt_token_ids  # the call's prompt, not the continuation's
    assert head_ids + joined(rest)[0] == joined(steps)[0]
    assert (head_msg.get("content") or "") + (joined(rest)[2]["content"] or "") == fake.model.reply(MATH)["content"]
    sent = fake.requests[-1]
    assert sent["prompt"] == [*start.prompt_token_ids, *head_ids]  # ids, nothing re-tokenized
    assert "messages" not in sent and sent["seed"] == MATH["seed"]
    assert sent["max_tokens"] == 100 - len(head_ids) and sent["logprobs"] == 0


async def test_openai_backend_leaves_out_an_empty_tools_list_which_vllm_refuses() -> None:
    """Bad input as vLLM sees it: `"tools": []` is a 400 there. A tool-less task's calls carry no tools
    field (and no tool_choice) upstream."""
    async with FakeVLLM() as fake:
        backend = OpenAICompatibleBackend(fake.url, model="m1")
        try:
            start, steps, end = await events_of(backend.generate({**MATH, "tools": [], "tool_choice": "auto"}, None))
        finally:
            await backend.close()
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{fake.url}/chat/completions", json={**MATH, "tools": []}) as resp:
                refused = (resp.status, await resp.json())
    assert end.finish_reason == "stop" and "tools" not in fake.requests[0] and "tool_choice" not in fake.requests[0]
    assert refused[0] == 400 and refused[1]["error"]["param"] == "tools"


@pytest.mark.parametrize("mode, request_body", [("drift", BLACKJACK), ("refuse", BLACKJACK), ("refuse", MATH)])
async def test_openai_backend_regenerates_and_says_why_when_the_upstream_cannot_continue(mode: str, request_body: dict) -> None:
    async with FakeVLLM(continuation=mode, derender=False) as fake:
        backend = OpenAICompatibleBackend(fake.url, model="m1")
        try:
            start, steps, _ = await events_of(backend.generate(request_body, None))
            head_ids, head_lps, head_msg = joined(steps[:2])
            prefix = Prefix(start.prompt_token_ids, tuple(head_ids), tuple(head_lps), head_msg)
            again, rest, _ = await events_of(backend.generate(request_body, prefix))
        finally:
            await backend.close()
    assert again.continuation is not None and again.continuation["mode"] == "regenerated"
    assert ("prompt_token_ids" if mode == "drift" else "refused") in again.continuation["reason"]
    assert joined(rest) == joined(steps)  # the whole generation again, never a splice
    assert "required_prefix_token_ids" not in fake.requests[-1] and "prompt" not in fake.requests[-1]


async def test_openai_backend_fails_clearly_when_the_upstream_stream_breaks_off() -> None:
    async with FakeVLLM() as fake:
        fake.fail_after = 2
        backend = OpenAICompatibleBackend(fake.url, model="m1")
        try:
            with pytest.raises(GenerationFailed, match="broke off|ended"):
                await events_of(backend.generate(MATH, None))
        finally:
            await backend.close()


async def test_a_new_call_digests_its_request_once(store, tokens, monkeypatch) -> None:
    """The request digest (sha256 of the canonical JSON of a body that may hold a long conversation and
    every tool schema) was computed twice per new call, at admission and again at accept."""
    import participants.model.server as model_server_module

    seen: list[str] = []
    real = model_server_module.request_digest
    monkeypatch.setattr(model_server_module, "request_digest", lambda body: seen.append("d") or real(body))
    await start_attempt(store, "dg")
    async with model_server(store, ScriptedBackend(), tokens) as client:
        resp = await client.post(url("dg"), json=MATH, headers=call_headers("dg.0.t0"))
        assert resp.status == 200
    events = await store.read_stream(call_stream("dg.0.t0"))
    assert len(seen) == 1, seen
    assert events[0].kind == "call_accepted" and len(events[0].data["request_digest"]) == 64


async def test_model_server_records_the_upstream_prompt_ids_generated_ids_and_logprobs(store, tokens) -> None:
    await start_attempt(store, "up")
    async with FakeVLLM() as fake:
        backend = OpenAICompatibleBackend(fake.url, model="m1", policy_version="weights-7")
        async with model_server(store, backend, tokens) as client:
            resp = await client.post(url("up"), json=MATH, headers=call_headers("up.0.t0"))
            body = await resp.json()
        await backend.close()
    assert body["choices"][0]["message"] == fake.model.reply(MATH)
    events = await store.read_stream(call_stream("up.0.t0"))
    assert events[0].data["policy_version"] == "weights-7" and events[0].data["stream"] is False
    assert fake.requests[0]["stream"] is True  # generated upstream in streaming mode whatever the client asked
    done = events[-1].data
    prompt, ids, lps = planned(fake.model, MATH)
    assert await tokens.get(done["receipt"]["blob_id"]) == TokenArray(tuple(ids), tuple(lps))
    assert (await tokens.get(done["prompt_receipt"]["blob_id"])).ids == tuple(prompt)
    assert done["finish_reason"] == "stop" and done["usage"]["completion_tokens"] == len(ids)
    assert done["segments"] == [{"policy_version": "weights-7", "tokens": len(ids)}]


# ---- the model server -----------------------------------------------------------------------


async def test_a_call_whose_upstream_breaks_off_is_answered_502_generation_failed(store, tokens) -> None:
    await start_attempt(store, "gf")
    async with FakeVLLM() as fake:
        fake.fail_after = 2  # the upstream's stream breaks off after two chunks
        backend = OpenAICompatibleBackend(fake.url, model="m1")
        async with model_server(store, backend, tokens) as client:
            resp = await client.post(url("gf"), json=MATH, headers=call_headers("gf.0.t0"))
            body = await resp.json()
        await backend.close()
    assert (resp.status, body["error"]["code"]) == (502, "generation_failed"), body
    assert await kinds(store, "gf.0.t0") == ["call_accepted", "call_failed"]


async def test_non_streaming_call_completes_with_custody_events(store, tokens) -> None:
    await start_attempt(store, "r1")
    backend = ScriptedBackend()
    async with model_server(store, backend, tokens) as client:
        resp = await client.post(url("r1"), json=MATH, headers={**call_headers("r1.0.t0"), "X-Rollbook-Parent-Call-Id": "r1.0.tX"})
        body = await resp.json()
        assert resp.status == 200, body
        no_prefix = await client.post("/v1/chat/completions", json=MATH, headers=call_headers("x"))
        no_prefix_error = (await no_prefix.json())["error"]["code"]
        no_call_id = await client.post(url("r1"), json=MATH, headers=DATA)
        numbered = (await no_call_id.json())["rollbook"]["call_id"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == backend.reply(MATH)
    events = await store.read_stream(call_stream("r1.0.t0"))
    assert [e.kind for e in events] == ["call_accepted", "call_completed"]
    assert all((e.rollout_id, e.attempt) == ("r1", 0) for e in events)
    assert events[0].data["parent_call_id"] == "r1.0.tX" and events[0].data["policy_version"] == "scripted-v1"
    done = events[1].data
    assert done["disposition"] == "generated" and done["reply"] == backend.reply(MATH)
    prompt, ids, lps = planned(backend, MATH)
    assert await tokens.get(done["receipt"]["blob_id"]) == TokenArray(tuple(ids), tuple(lps))
    assert (await tokens.get(done["prompt_receipt"]["blob_id"])).ids == tuple(prompt)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    assert done["finish_reason"] == body["choices"][0]["finish_reason"] == "stop"
    assert (no_prefix.status, no_prefix_error) == (400, "rollout_id_required")
    assert (no_call_id.status, numbered) == (200, "r1.0.a0.m0")  # no call id: the server numbers the call


async def test_streaming_call_streams_tokens_and_records_the_receipt(store, tokens) -> None:
    await start_attempt(store, "r2")
    backend = ScriptedBackend()
    async with model_server(store, backend, tokens) as client:
        resp = await client.post(url("r2"), json={**BLACKJACK, "stream": True, "logprobs": True}, headers=call_headers("r2.0.t0"))
        events = await sse_events(resp)
    _, ids, lps = planned(backend, BLACKJACK)
    assert streamed_ids(events) == ids
    assert streamed_message(events) == backend.reply(BLACKJACK)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "tool_calls"
    completed = (await store.read_stream(call_stream("r2.0.t0")))[-1]
    assert completed.kind == "call_completed" and completed.data["receipt"] == final["rollbook"]["receipt"]
    assert completed.data["receipt"]["digest"] == token_digest(TokenArray(tuple(ids), tuple(lps)))


async def test_a_repeated_call_id_returns_the_stored_reply_without_generating(store, tokens) -> None:
    await start_attempt(store, "r3")
    backend = ScriptedBackend()
    async with model_server(store, backend, tokens) as client:
        first = await (await client.post(url("r3"), json=MATH, headers=call_headers("r3.0.t0"))).json()
        again = await (await client.post(url("r3"), json=MATH, headers=call_headers("r3.0.t0"))).json()
        streamed = await sse_events(await client.post(url("r3"), json={**MATH, "stream": True}, headers=call_headers("r3.0.t0")))
        elsewhere = await client.post(url("r3", 1), json=MATH, headers=call_headers("r3.0.t0"))
        await elsewhere.read()
    assert again["choices"] == first["choices"]
    assert streamed_message(streamed) == first["choices"][0]["message"]
    assert backend.generations == 1
    assert (await kinds(store, "r3.0.t0")).count("call_completed") == 1
    assert elsewhere.status in (400, 409)  # attempt 1 was never started, and the id is attempt 0's anyway


async def test_streaming_call_is_cut_during_prepare_and_its_replacement_finishes_it_exactly(store, tokens) -> None:
    await start_attempt(store, "r4")
    backend = ScriptedBackend(token_latency_s=0.03)
    _, full, full_lps = planned(backend, MATH)
    async with model_server(store, backend, tokens) as client:
        resp = await client.post(url("r4"), json={**MATH, "stream": True, "logprobs": True}, headers=call_headers("r4.0.t0"))
        head = []
        for _ in range(4):  # the role chunk and three steps on the wire, then checkpoint
            head.append(json.loads((await resp.content.readline()).decode()[6:]))
            await resp.content.readline()
        await save_progress(client)
        prepared = await control(client, "prepare", "ck-cut")
        await control(client, "resume", "ck-cut")  # the cut's end waits for resume, like any reply
        rest = await sse_events(resp)
        assert prepared["ready"] and prepared["counts"]["cut"] == 1
        cut = (await store.read_stream(call_stream("r4.0.t0")))[-1]
        assert cut.kind == "call_cut" and rest[-1]["rollbook"]["cut"] is True and rest[-1]["error"]["code"] == "admission_closed"
        assert "[DONE]" not in rest
        n = cut.data["tokens"]
        # The cut keeps a prefix of what was streamed (its durable part: participants.model.progress) and says how long.
        streamed = streamed_ids(head + rest)
        assert 1 <= n <= len(streamed) < len(full) and streamed == full[:len(streamed)] and rest[-1]["rollbook"]["tokens"] == n
        prefix = await tokens.get(cut.data["receipt"]["blob_id"])  # verifies the digest
        assert prefix == TokenArray(tuple(full[:n]), tuple(full_lps[:n]))
        resp = await client.post(url("r4"), json=MATH, headers=call_headers("r4.0.t0b", replaces="r4.0.t0"))
        body = await resp.json()
    assert body["choices"][0]["message"] == backend.reply(MATH)
    done = (await store.read_stream(call_stream("r4.0.t0b")))[-1]
    assert done.data["prefix_tokens"] == n and done.data["continuation"]["mode"] == "continued"
    assert await tokens.get(done.data["receipt"]["blob_id"]) == TokenArray(tuple(full), tuple(full_lps))
    # The prefix was not generated twice; what was streamed past it (not yet saved) was.
    assert backend.tokens_generated == len(full) + cut.data.get("unsaved", 0)


async def test_a_non_streaming_call_is_cut_by_prepare_without_waiting_and_continues_under_its_own_id(store, tokens) -> None:
    await start_attempt(store, "r4b")
    backend = HeldAfter(2)  # the generation stops after two steps until released: it cannot end by itself
    _, full, full_lps = planned(backend, MATH)
    async with model_server(store, backend, tokens) as client:
        pending = asyncio.ensure_future(client.post(url("r4b"), json=MATH, headers=call_headers("r4b.0.t0")))
        await asyncio.wait_for(backend.holding.wait(), 30)
        await save_progress(client)
        prepared = await control(client, "prepare", "ck-nb")  # answers although the generation never ends
        assert not pending.done()  # the cut's reply waits for resume
        await control(client, "resume", "ck-nb")
        refused = await pending
        assert prepared["ready"] and prepared["counts"]["cut"] == 1
        assert backend.tokens_generated < len(full)  # cut where it stood, not finished first
        assert (refused.status, (await refused.json())["error"]["code"]) == (409, "admission_closed")
        body = await (await client.post(url("r4b"), json={**MATH, "logprobs": True}, headers=call_headers("r4b.0.t0"))).json()
    assert await kinds(store, "r4b.0.t0") == ["call_accepted", "call_cut", "call_accepted", "call_completed"]
    assert body["choices"][0]["message"] == backend.reply(MATH)
    assert [int(e["token"][9:]) for e in body["choices"][0]["logprobs"]["content"]] == full
    assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == full_lps
    assert backend.tokens_generated == len(full)


async def test_a_stored_reply_asked_for_during_a_checkpoint_is_held_until_resume(store, tokens) -> None:
    await start_attempt(store, "r5")
    backend = ScriptedBackend()
    async with model_server(store, backend, tokens) as client:
        assert (await client.post(url("r5"), json=MATH, headers=call_headers("r5.0.t0"))).status == 200
        prepared = await control(client, "prepare", "ck-held")
        assert prepared["ready"] and prepared["counts"] == {"accepted": 0, "cut": 0, "running": 0, "held": 0}
        # A repeat of the stored reply, whole or streamed, is held: its end would let the agent move on.
        pending = asyncio.ensure_future(client.post(url("r5"), json=MATH, headers=call_headers("r5.0.t0")))
        repeat = asyncio.ensure_future(stream_all(client, url("r5"), {**MATH, "stream": True}, call_headers("r5.0.t0")))
        participant = client.server.app[PARTICIPANT]
        await eventually("both repeats held by the server", lambda: participant.held() == 2)
        assert not pending.done() and not repeat.done(), "a reply was delivered while admission was closed"
        resumed = await control(client, "resume", "ck-held")
        resp = await asyncio.wait_for(pending, 5)
        assert resp.status == 200 and (await resp.json())["choices"][0]["message"] == backend.reply(MATH)
        streamed = await asyncio.wait_for(repeat, 5)
        assert streamed[-1] == "[DONE]" and backend.generations == 1
    assert resumed["detail"] == {"released": 2}  # the call and its streamed repeat


async def test_a_new_call_while_admission_is_closed_is_refused_and_recorded(store, tokens) -> None:
    await start_attempt(store, "r6")
    async with model_server(store, ScriptedBackend(), tokens) as client:
        await control(client, "prepare", "ck-closed")
        refused = await client.post(url("r6"), json=MATH, headers=call_headers("r6.0.t0"))
        refused_error = (await refused.json())["error"]["code"]
        await control(client, "resume", "ck-closed")
        later = await client.post(url("r6"), json=MATH, headers=call_headers("r6.0.t0"))
    assert (refused.status, refused_error) == (409, "admission_closed")
    assert later.status == 200
    events = await store.read_stream(call_stream("r6.0.t0"))
    assert [e.kind for e in events] == ["call_excluded", "call_accepted", "call_completed"]
    assert (events[0].rollout_id, events[0].attempt) == ("r6", 0)


async def test_a_fenced_attempt_gets_stale_attempt_and_writes_nothing(store, tokens) -> None:
    await start_attempt(store, "r7")
    async with model_server(store, ScriptedBackend(latency_s=0.3), tokens) as client:
        assert (await client.post(url("r7"), json=MATH, headers=call_headers("r7.0.t9"))).status == 200
        in_flight = asyncio.ensure_future(client.post(url("r7"), json=MATH, headers=call_headers("r7.0.t0")))
        while await kinds(store, "r7.0.t0") != ["call_accepted"]:
            await asyncio.sleep(0.02)
        await store.append(AppendRequest((NewEvent(rollout_stream("r7"), ATTEMPT_FENCED, {"reason": "test"}, "r7", 0),)))
        head = await store.head()
        late = await in_flight  # fenced while generating: its completion cannot land
        fresh = await client.post(url("r7"), json=MATH, headers=call_headers("r7.0.t1"))
        repeat = await client.post(url("r7"), json=MATH, headers=call_headers("r7.0.t9"))  # even a stored reply
        for resp in (late, fresh, repeat):
            assert (resp.status, (await resp.json())["error"]["code"]) == (409, "stale_attempt")
    assert await store.head() == head
    assert await kinds(store, "r7.0.t0") == ["call_accepted"] and await kinds(store, "r7.0.t1") == []


async def test_a_new_call_asks_the_gate_nothing_its_accepting_append_is_the_attempt_check(store, tokens, monkeypatch) -> None:
    """Input: new calls (named and numbered) of a live attempt, then a repeat of a stored one. The new ones
    read neither the fence position nor the attempt: their `call_accepted` append refuses a stale attempt
    itself. A repeat may be answered from the log without an append, so it asks the gate first."""
    await start_attempt(store, "r7g")
    reads: list[str] = []
    for name in ("fence_position", "attempt_reading", "attempt_status"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *a, _n=name, _real=real: (reads.append(_n), _real(*a))[1])
    async with model_server(store, ScriptedBackend(), tokens) as client:
        for call_id in ("r7g.0.t0", "r7g.0.t1"):
            assert (await client.post(url("r7g"), json=MATH, headers=call_headers(call_id))).status == 200
        assert (await client.post(url("r7g"), json=MATH, headers=DATA)).status == 200  # numbered by the server
        assert reads == []
        repeat = await client.post(url("r7g"), json=MATH, headers=call_headers("r7g.0.t0"))
    assert repeat.status == 200 and reads, reads


async def test_a_new_call_of_an_attempt_never_started_is_refused_as_stale_and_writes_nothing(store, tokens) -> None:
    """Input: a call naming attempt 3 of a rollout whose only attempt is 0, and one of a rollout never started
    (after a call of attempt 0, which records the server's policy version: its first call does)."""
    await start_attempt(store, "r7u")
    async with model_server(store, ScriptedBackend(), tokens) as client:
        assert (await client.post(url("r7u"), json=MATH, headers=call_headers("r7u.0.t0"))).status == 200
        head = await store.head()
        for rollout, attempt in (("r7u", 3), ("r7none", 0)):
            resp = await client.post(url(rollout, attempt), json=MATH, headers=call_headers(f"{rollout}.{attempt}.t0"))
            assert (resp.status, (await resp.json())["error"]["code"]) == (409, "stale_attempt")
    assert await store.head() == head


async def test_the_first_call_of_a_restored_attempt_links_to_its_saved_reply_once(store, tokens) -> None:
    await start_attempt(store, "r8")
    async with model_server(store, ScriptedBackend(), tokens) as client:
        saved = await (await client.post(url("r8"), json=MATH, headers=call_headers("r8.0.t0"))).json()
    cut = await make_cut(store, "ck-r", [("r8", 0)], [])
    await store.append(AppendRequest((committed_event(cut),)))
    await store.append(install_request(cut, {"r8": 0}))  # fences attempt 0, starts attempt 1

    fresh_backend = ScriptedBackend()
    async with model_server(store, fresh_backend, tokens, instance="model-1") as client:
        restored = await control(client, "restore", "ck-r")
        paused = await client.post(url("r8", 1), json=MATH, headers=call_headers("r8.1.t0", replaces="r8.0.t0"))
        assert (await paused.json())["error"]["code"] == "admission_closed"
        await control(client, "resume", "ck-r")
        body = await (await client.post(url("r8", 1), json=MATH, headers=call_headers("r8.1.t0", replaces="r8.0.t0"))).json()
        twice = await client.post(url("r8", 1), json=MATH, headers=call_headers("r8.1.t0-dup", replaces="r8.0.t0"))
        err = (await twice.json())["error"]
        old = await (await client.post(url("r8", 0), json=MATH, headers=call_headers("r8.0.t1"))).json()
    assert restored["detail"]["calls"] == 1
    assert body["choices"][0]["message"] == saved["choices"][0]["message"]
    assert body["rollbook"]["disposition"] == "linked" and fresh_backend.generations == 0
    events = await store.read_stream(call_stream("r8.1.t0"))
    done = [e for e in events if e.kind == "call_completed"]
    assert len(done) == 1 and done[0].data["replaces"] == "r8.0.t0" and done[0].attempt == 1
    assert twice.status == 409 and err["code"] == "invalid_phase" and "already linked" in err["detail"]
    assert old["error"]["code"] == "stale_attempt"


async def test_a_completed_call_converts_to_a_nemo_gym_token_entry_without_loss(store, tokens) -> None:
    await start_attempt(store, "ng")
    backend = ScriptedBackend()
    async with model_server(store, backend, tokens) as client:
        await client.post(url("ng"), json=BLACKJACK, headers={**call_headers("ng.0.t1"), "X-Rollbook-Parent-Call-Id": "ng.0.t0"})
    done = (await store.read_stream(call_stream("ng.0.t1")))[-1]
    record = await call_tokens(tokens, done.data, "ng", 0, parent="ng.0.t0")
    entry = record.to_token_entry(model="scripted")
    prompt, ids, lps = planned(backend, BLACKJACK)
    assert entry == {"schema_version": 1, "rollout_id": "ng", "model_call_id": "ng.0.t1", "model": "scripted",
                     "prompt_token_ids": prompt, "generation_token_ids": ids, "generation_log_probs": lps,
                     "parent_call_id": "ng.0.t0", "cum_len": len(prompt) + len(ids)}


@pytest.mark.parametrize("upstream", [None, "vllm", "refuse"])
async def test_a_cut_call_streamed_again_is_one_ordinary_completion_whether_continued_or_regenerated(
        store, tokens, upstream: str | None) -> None:
    await start_attempt(store, "rs")
    # The first generation stops after 3 steps until the test lets it go: a few tokens in, surely unfinished.
    fake = FakeVLLM(continuation=upstream) if upstream else None
    backend: Any = HeldAfter(3)
    if fake is not None:
        fake.stall_after = 3
        await fake.start()
        backend = OpenAICompatibleBackend(fake.url, model="m1")
    _, full, full_lps = planned(ScriptedBackend(), MATH)
    try:
        async with model_server(store, backend, tokens) as client:
            pending = asyncio.ensure_future(client.post(url("rs"), json=MATH, headers=call_headers("rs.0.t0")))
            calls = client.server.app[PARTICIPANT].calls  # type: ignore[attr-defined]
            await eventually("3 steps of the call received", lambda: "rs.0.t0" in calls and len(calls["rs.0.t0"].steps) >= 3)
            await save_progress(client)
            await control(client, "prepare", "ck-rs")
            if fake is not None:
                fake.unstall()  # the repeat below streams to its end
            await control(client, "resume", "ck-rs")
            assert (await pending).status == 409
            events = await stream_all(client, url("rs"), {**MATH, "stream": True, "logprobs": True}, call_headers("rs.0.t0"))
    finally:
        if fake is not None:
            await backend.close()
            await fake.stop()
    cut, done = [e for e in await store.read_stream(call_stream("rs.0.t0")) if e.kind in ("call_cut", "call_completed")]
    assert cut.data["tokens"] > 0 and events[-1] == "[DONE]"
    assert streamed_ids(events) == full and streamed_message(events) == ScriptedBackend().reply(MATH)
    assert [float(x) for x in full_lps] == [e["logprob"] for ev in events if isinstance(ev, dict) and ev.get("choices")
                                            for e in ((ev["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert done.data["continuation"]["mode"] == ("regenerated" if upstream == "refuse" else "continued")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def streaming_upstream(call: Callable[[int], tuple[Any, dict[str, Any]]]) -> web.Application:
    """An upstream that streams each call three chunks: the first with `prompt_token_ids`, one delta with
    one token, the finish. `call(n)` gives the n-th call's (1, 2, ...) prompt ids and delta."""
    served = {"n": 0}

    async def upstream(request: web.Request) -> web.StreamResponse:
        served["n"] += 1
        prompt_ids, delta = call(served["n"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = {"id": "c", "prompt_token_ids": prompt_ids,
                 "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        step = {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                        "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.5}]}}]}
        await resp.write(b"data: " + json.dumps(step).encode() + b"\n\n")
        end = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream)
    return app


@pytest.mark.parametrize("index", [2_000_000, -1, "0", 128])
async def test_an_upstream_tool_call_index_bomb_fails_that_call_upstream_invalid_before_anything_is_allocated(
        store, tokens, index: Any) -> None:
    """Bad input tried: one ~100-byte streamed chunk with `tool_calls[{"index": 2000000}]` (and a
    negative, a string and a just-too-large index). Before, the server filled the gap slot by slot in its
    event loop: 8-9 s and 2.2 GB for 2,000,000. Now that call fails `upstream_invalid` at once, the
    process grows by no more than a few MB, and the next call on the same server is answered."""
    bomb = {"index": index, "id": "x", "type": "function", "function": {"name": "f", "arguments": ""}}
    app = streaming_upstream(lambda n: ([1, 2, 3], {"tool_calls": [bomb]} if n == 1 else {"content": "42"}))
    await start_attempt(store, "bomb")
    async with TestServer(app) as server:
        backend = OpenAICompatibleBackend(str(server.make_url("/v1")), model="m1")
        try:
            async with model_server(store, backend, tokens) as client:
                before, started = _rss_mb(), time.monotonic()
                resp = await client.post(url("bomb"), json=BLACKJACK, headers=call_headers("bomb.0.t0"))
                body = await resp.json()
                took, grown = time.monotonic() - started, _rss_mb() - before
                again = await client.post(url("bomb"), json=MATH, headers=call_headers("bomb.0.t1"))
                assert again.status == 200, await again.text()
        finally:
            await backend.close()
    assert (resp.status, body["error"]["code"]) == (502, "upstream_invalid"), body
    assert grown < 50, f"the model server grew by {grown:.0f} MB on one chunk (in {took:.1f} s)"
    failed = [e for e in await store.read_stream(call_stream("bomb.0.t0")) if e.kind == "call_failed"]
    assert [e.data["error"]["code"] for e in failed] == ["upstream_invalid"]


@pytest.mark.parametrize("prompt_ids", [[1, "7", 3], [1, 1.5, 3], [1, None, 3], [1, [2], 3], "1 2 3", [1, float("nan")]],
                         ids=["string", "float", "null", "list", "text", "nan"])
async def test_an_upstreams_prompt_token_ids_that_are_not_integers_fail_that_call_upstream_invalid(
        store, tokens, prompt_ids: Any) -> None:
    """Bad input tried: a streamed first chunk whose `prompt_token_ids` holds a string id, a float, a null,
    a list or a NaN, or is a string itself. Before, `"7"` was taken for 7 and `1.5` for 1 (the call was
    answered), and the others failed the call `generation_failed` with Python's own TypeError or
    ValueError for a message. Now that call fails `upstream_invalid`, recorded in its stream, and the
    next call on the same server, whose ids are integers, is answered."""
    app = streaming_upstream(lambda n: (prompt_ids if n == 1 else [1, 2, 3], {"content": "42"}))
    await start_attempt(store, "ids")
    async with TestServer(app) as server:
        backend = OpenAICompatibleBackend(str(server.make_url("/v1")), model="m1")
        try:
            async with model_server(store, backend, tokens) as client:
                resp = await client.post(url("ids"), json=MATH, headers=call_headers("ids.0.t0"))
                body = await resp.json()
                again = await client.post(url("ids"), json=MATH, headers=call_headers("ids.0.t1"))
                assert again.status == 200, await again.text()
        finally:
            await backend.close()
    assert (resp.status, body["error"]["code"]) == (502, "upstream_invalid"), body
    assert "prompt_token_ids" in body["error"]["message"]
    failed = [e for e in await store.read_stream(call_stream("ids.0.t0")) if e.kind == "call_failed"]
    assert [e.data["error"]["code"] for e in failed] == ["upstream_invalid"]


@given(st.lists(st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.booleans(), st.floats(allow_nan=True),
                          st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2)), max_size=30))
@settings(max_examples=400)
def test_an_upstreams_token_ids_are_taken_exactly_when_every_one_is_an_integer(ids: list[Any]) -> None:
    """Any list of JSON-like scalars and lists as an upstream's `prompt_token_ids`: taken as they are
    when every element is an int (a bool is one, and the token store refuses it), refused
    `upstream_invalid` otherwise (a float however integral, a string, a null, a list)."""
    if all(isinstance(i, int) for i in ids):
        assert _integers(ids, "prompt_token_ids") == tuple(ids)
    else:
        with pytest.raises(UpstreamInvalid, match="prompt_token_ids must be integers"):
            _integers(ids, "prompt_token_ids")
