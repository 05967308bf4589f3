"""Projections are rebuildable from the log alone, and the public views read them.

The projections' one derivation (engine.projections.changes_for): which table each event changes,
under which key, to which values. The tables themselves are checked against a rebuild in PostgreSQL
(tests/engine/test_projections.py); here is the rule alone.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.postgres import PostgresEventStore
from engine import catalog as ev
from engine.attempts import (
    ATTEMPT_FENCED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    ROLLOUT_FORGOTTEN,
    ROLLOUT_RETIRED,
)
from engine.errors import StaleAttempt
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import call_stream, checkpoint_stream, episode_stream, rollout_stream, session_stream
from engine.projections import POSITION_COLUMNS, TABLES, Change, changes_for


async def _populate(store: PostgresEventStore) -> None:
    def E(stream, kind, r=None, a=None, **d):
        return NewEvent(stream, kind, d, r, a)

    for i in range(4):
        r = f"ro{i}"
        await store.append(AppendRequest((E(rollout_stream(r), ATTEMPT_STARTED, r, 0, parent_attempt=None),)))
        await store.append(
            AppendRequest(
                (
                    E(episode_stream(r, 0), "episode_started", r, 0, env="math", task_id=f"t{i}"),
                    E(session_stream(r, 0), "session_opened", r, 0, env="math"),
                    E(session_stream(r, 0), "mutation_applied", r, 0, revision=1, effect={"x": None, "y": ""}),
                    E(call_stream(f"c{i}"), "call_accepted", r, 0, call_id=f"c{i}", parent_call_id=None),
                    E(call_stream(f"c{i}"), "call_completed", r, 0, call_id=f"c{i}", receipt={"blob": "b", "n": 3}),
                    E(call_stream(f"x{i}"), "call_excluded", r, 0, call_id=f"x{i}", reason="admission_closed"),
                    E(episode_stream(r, 0), "episode_step", r, 0, step="agent"),
                )
            )
        )
    await store.append(AppendRequest((E(rollout_stream("ro0"), ATTEMPT_FINISHED, "ro0", 0, reward=1.0),)))
    await store.append(AppendRequest((E(rollout_stream("ro1"), ATTEMPT_FENCED, "ro1", 0),)))
    await store.append(AppendRequest((E(rollout_stream("ro1"), ATTEMPT_STARTED, "ro1", 1, parent_attempt=0, restored_from="ck1"),)))
    await store.append(AppendRequest((E(rollout_stream("ro2"), ROLLOUT_RETIRED, "ro2", 0, through=0),)))
    await store.append(
        AppendRequest(
            (
                E(checkpoint_stream("ck1"), "checkpoint_started", checkpoint_id="ck1"),
                E(checkpoint_stream("ck1"), "checkpoint_committed", checkpoint_id="ck1", position=5, scope=["ro1"], digest="ab"),
                E(checkpoint_stream("ck1"), "checkpoint_published", checkpoint_id="ck1"),
            )
        )
    )


def _dump(dsn: str) -> dict[str, list[tuple]]:
    with psycopg.connect(dsn) as conn:
        return {
            t: conn.execute(f"SELECT * FROM rollbook.{t} ORDER BY {', '.join(keys)}").fetchall() for t, keys in TABLES.items()
        }


async def test_every_projection_rebuilt_from_the_log_equals_the_live_one(store: PostgresEventStore, dsn: str) -> None:
    await _populate(store)
    live = _dump(dsn)
    assert all(live[t] for t in TABLES), "every projection must have rows for the comparison to mean something"
    count = await store.rebuild_projections(page=3)  # a small page crosses page boundaries mid-rollout
    assert count == await store.head()
    assert _dump(dsn) == live


async def test_public_views_answer_sql(store: PostgresEventStore, dsn: str) -> None:
    await _populate(store)
    with psycopg.connect(dsn) as conn:
        hist = conn.execute(
            "SELECT position, kind FROM rollbook.episode_history WHERE rollout_id = 'ro1' ORDER BY position"
        ).fetchall()
        attempts = dict(
            ((r, a), s) for r, a, s in conn.execute("SELECT rollout_id, attempt, status FROM rollbook.attempts").fetchall()
        )
        ck = conn.execute("SELECT checkpoint_id, phase, log_position, scope_size, published_at FROM rollbook.checkpoints").fetchall()
        calls = conn.execute("SELECT call_id, status, receipt FROM rollbook.model_calls ORDER BY call_id").fetchall()
    assert [k for _, k in hist][:2] == ["attempt_started", "episode_started"]
    assert attempts[("ro0", 0)] == "finished" and attempts[("ro1", 0)] == "fenced"
    assert attempts[("ro1", 1)] == "live" and attempts[("ro2", 0)] == "retired"
    assert ck[0][:4] == ("ck1", "published", 5, 1) and ck[0][4] is not None
    assert calls[0] == ("c0", "completed", {"blob": "b", "n": 3})
    with psycopg.connect(dsn) as conn:
        excluded = conn.execute("SELECT rollout_id, attempt, status FROM rollbook.model_calls WHERE call_id = 'x1'").fetchone()
    assert excluded == ("ro1", 0, "excluded")  # a call refused before acceptance still names its rollout


async def test_a_retire_ends_the_live_attempts_at_or_below_its_mark_and_leaves_finished_ones(
        store: PostgresEventStore, dsn: str) -> None:
    await _populate(store)  # ro2 attempt 0 was live, then retired through 0; ro0 attempt 0 finished
    await store.append(AppendRequest((NewEvent(rollout_stream("ro0"), ROLLOUT_RETIRED, {"through": 0}, "ro0", 0),)))
    with psycopg.connect(dsn) as conn:
        state = dict(((r, a), s) for r, a, s in conn.execute(
            "SELECT rollout_id, attempt, status FROM rollbook.attempt_state").fetchall())
    assert state[("ro2", 0)] == "retired" and state[("ro0", 0)] == "finished" and state[("ro3", 0)] == "live"
    assert ("ro2", 0) not in await store.running_attempts(0, None)  # so no later cut includes (and fences) it
    live = _dump(dsn)
    await store.rebuild_projections(page=2)
    assert _dump(dsn) == live


async def test_projections_written_by_concurrent_writers_equal_their_rebuild(dsn: str) -> None:
    # Each writer plans before the log's lock and has its positions moved by whatever the others
    # committed meanwhile: the position columns of the projections must move with them.
    import asyncio

    writers = [PostgresEventStore.connect(dsn, writer=f"w{i}") for i in range(4)]

    def E(stream, kind, r=None, a=None, **d):  # type: ignore[no-untyped-def]
        return NewEvent(stream, kind, d, r, a)

    async def lifecycle(store: PostgresEventStore, r: str, finished: bool) -> None:
        await store.append(AppendRequest((E(rollout_stream(r), ATTEMPT_STARTED, r, 0, parent_attempt=None),)))
        await store.append(AppendRequest((E(episode_stream(r, 0), "episode_started", r, 0, env="math"),
                                          E(session_stream(r, 0), "session_opened", r, 0, env="math"))))
        await store.append(AppendRequest((E(call_stream(f"c-{r}"), "call_accepted", r, 0, call_id=f"c-{r}"),)))
        await store.append(AppendRequest((E(call_stream(f"c-{r}"), "call_completed", r, 0, call_id=f"c-{r}"),
                                          E(episode_stream(r, 0), "episode_step", r, 0, step="agent"))))
        await store.append(AppendRequest((E(rollout_stream(r), ATTEMPT_FINISHED if finished else ATTEMPT_FENCED,
                                            r, 0, reward=1.0),)))

    try:
        await asyncio.gather(*(lifecycle(w, f"cw{i}-{j}", j % 2 == 0) for i, w in enumerate(writers) for j in range(6)))
        live = _dump(dsn)
        with psycopg.connect(dsn) as conn:
            started = dict(conn.execute("SELECT rollout_id, position FROM rollbook.events "
                                        "WHERE kind = 'attempt_started'").fetchall())
        assert len(live["attempt_state"]) == 24 and len(live["model_call_state"]) == 24
        await writers[0].rebuild_projections()
        assert _dump(dsn) == live
        with psycopg.connect(dsn) as conn:
            assert dict(conn.execute("SELECT rollout_id, started_position FROM rollbook.attempt_state").fetchall()) == started
    finally:
        for w in writers:
            await w.close()


async def test_a_start_after_a_retire_and_a_forget_in_one_group_stays_live(store: PostgresEventStore, dsn: str) -> None:
    # Input: one request retiring a rollout before any attempt of it started, forgetting it, and
    # starting attempt 0 (admitted: the forget lifted the mark). The retire ends only the attempts
    # live when it lands, in the append's transaction and in a rebuild's page alike.
    rid = rollout_stream("rfs")
    await store.append(AppendRequest((NewEvent(rid, ROLLOUT_RETIRED, {"through": 0}, "rfs", 0),
                                      NewEvent(rid, ROLLOUT_FORGOTTEN, {}, "rfs", 0),
                                      NewEvent(rid, ATTEMPT_STARTED, {"parent_attempt": None}, "rfs", 0))))
    with psycopg.connect(dsn) as conn:
        status = conn.execute("SELECT status FROM rollbook.attempt_state WHERE rollout_id = 'rfs'").fetchall()
    assert status == [("live",)]
    live = _dump(dsn)
    await store.rebuild_projections()
    assert _dump(dsn) == live


async def test_a_retire_below_the_mark_is_refused_and_the_mark_stays(store: PostgresEventStore, dsn: str) -> None:
    # Input: retire through 1, then a second retirer (which read the mark before the first landed)
    # retires through 0. Logged, it would set the projected mark to 0 and let attempt 1 write again.
    rid = rollout_stream("rlow")
    for a in (0, 1):
        await store.append(AppendRequest((NewEvent(rid, ATTEMPT_STARTED, {"parent_attempt": a - 1 if a else None},
                                                   "rlow", a),)))
    await store.append(AppendRequest((NewEvent(rid, ROLLOUT_RETIRED, {"through": 1}, "rlow", 1),)))
    with pytest.raises(StaleAttempt, match="already retired through 1"):
        await store.append(AppendRequest((NewEvent(rid, ROLLOUT_RETIRED, {"through": 0}, "rlow", 0),)))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = 'rlow'").fetchone() == (1,)
    with pytest.raises(StaleAttempt):
        await store.append(AppendRequest((NewEvent("agent:rlow:1", "turn", {}, "rlow", 1),)))


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
