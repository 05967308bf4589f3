"""The resources server over real HTTP against a real PostgreSQL: sessions, events, admission, restore."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.memory_store import MemoryEventStore
from apps.stack import MemoryBacking
from engine.agent_replay import divergence
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_STARTED
from engine.control import retire_events
from engine.errors import RestartInScope
from engine.events import AppendRequest, NewEvent, canonical_json
from engine.identity import rollout_stream, session_stream
from engine.install import install_request, retired_since
from engine.recovery import Recovery, recovery_request
from participants.base.wire import CONTROL
from participants.environments import get_environment
from participants.environments.tasks import make_task
from participants.resources.server import ResourcesParticipant
from tests.answers import answered
from tests.participants.environments.test_sandbox import host_processes_of
from tests.resources_harness import (
    AUTH,
    Served,
    call,
    checkpoint,
    control,
    email_seed,
    kinds,
    open_session,
    prefix,
    serving,
    start,
    state,
    tool,
)
from tests.waiting import QueuedLock, eventually


@pytest.fixture
def database(memory_database: MemoryBacking) -> MemoryBacking:
    """This module's rules promise no durability: its servers share a log in memory (docs/testing.md)."""
    return memory_database


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    return memory_store


@pytest.fixture
async def served(database: MemoryBacking) -> AsyncIterator[Served]:
    async with serving(database, "resources-a") as s:
        yield s


async def test_open_tool_verify_close_record_one_event_per_change(served: Served, store: MemoryEventStore) -> None:
    http, _ = served
    await start(store, "w1")
    seed = email_seed()
    opened = await open_session(http, "w1", "workplace", seed)
    assert (opened["state_mode"], opened["verification"], opened["revision"]) == ("exported", "replay", 0)
    assert "send_email" in [t["function"]["name"] for t in opened["tools"]]
    stream = session_stream("w1", 0)

    status, read = await tool(http, "w1", "read_inbox")
    assert status == 200 and read["revision"] == 0 and read["output"]["messages"]
    assert await kinds(store, stream) == ["session_opened"]  # a read appends nothing

    args = {"deal_id": "D-101", "notes": "renewal risk", "seats": 12}
    status, upd = await tool(http, "w1", "update_deal", args)
    assert status == 200 and upd["revision"] == 1
    # Verify before the goal is met: it fails, and the failed session keeps its state.
    await answered(store, "w1", "done")
    status, failed = await call(http, "POST", f"{prefix('w1', 0)}/verify", {})
    assert status == 200 and failed["reward"] == 0.0 and failed["status"] == "failed"
    assert (await state(http, "w1"))[0] == 200

    goal = make_task("workplace", seed).params["goal"]
    status, sent = await tool(http, "w1", "send_email", {"to": goal["to"], "subject": goal["subject"], "body": "hi"})
    assert status == 200 and sent["revision"] == 2 and sent["output"]["id"] == "s01"
    status, st = await state(http, "w1")
    events = await store.read_stream(stream)
    effects = [e.data["effect"] for e in events if e.kind == "mutation_applied"]
    env = get_environment("workplace")
    assert st["revision"] == 2
    assert canonical_json(st["state"]) == canonical_json(env.rebuild(make_task("workplace", seed), effects))
    mutation = events[1].data
    assert (mutation["revision"], mutation["tool"], mutation["arguments"]) == (1, "update_deal", args)

    sizes, commit = list[int](), store.log.commit
    store.log.commit = lambda request, *a: sizes.append(len(request.events)) or commit(request, *a)  # type: ignore[method-assign]
    status, passed = await call(http, "POST", f"{prefix('w1', 0)}/verify", {})
    store.log.commit = commit  # type: ignore[method-assign]
    assert status == 200 and passed == {"reward": 1.0, "status": "passed", "revision": 2, "closed": True}
    assert sizes == [2]  # the verification and the close it makes: one append, never one without the other
    # A passed verify retires the session; an explicit close afterwards is a harmless repeat.
    assert (await state(http, "w1"))[0] == 404
    assert await call(http, "POST", f"{prefix('w1', 0)}/close") == (200, {})
    assert await kinds(store, stream) == ["session_opened", "mutation_applied", "session_verified", "mutation_applied",
                                          "session_verified", "session_closed"]
    verified = [e.data for e in await store.read_stream(stream) if e.kind == "session_verified"]
    assert [(v["status"], v["revision"]) for v in verified] == [("failed", 1), ("passed", 2)]


async def test_a_failed_verify_asked_to_close_closes_the_session_in_its_own_append(
        served: Served, store: MemoryEventStore) -> None:
    """Input: a verify with `{"close": true}` before the goal is met (an episode's verify step, its close
    step next). It fails, and the session closes with it, in one append; asked again, the recorded
    verification comes back, closed. A body with a field the route does not know is refused."""
    http, _ = served
    await start(store, "w2")
    await open_session(http, "w2", "workplace", email_seed())
    await answered(store, "w2", "done")
    assert (await call(http, "POST", f"{prefix('w2', 0)}/verify", {"close": True, "later": 1}))[0] == 400
    sizes, commit = list[int](), store.log.commit
    store.log.commit = lambda request, *a: sizes.append(len(request.events)) or commit(request, *a)  # type: ignore[method-assign]
    status, failed = await call(http, "POST", f"{prefix('w2', 0)}/verify", {"close": True})
    store.log.commit = commit  # type: ignore[method-assign]
    assert status == 200 and failed == {"reward": 0.0, "status": "failed", "revision": 0, "closed": True}
    assert sizes == [2]
    assert (await state(http, "w2"))[0] == 404
    assert await kinds(store, session_stream("w2", 0)) == ["session_opened", "session_verified", "session_closed"]
    again = await call(http, "POST", f"{prefix('w2', 0)}/verify", {"close": True})
    assert again == (200, {"reward": 0.0, "status": "failed", "revision": 0, "closed": True, "repeated": True})


@pytest.mark.parametrize(
    "name, arguments, code, what",
    [
        ("send_email", {"to": "a@b.example", "subject": 7, "body": "x"}, "bad_arguments", "a number for a string"),
        ("send_email", {"to": "a@b.example", "subject": "s"}, "bad_arguments", "a missing required argument"),
        ("send_email", {"to": "nobody", "subject": "s", "body": "x"}, "bad_arguments", "a recipient without @"),
        ("update_deal", {"deal_id": "D-101", "colour": "red"}, "bad_arguments", "an unknown argument"),
        ("update_deal", {"deal_id": "D-999", "stage": "won"}, "not_found", "a deal that does not exist"),
        ("fly", {}, "unknown_tool", "a tool the environment does not have"),
    ],
)
async def test_refused_tool_calls_are_422_tool_error_and_change_nothing(
    served: Served, store: MemoryEventStore, name: str, arguments: dict[str, Any], code: str, what: str
) -> None:
    http, _ = served
    await start(store, "w2")
    await open_session(http, "w2", "workplace", 3)
    await tool(http, "w2", "update_deal", {"deal_id": "D-102", "seats": 9})
    before = await state(http, "w2")
    head = await store.head()
    status, reply = await tool(http, "w2", name, arguments)
    assert status == 422, what
    assert reply["error"]["code"] == "tool_error" and reply["error"]["context"] == {"tool_error": code}, what
    assert await store.head() == head, what
    assert await state(http, "w2") == before, what
    status, after = await tool(http, "w2", "update_deal", {"deal_id": "D-102", "seats": 10})
    assert status == 200 and after["revision"] == 2  # the refused call took no revision


async def test_a_mutation_whose_event_cannot_land_leaves_the_session_unchanged(
    served: Served, store: MemoryEventStore
) -> None:
    http, participant = served
    await start(store, "w7")
    await open_session(http, "w7", "workplace", 4)
    before = await state(http, "w7")
    lock = participant.sessions[("w7", 0)].lock = QueuedLock()
    await lock.acquire()  # the call is admitted and waits its turn while another writer gets in first
    calling = asyncio.ensure_future(tool(http, "w7", "update_deal", {"deal_id": "D-101", "seats": 77}))
    await lock.queued(1)
    await store.append(AppendRequest((NewEvent(session_stream("w7", 0), "session_note", {}, "w7", 0),)))
    lock.release()
    status, reply = await calling
    assert (status, reply["error"]["code"]) == (409, "version_conflict")
    assert await state(http, "w7") == before  # no event, so no new state and no revision
    assert "mutation_applied" not in await kinds(store, session_stream("w7", 0))


async def test_prepare_waits_for_no_mutation_then_refuses_new_ones_but_serves_reads(
    served: Served, store: MemoryEventStore
) -> None:
    """A mutation in flight lands after its rollout's latest boundary, where a restore rebuilds the
    session: prepare answers without waiting for it."""
    http, participant = served
    await start(store, "w3")
    await start(store, "w4")
    await open_session(http, "w3", "workplace", 5)
    lock = participant.sessions[("w3", 0)].lock = QueuedLock()
    await lock.acquire()  # a mutation in flight holds the session's lock
    status, report = await asyncio.wait_for(control(http, "prepare"), 10)
    assert lock.locked() and not participant.admission_open
    lock.release()
    assert status == 200 and report["ready"] and report["phase"] == "prepared"
    assert report["counts"] == {"sessions": 1, "stateless": 0, "exported": 1, "restart_only": 0, "replay": 0, "snapshot": 0}

    head = await store.head()
    status, reply = await tool(http, "w3", "update_deal", {"deal_id": "D-101", "seats": 3})
    assert (status, reply["error"]["code"]) == (409, "admission_closed")
    task = make_task("math", 1).to_json()
    status, reply = await call(http, "POST", f"{prefix('w4', 0)}/session", {"env": "math", "task": task})
    assert (status, reply["error"]["code"]) == (409, "admission_closed")
    assert (await tool(http, "w3", "get_deal", {"deal_id": "D-101"}))[0] == 200
    assert (await state(http, "w3"))[0] == 200
    assert await store.head() == head

    assert (await control(http, "resume"))[0] == 200
    status, reply = await tool(http, "w3", "update_deal", {"deal_id": "D-101", "seats": 3})
    assert status == 200 and reply["revision"] == 1
    # The refused call, which named no key, gave its number back: the read took a0.s0, the change a0.s1,
    # as in a run that was never refused (an agent continued by replay numbers its calls the same way).
    [applied] = [e for e in await store.read_rollout("w3") if e.kind == "mutation_applied"]
    assert applied.data["tool_call"] == "a0.s1"


@pytest.mark.usefixtures("restart_only_live")
async def test_prepare_reports_live_restart_only_sessions_as_restarts(served: Served, store: MemoryEventStore) -> None:
    http, _ = served
    for rid in ("sb", "bj", "m"):
        await start(store, rid)
    opened = await open_session(http, "sb", "sandbox", 1)
    assert (opened["state_mode"], opened["verification"]) == ("restart_only", "wait")
    await open_session(http, "bj", "blackjack", 2)
    await open_session(http, "m", "math", 3)
    try:
        status, ran = await tool(http, "sb", "run", {"command": "X=41; echo $((X + 1))"})
        assert status == 200 and ran["output"] == {"output": "42\n", "exit_code": 0} and ran["revision"] == 1
        status, report = await control(http, "prepare")
        assert status == 200 and report["ready"]
        assert report["restarts"] == [{"rollout_id": "sb", "attempt": 0}]
        assert report["counts"] == {"sessions": 3, "stateless": 1, "exported": 1, "restart_only": 1, "replay": 0, "snapshot": 0}
        # The live shell's command is still on the log, even though it can never be replayed.
        mutation = (await store.read_stream(session_stream("sb", 0)))[1]
        assert mutation.kind == "mutation_applied" and mutation.data["effect"]["command"].startswith("X=41")
        await control(http, "resume")
    finally:
        await call(http, "POST", f"{prefix('sb', 0)}/close")
    assert await kinds(store, session_stream("sb", 0)) == ["session_opened", "mutation_applied", "session_closed"]


@pytest.mark.usefixtures("restart_only_live")
async def test_a_fresh_process_reports_the_restart_only_sessions_its_dead_predecessor_held_as_restarts(
    database: MemoryBacking, store: MemoryEventStore
) -> None:
    # A killed resources server takes its live shells with it; the log still has their sessions open.
    # Its successor never held them, yet a checkpoint must not scope them: their restore is refused.
    for rid in ("sb", "m"):
        await start(store, rid)
    async with serving(database, "resources-a") as (http, first):
        await open_session(http, "sb", "sandbox", 1)
        await open_session(http, "m", "math", 3)
        for s in first.sessions.values():
            await first._close_live(s)  # what the SIGKILL did to the shell; nothing reaches the log
    async with serving(database, "resources-b") as (http, second):
        status, report = await control(http, "prepare")
        assert status == 200 and report["ready"], report
        assert report["restarts"] == [{"rollout_id": "sb", "attempt": 0}]  # the math session rebuilds: not a restart
        assert second.sessions == {}
        await control(http, "resume")
        status, reply = await tool(http, "sb", "run", {"command": "true"})
        assert (status, reply["error"]["code"]) == (409, "attempt_lost")


async def test_prepare_waits_for_a_wait_mode_verify_and_reports_it_as_a_blocker_at_the_deadline(
    served: Served, store: MemoryEventStore
) -> None:
    http, participant = served
    await start(store, "sbv")
    await open_session(http, "sbv", "sandbox", 6)  # sandbox verification is `wait`
    verify_path = f"{prefix('sbv', 0)}/verify"
    await answered(store, "sbv", "no idea")
    lock = participant.sessions[("sbv", 0)].lock = QueuedLock()
    try:
        await lock.acquire()  # holds the verify before it records its result
        verifying = asyncio.ensure_future(call(http, "POST", verify_path, {}))
        await lock.queued(1)  # the verify is in progress, waiting to record its result
        status, report = await call(http, "POST", f"{CONTROL}/prepare",
                                    {"checkpoint_id": "ck1", "deadline": time.time() + 2.0}, AUTH)
        assert status == 200 and not report["ready"] and report["blockers"] == ["sbv:0 verify in progress"]
        lock.release()
        assert (await verifying)[1]["status"] == "failed"  # a failed verify keeps the session
        assert (await control(http, "resume"))[0] == 200

        await lock.acquire()
        verifying = asyncio.ensure_future(call(http, "POST", verify_path, {}))
        await lock.queued(1)
        preparing = asyncio.ensure_future(control(http, "prepare", "ck2"))
        # prepare has closed admission while the verify is held: it can only answer once the verify ends
        await eventually("prepare to close admission", lambda: not participant.admission_open)
        assert not preparing.done()
        lock.release()
        status, report = await preparing
        assert status == 200 and report["ready"] and report["blockers"] == []
        assert (await verifying)[0] == 200
        await control(http, "resume", "ck2")
    finally:
        if lock.locked():
            lock.release()
        await call(http, "POST", f"{prefix('sbv', 0)}/close")


async def test_retire_drops_sessions_and_stops_live_shells(served: Served, store: MemoryEventStore) -> None:
    http, participant = served
    for rid in ("rs", "rm"):
        await start(store, rid)
    await open_session(http, "rs", "sandbox", 7)
    await open_session(http, "rm", "math", 8)
    shell = participant.sessions[("rs", 0)].live.process
    status, _ = await call(http, "POST", f"{CONTROL}/retire", {"checkpoint_id": "r1", "deadline": time.time() + 30,
                                                               "rollouts": [{"rollout_id": "rs", "through": 0}]}, AUTH)
    assert status == 200
    assert set(participant.sessions) == {("rm", 0)}
    assert shell.poll() is not None  # the live shell is stopped, not leaked
    status, reply = await call(http, "POST", f"{prefix('rs', 0)}/tools/run", {"arguments": {"command": "true"}})
    assert (status, reply["error"]["code"]) == (409, "stale_attempt")


async def test_a_new_attempt_ends_the_live_shell_of_the_attempt_it_replaces(served: Served, store: MemoryEventStore) -> None:
    """A rollout that failed and restarts under a new attempt never closes its old session: the old
    attempt's shell (and whatever it left running) ends when the new attempt opens its session."""
    http, participant = served
    await start(store, "rf")
    await open_session(http, "rf", "sandbox", 9)
    old = participant.sessions[("rf", 0)].live.process
    await store.append(AppendRequest((NewEvent(rollout_stream("rf"), ATTEMPT_FENCED, {"reason": "test"}, "rf", 0),
                                      NewEvent(rollout_stream("rf"), ATTEMPT_STARTED, {"parent_attempt": 0}, "rf", 1))))
    await open_session(http, "rf", "sandbox", 9, attempt=1)
    try:
        assert old.poll() is not None and set(participant.sessions) == {("rf", 1)}
    finally:
        await call(http, "POST", f"{prefix('rf', 1)}/close")


async def test_restore_in_a_fresh_process_rebuilds_sessions_exactly_and_continues_revisions(
    database: MemoryBacking, store: MemoryEventStore
) -> None:
    seed = next(s for s in range(100) if not get_environment("blackjack").initial_state(make_task("blackjack", s))["done"])
    async with serving(database, "resources-a") as (http, _):
        await start(store, "rw")
        await start(store, "rb")
        await open_session(http, "rw", "workplace", 11)
        await open_session(http, "rb", "blackjack", seed)
        await tool(http, "rw", "update_deal", {"deal_id": "D-103", "stage": "won", "amount": 1234.5})
        await tool(http, "rw", "send_email", {"to": "x@y.example", "subject": "hi", "body": "", "cc": ""})
        await tool(http, "rw", "create_event", {"title": "T", "day": "2026-12-03", "attendees": ["a@b.example"]})
        await tool(http, "rb", "look")
        before = {rid: (await state(http, rid))[1] for rid in ("rw", "rb")}
        assert (before["rw"]["revision"], before["rb"]["revision"]) == (3, 0)
        cut = await checkpoint(store, "ck1", {"rw": 3, "rb": 0})
        # Work after the boundary is lost with the crash: restore goes back to the boundary.
        await tool(http, "rw", "send_email", {"to": "late@y.example", "subject": "lost", "body": "x"})
        await tool(http, "rb", "hit")
    # crash: that process and its memory are gone

    async with serving(database, "resources-b") as (http, participant):
        status, reply = await control(http, "restore")
        assert status == 200 and reply["phase"] == "restored" and reply["detail"] == {"staged": 2, "scope": 2}
        await store.append(install_request(cut, latest={"rw": 0, "rb": 0}))
        status, reply = await control(http, "resume")
        assert status == 200 and reply["detail"] == {"installed": 2}
        for rid in ("rw", "rb"):
            status, after = await state(http, rid, attempt=1)
            assert status == 200
            assert canonical_json(after) == canonical_json(before[rid]), rid
            opened = (await store.read_stream(session_stream(rid, 1)))[0]
            assert opened.kind == "session_opened"
            assert {k: opened.data[k] for k in ("restored_from", "revision", "origin_attempt")} == {
                "restored_from": "ck1", "revision": before[rid]["revision"], "origin_attempt": 0}
        status, reply = await tool(http, "rw", "update_deal", {"deal_id": "D-104", "seats": 8}, attempt=1)
        assert status == 200 and reply["revision"] == 4
        # The restored deck deals the card the uninterrupted game would have dealt.
        expected = get_environment("blackjack").call_tool(before["rb"]["state"], "hit", {})
        status, reply = await tool(http, "rb", "hit", attempt=1)
        assert status == 200 and reply["output"] == expected.output and reply["revision"] == 1
        status, reply = await tool(http, "rw", "get_deal", {"deal_id": "D-103"}, attempt=0)
        assert (status, reply["error"]["code"]) == (409, "stale_attempt")
        assert participant.sessions.keys() == {("rw", 1), ("rb", 1)}
        assert (await store.read_stream(session_stream("rw", 1)))[-1].data["revision"] == 4
        again = {rid: (await state(http, rid, attempt=1))[1] for rid in ("rw", "rb")}
        cut2 = await checkpoint(store, "ck2", {"rw": 4, "rb": 1}, attempt=1)

    # A second crash: attempt 1 replays through its origin (attempt 0 up to ck1's boundary), then its own events.
    async with serving(database, "resources-c") as (http, _):
        assert (await control(http, "restore", "ck2"))[0] == 200
        await store.append(install_request(cut2, latest={"rw": 1, "rb": 1}))
        assert (await control(http, "resume", "ck2"))[0] == 200
        for rid in ("rw", "rb"):
            assert canonical_json((await state(http, rid, attempt=2))[1]) == canonical_json(again[rid]), rid


async def corrupt_by_deleting(store: MemoryEventStore, rid: str) -> None:
    """Delete an event behind the store's back, as a careless operator would a row."""
    victim = next(e for e in await store.read_stream(session_stream(rid, 0)) if e.kind == "mutation_applied")
    store.log.events.remove(victim)


@pytest.mark.parametrize("how", ["deleted_row", "unreplayable_effect", "revision_gap"])
async def test_restore_with_one_corrupt_session_stages_nothing(database: MemoryBacking, store: MemoryEventStore, how: str) -> None:
    async with serving(database, "resources-a") as (http, _):
        for rid in ("r1-good", "r2-bad"):
            await start(store, rid)
            await open_session(http, rid, "workplace", 21)
            await tool(http, rid, "update_deal", {"deal_id": "D-101", "seats": 2})
        revision = 1
        if how != "deleted_row":
            # Appended through the log itself, so every hash checks out: only the replay can tell.
            if how == "unreplayable_effect":
                revision, effect = 2, {"op": "update", "table": "deals", "row": "D-101", "values": {"seats": "many"}}
            else:
                revision, effect = 3, {"op": "update", "table": "deals", "row": "D-101", "values": {"seats": 4}}
            await store.append(AppendRequest((NewEvent(session_stream("r2-bad", 0), "mutation_applied", {
                "revision": revision, "tool": "update_deal", "arguments": {}, "effect": effect}, "r2-bad", 0),)))
        await checkpoint(store, "ck1", {"r1-good": 1, "r2-bad": revision})
    if how == "deleted_row":
        await corrupt_by_deleting(store, "r2-bad")

    async with serving(database, "resources-b") as (http, participant):
        status, reply = await control(http, "restore")
        assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state"), how
        # r1-good comes first in the scope and rebuilds fine, yet it is not staged either.
        assert participant.staged == {} and participant.sessions == {}, how
        status, st = await call(http, "GET", f"{CONTROL}/status", headers=AUTH)
        assert st["phase"] == "idle"


@pytest.mark.usefixtures("restart_only_live")
async def test_restore_refuses_a_restart_only_session_in_scope(database: MemoryBacking, store: MemoryEventStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(database, "resources-a") as (http, _):
        await start(store, "sb")
        await open_session(http, "sb", "sandbox", 4)
        try:
            await tool(http, "sb", "run", {"command": "cd /tmp"})
            with pytest.raises(RestartInScope):  # the cut reads the log's rule and refuses to scope it
                await checkpoint(store, "ck0", {"sb": 1})
            # A cut committed without that rule (an older rollbook's) is refused again at restore.
            monkeypatch.setattr(store, "restart_only_at", lambda boundaries: asyncio.sleep(0, []))
            await checkpoint(store, "ck1", {"sb": 1})
        finally:
            await call(http, "POST", f"{prefix('sb', 0)}/close")
    async with serving(database, "resources-b") as (http, participant):
        status, reply = await control(http, "restore")
        assert (status, reply["error"]["code"]) == (409, "restart_in_scope")
        assert participant.staged == {}


async def test_restore_is_refused_in_a_process_that_has_served_sessions(served: Served, store: MemoryEventStore) -> None:
    http, participant = served
    await start(store, "w5")
    await open_session(http, "w5", "workplace", 2)
    await checkpoint(store, "ck1", {"w5": 0})
    status, reply = await control(http, "restore")
    assert (status, reply["error"]["code"]) == (409, "invalid_phase")
    assert participant.staged == {}


async def test_a_fenced_attempt_gets_409_stale_attempt(served: Served, store: MemoryEventStore) -> None:
    http, _ = served
    await start(store, "w6")
    await open_session(http, "w6", "workplace", 2)
    await store.append(AppendRequest((NewEvent(rollout_stream("w6"), ATTEMPT_FENCED, {"reason": "test"}, "w6", 0),)))
    head = await store.head()
    for status, reply in [await tool(http, "w6", "update_deal", {"deal_id": "D-101", "seats": 1}), await state(http, "w6")]:
        assert (status, reply["error"]["code"]) == (409, "stale_attempt")
    assert await store.head() == head


@pytest.mark.parametrize("method, path", [("POST", "/session"), ("POST", "/tools/look"), ("POST", "/verify"),
                                          ("POST", "/close"), ("GET", "/state")])
async def test_data_routes_without_the_identity_prefix_are_400(served: Served, method: str, path: str) -> None:
    http, participant = served
    status, reply = await call(http, method, path, {} if method == "POST" else None)
    assert (status, reply["error"]["code"]) == (400, "rollout_id_required")
    assert not participant.served_sessions


async def test_closing_a_restored_attempt_whose_session_was_retired_before_the_cut_succeeds(
    database: MemoryBacking, store: MemoryEventStore
) -> None:
    # Found by the demo: an episode checkpointed between its verify step (which retired the session
    # after a passing verify) and its close step could never finish after a restore.
    seed = email_seed()
    task = make_task("workplace", seed)
    async with serving(database, "resources-a") as (http, _):
        await start(store, "rv")
        await open_session(http, "rv", "workplace", seed)
        goal = task.params["goal"]
        status, _ = await tool(http, "rv", "send_email", {"to": goal["to"], "subject": goal["subject"], "body": "hi"})
        assert status == 200
        await answered(store, "rv", "done")
        status, reply = await call(http, "POST", f"{prefix('rv', 0)}/verify", {})
        assert status == 200 and reply["reward"] > 0
        assert (await kinds(store, session_stream("rv", 0)))[-1] == "session_closed"  # a passing verify retires it
        cut = await checkpoint(store, "ckv", {"rv": 1})
    async with serving(database, "resources-b") as (http, _):
        assert (await control(http, "restore", "ckv"))[0] == 200
        await store.append(install_request(cut, latest={"rv": 0}))
        assert (await control(http, "resume", "ckv"))[0] == 200
        status, reply = await call(http, "POST", f"{prefix('rv', 1)}/close", {})
        assert (status, reply) == (200, {})


async def retire(store: MemoryEventStore, rid: str, through: int) -> None:
    await store.append(AppendRequest(retire_events([(rid, through)], {})))


@pytest.mark.parametrize("retired_when", ["before the install", "between the install and the resume"])
async def test_a_restore_leaves_a_rollout_retired_since_its_cut_retired_and_installs_the_rest(
    database: MemoryBacking, store: MemoryEventStore, retired_when: str
) -> None:
    """A rollout the framework retired after the cut has no attempt restored from it: the install
    (engine.install.install_request) leaves it as it is, and the resume installs every other
    session and opens. It used to refuse the whole resume and stay closed, so the rollouts it did
    hold waited for a resume that never succeeded."""
    async with serving(database, "resources-a") as (http, _):
        for rid in ("kept", "gone"):
            await start(store, rid)
            await open_session(http, rid, "workplace", 11)
        cut = await checkpoint(store, "ck1", {"kept": 0, "gone": 0})
    async with serving(database, "resources-b") as (http, participant):
        assert (await control(http, "restore"))[1]["detail"] == {"staged": 2, "scope": 2}
        if retired_when == "before the install":
            await retire(store, "gone", 0)
            rows = await store.attempt_rows(["kept", "gone"])
            await store.append(install_request(cut, latest={"kept": 0, "gone": 0}, retired=retired_since(rows)))
            assert await kinds(store, rollout_stream("gone")) == ["attempt_started", "rollout_retired"]
        else:
            await store.append(install_request(cut, latest={"kept": 0, "gone": 0}))
            await retire(store, "gone", 1)
        status, reply = await control(http, "resume")
        assert (status, reply["detail"]) == (200, {"installed": 1}), reply
        assert participant.admission_open and participant.sessions.keys() == {("kept", 1)}
        assert (await tool(http, "kept", "get_deal", {"deal_id": "D-103"}, attempt=1))[0] == 200


async def test_a_resume_without_the_install_is_refused_and_stays_closed(
    database: MemoryBacking, store: MemoryEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Staged sessions are handed over only once the coordinator has installed the cut; the refusal
    is said in the server's log too, since every session waiting on this server waits for it."""
    async with serving(database, "resources-a") as (http, _):
        await start(store, "r1")
        await open_session(http, "r1", "workplace", 11)
        await checkpoint(store, "ck1", {"r1": 0})
    async with serving(database, "resources-b") as (http, participant):
        assert (await control(http, "restore"))[0] == 200
        status, reply = await control(http, "resume")
        assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state"), reply
        assert not participant.admission_open
        assert "admission stays closed until a resume succeeds" in caplog.text


@pytest.mark.parametrize("key", ["../a0.t0.0", "victim.0.a0.t3.0", "a0.t0", "a01.t0.0", "a0.t0.0\u00e9", "x" * 200])
async def test_a_tool_call_key_of_any_other_shape_is_refused_before_anything_runs(
    served: Served, store: MemoryEventStore, key: str
) -> None:
    """The key names a call within the session the path names (a<activation>.t<turn>.<index>, as the
    agent derives it); anything else is refused, so no key can speak for another session's calls."""
    http, _ = served
    await start(store, "k1")
    await open_session(http, "k1", "workplace", 11)
    status, reply = await call(http, "POST", f"{prefix('k1', 0)}/tools/update_deal",
                               {"arguments": {"deal_id": "D-101", "seats": 3}},
                               {"X-Rollbook-Tool-Call": key.encode("utf-8").decode("latin-1")})
    assert (status, reply["error"]["code"]) == (400, "invalid_identifier"), reply
    assert await kinds(store, session_stream("k1", 0)) == ["session_opened"]



# -- a sandbox session ends with its attempt, however the attempt ends --------------------------




async def left_running(http: aiohttp.ClientSession, participant: ResourcesParticipant, rid: str, attempt: int = 0):
    """The attack: a background job in the session, then the attempt ends some way other than a close."""
    await open_session(http, rid, "sandbox", 3, attempt=attempt)
    live = participant.sessions[(rid, attempt)].live
    status, reply = await tool(http, rid, "run", {"command": "sleep 600 & echo started"}, attempt=attempt)
    assert status == 200 and reply["output"]["output"] == "started\n", reply
    assert host_processes_of(live.uid)
    return live


async def ended(live: Any, within: float = 5.0) -> bool:
    """The session's jail, its processes and its cgroups are gone, and its uid free again."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if live.ended.is_set() and not host_processes_of(live.uid) and not any(os.path.exists(g) for g in getattr(live, "cgroups", ())):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_finished_attempt_ends_its_sandbox_session(served: Served, store: MemoryEventStore) -> None:
    """Attack: `sleep 600 &`, then the episode finishes (its close step): nothing of the session stays."""
    http, participant = served
    await start(store, "sb-finished")
    live = await left_running(http, participant, "sb-finished")
    await call(http, "POST", f"{prefix('sb-finished', 0)}/close")
    assert await ended(live)


@pytest.mark.parametrize("reason", ["failed", "restore"])
async def test_a_fenced_attempt_ends_its_sandbox_session(served: Served, store: MemoryEventStore, reason: str) -> None:
    """Attack: `sleep 600 &`, then the rollout fails (the environment server fences the attempt) or a
    restore fences it: the session lived on until idle_s (30 minutes), its uid and memory held."""
    http, participant = served
    rid = f"sb-fenced-{reason}"
    await start(store, rid)
    live = await left_running(http, participant, rid)
    await store.append(AppendRequest((NewEvent(rollout_stream(rid), ATTEMPT_FENCED, {"reason": reason}, rid, 0),)))
    assert await ended(live)
    assert (rid, 0) not in participant.sessions


async def test_a_retired_attempt_ends_its_sandbox_session(served: Served, store: MemoryEventStore) -> None:
    """Attack: `sleep 600 &`, then the rollout is retired by a mark another server wrote (no retire
    request reaches this one)."""
    http, participant = served
    await start(store, "sb-retired")
    live = await left_running(http, participant, "sb-retired")
    await store.append(AppendRequest(retire_events([("sb-retired", 0)], {})))
    assert await ended(live)


async def test_a_server_shutdown_ends_its_sandbox_sessions(database: MemoryBacking, store: MemoryEventStore) -> None:
    """Attack: `sleep 600 &`, then the server stops inside a process that goes on (the jail watched
    only for its server's process to exit)."""
    async with serving(database, "resources-a") as (http, participant):
        await start(store, "sb-shutdown")
        live = await left_running(http, participant, "sb-shutdown")
    assert await ended(live)


_FUZZED = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
# A list joined, not st.text: hypothesis's text strategies leave lone surrogates out.
@given(command=st.lists(st.one_of(st.characters(codec=None), st.sampled_from(["\ud800", "\udfff", "\x00", "\n", "e"])),
                        min_size=1, max_size=40).map("".join))
async def test_any_command_text_is_an_answer_or_a_tool_error_never_a_server_error(
        served: Served, store: MemoryEventStore, command: str, caplog: pytest.LogCaptureFixture) -> None:
    """Fuzz of a sandbox command's arguments through the real resources server and the real jail:
    any code point (lone surrogates, NUL, controls included) is run or refused as the model's own
    error (4xx, `tool_error`); never a 500, never a Traceback in the server's log."""
    http, participant = served
    rid = f"fz{next(_FUZZED)}"
    await start(store, rid)
    await open_session(http, rid, "sandbox", 3)
    with caplog.at_level(logging.ERROR):
        status, reply = await call(http, "POST", f"{prefix(rid, 0)}/tools/run", {"arguments": {"command": command}})
    assert status < 500, reply
    assert status == 200 or reply["error"]["code"] in ("tool_error", "invalid_request"), reply
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    await call(http, "POST", f"{prefix(rid, 0)}/close")


async def continue_from(store: MemoryEventStore, rid: str, origin: int) -> None:
    """What a recovery writes: the attempt fenced, the next one started from all of it."""
    await store.append(recovery_request(Recovery(rid, origin, "continue", None, True, "the agent crashed")))


async def test_tool_calls_that_name_no_key_are_numbered_and_answered_from_the_log_when_the_agent_runs_again(
        database: MemoryBacking, store: MemoryEventStore) -> None:
    """An agent that sends no X-Rollbook-Tool-Call (a stranger's) makes two changes and a read; after a
    crash it runs again from its start under attempt 1, on a fresh process: the two changes get their
    recorded answers and change nothing, the read runs, the call past them is applied. Under attempt 2
    its first call asks for other arguments: refused as agent_divergence, nothing applied."""
    await start(store, "nk")
    seed = email_seed()
    goal = make_task("workplace", seed).params["goal"]
    deal, email = {"deal_id": "D-101", "notes": "renewal risk"}, {"to": goal["to"], "subject": goal["subject"], "body": "hi"}
    async with serving(database, "resources-a") as (http, _):
        await open_session(http, "nk", "workplace", seed)
        first = [await tool(http, "nk", "update_deal", deal), await tool(http, "nk", "read_inbox"),
                 await tool(http, "nk", "send_email", email)]
    await continue_from(store, "nk", 0)
    async with serving(database, "resources-b") as (http, _):
        again = [await tool(http, "nk", "update_deal", deal, attempt=1), await tool(http, "nk", "read_inbox", attempt=1),
                 await tool(http, "nk", "send_email", email, attempt=1)]
        past = await tool(http, "nk", "update_deal", {"deal_id": "D-101", "seats": 3}, attempt=1)
        await continue_from(store, "nk", 1)
        diverged = await tool(http, "nk", "update_deal", {"deal_id": "D-101", "notes": "other"}, attempt=2)
    assert [s for s, _ in first + again] == [200] * 6 and past[0] == 200
    changes = [(r["output"], r["revision"]) for i, (_, r) in enumerate(again) if i != 1]
    assert changes == [(r["output"], r["revision"]) for i, (_, r) in enumerate(first) if i != 1]
    # The read was not recorded: it ran again, on the state the session holds now (both changes in it).
    assert [r.get("repeated") for _, r in again] == [True, None, True] and again[1][1]["revision"] == 2
    assert past[1]["revision"] == 3
    mutations = [(e.attempt, e.data["tool_call"]) for e in await store.read_rollout("nk") if e.kind == "mutation_applied"]
    assert mutations == [(0, "a0.s0"), (0, "a0.s2"), (1, "a0.s3")]
    assert (diverged[0], diverged[1]["error"]["code"]) == (409, "agent_divergence")
    # Recorded on the session's stream, where the agent server finds it (engine.agent_replay.divergence).
    [recorded] = [e for e in await store.read_rollout("nk", 2) if e.kind == "tool_call_diverged"]
    assert (recorded.data["tool_call"], recorded.data["diverges_from"]["arguments"]) == ("a0.s0", deal)
    assert divergence(await store.read_rollout("nk", 2), "nk", 2, 0) == recorded
