"""The event catalog (engine/catalog.py) is the one place an event kind is spelt, docs/events.md is
generated from it and current, and what the servers really write is what the catalog says.

engine.catalog's rules on their own: which stream family each kind goes to, what `problems` finds
in a recorded event, and the JSON types a SQL user reads.
"""

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
from engine.events import GENESIS_HASH, AppendRequest, NewEvent, RecordedEvent
from engine.identity import checkpoint_stream, episode_stream, policy_stream, rollout_stream, session_stream
from participants.environments import ENVIRONMENTS
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
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
    async def seen() -> bool:
        return any(e.kind == kind for e in await all_events(store))
    await eventually(f"a {kind} event", seen, timeout=20)


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


def test_a_stream_family_is_spelt_by_its_function_with_its_parameters_named() -> None:
    assert (ev.EPISODE.pattern, ev.EPISODE.prefix) == ("episode:<rollout_id>:<attempt>", "episode:")
    assert (ev.CHECKPOINT.pattern, ev.CHECKPOINT.prefix) == ("checkpoint:<checkpoint_id>", "checkpoint:")
    assert (ev.POLICY.pattern, ev.POLICY.prefix) == ("policy", "policy")


def test_a_kind_goes_to_its_family_only() -> None:
    step = ev.CATALOG[ev.EPISODE_STEP]
    assert step.goes_to(episode_stream("r", 0)) and not step.goes_to(rollout_stream("r"))
    policy = ev.CATALOG[ev.POLICY_VERSION_CHANGED]
    assert policy.goes_to(policy_stream())
    assert not policy.goes_to("policy:x") and not policy.goes_to("other")


def test_an_append_of_a_kind_to_another_family_is_refused_and_a_foreign_kind_is_not_checked() -> None:
    ev.check(NewEvent(episode_stream("r", 0), ev.EPISODE_STEP, {}, "r", 0))
    with pytest.raises(InvalidPayload, match="a episode_step event goes to a episode:<rollout_id>:<attempt> stream, not 'x'") as refused:
        ev.check(NewEvent("x", ev.EPISODE_STEP, {}, "r", 0))
    assert refused.value.context == {"kind": ev.EPISODE_STEP, "stream": "x"}
    ev.check(NewEvent("x", "not_ours", {}))


def rec(stream: str, kind: str, data: dict[str, object], rollout: str | None = "r") -> RecordedEvent:
    return RecordedEvent(1, stream, 1, kind, data, rollout, 0 if rollout else None, 1, "t", GENESIS_HASH)


def test_a_conforming_event_has_no_problems() -> None:
    started = rec(checkpoint_stream("k"), ev.CHECKPOINT_STARTED, {"checkpoint_id": "k", "deadline": 1.5}, rollout=None)
    assert ev.problems(started) == []


def test_problems_names_each_departure_from_the_catalog() -> None:
    assert ev.problems(rec("x", "not_ours", {})) == ["not_ours is not in the catalog"]
    bad = rec(rollout_stream("k"), ev.CHECKPOINT_STARTED, {"deadline": "soon", "extra": 1})
    assert ev.problems(bad) == [
        "checkpoint_started: stream 'rollout:k' is not checkpoint:<checkpoint_id>",
        "checkpoint_started: rollout_id/attempt set on a non-execution stream",
        "checkpoint_started: missing required field checkpoint_id",
        "checkpoint_started: field extra is not in the catalog",
        "checkpoint_started: field deadline is a str, not number",
    ]
    missing = rec(episode_stream("r", 0), ev.EPISODE_STEP, {}, rollout=None)
    assert "episode_step: rollout_id/attempt missing" in ev.problems(missing)


@pytest.mark.parametrize("declared, value, matches", [
    ("string", "a", True), ("string", 1, False), ("integer", 1, True), ("integer", True, False),
    ("integer", 1.5, False), ("number", 1.5, True), ("number", 2, True), ("number", False, False),
    ("boolean", True, True), ("object", {}, True), ("array", [], True), ("array", {}, False),
    ("string|null", None, True), ("string", None, False), ("integer|string", "x", True), ("unknown", "x", False),
])
def test_json_types_as_a_sql_user_reads_them(declared: str, value: object, matches: bool) -> None:
    assert ev.json_type_matches(declared, value) is matches


def test_the_phase_kinds_are_cataloged_and_nothing_else_passes() -> None:
    assert ev.checkpoint_phase_kind("committed") == ev.CHECKPOINT_COMMITTED
    assert ev.participant_phase_kind("prepare") == ev.PARTICIPANT_PREPARE
    with pytest.raises(KeyError, match="checkpoint_nowhere is not in the event catalog"):
        ev.checkpoint_phase_kind("nowhere")


def test_the_reference_lists_every_kind_with_its_stream_writer_and_fields() -> None:
    text = ev.reference()
    assert text.startswith("# Events\n") and text.endswith("\n")
    assert f"| [`{ev.EPISODE_STEP}`](#{ev.EPISODE_STEP}) | `episode:<rollout_id>:<attempt>` |" in text
    assert "- stream: `episode:<rollout_id>:<attempt>` (execution)" in text
    assert "- stream: `checkpoint:<checkpoint_id>`\n" in text
    assert "| `checkpoint_id` | string | yes |" in text
    assert "No payload fields." in text  # a kind without fields says so
