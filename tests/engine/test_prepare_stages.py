"""A checkpoint's prepare runs environment, model and agent at once, then resources, and appends only
the checkpoint's own two events (engine.coordinator): each participant's transitions go out with its
next one (participants/base/control_plane.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from adapters.postgres import PostgresEventStore
from apps.stack import start_stack
from participants.model.backends.scripted import ScriptedBackend
from tests.waiting import eventually


def count_appends(store: PostgresEventStore, tally: list[str], name: str) -> None:
    inner = store.append

    async def append(request: Any) -> Any:
        tally.append(name)
        return await inner(request)

    store.append = append  # type: ignore[method-assign]


async def test_prepare_appends_twice_for_the_checkpoint_and_nothing_for_the_participants(dsn: str, store: PostgresEventStore) -> None:
    stack = await start_stack(dsn, "appends", ScriptedBackend())
    try:
        appends: list[str] = []
        count_appends(store, appends, "coordinator")
        for kind in stack.servers:
            count_appends(stack.participant(kind).store, appends, kind)
        reply = await stack.coordinator(store).prepare("ck-a", time.time() + 30)
        assert reply["ready"], reply
        # started + prepared for the checkpoint; a participant's preparing -> prepared waits for its next transition
        assert appends == ["coordinator", "coordinator"]
        await stack.coordinator(store).resume("ck-a")

        async def recorded() -> bool:
            events = [e.kind for kind in stack.servers for e in await store.read_stream(f"participant:{kind}:{kind}-appends")]
            return events == ["participant_prepare", "participant_prepared", "participant_resume"] * 4
        await eventually("every transition to be an event", recorded)  # each goes out right after the resume's reply
    finally:
        await stack.close()


async def test_environment_model_and_agent_prepare_at_once_and_resources_only_after_them(
    dsn: str, store: PostgresEventStore
) -> None:
    stack = await start_stack(dsn, "stages", ScriptedBackend())
    try:
        seen: list[tuple[str, str]] = []
        first_stage: set[str] = set()
        all_started = asyncio.Event()
        for kind in stack.servers:
            participant = stack.participant(kind)
            inner = participant.prepare

            async def prepare(checkpoint_id: str, deadline: float, inner: Any = inner, kind: str = kind) -> Any:
                seen.append(("start", kind))
                if kind != "resources":
                    # none of the first stage ends before all three started: a sequential prepare would
                    # wait here for good (and fail on the timeout) instead of merely not overlapping
                    first_stage.add(kind)
                    if len(first_stage) == 3:
                        all_started.set()
                    await asyncio.wait_for(all_started.wait(), 30)
                report = await inner(checkpoint_id, deadline)
                seen.append(("end", kind))
                return report

            participant.prepare = prepare  # type: ignore[method-assign]
        reply = await stack.coordinator(store).prepare("ck-s", time.time() + 30)
        assert reply["ready"], reply
        starts = [k for what, k in seen[:3]]
        assert sorted(starts) == ["agent", "environment", "model"] and all(w == "start" for w, _ in seen[:3])
        assert seen[-2:] == [("start", "resources"), ("end", "resources")]  # resources close once every caller parked
        await stack.coordinator(store).resume("ck-s")
    finally:
        await stack.close()


async def test_an_episode_in_a_replayable_verify_does_not_hold_the_environment_servers_prepare(
        store: PostgresEventStore) -> None:
    """A verify that may simply run again (its session said `replay` at seed: rollbook's stateless
    environments, NeMo Gym servers declared replay or stateless) is no blocker; a `wait` one is."""
    from participants.environment.server import EnvironmentParticipant, Episode
    from participants.environments import Task

    env = EnvironmentParticipant(store, "environment-verify", None, "http://127.0.0.1:9", "http://127.0.0.1:9")
    hold = asyncio.Event()
    try:
        for rid, verification in (("replayable", "replay"), ("waiting", "wait")):
            ep = Episode(rid, 0, Task("math", rid, "1 + 1?"), 0, 4, done=[
                {"step": "seed", "verification": verification}, {"step": "agent"}])
            ep.step = "verify"
            env.episodes[rid] = ep
            env.tasks[rid] = asyncio.ensure_future(hold.wait())
        report = await env.prepare("ck-v", time.time() + 0.5)
        assert not report.ready and report.blockers == ["waiting:0 in step verify"], report
        del env.episodes["waiting"]
        report = await env.prepare("ck-v2", time.time() + 0.5)
        assert report.ready and report.blockers == [], report
    finally:
        hold.set()
        await asyncio.gather(*env.tasks.values())
        await env.close()
