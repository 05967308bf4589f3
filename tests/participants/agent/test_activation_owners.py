"""One owner at a time (engine/ownership.py) for agent activations and episodes: two agent servers, or
two environment servers, on one PostgreSQL database with the model and resources servers of one
stack, each instance recorded with a lease. A second instance that gets the same activation or
episode while its owner lives waits for the owner's outcome; a dead owner's activation is taken over."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.http_client import JsonClient, data_url
from adapters.membership import MembershipReader
from adapters.postgres import PostgresEventStore
from apps.stack import CREDS, SEED, Stack, all_events, of, start_stack
from engine.catalog import AGENT_BOUNDARY, ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import agent_stream, episode_stream, rollout_stream
from participants.agent.app import build_agent_app
from participants.agent.external import ExternalAgents, GymAgent, gym_drivers
from participants.agent.server import AGENT_KINDS
from participants.agent.session import RunRequest, fresh_session
from participants.base.app import PARTICIPANT
from participants.base.wire import ACTIVATION_HEADER
from participants.environment.app import build_environment_app
from participants.environments.nemo_gym_relay import GymServer
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend
from tests.participants.base.test_ownership import leased
from tests.participants.model.test_server import start_attempt

pytestmark = pytest.mark.timeout(120)

WORKPLACE = make_task("workplace", 3)  # 4 turns with the scripted policy, tool calls among them


@contextlib.asynccontextmanager
async def second(dsn: str, kind: str, tag: str, s: Stack) -> AsyncIterator[tuple[str, Any]]:
    """The stack's `kind` server and another instance of it on the same database, both leased: each
    sees the other live. Yields the other's address and participant."""
    name = f"{kind}-{tag}-b"
    async with contextlib.AsyncExitStack() as stack:
        store = PostgresEventStore.connect(dsn, writer=name)
        stack.push_async_callback(store.close)
        if kind == "agent":
            app = build_agent_app(store, CREDS, s.url("model"), s.url("resources"), name)
        else:
            app = build_environment_app(store, CREDS, s.url("agent"), s.url("resources"), name)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server(shutdown_timeout=1.0)
        stack.push_async_callback(server.close)
        own = s.participant(kind)
        await stack.enter_async_context(leased(dsn, kind, own.instance, s.url(kind)))
        await stack.enter_async_context(leased(dsn, kind, name, str(server.make_url("")).rstrip("/")))
        other = server.app[PARTICIPANT]
        own.members, other.members = MembershipReader(store), MembershipReader(store)
        yield str(server.make_url("")).rstrip("/"), other


@contextlib.asynccontextmanager
async def stack(dsn: str, tag: str) -> AsyncIterator[Stack]:
    s = await start_stack(dsn, tag, ScriptedBackend(latency_s=0.02))
    try:
        yield s
    finally:
        await s.close()


async def seeded(s: Stack, store: PostgresEventStore, rid: str) -> None:
    """Attempt 0 of `rid` with its resources session open, as the environment's seed step leaves it."""
    await start_attempt(store, rid)
    await s.client.post(data_url(s.url("resources"), rid, 0, "/session"), {"env": WORKPLACE.env, "task": WORKPLACE.to_json()})


async def activate(client: JsonClient, base: str, rid: str) -> dict[str, Any]:
    return await client.post(data_url(base, rid, 0, "/run"), {"task": WORKPLACE.to_json(), "seed": SEED},
                             {ACTIVATION_HEADER: "0"})


async def agent_log(store: PostgresEventStore, rid: str) -> list[tuple[str, Any, Any]]:
    return [(e.kind, e.data.get("turn"), e.data.get("instance")) for e in await store.read_stream(agent_stream(rid, 0))]


async def test_two_agent_servers_racing_for_the_same_activation_run_it_exactly_once(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "ra") as s, second(dsn, "agent", "ra", s) as (b_url, _):
        for i in range(3):
            rid = f"race-{i}"
            await seeded(s, store, rid)
            ra, rb = await asyncio.gather(activate(s.client, s.url("agent"), rid), activate(s.client, b_url, rid))
            assert ra == rb
            events = await store.read_stream(agent_stream(rid, 0))
            assert len(of(events, "agent_activation_completed")) == 1
            firsts = [e for e in of(events, AGENT_BOUNDARY) if e.data["turn"] == 0 and e.data["state"] == "before_model"]
            assert len(firsts) == 1 and firsts[0].data["instance"] in {"agent-ra", "agent-ra-b"}
            turns = ra["turns"]
            assert len(of(events, AGENT_BOUNDARY)) == 2 * turns  # one before and one after each turn, no more
            assert len([e for e in await all_events(store) if e.kind == "mutation_applied" and e.rollout_id == rid]) == 1


async def test_an_activation_held_by_a_live_agent_is_awaited_and_taken_over_once_its_owner_is_gone(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "ho") as s, second(dsn, "agent", "ho", s) as (b_url, _):
        await seeded(s, store, "held")
        req = RunRequest(task=WORKPLACE.to_json(), seed=SEED)
        # The first boundary of an activation claimed by an instance that then stops answering.
        first = fresh_session(("held", 0), 0, req).boundary_data("before_model", 0, "held.0.t0")
        async with leased(dsn, "agent", "agent-gone", "http://gone:1") as (_, gone):
            await store.append(AppendRequest((NewEvent(agent_stream("held", 0), AGENT_BOUNDARY,
                                                       {**first, "instance": "agent-gone"}, "held", 0),)))
            waiting = asyncio.ensure_future(activate(s.client, b_url, "held"))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # its owner is live: nothing runs here
            assert await agent_log(store, "held") == [(AGENT_BOUNDARY, 0, "agent-gone")]
            await gone.stop()  # the owner leaves with its activation unfinished
            reply = await waiting
        events = await store.read_stream(agent_stream("held", 0))
        assert [(e.kind, e.data["instance"]) for e in events if e.data.get("instance")] == [
            (AGENT_BOUNDARY, "agent-gone"), ("agent_activation_claimed", "agent-ho-b")]  # the takeover's claim, once
        assert len(of(events, AGENT_BOUNDARY)) == 2 * reply["turns"]  # the claimed boundary is not recorded again
        (completed,) = of(events, "agent_activation_completed")
        assert completed.data["reply"]["turns"] == reply["turns"]


async def test_two_environment_servers_racing_for_the_same_new_episode_run_it_exactly_once(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "re") as s, second(dsn, "environment", "re", s) as (b_url, _):
        for i in range(3):
            rid = f"ep-{i}"
            body = {"rollout_id": rid, "task": WORKPLACE.to_json(), "seed": SEED}
            ra, rb = await asyncio.gather(s.client.post(f"{s.url('environment')}/episodes", body),
                                          s.client.post(f"{b_url}/episodes", body))
            assert ra == rb and ra["steps"] == ["seed", "agent", "verify", "close"]
            events = await store.read_rollout(rid)
            assert len(of(events, "attempt_started")) == 1 and len(of(events, "attempt_finished")) == 1
            (started,) = of(events, "episode_started")
            assert started.data["instance"] in {"environment-re", "environment-re-b"}
            assert [e.data["step"] for e in of(events, "episode_step")] == ["seed", "agent", "verify", "close"]
            assert len(of(events, "agent_activation_completed")) == 1


async def test_an_episode_held_by_a_live_environment_is_awaited_and_taken_over_once_its_owner_is_gone(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "he") as s, second(dsn, "environment", "he", s) as (b_url, _):
        body = {"rollout_id": "orphan", "task": WORKPLACE.to_json(), "seed": SEED}
        async with leased(dsn, "environment", "environment-gone", "http://gone:1") as (_, gone):
            # Attempt 0 of an episode started by an instance that then stops answering.
            await store.append(AppendRequest((
                NewEvent(rollout_stream("orphan"), "attempt_started", {"parent_attempt": None}, "orphan", 0),
                NewEvent(episode_stream("orphan", 0), "episode_started", {
                    "env": WORKPLACE.env, "task_id": WORKPLACE.task_id, "task": WORKPLACE.to_json(), "seed": SEED,
                    "max_steps": 16, "status": "running", "instance": "environment-gone"}, "orphan", 0))))
            waiting = asyncio.ensure_future(s.client.post(f"{b_url}/episodes", body))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # its owner is live: nothing runs here
            assert len(await store.read_rollout("orphan")) == 2
            await gone.stop()
            result = await waiting
        assert result["steps"] == ["seed", "agent", "verify", "close"]
        events = await store.read_rollout("orphan")
        assert [(e.kind, e.data["instance"]) for e in events if e.kind.startswith("episode_") and e.data.get("instance")] == [
            ("episode_started", "environment-gone"), ("episode_continued", "environment-he-b")]  # the takeover, once
        assert [e.data["step"] for e in of(events, "episode_step")] == ["seed", "agent", "verify", "close"]
        assert len(of(events, "attempt_finished")) == 1


async def test_two_agent_servers_racing_for_an_activation_of_a_nemo_gym_agent_forward_it_once(
        dsn: str, store: PostgresEventStore) -> None:
    """The agent is an HTTP server here that answers `/ng-rollout/<capture>/v1/responses` once it is
    let go and counts the runs it got (NeMo Gym's own simple_agent is tests/e2e/test_nemo_gym_simple_agent.py):
    both instances are asked at once, one claims the activation in the log and forwards it, the
    other waits for its outcome. Without the claim both forwarded it: two runs of one activation."""
    runs: list[str] = []
    go = asyncio.Event()

    async def responses(request: web.Request) -> web.Response:
        runs.append(request.match_info["capture"])
        await go.wait()
        return web.json_response({"output": [{"type": "message", "role": "assistant",
                                              "content": [{"type": "output_text", "text": "done"}]}]})

    gym_app = web.Application()
    gym_app.router.add_post("/ng-rollout/{capture}/v1/responses", responses)
    gym = TestServer(gym_app, host="127.0.0.1")
    await gym.start_server()
    try:
        async with stack(dsn, "ga") as s, second(dsn, "agent", "ga", s) as (b_url, other):
            agent = GymAgent(GymServer("simple", "responses_api_agents.simple_agent.app",
                                       url=str(gym.make_url("")).rstrip("/")), "replay")
            s.participant("agent").external_agents = ExternalAgents(gym_drivers({"simple": agent}))  # type: ignore[attr-defined]
            other.external_agents = ExternalAgents(gym_drivers({"simple": agent}))
            await seeded(s, store, "gym-race")
            task = {**WORKPLACE.to_json(), "agent": "simple"}
            both = [asyncio.ensure_future(s.client.post(data_url(base, "gym-race", 0, "/run"), {"task": task},
                                                        {ACTIVATION_HEADER: "0"})) for base in (s.url("agent"), b_url)]
            await asyncio.sleep(1.0)  # time for both to have forwarded it, were they to
            go.set()
            ra, rb = await asyncio.gather(*both)
        assert ra == rb and ra["final_answer"] == "done"
        assert runs == ["gym-race.0.0"]
        events = await store.read_stream(agent_stream("gym-race", 0))
        assert len(of(events, "agent_activation_claimed")) == 1 and len(of(events, "agent_activation_completed")) == 1
    finally:
        await gym.close()


def reads_of(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...] | None]:
    """The kinds each read_rollout of `store` asked for (None: every kind), in order."""
    asked: list[tuple[str, ...] | None] = []
    real = store.read_rollout

    async def read_rollout(*args: Any, **kw: Any) -> Any:
        kinds = kw.get("kinds", args[3] if len(args) > 3 else None)
        asked.append(None if kinds is None else tuple(kinds))
        return await real(*args, **kw)

    monkeypatch.setattr(store, "read_rollout", read_rollout)
    return asked


async def test_an_activations_start_reads_its_agent_stream_kinds_alone(
        dsn: str, store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: an activation of an attempt whose log holds its start and its open session (the task, in
    full, twice). Its start reads the attempt's agent kinds and starts alone, and it runs to its end."""
    async with stack(dsn, "kinds") as s:
        await seeded(s, store, "kinds-0")
        asked = reads_of(s.participant("agent").store, monkeypatch)  # type: ignore[attr-defined]
        out = await activate(s.client, s.url("agent"), "kinds-0")
    assert out["turns"] >= 1
    assert set(AGENT_KINDS) == {AGENT_BOUNDARY, "agent_activation_claimed", "agent_activation_completed"}
    assert asked and all(k is not None and set(k) <= {*AGENT_KINDS, ATTEMPT_STARTED} for k in asked), asked
    assert len(of(await store.read_stream(agent_stream("kinds-0", 0)), "agent_activation_completed")) == 1


async def test_an_agent_stream_holding_a_kind_outside_the_catalog_is_claimed_after_a_read_of_every_kind(
        dsn: str, store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: an operator's own event (a kind the catalog does not name) on the attempt's agent stream
    before its activation starts. The first claim, at the version the agent kinds alone gave, is refused
    by the log; the next read takes every kind, and the activation is claimed after that event and runs."""
    async with stack(dsn, "odd") as s:
        await seeded(s, store, "odd-0")
        await store.append(AppendRequest((NewEvent(agent_stream("odd-0", 0), "operator_note", {"note": "x"}, "odd-0", 0),)))
        asked = reads_of(s.participant("agent").store, monkeypatch)  # type: ignore[attr-defined]
        out = await activate(s.client, s.url("agent"), "odd-0")
    assert out["turns"] >= 1
    assert None in asked, asked
    events = await store.read_stream(agent_stream("odd-0", 0))
    assert [e.kind for e in events[:2]] == ["operator_note", AGENT_BOUNDARY]
    assert len(of(events, "agent_activation_completed")) == 1
