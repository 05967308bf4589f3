"""The token progress of generations in flight is saved in the background, and a prepare cuts every
call that has tokens of its own saved, at its durable prefix, appending nothing and writing no blob:
it hands the cuts to the coordinator (engine.prepare_records); the other calls run on through the
checkpoint.

The model server runs on a real aiohttp server with its log and token store in memory; the backend is
the scripted policy, held at a step the test chooses. Without a coordinator, a resume appends the cuts
a prepare handed over, as after a checkpoint aborted before its commit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.identity import call_stream
from engine.prepare_records import PrepareRecord
from engine.tokens import TokenArray
from participants.base.app import PARTICIPANT
from participants.base.observability import METRICS_PATH
from participants.model.backends import Prefix, Start, Step
from participants.model.backends.scripted import ScriptedBackend
from tests.participants.model.test_server import (
    MATH,
    TOKEN,
    call_headers,
    control,
    model_server,
    planned,
    start_attempt,
    url,
)
from tests.waiting import eventually


class Paced(ScriptedBackend):
    """Every generation (a continuation too) stops before its step `allowed` until the test allows more (a
    cut cancels the wait)."""

    def __init__(self, allowed: int) -> None:
        super().__init__()
        self.allowed = allowed
        self.more = asyncio.Condition()

    async def allow(self, steps: int) -> None:
        async with self.more:
            self.allowed = steps
            self.more.notify_all()

    async def generate(self, request: dict[str, Any], prefix: Prefix | None):  # type: ignore[override]
        sent = 0
        async for event in super().generate(request, prefix):
            if isinstance(event, Step):
                async with self.more:
                    await self.more.wait_for(lambda n=sent: n < self.allowed)
                sent += 1
            yield event


async def cuttable(client: Any) -> float:
    resp = await client.get(METRICS_PATH, headers={"Authorization": f"Bearer {TOKEN}"})
    line = next(x for x in (await resp.text()).splitlines() if x.startswith("rollbook_model_calls_cuttable "))
    return float(line.split()[1])


class Spy:
    """Wraps a store's append and a token store's writes: what each append carried, and every write."""

    def __init__(self, store: Any, tokens: Any) -> None:
        self.appends: list[list[str]] = []
        self.writes = 0
        append, put, stage = store.append, tokens.put, tokens.stage

        async def spy_append(request: Any) -> Any:
            self.appends.append([e.kind for e in request.events])
            return await append(request)

        async def spy_put(*a: Any, **k: Any) -> Any:
            self.writes += 1
            return await put(*a, **k)

        async def spy_stage(*a: Any, **k: Any) -> Any:
            self.writes += 1
            return await stage(*a, **k)

        store.append, tokens.put, tokens.stage = spy_append, spy_put, spy_stage


async def test_prepare_hands_over_the_cut_of_every_call_at_its_saved_prefix_and_appends_nothing(memory_store, memory_tokens) -> None:
    store, tokens = memory_store, memory_tokens
    rollouts = [f"pg{i}" for i in range(6)]
    for r in rollouts:
        await start_attempt(store, r)
    backend = Paced(allowed=3)
    _, full, full_lps = planned(ScriptedBackend(), MATH)
    five = sum(len(step.ids) for step in ScriptedBackend().plan(MATH)[1][:5])
    async with model_server(store, backend, tokens) as client:
        model = client.server.app[PARTICIPANT]  # type: ignore[attr-defined]
        pending = [asyncio.ensure_future(client.post(url(r), json={**MATH, "stream": i % 2 == 0},
                                                     headers=call_headers(f"{r}.0.t0"))) for i, r in enumerate(rollouts)]
        calls = model.calls
        await eventually("every call three steps in", lambda: len(calls) == len(rollouts) and all(len(c.steps) >= 3 for c in calls.values()))
        await eventually("every call's three steps saved", lambda: all(c.durable is not None and c.durable.tokens == len(c.ids)
                                                                      for c in calls.values()))
        saved = {c.call_id: c.durable.tokens for c in calls.values()}
        assert await cuttable(client) == len(rollouts)  # what a prepare now would cut, on /metrics
        await model.progress.stop()  # the saver sees no more steps: the cut must be at the saved prefix
        await backend.allow(5)  # two more steps each
        await eventually("every call five steps in", lambda: all(len(c.steps) >= 5 for c in calls.values()))
        spy = Spy(store, tokens)
        prepared = await control(client, "prepare", "ck-pg")
        assert prepared["ready"] and prepared["counts"]["cut"] == len(rollouts)
        assert spy.appends == [] and spy.writes == 0  # the prefixes were durable already: nothing written
        assert await cuttable(client) == 0
        records = [PrepareRecord.from_json(r) for r in prepared["records"]]
        assert sorted(r.event.stream for r in records) == sorted(call_stream(f"{r}.0.t0") for r in rollouts)
        for r in records[:3]:  # as the coordinator does, with `checkpoint_prepared`; the rest were left out
            await store.append(r.request())
        await control(client, "resume", "ck-pg")  # appends what was left out, under the same keys
        await asyncio.gather(*pending)
        await backend.allow(len(full))
        body = await (await client.post(url("pg1"), json={**MATH, "logprobs": True}, headers=call_headers("pg1.0.t0"))).json()
    for r in rollouts:
        events = await store.read_stream(call_stream(f"{r}.0.t0"))
        assert [e.kind for e in events][:2] == ["call_accepted", "call_cut"]
        assert [e.kind for e in events].count("call_cut") == 1  # one copy, whoever appended it first
        cut = events[1]
        assert cut.data["tokens"] == saved[f"{r}.0.t0"] < len(full)
        assert cut.data["tokens"] + cut.data["unsaved"] == five  # what it had received, counted as generated again
        n = cut.data["tokens"]
        assert await tokens.get(cut.data["receipt"]["blob_id"]) == TokenArray(tuple(full[:n]), tuple(full_lps[:n]))
    assert [int(e["token"][9:]) for e in body["choices"][0]["logprobs"]["content"]] == full
    done = (await store.read_stream(call_stream("pg1.0.t0")))[-1]
    assert done.kind == "call_completed" and done.data["continuation"]["mode"] == "continued"


async def test_a_call_recording_its_reply_when_prepare_comes_is_not_waited_for_and_its_reply_waits_for_resume(
        memory_store, memory_tokens) -> None:
    """Prepare answers while the call's completion is still being appended; the reply, ready during the
    checkpoint, reaches the client only at resume, and the call ends with that reply alone."""
    store, tokens = memory_store, memory_tokens
    await start_attempt(store, "pr")
    held, release = asyncio.Event(), asyncio.Event()
    append = store.append

    async def slow_completion(request: Any) -> Any:
        if any(e.kind == "call_completed" for e in request.events):
            held.set()
            await release.wait()  # the reply is being recorded when the checkpoint comes
        return await append(request)

    store.append = slow_completion
    async with model_server(store, ScriptedBackend(), tokens) as client:
        model = client.server.app[PARTICIPANT]  # type: ignore[attr-defined]
        pending = asyncio.ensure_future(client.post(url("pr"), json=MATH, headers=call_headers("pr.0.t0")))
        await asyncio.wait_for(held.wait(), 30)
        call = model.calls["pr.0.t0"]
        prepared = await asyncio.wait_for(control(client, "prepare", "ck-pr"), 10)  # without the release
        release.set()
        await eventually("the completion recorded", lambda: call.state == "completed")
        await asyncio.sleep(0.1)
        assert not pending.done()  # held: the checkpoint is still open
        await control(client, "resume", "ck-pr")
        reply = await pending
        body = await reply.json()
    assert prepared["ready"] and prepared["counts"]["cut"] == 0 and prepared["counts"]["running"] == 1
    assert [e.kind for e in await store.read_stream(call_stream("pr.0.t0"))] == ["call_accepted", "call_completed"]
    assert reply.status == 200 and body["choices"][0]["message"] == ScriptedBackend().reply(MATH)


async def test_a_call_with_nothing_of_its_generation_saved_is_not_cut_but_runs_on_to_its_reply(memory_store, memory_tokens) -> None:
    """A cut keeps only what is durable already: a generation none of whose tokens the saver has
    written would lose them all, so prepare leaves it running and its reply waits for resume."""
    store, tokens = memory_store, memory_tokens
    await start_attempt(store, "ns")
    backend = Paced(allowed=2)
    _, full, _ = planned(ScriptedBackend(), MATH)
    async with model_server(store, backend, tokens) as client:
        model = client.server.app[PARTICIPANT]  # type: ignore[attr-defined]
        first = asyncio.ensure_future(client.post(url("ns"), json=MATH, headers=call_headers("ns.0.t0")))
        await eventually("two steps in", lambda: "ns.0.t0" in model.calls and len(model.calls["ns.0.t0"].steps) >= 2)
        await model.progress.stop()  # no save happens from here on
        call = model.calls["ns.0.t0"]
        prepared = await control(client, "prepare", "ck-ns")
        await backend.allow(len(full))
        await eventually("the call completed", lambda: call.state == "completed")
        assert not first.done()  # its reply waits for resume
        await control(client, "resume", "ck-ns")
        reply = await first
    assert prepared["counts"]["cut"] == 0 and prepared["counts"]["running"] == 1 and prepared["records"] == []
    assert reply.status == 200
    assert [e.kind for e in await store.read_stream(call_stream("ns.0.t0"))] == ["call_accepted", "call_completed"]


class HeldStart(Paced):
    """Paced, and while `starting` is clear a generation waits before its first event (the backend has
    not answered yet: the call holds its prefix and no prompt ids of this generation)."""

    def __init__(self, allowed: int) -> None:
        super().__init__(allowed)
        self.starting = asyncio.Event()
        self.starting.set()

    async def generate(self, request: dict[str, Any], prefix: Prefix | None):  # type: ignore[override]
        await self.starting.wait()
        async for event in super().generate(request, prefix):
            yield event


async def test_a_continued_call_that_made_nothing_since_its_cut_is_not_cut_again_but_runs_on_through_the_checkpoint(
        memory_store, memory_tokens) -> None:
    """Cut once, continued, and the next checkpoint comes before the continuation's backend answers:
    a cut would keep nothing it made, so that prepare leaves the call running (without waiting for
    it), and it goes on to its reply, which waits for resume. However often checkpoints come, a call
    is cut only where the cut keeps tokens it made."""
    store, tokens = memory_store, memory_tokens
    await start_attempt(store, "lf")
    backend = HeldStart(allowed=2)
    _, full, _ = planned(ScriptedBackend(), MATH)
    async with model_server(store, backend, tokens) as client:
        model = client.server.app[PARTICIPANT]  # type: ignore[attr-defined]
        first = asyncio.ensure_future(client.post(url("lf"), json=MATH, headers=call_headers("lf.0.t0")))
        await eventually("two steps in", lambda: "lf.0.t0" in model.calls and len(model.calls["lf.0.t0"].steps) >= 2)
        assert await model.progress.save() == 1
        assert (await control(client, "prepare", "ck-lf1"))["counts"]["cut"] == 1
        backend.starting.clear()
        await control(client, "resume", "ck-lf1")
        await first
        again = asyncio.ensure_future(client.post(url("lf"), json=MATH, headers=call_headers("lf.0.t0")))
        await eventually("the call continued", lambda: "lf.0.t0" in model.calls and model.calls["lf.0.t0"].state == "generating")
        call = model.calls["lf.0.t0"]
        prepared = await control(client, "prepare", "ck-lf2")  # its backend has not answered
        backend.starting.set()
        await backend.allow(len(full))
        await eventually("the continuation completed", lambda: call.state == "completed")
        assert not again.done()  # its reply waits for resume
        await control(client, "resume", "ck-lf2")
        reply = await again
        assert reply.status == 200
    assert prepared["ready"] and prepared["counts"]["cut"] == 0 and prepared["counts"]["running"] == 1
    events = await store.read_stream(call_stream("lf.0.t0"))
    assert [e.kind for e in events] == ["call_accepted", "call_cut", "call_accepted", "call_completed"]
    assert events[-1].data["continuation"]["mode"] == "continued" and events[-1].data["tokens"] == len(full)


class Regenerating(Paced):
    """An upstream that cannot continue a prefix (stock vLLM re-tokenizing a partial tool call): every
    continuation starts over, and says so."""

    async def generate(self, request: dict[str, Any], prefix: Prefix | None):  # type: ignore[override]
        async for event in super().generate(request, None):
            if isinstance(event, Start) and prefix is not None:
                event = Start(event.prompt_token_ids, {"mode": "regenerated", "reason": "cannot continue"})
            yield event


async def test_a_call_regenerated_after_a_cut_is_not_cut_again_until_it_has_saved_more_than_that_cut_kept(
        memory_store, memory_tokens) -> None:
    """The livelock a real vLLM showed: a cut call its upstream regenerates from the start was cut again
    at the next checkpoint with fewer tokens than before, every second, and never finished. Cut at 4
    steps, regenerated, 2 steps saved: the next prepare leaves it running (without it, it cuts at 2);
    it goes on to the uninterrupted reply."""
    store, tokens = memory_store, memory_tokens
    await start_attempt(store, "fl")
    backend = Regenerating(allowed=4)
    _, full, _ = planned(ScriptedBackend(), MATH)
    async with model_server(store, backend, tokens) as client:
        model = client.server.app[PARTICIPANT]  # type: ignore[attr-defined]
        first = asyncio.ensure_future(client.post(url("fl"), json=MATH, headers=call_headers("fl.0.t0")))
        await eventually("four steps in", lambda: "fl.0.t0" in model.calls and len(model.calls["fl.0.t0"].steps) >= 4)
        assert await model.progress.save() == 1
        kept = model.calls["fl.0.t0"].durable.tokens
        assert (await control(client, "prepare", "ck-fl1"))["counts"]["cut"] == 1
        await backend.allow(2)
        await control(client, "resume", "ck-fl1")
        await first
        again = asyncio.ensure_future(client.post(url("fl"), json=MATH, headers=call_headers("fl.0.t0")))
        await eventually("two steps of the regeneration", lambda: "fl.0.t0" in model.calls
                         and model.calls["fl.0.t0"].state == "generating" and len(model.calls["fl.0.t0"].steps) >= 2)
        call = model.calls["fl.0.t0"]
        assert await model.progress.save() == 1 and 0 < call.durable.tokens < kept
        prepared = await control(client, "prepare", "ck-fl2")
        await backend.allow(len(full))
        await eventually("the regeneration completed", lambda: call.state == "completed")
        await control(client, "resume", "ck-fl2")
        assert (await again).status == 200
    assert prepared["counts"]["cut"] == 0 and prepared["counts"]["running"] == 1
    events = await store.read_stream(call_stream("fl.0.t0"))
    assert [e.kind for e in events] == ["call_accepted", "call_cut", "call_accepted", "call_completed"]
    assert events[-1].data["continuation"]["mode"] == "regenerated" and events[-1].data["tokens"] == len(full)


async def test_a_save_keeps_tokens_and_reply_as_they_stood_together_though_a_step_lands_during_its_writes(
        memory_store, memory_tokens) -> None:
    """The call's own task may add a step while the saver writes its tokens. A prefix that read the
    reply after the write kept a reply one step ahead of its tokens, and a cut at it continued that
    step twice (a cut tool call continued to arguments `{}{}`)."""
    store, tokens = memory_store, memory_tokens
    await start_attempt(store, "sn")
    backend = Paced(allowed=2)
    async with model_server(store, backend, tokens) as client:
        model = client.server.app[PARTICIPANT]  # type: ignore[attr-defined]
        first = asyncio.ensure_future(client.post(url("sn"), json=MATH, headers=call_headers("sn.0.t0")))
        await eventually("two steps in", lambda: "sn.0.t0" in model.calls and len(model.calls["sn.0.t0"].steps) >= 2)
        await model.progress.stop()
        call = model.calls["sn.0.t0"]
        kept = (list(call.ids), dict(call.message))
        landed: list[bool] = []
        put = tokens.put

        async def a_step_lands(ids: Any, *a: Any, **k: Any) -> Any:
            receipt = await put(ids, *a, **k)
            if ids == kept[0] and call.ids == kept[0]:  # the call's own task adds a step it had received
                call.ids.append(7)
                call.logprobs.append(-0.5)
                call.message = {**call.message, "content": (call.message.get("content") or "") + "!"}
                landed.append(True)
            return receipt

        tokens.put = a_step_lands
        await model.progress.save()
        prepared = await control(client, "prepare", "ck-sn")
        await control(client, "resume", "ck-sn")
        await first
    assert landed
    (record,) = prepared["records"]
    (cut,) = [e for e in await store.read_stream(call_stream("sn.0.t0")) if e.kind == "call_cut"]
    assert cut.data == record["data"]
    assert cut.data["tokens"] == len(kept[0]) == len((await tokens.get(cut.data["receipt"]["blob_id"])).ids)
    assert cut.data["partial"] == kept[1] and cut.data["unsaved"] == 1
