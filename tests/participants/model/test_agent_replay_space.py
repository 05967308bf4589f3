"""Replay over the space of crashes: wherever a black-box agent and its model server die, and whatever
boundary the next attempt continues from, the agent run again from its start ends with the answers of
an uninterrupted run, and the model generates no recorded call again.

Hypothesis draws the questions and, for each crash, how many calls completed before it, whether a
call was in flight (the agent and the server stopped mid-generation), and the boundary the next
attempt continues from (all of the attempt, or the end of an earlier call). Each run of the agent is
on a fresh server over the same log in memory (nothing of the last one in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import openai
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.memory_store import MemoryEventStore
from adapters.token_store import MemoryTokenStore
from apps.stack import MemoryBacking
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream, server_call_number
from participants.base.app import PARTICIPANT
from participants.base.guard import Credentials
from participants.model.app import build_model_app
from participants.model.backends.scripted import ScriptedBackend
from tests.waiting import eventually

CREDS = Credentials(control="space-control", data="space-data")

crashes = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), max_size=3)
questions = st.lists(st.integers(0, 99), min_size=2, max_size=4)


@contextlib.asynccontextmanager
async def served(store: MemoryEventStore, tokens: MemoryTokenStore, backend: ScriptedBackend):
    server = TestServer(build_model_app(store, backend, tokens, CREDS))
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def ask(server: TestServer, rollout: str, attempt: int, numbers: list[int], answers: list[str]) -> None:
    """The agent: one growing conversation, no rollbook header; `answers` collects what it was told."""
    client = openai.AsyncOpenAI(base_url=str(server.make_url(f"/rollouts/{rollout}/attempts/{attempt}/v1")),
                                api_key=CREDS.data, max_retries=0)
    history: list[Any] = []
    try:
        for n in numbers:
            history.append({"role": "user", "content": f"What is {n} + {n + 1}?"})
            reply = await client.chat.completions.create(model="scripted", messages=history)
            answers.append(reply.choices[0].message.content or "")
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
    finally:
        await client.close()


async def thrown_away(store: MemoryEventStore, rollout: str, attempt: int, boundary: int | None) -> int:
    """The generations of `attempt` its successor cannot be given: in flight at the crash (accepted, no
    outcome), or completed after the boundary it continues from. Nothing else may be generated again."""
    events = [e for e in await store.read_rollout(rollout, attempt) if str(e.data.get("call_id", "")).startswith(rollout)]
    ended = {e.data["call_id"] for e in events if e.kind != "call_accepted"}
    in_flight = {e.data["call_id"] for e in events if e.kind == "call_accepted"} - ended
    late = [e for e in events if e.kind == "call_completed" and e.data.get("disposition") == "generated"
            and boundary is not None and e.position > boundary]
    return len(in_flight) + len(late)


async def run(rollout: str, numbers: list[int], plan: list[tuple[int, bool, bool]]) -> tuple[list[str], int, int, Any]:
    """(final answers, generations, generations a crash may have thrown away, the rollout's events)."""
    backing = MemoryBacking()
    store, tokens = MemoryEventStore(backing.log), backing.token_store
    await store.append(AppendRequest((NewEvent(rollout_stream(rollout), ATTEMPT_STARTED, {"parent_attempt": None}, rollout, 0),)))
    generations, wasted, attempt = 0, 0, 0
    for completed, mid_call, from_earlier in plan:
        completed = min(completed, len(numbers) - 1)
        backend = ScriptedBackend(token_latency_s=0.01)
        heads: list[int] = []
        async with served(store, tokens, backend) as server:
            answers: list[str] = []
            agent = asyncio.create_task(ask(server, rollout, attempt, numbers, answers))
            model = server.app[PARTICIPANT]
            await eventually("the calls before the crash answered", lambda a=answers, c=completed, t=agent: len(a) >= c or t.done())
            heads.append(await store.head())
            if mid_call:  # the next call in flight, tokens made, when everything dies
                await eventually("a call generating", lambda m=model, t=agent: any(c.ids for c in m.calls.values()) or t.done())
            agent.cancel()
            await asyncio.gather(agent, return_exceptions=True)
        generations += backend.generations
        boundary = heads[0] if from_earlier else None  # a restore to the end of an earlier call, or all of it
        wasted += await thrown_away(store, rollout, attempt, boundary)
        await store.append(AppendRequest((
            NewEvent(rollout_stream(rollout), ATTEMPT_FENCED, {"reason": "crash"}, rollout, attempt),
            NewEvent(rollout_stream(rollout), ATTEMPT_STARTED,
                     {"parent_attempt": attempt, "origin_attempt": attempt, "origin_position": boundary}, rollout, attempt + 1))))
        attempt += 1
    backend = ScriptedBackend()
    final: list[str] = []
    async with served(store, tokens, backend) as server:
        await ask(server, rollout, attempt, numbers, final)
    return final, generations + backend.generations, wasted, await store.read_rollout(rollout)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(questions, crashes)
def test_an_agent_run_again_after_any_crash_ends_as_an_uninterrupted_run_without_generating_a_recorded_call_again(
        numbers: list[int], plan: list[tuple[int, bool, bool]]) -> None:
    clean, clean_generations, _, _ = asyncio.run(run("clean", numbers, []))
    final, generations, wasted, events = asyncio.run(run("crashy", numbers, plan))
    assert final == clean and clean_generations == len(numbers)
    # Every call generated once, but for those a crash or an earlier boundary threw away.
    assert len(numbers) <= generations <= len(numbers) + wasted
    # Each attempt numbered its calls without a gap.
    places: dict[int, set[int]] = {}
    for e in events:
        place = server_call_number(str(e.data.get("call_id")), "crashy") if e.kind == "call_accepted" else None
        if place is not None:
            places.setdefault(place[0], set()).add(place[2])
    assert all(numbers_seen == set(range(len(numbers_seen))) for numbers_seen in places.values()), places
