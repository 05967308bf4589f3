"""engine.recovery at its edges, without a store: a session's mode as its episode seeded it, whose
finish counts, and the one request that moves a lost attempt to the next."""

from __future__ import annotations

import pytest

from engine import recovery, sessions
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_FINISHED, ATTEMPT_STARTED
from engine.catalog import ROLLOUT_RECOVERED
from engine.identity import agent_stream, episode_stream, rollout_stream, session_stream
from tests.test_recovery import HISTORY, ev

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
