"""Session snapshots (engine/snapshots.py): a snapshot plus the events after it folds to the state the
events give from the start, and a snapshot that does not match is ignored, never trusted.

Through the real PostgreSQL store: the rows are written and read back as rollbook.stream_snapshots
holds them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.database import libpq_dsn
from adapters.postgres import PostgresEventStore
from adapters.retention import retain
from apps.replay import replay
from engine import snapshots
from engine.events import AppendRequest, NewEvent, RecordedEvent, canonical_json
from engine.identity import agent_stream, rollout_stream, session_stream
from engine.install import install_request
from engine.lineage import effective_history
from engine.sessions import SessionReplay
from engine.snapshots import COUNTS, SessionSnapshot, fold_session, snapshot_digest
from participants.environments import get_environment, open_from_log
from tests.resources_harness import checkpoint, control, make_task, open_session, serving, start, tool

_ids = itertools.count()


def fingerprint(replay: SessionReplay) -> str:
    """Everything a reader takes from the fold."""
    return canonical_json({"env": replay.env.name if replay.env else None, "task": replay.task.to_json() if replay.task else None,
                           "state": replay.state, "revision": replay.revision, "open": replay.open,
                           "revisions": replay.revisions})


@pytest.fixture
def snapshot_every() -> Iterator[None]:
    """A snapshot after every fold of at least one session event, so short histories leave one."""
    before = snapshots.SNAPSHOT_AFTER
    snapshots.SNAPSHOT_AFTER = 1
    yield
    snapshots.SNAPSHOT_AFTER = before


# One step of a random history: a tool call on the workplace session (seed, tool, subject), an agent
# boundary, or the session closed and a new one opened.
STEP = st.one_of(
    st.tuples(st.just("email"), st.integers(0, 9)),
    st.tuples(st.just("deal"), st.integers(1, 40)),
    st.tuples(st.just("boundary"), st.just(0)),
    st.tuples(st.just("reopen"), st.integers(0, 50)),
)


def history_events(rid: str, steps: list[tuple[str, int]]) -> list[NewEvent]:
    env = get_environment("workplace")
    ses = session_stream(rid, 0)
    task = make_task("workplace", 3)
    state, revision = env.initial_state(task), 0
    events = [NewEvent(rollout_stream(rid), "attempt_started", {"parent_attempt": None}, rid, 0),
              NewEvent(ses, "session_opened", {"env": "workplace", "task": task.to_json(), "state_mode": "exported"}, rid, 0)]
    for kind, n in steps:
        if kind == "reopen":
            task = make_task("workplace", n)
            state, revision = env.initial_state(task), 0
            events += [NewEvent(ses, "session_closed", {"status": "unverified"}, rid, 0),
                       NewEvent(ses, "session_opened", {"env": "workplace", "task": task.to_json()}, rid, 0)]
        elif kind == "boundary":
            events.append(NewEvent(agent_stream(rid, 0), "agent_boundary", {"revisions": {ses: revision}}, rid, 0))
        else:
            name, args = (("send_email", {"to": "a@example.com", "subject": f"s{n}", "body": "b"}) if kind == "email"
                          else ("update_deal", {"deal_id": "D-103", "seats": n}))
            outcome = env.call_tool(state, name, args)
            if outcome.effect is None:
                continue
            state, revision = env.apply(state, outcome.effect), revision + 1
            events.append(NewEvent(ses, "mutation_applied", {"revision": revision, "tool": name, "effect": outcome.effect,
                                                             "output": outcome.output}, rid, 0))
    return events


def from_start(history: list[RecordedEvent]) -> SessionReplay:
    replay = SessionReplay(open_from_log)
    for e in history:
        replay.apply(e)
    return replay


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEP, max_size=25), cuts=st.lists(st.integers(0, 1000), min_size=1, max_size=3))
async def test_a_snapshot_plus_the_events_after_it_folds_to_the_state_from_the_start(
        store: PostgresEventStore, snapshot_every: None, steps: list[tuple[str, int]], cuts: list[int]) -> None:
    """Random histories (mutations, boundaries, sessions closed and reopened), snapshots taken at
    random positions of them (each written by a fold of the prefix, read back from PostgreSQL): the
    fold from the newest one plus the tail equals the fold of every event."""
    rid = f"prop{next(_ids)}"
    await store.append(AppendRequest(tuple(history_events(rid, steps))))
    history = await effective_history(store, rid, 0)
    for k in sorted({c % len(history) + 1 for c in cuts}):
        await fold_session(store, open_from_log, history[:k])  # leaves a snapshot at history[k - 1]
    used = COUNTS.used
    via_snapshot = await fold_session(store, open_from_log, history, write=False)
    assert fingerprint(via_snapshot) == fingerprint(from_start(history))
    written = len(await store.session_snapshots({session_stream(rid, 0): history[-1].position}))
    assert COUNTS.used == used + written  # a snapshot was there whenever one had been written, and was used


async def test_an_origins_snapshot_serves_the_attempt_restored_from_it(dsn: str, store: PostgresEventStore,
                                                                       snapshot_every: None) -> None:
    """A restore writes a snapshot of the origin's session at the boundary; the restored attempt's
    own fold (recovery after a crash here) starts from it and adds only its own events."""
    expected = await restore_twice(dsn, store, "or1")
    assert expected["second"] == expected["first"]
    async with serving(dsn, "resources-c") as (http, _):
        assert (await control(http, "restore"))[0] == 200
        await store.append(install_request(expected["cut"], latest={"or1": 0}))
        assert (await control(http, "resume"))[0] == 200
        assert (await tool(http, "or1", "update_deal", {"deal_id": "D-103", "seats": 9}, attempt=1))[0] == 200
    history = await effective_history(store, "or1", 1)
    used = COUNTS.used
    assert fingerprint(await fold_session(store, open_from_log, history, write=False)) == fingerprint(from_start(history))
    assert COUNTS.used == used + 1


async def restore_twice(dsn: str, store: PostgresEventStore, rid: str, tamper: str | None = None,
                        forge: bool = False) -> dict[str, Any]:
    """A session of four mutations, a cut after them, then two restores in fresh processes: the first
    folds from the start and writes a snapshot, `tamper` edits it through SQL, the second restores again."""
    async with serving(dsn, "resources-a") as (http, _):
        await start(store, rid)
        await open_session(http, rid, "workplace", 11)
        for seats in (3, 4, 5, 6):
            await tool(http, rid, "update_deal", {"deal_id": "D-103", "seats": seats})
        cut = await checkpoint(store, "ck1", {rid: 4})
    out: dict[str, Any] = {"cut": cut}
    for name in ("first", "second"):
        async with serving(dsn, f"resources-{name}") as (http, participant):
            read, out[f"{name}_read"] = participant.store.read_rollouts, []

            async def counted(*args: Any, read: Any = read, name: str = name, **kw: Any) -> Any:
                events = await read(*args, **kw)
                out[f"{name}_read"].append(len(events))
                return events

            participant.store.read_rollouts = counted
            status, reply = await control(http, "restore")
            assert status == 200 and reply["detail"]["staged"] == 1, reply
            staged = participant.staged[(rid, 0)]
            out[name] = canonical_json({"state": staged.state, "revision": staged.revision, "task": staged.task.to_json()})
        if name == "first" and tamper is not None:
            with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
                assert conn.execute(tamper).rowcount == 1
        if name == "first" and forge:
            forge_heads(dsn, rid)
    return out


async def test_a_restore_writes_a_snapshot_and_the_next_restore_uses_it(dsn: str, store: PostgresEventStore,
                                                                        snapshot_every: None) -> None:
    written, used = COUNTS.written, COUNTS.used
    out = await restore_twice(dsn, store, "sn1")
    assert out["second"] == out["first"]
    assert (COUNTS.written, COUNTS.used) == (written + 1, used + 1)
    # The first read every event of the rollout; the second only those past the snapshot (none: it
    # stands at the boundary, and the rollout wrote nothing after it up to the cut).
    assert out["first_read"][0] > 0 and out["second_read"] == [0]
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM rollbook.stream_snapshots WHERE stream = %s",
                            (session_stream("sn1", 0),)).fetchone() == (1,)


def forge_heads(dsn: str, rid: str) -> None:
    """The rollout's snapshot made to name other hashes, its digest recomputed to match."""
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        stream, position, data = conn.execute("SELECT stream, position, data FROM rollbook.stream_snapshots "
                                              "WHERE stream = %s", (session_stream(rid, 0),)).fetchone()
        heads = [[s, v, "00" * 32] for s, v, _ in data["heads"]]
        forged = SessionSnapshot(stream, position, tuple(tuple(h) for h in heads), data["state"])
        assert forged.digest == snapshot_digest(stream, position, heads, data["state"])
        conn.execute("UPDATE rollbook.stream_snapshots SET data = jsonb_set(data, '{heads}', %s::jsonb), digest = %s "
                     "WHERE stream = %s", (canonical_json(heads), forged.digest, stream))


async def test_a_restore_ignores_a_snapshot_whose_heads_are_not_the_logs(dsn: str, store: PostgresEventStore,
                                                                        snapshot_every: None) -> None:
    ignored, used = COUNTS.ignored, COUNTS.used
    out = await restore_twice(dsn, store, "hr1", forge=True)
    # the tail past the snapshot (none), then, the snapshot not agreeing with the log, every event again
    assert out["second"] == out["first"] and out["second_read"] == [0, *out["first_read"]]
    assert (COUNTS.ignored, COUNTS.used) == (ignored + 1, used)


TAMPERED_STATE = "UPDATE rollbook.stream_snapshots SET data = jsonb_set(data, '{state,revision}', '99')"


async def test_a_snapshot_row_edited_through_sql_is_ignored_and_restore_folds_the_events(
        dsn: str, store: PostgresEventStore, snapshot_every: None) -> None:
    ignored, used = COUNTS.ignored, COUNTS.used
    out = await restore_twice(dsn, store, "tp1", tamper=TAMPERED_STATE)
    assert out["second"] == out["first"]  # the right state, folded from the events
    assert (COUNTS.ignored, COUNTS.used) == (ignored + 1, used)


async def test_a_snapshot_standing_for_other_events_is_ignored_even_with_a_matching_digest(
        dsn: str, store: PostgresEventStore, snapshot_every: None) -> None:
    """A row consistent with itself (its digest recomputed) whose heads are not the log's: the events
    it was folded from are not the ones there now, so it is not used."""
    await restore_twice(dsn, store, "hd1")
    forge_heads(dsn, "hd1")
    ignored = COUNTS.ignored
    history = await effective_history(store, "hd1", 0)
    assert fingerprint(await fold_session(store, open_from_log, history, write=False)) == fingerprint(from_start(history))
    assert COUNTS.ignored == ignored + 1


async def test_retention_leaves_every_snapshot_a_restore_uses(dsn: str, store: PostgresEventStore,
                                                              snapshot_every: None) -> None:
    """`rollbook db retain` drops old append keys and unnamed token blobs; run over a database whose
    snapshot and keys are older than the retention, a restore still uses the snapshot and gets the
    state the events give."""
    await restore_twice(dsn, store, "rt1")
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute("UPDATE rollbook.stream_snapshots SET created_at = now() - interval '2 days'")
        conn.execute("UPDATE rollbook.append_keys SET recorded_at = now() - interval '2 days'")
    dropped = await retain(store, older_than_s=3600)
    assert dropped.append_keys > 0
    used = COUNTS.used
    async with serving(dsn, "resources-after") as (http, participant):
        status, reply = await control(http, "restore")
        assert status == 200 and reply["detail"]["staged"] == 1, reply
        staged = participant.staged[("rt1", 0)]
    history = await effective_history(store, "rt1", 0, to=(await store.latest_boundaries([("rt1", 0)], 10**9, ["agent_boundary"]))[("rt1", 0)])
    assert COUNTS.used == used + 1
    assert canonical_json(staged.state) == canonical_json(from_start(history).state)


async def test_rollbook_replay_folds_every_step_and_leaves_a_snapshot_for_the_next_restore(
        store: PostgresEventStore, snapshot_every: None) -> None:
    """Replay's check is the fold itself, so it starts from no snapshot; it leaves one where it ended."""
    await store.append(AppendRequest(tuple(history_events("rp1", [("deal", 3), ("boundary", 0), ("deal", 5)]))))
    used = COUNTS.used
    steps, state = await replay(store, "rp1", 0)
    assert len(steps) == 5 and state.revision == 2 and COUNTS.used == used
    history = await effective_history(store, "rp1", 0)
    assert fingerprint(await fold_session(store, open_from_log, history, write=False)) == fingerprint(from_start(history))
    assert COUNTS.used == used + 1
