"""A stranger's agent continued by replay (engine.agent_replay), on the model server.

The agent is a deterministic OpenAI SDK loop that names no call: one growing conversation. After a
crash it is run again from its start, under the attempt a recovery starts (engine.recovery writes it
here, as the environment server would), on a fresh model server over the same log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from adapters.memory_store import MemoryEventStore
from adapters.postgres import PostgresEventStore
from adapters.token_store import PostgresTokenStore
from apps.stack import MemoryBacking
from engine.identity import server_call_number
from engine.recovery import Recovery, recovery_request
from participants.base.app import PARTICIPANT
from participants.model.backends.scripted import ScriptedBackend
from tests.participants.model.test_responses import CREDS, served, start
from tests.waiting import eventually

QUESTIONS = ["What is 1 + 2?", "What is 3 + 4?", "What is 5 + 6?"]
crashes = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), max_size=3)
numbers_asked = st.lists(st.integers(0, 99), min_size=2, max_size=4)


def questions_of(numbers: list[int]) -> list[str]:
    return [f"What is {n} + {n + 1}?" for n in numbers]


async def ask(server: TestServer, rollout: str, attempt: int, questions: list[str], answers: list[str],
              after: Callable[[int], Awaitable[None]] | None = None) -> None:
    """The agent, on one attempt's routes: `answers` collects what it was told, as it is told (a crash
    may cut it short); `after(n)` runs once the n-th reply is in."""
    client = openai.AsyncOpenAI(base_url=str(server.make_url(f"/rollouts/{rollout}/attempts/{attempt}/v1")),
                                api_key=CREDS.data, max_retries=0)
    history: list[Any] = []
    try:
        for n, q in enumerate(questions):
            history.append({"role": "user", "content": q})
            reply = await client.chat.completions.create(model="scripted", messages=history)
            answers.append(reply.choices[0].message.content or "")
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            if after is not None:
                await after(n)
    finally:
        await client.close()


async def recover(store: Any, rollout: str, attempt: int, boundary: int | None) -> None:
    """What a recovery writes: the attempt fenced and the next one started, continuing from `boundary`
    (None: all of the attempt)."""
    await store.append(recovery_request(Recovery(rollout, attempt, "continue", boundary, True, "the agent crashed")))


async def custody(store: PostgresEventStore, rollout: str) -> list[tuple[Any, ...]]:
    """(call, event kind, disposition, the call it replaces or differs from, why it was refused) for
    every call event of the rollout, read with SQL."""
    async with store.engine.connect() as conn:
        rows = await conn.execute(text(
            "SELECT data->>'call_id', kind, data->>'disposition', coalesce(data->>'replaces', data->>'diverges_from'), "
            "data->>'reason' FROM rollbook.events WHERE rollout_id = :r AND stream LIKE 'call:%' ORDER BY position"),
            {"r": rollout})
        return [tuple(r) for r in rows]


async def test_an_agent_that_names_no_call_is_continued_by_replay_and_a_divergence_is_recorded(store: PostgresEventStore) -> None:
    """Attempt 0 asks three questions; its boundary falls after the second reply. Attempt 1 runs the
    agent again from its start: the first two calls are answered from the log (nothing generated), the
    third, past the boundary, is generated. Attempt 2 (from all of attempt 1) asks another first
    question: refused with agent_divergence, recorded against the call it differs from."""
    tokens = PostgresTokenStore(store)
    await start(store, "rp1")
    boundary: list[int] = []

    async def mark(n: int) -> None:
        if n == 1:
            boundary.append(await store.head())

    first, second = ScriptedBackend(), ScriptedBackend()
    before: list[str] = []
    after: list[str] = []
    async with served(store, first, tokens) as server:
        await ask(server, "rp1", 0, QUESTIONS, before, mark)
    await recover(store, "rp1", 0, boundary[0])
    async with served(store, second, tokens) as server:  # a new process: the agent and the server restarted
        await ask(server, "rp1", 1, QUESTIONS, after)
        await recover(store, "rp1", 1, None)
        with pytest.raises(openai.ConflictError) as diverged:
            await ask(server, "rp1", 2, ["What is 9 + 9?"], [])
    assert after == before and (first.generations, second.generations) == (3, 1)
    assert diverged.value.code == "agent_divergence"
    assert [r for r in await custody(store, "rp1") if r[0].startswith(("rp1.1.", "rp1.2."))] == [
        ("rp1.1.a0.m0", "call_accepted", None, "rp1.0.a0.m0", None),
        ("rp1.1.a0.m0", "call_completed", "linked", "rp1.0.a0.m0", None),
        ("rp1.1.a0.m1", "call_accepted", None, "rp1.0.a0.m1", None),
        ("rp1.1.a0.m1", "call_completed", "linked", "rp1.0.a0.m1", None),
        ("rp1.1.a0.m2", "call_accepted", None, None, None),
        ("rp1.1.a0.m2", "call_completed", "generated", None, None),
        ("rp1.2.a0.m0", "call_excluded", None, "rp1.1.a0.m0", "agent_divergence")]


# ---- the space of crashes, on a log in memory --------------------------------------------------------


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
    await start(store, rollout)
    generations, wasted, attempt = 0, 0, 0
    for completed, mid_call, from_earlier in plan:
        completed = min(completed, len(numbers) - 1)
        backend = ScriptedBackend(token_latency_s=0.01)
        heads: list[int] = []
        async with served(store, backend, tokens) as server:
            answers: list[str] = []
            agent = asyncio.create_task(ask(server, rollout, attempt, questions_of(numbers), answers))
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
        await recover(store, rollout, attempt, boundary)
        attempt += 1
    backend = ScriptedBackend()
    final: list[str] = []
    async with served(store, backend, tokens) as server:
        await ask(server, rollout, attempt, questions_of(numbers), final)
    return final, generations + backend.generations, wasted, await store.read_rollout(rollout)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numbers_asked, crashes)
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
