"""The projections' one derivation (engine.projections.changes_for): which table each event changes,
under which key, to which values. The tables themselves are checked against a rebuild in PostgreSQL
(tests/test_projections.py); here is the rule alone."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from engine import catalog as ev
from engine.events import RecordedEvent
from engine.projections import POSITION_COLUMNS, Change, changes_for

AT = {"rollout_id": "r", "attempt": 2}


def rec(kind: str, data: dict[str, Any] | None = None, position: int = 40, version: int = 3) -> RecordedEvent:
    return RecordedEvent(position, "s", version, kind, data or {}, "r", 2, 1, "t", b"\x00" * 32)


def test_an_attempt_start_makes_it_live_and_the_rollouts_latest() -> None:
    assert changes_for(rec(ev.ATTEMPT_STARTED, {"parent_attempt": 1, "restored_from": "ck", "origin_position": 9})) == [
        Change("attempt_state", AT, {"status": "live", "parent_attempt": 1, "restored_from": "ck", "origin_position": 9,
                                     "started_position": 40}),
        Change("rollout_state", {"rollout_id": "r"}, {"latest_attempt": 2}),
    ]


def test_a_fence_and_a_finish_end_the_attempt() -> None:
    assert changes_for(rec(ev.ATTEMPT_FENCED)) == [
        Change("attempt_state", AT, {"status": "fenced", "ended_position": 40})]
    assert changes_for(rec(ev.ATTEMPT_FINISHED, {"reward": 0.5})) == [
        Change("attempt_state", AT, {"status": "finished", "ended_position": 40, "reward": 0.5})]


def test_a_retire_sets_the_mark_and_ends_the_live_attempts_it_reaches_and_forget_lifts_it() -> None:
    assert changes_for(rec(ev.ROLLOUT_RETIRED, {"through": 1})) == [
        Change("rollout_state", {"rollout_id": "r"}, {"retired_through": 1}),
        Change("attempt_state", {"rollout_id": "r", "attempt": 1}, {"status": "retired", "ended_position": 40},
               guard="live_through"),
    ]
    assert changes_for(rec(ev.ROLLOUT_FORGOTTEN)) == [
        Change("rollout_state", {"rollout_id": "r"}, {"retired_through": -1})]


def test_episode_events_carry_their_status_and_the_columns_they_name() -> None:
    assert changes_for(rec(ev.EPISODE_STARTED, {"env": "math", "task_id": "t1"})) == [
        Change("episode_state", AT, {"status": "started", "updated_position": 40, "env": "math", "task_id": "t1",
                                     "started_position": 40})]
    assert changes_for(rec(ev.EPISODE_STEP, {"step": 4, "reward": 1.0, "status": "done", "other": 1})) == [
        Change("episode_state", AT, {"status": "done", "updated_position": 40, "step": 4, "reward": 1.0})]


def test_session_events_carry_their_stream_version_status_and_revision() -> None:
    assert changes_for(rec(ev.SESSION_OPENED, {"env": "workplace"})) == [
        Change("session_state", AT, {"updated_position": 40, "stream_version": 3, "status": "open",
                                     "env": "workplace", "revision": 0})]
    assert changes_for(rec(ev.SESSION_OPENED, {"env": "w", "revision": 5}))[0].values["revision"] == 5
    assert changes_for(rec(ev.MUTATION_APPLIED, {"revision": 7})) == [
        Change("session_state", AT, {"updated_position": 40, "stream_version": 3, "revision": 7})]
    assert changes_for(rec(ev.SESSION_CLOSED)) == [
        Change("session_state", AT, {"updated_position": 40, "stream_version": 3, "status": "closed"})]


def test_call_events_carry_custody_and_what_the_record_says() -> None:
    accepted = rec(ev.CALL_ACCEPTED, {"call_id": "c", "parent_call_id": "p", "policy_version": "v1"})
    assert changes_for(accepted) == [Change("model_call_state", {"call_id": "c"}, {
        "status": "accepted", "updated_position": 40, "rollout_id": "r", "attempt": 2, "parent_call_id": "p",
        "policy_version": "v1", "accepted_position": 40})]
    completed = rec(ev.CALL_COMPLETED, {"call_id": "c", "receipt": "x", "tokens": 5, "disposition": "d",
                                        "parent_call_id": "q"})
    assert changes_for(completed) == [Change("model_call_state", {"call_id": "c"}, {
        "status": "completed", "updated_position": 40, "rollout_id": "r", "attempt": 2, "receipt": "x", "tokens": 5,
        "disposition": "d", "parent_call_id": "q"})]
    unparented = changes_for(rec(ev.CALL_COMPLETED, {"call_id": "c", "parent_call_id": None}))[0].values
    failed = changes_for(rec(ev.CALL_FAILED, {"call_id": "c", "parent_call_id": "q"}))[0].values
    assert "parent_call_id" not in unparented and "parent_call_id" not in failed


def test_checkpoint_events_carry_their_phase_and_positions() -> None:
    assert changes_for(rec(ev.CHECKPOINT_STARTED, {"checkpoint_id": "k"})) == [
        Change("checkpoint_state", {"checkpoint_id": "k"}, {"phase": "started", "updated_position": 40,
                                                             "started_position": 40})]
    assert changes_for(rec(ev.CHECKPOINT_COMMITTED, {"checkpoint_id": "k", "position": 30, "scope": ["a", "b"],
                                                     "digest": "d"})) == [
        Change("checkpoint_state", {"checkpoint_id": "k"}, {"phase": "committed", "updated_position": 40,
                                                             "position": 30, "scope_size": 2, "digest": "d"})]
    assert changes_for(rec(ev.CHECKPOINT_PUBLISHED, {"checkpoint_id": "k"})) == [
        Change("checkpoint_state", {"checkpoint_id": "k"}, {"phase": "published", "updated_position": 40,
                                                             "published_position": 40})]


def test_other_events_change_no_table() -> None:
    assert changes_for(rec(ev.AGENT_BOUNDARY, {"messages": []})) == []
    assert changes_for(rec(ev.POLICY_VERSION_CHANGED, {"version": "v"})) == []


# Every kind the catalog knows, with data naming every field some kind's change reads (and positions of
# its own, which are not the event's).
ANY_DATA = {"through": 1, "call_id": "c", "checkpoint_id": "k", "scope": ["a"], "digest": "d", "revision": 2,
            "parent_attempt": 1, "restored_from": "ck", "reward": 0.5, "env": "m", "task_id": "t", "step": 3,
            "receipt": {"blob_id": "b"}, "parent_call_id": "p", "tokens": 4, "disposition": "kept"}


@given(kind=st.sampled_from(sorted(ev.CATALOG)), position=st.integers(1, 2**40), moved=st.integers(1, 2**20),
       named=st.integers(1, 2**40))
def test_a_change_moves_with_its_events_position_in_the_position_columns_and_nowhere_else(
        kind: str, position: int, moved: int, named: int) -> None:
    # The append writes a plan made before its positions were known, moving exactly these columns.
    data = {**ANY_DATA, "origin_position": named, "position": named}
    here, there = changes_for(rec(kind, data, position)), changes_for(rec(kind, data, position + moved))
    assert [(c.table, c.key, c.guard, set(c.values)) for c in here] == [(c.table, c.key, c.guard, set(c.values)) for c in there]
    for a, b in zip(here, there, strict=True):
        for column, value in a.values.items():
            if column in POSITION_COLUMNS:
                assert (value, b.values[column]) == (position, position + moved), (kind, column)
            else:
                assert b.values[column] == value, (kind, column)
