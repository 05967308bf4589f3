"""The policy model server on real aiohttp servers and a real PostgreSQL log.

The only fake is at the edge of the world: a small OpenAI-compatible upstream for the
OpenAI-compatible backend, standing in for a hosted model we cannot reach from a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from adapters.generation import OpenAICompatibleBackend, ScriptedBackend, message_from_tokens
from adapters.postgres import PostgresEventStore
from adapters.token_store import PostgresTokenStore, token_digest
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_STARTED
from engine.checkpoint import committed_event, install_request, make_cut
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, rollout_stream
from participants.control_plane import CONTROL
from participants.guard import Credentials
from participants.model_server import build_model_app

CREDS = Credentials(control="secret-control", data="secret-data")
TOKEN = CREDS.control
DATA = {"Authorization": f"Bearer {CREDS.data}"}
MATH = {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "seed": 3}
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("look", "hit", "stand")]
BLACKJACK = {"messages": [{"role": "user", "content": "Play a hand of blackjack."}], "tools": TOOLS, "seed": 1}


@pytest.fixture
async def tokens(dsn: str):
    s = PostgresTokenStore(dsn)
    yield s
    await s.close()


@contextlib.asynccontextmanager
async def model_server(store: PostgresEventStore, backend: Any, tokens: Any, instance: str = "model-0"):
    async with TestClient(TestServer(build_model_app(store, backend, tokens, CREDS, instance))) as client:
        yield client


async def start_attempt(store: PostgresEventStore, rollout: str, attempt: int = 0) -> None:
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


async def kinds(store: PostgresEventStore, call_id: str) -> list[str]:
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


def streamed_tokens(events: list[Any]) -> list[str]:
    return [e["rollbook"]["token"] for e in events if isinstance(e, dict) and "token" in e.get("rollbook", {})]


# ---- backends ---------------------------------------------------------------------------------


async def collect(gen: Any) -> list[str]:
    return [tok async for tok in gen]


async def test_scripted_backend_continues_any_prefix_to_the_uninterrupted_output() -> None:
    backend = ScriptedBackend()
    for request in (MATH, BLACKJACK):
        full = await collect(backend.generate(request, []))
        assert message_from_tokens(full) == backend.reply(request)
        for k in (0, 1, len(full) // 2, len(full)):
            assert full[:k] + await collect(backend.generate(request, full[:k])) == full


CANNED = 'Hello, wörld! "quoted"\nbye'
CALL = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"hand": 1}'}}


@contextlib.asynccontextmanager
async def openai_upstream():
    """A minimal OpenAI-compatible server: canned content (or a tool call when tools are given),
    streamed in small deltas, and vLLM's continue_final_message for a partial assistant reply."""
    seen: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body.get("tools"):
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [CALL]}
            deltas = [{"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                            "function": {"name": "look", "arguments": '{"hand"'}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
        else:
            text = CANNED
            last = body["messages"][-1]
            if body.get("continue_final_message") and last["role"] == "assistant":
                assert CANNED.startswith(last["content"])
                text = CANNED[len(last["content"]):]
            message = {"role": "assistant", "content": text, "refusal": None}
            deltas = [{"content": text[i:i + 4]} for i in range(0, len(text), 4)]
        if not body.get("stream"):
            return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for d in deltas:
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'delta': d}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/v1", seen
    finally:
        await runner.cleanup()


async def test_openai_backend_maps_streamed_and_whole_replies_to_the_upstream_message() -> None:
    async with openai_upstream() as (base, seen):
        streaming = OpenAICompatibleBackend(base, api_key="k", model="m1")
        whole = OpenAICompatibleBackend(base, model="m1", stream_upstream=False)
        try:
            for backend in (streaming, whole):
                text = message_from_tokens(await collect(backend.generate(MATH, [])))
                assert text == {"role": "assistant", "content": CANNED}
                call = message_from_tokens(await collect(backend.generate(BLACKJACK, [])))
                assert call == {"role": "assistant", "content": None, "tool_calls": [CALL]}
            assert [b["stream"] for b in seen] == [True, True, False, False]
            assert all(b["model"] == "m1" for b in seen)
            # A cut inside the content continues upstream from the partial reply, and joins exactly.
            full = await collect(streaming.generate(MATH, []))
            rest = await collect(streaming.generate(MATH, full[:3]))
            assert full[:3] + rest == full
            assert seen[-1]["continue_final_message"] is True and seen[-1]["messages"][-1]["role"] == "assistant"
        finally:
            await streaming.close()
            await whole.close()


async def test_model_server_returns_the_upstream_message_of_an_openai_backend(store, tokens) -> None:
    await start_attempt(store, "up")
    async with openai_upstream() as (base, _seen):
        backend = OpenAICompatibleBackend(base, model="m1", policy_version="weights-7")
        async with model_server(store, backend, tokens) as client:
            resp = await client.post(url("up"), json=MATH, headers=call_headers("up.0.t0"))
            body = await resp.json()
        await backend.close()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CANNED}
    accepted = (await store.read_stream(call_stream("up.0.t0")))[0]
    assert accepted.data["policy_version"] == "weights-7"


# ---- the model server -----------------------------------------------------------------------


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
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == backend.reply(MATH)
    events = await store.read_stream(call_stream("r1.0.t0"))
    assert [e.kind for e in events] == ["call_accepted", "call_completed"]
    assert all((e.rollout_id, e.attempt) == ("r1", 0) for e in events)
    assert events[0].data["parent_call_id"] == "r1.0.tX" and events[0].data["policy_version"] == "scripted-v1"
    done = events[1].data
    assert done["disposition"] == "generated" and done["reply"] == backend.reply(MATH)
    assert await tokens.get(done["receipt"]["blob_id"]) == backend.full_tokens(MATH)
    assert (no_prefix.status, no_prefix_error) == (400, "rollout_id_required")
    assert no_call_id.status == 400


async def test_streaming_call_streams_tokens_and_records_the_receipt(store, tokens) -> None:
    await start_attempt(store, "r2")
    backend = ScriptedBackend()
    async with model_server(store, backend, tokens) as client:
        resp = await client.post(url("r2"), json={**BLACKJACK, "stream": True}, headers=call_headers("r2.0.t0"))
        events = await sse_events(resp)
    full = backend.full_tokens(BLACKJACK)
    assert streamed_tokens(events) == full
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "tool_calls"
    assert final["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "look"
    completed = (await store.read_stream(call_stream("r2.0.t0")))[-1]
    assert completed.kind == "call_completed" and completed.data["receipt"] == final["rollbook"]["receipt"]
    assert completed.data["receipt"]["digest"] == token_digest(full)


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
    assert streamed[-2]["choices"][0]["delta"]["content"] == first["choices"][0]["message"]["content"]
    assert backend.generations == 1
    assert (await kinds(store, "r3.0.t0")).count("call_completed") == 1
    assert elsewhere.status in (400, 409)  # attempt 1 was never started, and the id is attempt 0's anyway


async def test_streaming_call_is_cut_during_prepare_and_its_replacement_finishes_it_exactly(store, tokens) -> None:
    await start_attempt(store, "r4")
    backend = ScriptedBackend(token_latency_s=0.03)
    full = backend.full_tokens(MATH)
    async with model_server(store, backend, tokens) as client:
        resp = await client.post(url("r4"), json={**MATH, "stream": True}, headers=call_headers("r4.0.t0"))
        for _ in range(3):  # three tokens on the wire, then checkpoint
            await resp.content.readline()
            await resp.content.readline()
        prepared = await control(client, "prepare", "ck-cut")
        rest = await sse_events(resp)
        assert prepared["ready"] and prepared["counts"]["cut"] == 1
        cut = (await store.read_stream(call_stream("r4.0.t0")))[-1]
        assert cut.kind == "call_cut" and rest[-1]["rollbook"]["cut"] is True
        n = cut.data["tokens"]
        assert 3 <= n < len(full) and len(streamed_tokens(rest)) == n - 3
        prefix = await tokens.get(cut.data["receipt"]["blob_id"])  # verifies the digest
        assert prefix == full[:n] and token_digest(prefix) == cut.data["receipt"]["digest"]

        await control(client, "resume", "ck-cut")
        resp = await client.post(url("r4"), json=MATH, headers=call_headers("r4.0.t0b", replaces="r4.0.t0"))
        body = await resp.json()
    assert body["choices"][0]["message"] == backend.reply(MATH)
    done = (await store.read_stream(call_stream("r4.0.t0b")))[-1]
    assert done.data["prefix_tokens"] == n and await tokens.get(done.data["receipt"]["blob_id"]) == full
    assert backend.tokens_generated == len(full)  # the prefix was not generated twice


async def test_a_reply_completed_during_prepare_is_held_until_resume(store, tokens) -> None:
    await start_attempt(store, "r5")
    backend = ScriptedBackend(latency_s=0.5)
    async with model_server(store, backend, tokens) as client:
        pending = asyncio.ensure_future(client.post(url("r5"), json=MATH, headers=call_headers("r5.0.t0")))
        while await kinds(store, "r5.0.t0") != ["call_accepted"]:
            await asyncio.sleep(0.02)
        prepared = await control(client, "prepare", "ck-held")
        assert prepared["ready"] and prepared["counts"] == {"accepted": 1, "completed": 1, "cut": 0, "held": 1}
        assert await kinds(store, "r5.0.t0") == ["call_accepted", "call_completed"]
        # A streamed repeat of the stored reply is held as well: its end would let the agent move on.
        repeat = asyncio.ensure_future(stream_all(client, url("r5"), {**MATH, "stream": True}, call_headers("r5.0.t0")))
        await asyncio.sleep(0.2)
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
