"""A model call cut inside a tool call continues from its durable prefix, as a text reply does.

The upstream is the vLLM-style fake (testkit/fake_vllm.py); the model server runs on a real aiohttp
server with its log in memory. The tokens generated again after a cut are counted from what the
upstream sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from adapters.openai_wire import final_message, merge_delta
from engine.identity import call_stream
from participants.base.app import PARTICIPANT
from participants.model.backends import End, Prefix, Start, Step
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from participants.model.backends.scripted import ScriptedBackend
from testkit.fake_vllm import FakeVLLM
from tests.participants.model.test_server import (
    BLACKJACK,
    call_headers,
    control,
    events_of,
    joined,
    kinds,
    model_server,
    planned,
    save_progress,
    start_attempt,
    url,
)
from tests.waiting import eventually


def inside_the_tool_call(steps: list[Any]) -> int:
    """How many steps to keep so the prefix ends inside the tool call's arguments."""
    first_args = next(i for i, s in enumerate(steps) if (s.delta.get("tool_calls") or [{}])[0].get("function", {}).get("arguments"))
    return first_args + 2


@dataclass
class CutAndContinued:
    """A BLACKJACK generation cut inside its tool call, and the generation that continued it."""

    start: Start
    steps: list[Step]
    head_ids: list[int]
    head_msg: dict[str, Any]
    steps_sent_before: int  # what the upstream had sent before the continuation was asked
    again: Start
    rest: list[Step]
    end: End


async def cut_inside_a_tool_call_and_continued(fake: FakeVLLM) -> CutAndContinued:
    backend = OpenAICompatibleBackend(fake.url, model="m1")
    try:
        start, steps, _ = await events_of(backend.generate(BLACKJACK, None))
        head_ids, head_lps, head_msg = joined(steps[: inside_the_tool_call(steps)])
        assert head_msg.get("tool_calls"), "the prefix must end inside a tool call"
        prefix = Prefix(start.prompt_token_ids, tuple(head_ids), tuple(head_lps), head_msg)
        sent_before = fake.steps_sent
        again, rest, end = await events_of(backend.generate(BLACKJACK, prefix))
    finally:
        await backend.close()
    return CutAndContinued(start, steps, head_ids, head_msg, sent_before, again, rest, end)


async def test_the_openai_backend_continues_a_prefix_cut_inside_a_tool_call_on_an_upstream_that_honours_the_prefix_ids() -> None:
    """NeMo Gym's patched vLLM takes `required_prefix_token_ids` as the exact prompt: the tool call goes on
    where it was cut."""
    async with FakeVLLM(continuation="nemo_gym", derender=False) as fake:
        cut = await cut_inside_a_tool_call_and_continued(fake)
    start, steps, head_ids, head_msg = cut.start, cut.steps, cut.head_ids, cut.head_msg
    assert cut.again.continuation == {"mode": "continued", "prefix_tokens": len(head_ids), "via": "continue_final_message"}
    assert head_ids + joined(cut.rest)[0] == joined(steps)[0]
    assert fake.steps_sent - cut.steps_sent_before == len(steps) - inside_the_tool_call(steps)  # nothing of the prefix again
    assert cut.end.finish_reason == "tool_calls"
    sent = fake.requests[-1]
    assert sent["messages"][-1]["tool_calls"] == head_msg["tool_calls"]  # the partial call rides in the message
    assert sent["required_prefix_token_ids"] == [*start.prompt_token_ids, *head_ids]


async def test_a_cut_inside_a_tool_call_continues_as_token_ids_parsed_by_the_upstreams_derender_route() -> None:
    """vLLM with `--enable-scale-out`: the rest of the tool call comes from the completions route with
    the ids as the prompt, and the upstream's parser turns the whole generation's ids into the reply,
    which is the uninterrupted one."""
    async with FakeVLLM() as fake:
        cut = await cut_inside_a_tool_call_and_continued(fake)
    start, steps, head_ids, head_msg = cut.start, cut.steps, cut.head_ids, cut.head_msg
    assert cut.again.continuation == {"mode": "continued", "prefix_tokens": len(head_ids), "via": "completions+derender"}
    ids, _, tail = joined(cut.rest)
    assert head_ids + ids == joined(steps)[0] and cut.end.finish_reason == "tool_calls"
    whole: dict = {}
    for delta in (head_msg, tail):
        merge_delta(whole, {"content": delta.get("content"), "tool_calls": [{**c, "index": i} for i, c in enumerate(delta.get("tool_calls") or [])]})
    assert final_message(whole) == final_message(joined(steps)[2])
    completion, derender = fake.requests[-2:]
    assert completion["prompt"] == [*start.prompt_token_ids, *head_ids]
    assert derender["generate_response"]["choices"][0]["token_ids"] == joined(steps)[0]


async def test_a_cut_inside_a_tool_call_on_stock_vllm_without_the_derender_route_is_regenerated_and_says_why() -> None:
    """Without the derender route the chat route continues it, and stock vLLM ignores
    `required_prefix_token_ids` and its chat template closes a partial tool call: the prompt it reports
    is not the prompt plus the prefix, so the call starts over, never a splice."""
    async with FakeVLLM(derender=False) as fake:
        cut = await cut_inside_a_tool_call_and_continued(fake)
    assert cut.again.continuation is not None and cut.again.continuation["mode"] == "regenerated"
    assert "prompt_token_ids" in cut.again.continuation["reason"]
    assert joined(cut.rest)[0] == joined(cut.steps)[0] and cut.end.finish_reason == "tool_calls"


async def test_a_tool_call_cut_by_prepare_is_continued_and_its_reply_is_the_uninterrupted_one(memory_store, memory_tokens) -> None:
    store, tokens = memory_store, memory_tokens
    await start_attempt(store, "tc")
    _, full, full_lps = planned(ScriptedBackend(), BLACKJACK)
    reply = ScriptedBackend().reply(BLACKJACK)
    assert reply.get("tool_calls"), "this request must make the scripted policy call a tool"
    fake = FakeVLLM()  # vLLM with the derender route: the rest comes as token ids, parsed by the upstream
    _, steps, _ = fake.model.plan(BLACKJACK)
    fake.stall_after = inside_the_tool_call(steps)  # the stream stops inside the tool call until let go
    await fake.start()
    backend = OpenAICompatibleBackend(fake.url, model="m1")
    try:
        async with model_server(store, backend, tokens) as client:
            pending = asyncio.ensure_future(client.post(url("tc"), json=BLACKJACK, headers=call_headers("tc.0.t0")))
            calls = client.server.app[PARTICIPANT].calls  # type: ignore[attr-defined]
            await eventually("the call stalled inside its tool call",
                             lambda: "tc.0.t0" in calls and len(calls["tc.0.t0"].steps) >= fake.stall_after)
            await save_progress(client)
            await control(client, "prepare", "ck-tc")
            cut_call = calls["tc.0.t0"]
            await eventually("the cut generation's stream closed", lambda: cut_call.task is not None and cut_call.task.done())
            fake.unstall()
            sent_before = fake.steps_sent
            await control(client, "resume", "ck-tc")
            assert (await pending).status == 409
            body = await (await client.post(url("tc"), json={**BLACKJACK, "logprobs": True},
                                            headers=call_headers("tc.0.t0"))).json()
    finally:
        await backend.close()
        await fake.stop()
    cut, done = [e for e in await store.read_stream(call_stream("tc.0.t0")) if e.kind in ("call_cut", "call_completed")]
    assert cut.data["partial"].get("tool_calls"), "the cut fell inside the tool call"
    assert done.data["continuation"]["mode"] == "continued", done.data["continuation"]
    assert body["choices"][0]["message"] == reply
    assert [int(e["token"][9:]) for e in body["choices"][0]["logprobs"]["content"]] == full
    assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == full_lps
    regenerated = fake.steps_sent - sent_before - (len(steps) - fake_prefix_steps(steps, cut.data["tokens"]))
    assert regenerated == 0  # not one token of the prefix was generated again
    assert await kinds(store, "tc.0.t0") == ["call_accepted", "call_cut", "call_accepted", "call_completed"]


def fake_prefix_steps(steps: list[Any], tokens: int) -> int:
    n, k = 0, 0
    while n < tokens:
        n += len(steps[k].ids)
        k += 1
    return k
