"""The event catalog (engine/catalog.py) is the one place an event kind is spelt, docs/events.md is
generated from it and current, and what the servers really write is what the catalog says."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import pytest

from adapters.postgres import PostgresEventStore
from apps.stack import all_events, start_stack
from engine import catalog as ev
from engine import phases
from engine.errors import InvalidPayload
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream, session_stream
from participants.environments import ENVIRONMENTS
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "participants", "adapters", "apps")


def test_docs_events_md_is_what_the_catalog_generates() -> None:
    checked_in = (ROOT / "docs" / "events.md").read_text()
    assert checked_in == ev.reference(), "docs/events.md is stale: run .venv/bin/python docs/generate_events.py"


def spelt_kinds(path: Path) -> list[str]:
    """String constants naming a cataloged kind, except an error code (`"code": ...`) that shares a name."""
    tree = ast.parse(path.read_text())
    codes = {id(v) for d in ast.walk(tree) if isinstance(d, ast.Dict)
             for k, v in zip(d.keys, d.values, strict=True) if isinstance(k, ast.Constant) and k.value == "code"}
    return [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in ev.CATALOG and id(n) not in codes]


def test_no_module_but_the_catalog_spells_an_event_kind() -> None:
    skip = {ROOT / "engine" / "catalog.py", ROOT / "engine" / "errors.py"}  # errors: codes, not kinds
    spelt = [hit for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py")) if path not in skip
             for hit in spelt_kinds(path)]
    assert spelt == []


def test_every_phase_move_is_recorded_as_a_cataloged_kind() -> None:
    for t in phases.PARTICIPANT_TRANSITIONS:
        assert ev.CATALOG[ev.participant_phase_kind(t["trigger"])].stream is ev.PARTICIPANT
    for phase in phases.CHECKPOINT_PHASES:
        assert ev.CATALOG[ev.checkpoint_phase_kind(phase)].stream is ev.CHECKPOINT
    with pytest.raises(KeyError):
        ev.participant_phase_kind("dance")


async def test_an_event_appended_to_another_stream_family_than_its_kinds_is_refused(store: PostgresEventStore) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream("cat-s"), ev.ATTEMPT_STARTED, {"parent_attempt": None},
                                               "cat-s", 0),)))
    head = await store.head()
    misplaced = NewEvent(session_stream("cat-s", 0), ev.ATTEMPT_FINISHED, {"reward": 1.0}, "cat-s", 0)
    with pytest.raises(InvalidPayload, match="attempt_finished event goes to a rollout:<rollout_id> stream"):
        await store.append(AppendRequest((misplaced,)))
    assert await store.head() == head  # nothing written


async def wait_for_kind(store: PostgresEventStore, kind: str) -> None:
    stop = time.monotonic() + 20
    while time.monotonic() < stop:
        if any(e.kind == kind for e in await all_events(store)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} event")


@pytest.mark.timeout(120)
async def test_every_event_of_a_checkpointed_crashed_and_restored_run_is_as_the_catalog_says(
        dsn: str, store: PostgresEventStore) -> None:
    """Every registered environment, checkpointed mid-episode, every server lost, restored into fresh
    servers and finished: each event's kind is cataloged, it went to its kind's stream, it carries
    the required fields, every field is one the catalog names, with the type it says."""
    tasks = {f"cat-{name}": make_task(name, 1) for name in ENVIRONMENTS}
    old = await start_stack(dsn, "cat-old", ScriptedBackend(latency_s=0.1))
    try:
        running = [asyncio.create_task(old.episode(task, rid)) for rid, task in tasks.items()]
        await wait_for_kind(store, ev.MUTATION_APPLIED)
        coordinator = old.coordinator(store)
        assert (await coordinator.prepare("cat-ck", time.time() + 10))["ready"]
        await coordinator.commit("cat-ck", time.time() + 10)
        token_ref = await old.tokens.snapshot("cat-ck", [])
        await coordinator.publish("cat-ck", {"checkpoint_id": "cat-ck"}, token_ref, old.tokens)
    finally:
        await old.close()
        for r in running:
            r.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    new = await start_stack(dsn, "cat-new", ScriptedBackend())
    try:
        coordinator = new.coordinator(store)
        await coordinator.restore("cat-ck", time.time() + 10)
        await coordinator.resume("cat-ck")
        for rid in tasks:  # a rollout finished before the cut is answered from the log
            status = await new.wait_finished(rid) if rid in new.participant("environment").episodes else None
            assert status is None or status["status"] == "finished", (rid, status)
    finally:
        await new.close()
    events = await all_events(store)
    problems = sorted({p for e in events for p in ev.problems(e)})
    assert problems == [], "\n".join(problems)
    seen = {e.kind for e in events}
    assert {ev.EPISODE_STEP, ev.AGENT_BOUNDARY, ev.MUTATION_APPLIED, ev.CALL_COMPLETED, ev.CHECKPOINT_PUBLISHED,
            ev.RESTORE_INSTALLED, ev.PARTICIPANT_RESTORE, ev.ATTEMPT_FENCED, ev.ATTEMPT_FINISHED} <= seen
