"""Projections are rebuildable from the log alone, and the public views read them."""

from __future__ import annotations

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from engine.attempts import (
    ATTEMPT_FENCED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    ROLLOUT_FORGOTTEN,
    ROLLOUT_RETIRED,
)
from engine.errors import StaleAttempt
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, checkpoint_stream, episode_stream, rollout_stream, session_stream
from engine.projections import TABLES


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
