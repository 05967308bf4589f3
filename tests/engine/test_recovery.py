"""The recovery rules (engine.recovery) and the servers' way back from the log after a restart.

engine.recovery at its edges, without a store: a session's mode as its episode seeded it, whose
finish counts, and the one request that moves a lost attempt to the next.
"""

from __future__ import annotations

import pytest

from adapters.memory_store import MemoryEventStore
from apps.replay import replay
from apps.stack import MemoryBacking
from engine import recovery, sessions
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_FINISHED, ATTEMPT_STARTED
from engine.catalog import ROLLOUT_RECOVERED
from engine.errors import StaleAttempt
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import agent_stream, episode_stream, rollout_stream, session_stream
from engine.lineage import effective_history
from participants.environments.tasks import make_task
from tests.answers import answered
from tests.resources_harness import call, email_seed, kinds, open_session, prefix, serving, start, state


@pytest.fixture
def database(memory_database: MemoryBacking) -> MemoryBacking:
    """The recovery rules promise no durability of their own: the servers share a log in memory."""
    return memory_database


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    return memory_store


def ev(position: int, kind: str, stream: str = "s", attempt: int = 0, **data: object) -> RecordedEvent:
    return RecordedEvent(position, stream, position, kind, dict(data), "r", attempt, 1, "test", b"")


HISTORY = [
    ev(1, ATTEMPT_STARTED, rollout_stream("r")),
    ev(2, "episode_step", episode_stream("r", 0), step="seed", state_mode="exported"),
    ev(3, "session_opened", session_stream("r", 0), env="workplace"),
    ev(4, "agent_boundary", agent_stream("r", 0), activation=0, turn=0, state="before_model"),
    ev(5, "mutation_applied", session_stream("r", 0), revision=1, tool_call="a0.t0.0", output={"ok": 1}, done=False),
    ev(6, "agent_boundary", agent_stream("r", 0), activation=0, turn=1, state="before_model"),
]


def test_an_attempt_with_every_part_intact_continues_from_its_latest_boundary() -> None:
    r = recovery.classify("r", 0, HISTORY)
    assert (r.disposition, r.boundary, r.new_attempt) == ("continue", 6, False)


def test_a_finished_attempt_is_never_continued() -> None:
    r = recovery.classify("r", 0, [*HISTORY, ev(7, ATTEMPT_FINISHED, rollout_stream("r"), reward=1.0)], lost="call")
    assert (r.disposition, r.new_attempt) == ("finished", False)


def test_a_lost_model_call_continues_under_a_new_attempt_from_the_boundary_before_it() -> None:
    r = recovery.classify("r", 0, HISTORY, lost="call")
    assert (r.disposition, r.boundary, r.new_attempt) == ("continue", 6, True)


@pytest.mark.parametrize("lost", ["session", "call"])
def test_an_attempt_whose_restart_only_state_is_gone_starts_over_from_its_input(lost: str) -> None:
    sandbox = [ev(1, ATTEMPT_STARTED, rollout_stream("r")),
               ev(2, "session_opened", session_stream("r", 0), env="sandbox", state_mode="restart_only"),
               ev(3, "agent_boundary", agent_stream("r", 0), activation=0, turn=0, state="before_model")]
    r = recovery.classify("r", 0, sandbox, lost=lost)  # type: ignore[arg-type]
    assert (r.disposition, r.boundary, r.new_attempt) == ("fresh_dispatch", None, True)


def test_a_closed_session_does_not_count_as_open() -> None:
    closed = [*HISTORY, ev(7, "session_closed", session_stream("r", 0))]
    assert sessions.open_session_mode(HISTORY) == "exported"
    assert sessions.open_session_mode(closed) is None


def test_resume_point_is_the_last_boundary_of_an_unfinished_activation_only() -> None:
    assert recovery.resume_point(HISTORY, 0) == HISTORY[-1]
    assert recovery.resume_point(HISTORY, 1) is None
    done = [*HISTORY, ev(7, "agent_activation_completed", agent_stream("r", 0), index=0)]
    assert recovery.resume_point(done, 0) is None


def test_tool_call_outcomes_name_each_applied_call_and_call_lost_needs_an_orphaned_acceptance() -> None:
    assert recovery.tool_call_outcomes(HISTORY) == {"a0.t0.0": HISTORY[4].data}
    assert recovery.call_lost("accepted", "orphaned")
    assert not recovery.call_lost("accepted", "mine")
    assert not recovery.call_lost("accepted", "held")  # another live instance serves it
    assert not recovery.call_lost("completed", "orphaned")


def test_run_dispositions_from_attempt_rows() -> None:
    rows = {("a", 0): {"status": "finished"}, ("b", 0): {"status": "fenced"}, ("b", 1): {"status": "live"},
            ("c", 0): {"status": "fenced"}}
    assert recovery.run_dispositions(rows, ["a", "b", "c", "d"]) == {
        "a": "finished", "b": "continue", "c": "stale", "d": "not_started"}


async def test_a_recovery_request_fences_the_attempt_and_starts_the_next_from_its_boundary(store: MemoryEventStore) -> None:
    await start(store, "rv")
    step = NewEvent(episode_stream("rv", 0), "episode_step", {"step": "seed"}, "rv", 0)
    (boundary,) = await store.append(AppendRequest((step,)))
    history = await effective_history(store, "rv", 0)
    decision = recovery.classify("rv", 0, history, lost="call")
    written = await store.append(recovery.recovery_request(decision))
    assert [e.kind for e in written] == [recovery.ROLLOUT_RECOVERED, "attempt_fenced", ATTEMPT_STARTED]
    assert written[2].data["origin_position"] == boundary.position and written[2].attempt == 1
    rows = await store.attempt_rows(["rv"])
    assert rows[("rv", 0)]["status"] == "fenced" and rows[("rv", 1)]["origin_position"] == boundary.position
    # Attempt 1 inherits attempt 0's events up to the boundary, nothing after it.
    assert [e.position for e in await effective_history(store, "rv", 1)][:2] == [history[0].position, boundary.position]
    with pytest.raises(StaleAttempt):  # a second recovery of the same attempt (a racing server) writes nothing
        await store.append(recovery.recovery_request(decision))


async def test_a_restarted_resources_server_rebuilds_the_session_and_answers_an_applied_tool_call_from_the_log(
        database: MemoryBacking, store: MemoryEventStore) -> None:
    await start(store, "rr")
    hit = {"X-Rollbook-Tool-Call": "a0.t0.0"}
    async with serving(database, "resources-a") as (http, _):
        await open_session(http, "rr", "blackjack", 3)
        status, first = await call(http, "POST", f"{prefix('rr', 0)}/tools/hit", {"arguments": {}}, hit)
        assert status == 200 and first["revision"] == 1
        _, before = await state(http, "rr")
    # A fresh process: nothing in memory, only the log.
    async with serving(database, "resources-b") as (http, _):
        status, again = await call(http, "POST", f"{prefix('rr', 0)}/tools/hit", {"arguments": {}}, hit)
        assert status == 200 and again["revision"] == 1 and again["output"] == first["output"] and again["repeated"]
        _, after = await state(http, "rr")
        assert after == before
        status, other = await call(http, "POST", f"{prefix('rr', 0)}/tools/look", {"arguments": {}},
                                   {"X-Rollbook-Tool-Call": "a0.t1.0"})
        assert status == 200
    assert (await kinds(store, session_stream("rr", 0))).count("mutation_applied") == 1


@pytest.mark.usefixtures("restart_only_live")
async def test_a_restart_only_session_lost_with_its_server_is_attempt_lost(database: MemoryBacking, store: MemoryEventStore) -> None:
    await start(store, "rs")
    async with serving(database, "resources-a") as (http, _):
        await open_session(http, "rs", "sandbox", 2)
    async with serving(database, "resources-b") as (http, _):
        status, reply = await call(http, "POST", f"{prefix('rs', 0)}/tools/run", {"arguments": {"command": "echo hi"}},
                                   {"X-Rollbook-Tool-Call": "a0.t0.0"})
    assert status == 409 and reply["error"]["code"] == "attempt_lost"
    assert reply["error"]["context"]["lost"] == "session"


async def test_an_attempt_continuing_another_reopens_its_inherited_session_at_the_boundary(
        database: MemoryBacking, store: MemoryEventStore) -> None:
    await start(store, "ri")
    async with serving(database, "resources-a") as (http, _):
        await open_session(http, "ri", "blackjack", 5)
        await call(http, "POST", f"{prefix('ri', 0)}/tools/hit", {"arguments": {}}, {"X-Rollbook-Tool-Call": "a0.t0.0"})
        _, at_boundary = await state(http, "ri")
    (boundary,) = await store.append(AppendRequest((NewEvent(agent_stream("ri", 0), "agent_boundary", {
        "activation": 0, "turn": 1, "state": "before_model"}, "ri", 0),)))
    decision = recovery.classify("ri", 0, await effective_history(store, "ri", 0), lost="call")
    assert decision.boundary == boundary.position
    await store.append(recovery.recovery_request(decision))
    async with serving(database, "resources-b") as (http, _):
        status, now = await state(http, "ri", attempt=1)
    assert status == 200 and now == at_boundary
    opened = (await store.read_stream(session_stream("ri", 1)))[0]
    assert opened.kind == "session_opened" and opened.data["recovered"] and opened.data["revision"] == 1
    # `rollbook replay` rebuilds the recovered attempt from the log alone, through its origin.
    steps, replayed = await replay(store, "ri", 1)
    assert replayed.revision == 1 and replayed.env_state == now["state"]
    assert any("recovered from attempt 0" in s.change for s in steps)


async def test_a_verify_asked_again_after_it_passed_gets_the_recorded_verification(database: MemoryBacking, store: MemoryEventStore) -> None:
    # The environment server crashed after a passed verify (which retires the session) and before it
    # recorded its own verify step; dispatched again, it asks again and must not get not_found.
    await start(store, "rq")
    seed = email_seed()
    goal = make_task("workplace", seed).params["goal"]
    async with serving(database, "resources-a") as (http, _):
        await open_session(http, "rq", "workplace", seed)
        await call(http, "POST", f"{prefix('rq', 0)}/tools/send_email",
                   {"arguments": {"to": goal["to"], "subject": goal["subject"], "body": "hi"}}, {"X-Rollbook-Tool-Call": "a0.t0.0"})
        await answered(store, "rq", "sent")
        status, passed = await call(http, "POST", f"{prefix('rq', 0)}/verify", {})
        assert status == 200 and passed["status"] == "passed"
    async with serving(database, "resources-b") as (http, _):
        status, again = await call(http, "POST", f"{prefix('rq', 0)}/verify", {})
    assert status == 200 and (again["reward"], again["status"], again["revision"]) == (1.0, "passed", 1)
    assert (await kinds(store, session_stream("rq", 0))).count("session_verified") == 1


OPENED = ev(3, "session_opened", session_stream("r", 0), env="sandbox")


def test_a_session_opened_without_a_mode_takes_the_mode_its_episode_seeded() -> None:
    seeded = ev(2, "episode_step", episode_stream("r", 0), step="seed", state_mode="restart_only")
    assert sessions.open_session_mode([seeded, OPENED]) == "restart_only"
    assert sessions.open_session_mode([OPENED]) == "exported"


def test_only_an_episodes_seed_step_seeds_a_mode() -> None:
    other_step = ev(2, "episode_step", episode_stream("r", 0), step="act", state_mode="restart_only")
    not_a_step = ev(2, "episode_started", episode_stream("r", 0), step="seed", state_mode="restart_only")
    assert sessions.open_session_mode([other_step, OPENED]) == "exported"
    assert sessions.open_session_mode([not_a_step, OPENED]) == "exported"


def test_a_mode_the_session_names_wins_over_the_seeded_one() -> None:
    seeded = ev(2, "episode_step", episode_stream("r", 0), step="seed", state_mode="restart_only")
    named = ev(3, "session_opened", session_stream("r", 0), env="w", state_mode="exported")
    assert sessions.open_session_mode([seeded, named]) == "exported"


def test_events_outside_a_session_stream_open_nothing() -> None:
    assert sessions.open_session_mode([ev(3, "session_opened", episode_stream("r", 0), env="w")]) is None


def test_only_this_attempts_finish_makes_it_finished() -> None:
    other = ev(7, ATTEMPT_FINISHED, rollout_stream("r"), attempt=1, reward=1.0)
    assert recovery.classify("r", 0, [*HISTORY, other]).disposition == "continue"


def test_an_attempt_with_no_boundary_continues_from_none() -> None:
    r = recovery.classify("r", 0, [ev(3, "session_opened", session_stream("r", 0), env="w")], lost="call")
    assert (r.disposition, r.boundary, r.new_attempt) == ("continue", None, True)


def test_a_recovery_request_records_fences_and_starts_the_next_attempt_from_its_boundary() -> None:
    r = recovery.classify("r", 2, HISTORY, lost="call")
    recorded, fenced, started = recovery.recovery_request(r).events
    assert (recorded.kind, recorded.attempt, recorded.data) == (ROLLOUT_RECOVERED, 2, r.to_json())
    assert r.to_json() == {"attempt": 2, "disposition": "continue", "boundary": 6, "new_attempt": True,
                           "reason": r.reason}
    assert (fenced.kind, fenced.attempt, fenced.data) == (ATTEMPT_FENCED, 2, {"reason": "recovery",
                                                                               "disposition": "continue"})
    assert (started.kind, started.attempt, started.stream) == (ATTEMPT_STARTED, 3, rollout_stream("r"))
    assert started.data == {"parent_attempt": 2, "restored_from": None, "recovered": True, "origin_attempt": 2,
                            "origin_position": 6, "disposition": "continue"}


def test_a_fresh_dispatch_starts_from_no_origin_and_an_attempt_going_on_needs_no_request() -> None:
    fresh = recovery.classify("r", 0, HISTORY, lost="session")
    started = recovery.recovery_request(fresh).events[2]
    assert (started.data["origin_attempt"], started.data["origin_position"]) == (None, None)
    with pytest.raises(ValueError, match="r attempt 0 continues as it is"):
        recovery.recovery_request(recovery.classify("r", 0, HISTORY))


def test_a_boundary_without_an_activation_is_activation_zeros() -> None:
    bare = [*HISTORY[:3], ev(4, "agent_boundary", agent_stream("r", 0), turn=0, messages=[])]
    assert recovery.resume_point(bare, 0) == bare[-1]
    assert recovery.resume_point(bare, 1) is None
    assert recovery.resume_point(HISTORY[:3], 0) is None


def test_a_completion_of_another_activation_leaves_this_ones_boundary() -> None:
    done_other = [*HISTORY, ev(7, "agent_activation_completed", agent_stream("r", 0), index=1)]
    assert recovery.resume_point(done_other, 0) == HISTORY[-1]


def test_a_mutation_without_a_tool_call_is_no_tool_calls_outcome() -> None:
    assert recovery.tool_call_outcomes([ev(5, "mutation_applied", session_stream("r", 0), revision=1, tool_call=None),
                                        ev(6, "episode_step", episode_stream("r", 0), tool_call="x")]) == {}


def test_a_rollout_whose_latest_attempt_is_live_continues_even_after_a_fenced_one() -> None:
    rows = {("b", 0): {"status": "live"}, ("b", 1): {"status": "fenced"}, ("c", 2): {"status": "live"},
            ("c", 1): {"status": "fenced"}}
    assert recovery.run_dispositions(rows, ["b", "c"]) == {"b": "stale", "c": "continue"}


def test_an_interrupted_replay_agent_continues_under_a_new_attempt_from_all_of_the_old_one() -> None:
    """An agent continued by replay (engine.agent_replay) cut off after it made calls: all of the
    attempt, not its latest boundary, is the new attempt's lineage, so every call it recorded answers
    the agent's next run."""
    history = [ev(1, ATTEMPT_STARTED, rollout_stream("r")), ev(2, "episode_step", "episode:r:0", step="seed")]
    r = recovery.classify("r", 0, history, "agent")
    assert (r.disposition, r.new_attempt, r.boundary) == ("continue", True, None)
    _, _, started = recovery.recovery_request(r).events
    assert (started.attempt, started.data["origin_attempt"], started.data["origin_position"]) == (1, 0, None)


def test_a_divergence_is_recorded_with_the_reason_its_caller_gives() -> None:
    """A relayed session's replay diverging says replay_divergence; an agent's, agent_divergence."""
    assert recovery.classify("r", 1, [], "divergence").reason == "replay_divergence"
    r = recovery.classify("r", 1, [], "divergence", "agent_divergence")
    assert (r.disposition, r.new_attempt, r.reason) == ("fresh_dispatch", True, "agent_divergence")
