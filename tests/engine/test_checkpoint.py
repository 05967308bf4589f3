"""The cut and the restore, on a log in memory; the log edited behind the store's back on PostgreSQL too.

The world: rollouts r0, r1, r2 are live and checkpointed (the scope); r3 is live and named nowhere;
r4 finished before the cut; r5 is live but its environment is restart-only. Each episode has two
boundaries (an environment step, then an agent boundary that depends on a model call and saw its
session at revision 2) and events after its last boundary.

The cut and the restore (engine.checkpoint) on the cut store in memory (tests/memory_cut_store.py):
the rules of tests/engine/test_checkpoint.py, fast enough for a mutation run, plus their edges. The
world is that file's: r0-r2 live and scoped, r3 live and named nowhere, r4 finished, r5 restart-only.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest

from adapters.database import libpq_dsn
from adapters.memory_store import MemoryEventStore
from adapters.postgres import PostgresEventStore
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_FINISHED, ATTEMPT_STARTED
from engine.catalog import CHECKPOINT_PUBLISHED, CHECKPOINT_STARTED, RESTORE_INSTALLED
from engine.checkpoint import (
    Cut,
    CutHistory,
    ScopeEntry,
    classify,
    committed_event,
    cut_digest,
    load_cut,
    make_cut,
    make_online_cut,
    read_cut,
    started_after,
    validate_cut,
)
from engine.errors import InvalidCheckpointState, RestartInScope, StaleAttempt, UnknownCheckpoint
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import (
    agent_stream,
    call_stream,
    checkpoint_stream,
    episode_stream,
    rollout_stream,
    session_stream,
)
from engine.install import install_request
from engine.lineage import effective_history
from engine.log import append_one

SCOPE = [("r0", 0), ("r1", 0), ("r2", 0)]
RESTARTS = [("r5", 0)]

Positions = dict[str, int]
Store = MemoryEventStore | PostgresEventStore


def E(stream: str, kind: str, r: str | None = None, a: int | None = None, **data: Any) -> NewEvent:
    return NewEvent(stream, kind, data, r, a)


async def episode(
    store: Store, r: str, *, complete_call: bool = True, seen_revision: int = 2
) -> Positions:
    """One attempt-0 episode, appended atomically; returns the position of each named event."""
    ses, call = session_stream(r, 0), f"{r}-c1"
    named = [
        ("start", E(rollout_stream(r), ATTEMPT_STARTED, r, 0, parent_attempt=None)),
        ("opened", E(episode_stream(r, 0), "episode_started", r, 0, env="math", task_id=f"t-{r}")),
        ("session", E(ses, "session_opened", r, 0, env="math")),
        ("rev1", E(ses, "mutation_applied", r, 0, revision=1, effect={"x": 1})),
        ("step", E(episode_stream(r, 0), "episode_step", r, 0, step="seed")),
        ("accepted", E(call_stream(call), "call_accepted", r, 0, call_id=call)),
        ("completed", E(call_stream(call), "call_completed", r, 0, call_id=call, tokens=12)),
        ("rev2", E(ses, "mutation_applied", r, 0, revision=2, effect={"x": 2})),
        (
            "boundary",
            E(agent_stream(r, 0), "agent_boundary", r, 0, calls=[call], revisions={ses: seen_revision}),
        ),
        # after the last boundary: work the checkpoint does not keep
        ("rev3", E(ses, "mutation_applied", r, 0, revision=3, effect={"x": 3})),
        ("late_call", E(call_stream(f"{r}-c2"), "call_accepted", r, 0, call_id=f"{r}-c2")),
    ]
    if not complete_call:
        named = [(n, e) for n, e in named if n != "completed"]
    recorded = await store.append(AppendRequest(tuple(e for _, e in named)))
    return {n: rec.position for (n, _), rec in zip(named, recorded, strict=True)}


@pytest.fixture
async def world(store: Store) -> dict[str, Positions]:
    w = {r: await episode(store, r) for r in ("r0", "r1", "r2", "r3", "r4", "r5")}
    await append_one(store, E(rollout_stream("r4"), ATTEMPT_FINISHED, "r4", 0, reward=1.0))
    return w


@pytest.fixture
async def store(request: pytest.FixtureRequest, memory_store: MemoryEventStore) -> AsyncIterator[Store]:
    """The cut's rules promise no durability: a log in memory, unless a test asks for PostgreSQL too
    (ON_BOTH: its log is edited behind the store's back, and there that means the database's rows)."""
    if getattr(request, "param", "memory") == "memory":
        yield memory_store
        return
    s = PostgresEventStore.connect(request.getfixturevalue("dsn"), writer="test")
    yield s
    await s.close()


ON_BOTH = pytest.mark.parametrize("store", ["memory", "postgres"], indirect=True)


async def tamper(store: Store, sql: str, position: int, edit: Callable[[dict[str, Any]], dict[str, Any]] | None) -> None:
    """Change the log behind the store's back, as a faulty disk or a careless operator would: `sql` on
    PostgreSQL's rows, `edit` of the event's data in memory (None: the event is deleted)."""
    if isinstance(store, PostgresEventStore):
        async with await psycopg.AsyncConnection.connect(libpq_dsn(store.dsn), autocommit=True) as conn:
            cur = await conn.execute(sql, {"p": position})
            assert cur.rowcount == 1
        return
    events = store.log.events
    (i,) = [i for i, e in enumerate(events) if e.position == position]
    if edit is None:
        del events[i]
    else:
        events[i] = dataclasses.replace(events[i], data=edit(events[i].data))


async def latest_attempts(store: Store, rollouts: list[str]) -> dict[str, int]:
    latest: dict[str, int] = {}
    for r, a in await store.attempt_rows(rollouts):
        latest[r] = max(latest.get(r, -1), a)
    return latest


async def restore(store: Store, cut: Cut) -> list[RecordedEvent]:
    """Restore as the engine defines it: validate everything, then one atomic install."""
    await validate_cut(store, cut)
    rollouts = sorted({s.rollout_id for s in cut.scope} | {r for r, _ in cut.fresh})
    return await store.append(install_request(cut, await latest_attempts(store, rollouts)))


async def statuses(store: Store) -> dict[tuple[str, int], str]:
    rows = await store.attempt_rows([f"r{i}" for i in range(6)])
    return {k: row["status"] for k, row in rows.items()}


# ---- the cut -------------------------------------------------------------------------------


async def test_cut_takes_p_at_the_head_and_each_scoped_attempts_latest_boundary(
    store: Store, world: dict[str, Positions]
) -> None:
    head = await store.head()
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    assert cut.position == head
    # not "step" (an earlier boundary), not "rev3"/"late_call" (later events that are no boundary)
    assert {(s.rollout_id, s.attempt): s.boundary for s in cut.scope} == {
        (r, 0): world[r]["boundary"] for r in ("r0", "r1", "r2")
    }
    assert all(world[r]["boundary"] < world[r]["late_call"] <= head for r in ("r0", "r1", "r2"))


async def test_boundary_appended_after_commit_belongs_to_the_next_cut_only(
    store: Store, world: dict[str, Positions]
) -> None:
    first = await make_cut(store, "ck1", SCOPE, RESTARTS)
    later = await append_one(store, E(episode_stream("r0", 0), "episode_step", "r0", 0, step="verify"))
    second = await make_cut(store, "ck2", SCOPE, RESTARTS)
    boundary = {c.checkpoint_id: {s.rollout_id: s.boundary for s in c.scope}["r0"] for c in (first, second)}
    assert boundary == {"ck1": world["r0"]["boundary"], "ck2": later.position}
    assert first.position < later.position == second.position
    await validate_cut(store, first)  # the old cut still stands on its own boundary


@ON_BOTH
async def test_cut_of_an_attempt_with_no_boundary_in_the_log_is_refused(
    store: Store
) -> None:
    # Bad input: the attempt's start (its first boundary) was deleted, so it has nowhere to resume from.
    start = await append_one(store, E(rollout_stream("rx"), ATTEMPT_STARTED, "rx", 0))
    await append_one(store, E(session_stream("rx", 0), "session_opened", "rx", 0, env="math"))
    await tamper(store, "DELETE FROM rollbook.events WHERE position = %(p)s", start.position, None)
    with pytest.raises(InvalidCheckpointState, match="no boundary"):
        await make_cut(store, "ck1", [("rx", 0)], [])


async def test_cut_digest_is_the_same_for_the_same_log(
    store: Store, world: dict[str, Positions]
) -> None:
    first = await make_cut(store, "ck1", SCOPE, RESTARTS)
    second = await make_cut(store, "ck2", SCOPE, RESTARTS)
    items = await validate_cut(store, first)
    assert first.digest == second.digest
    assert [(i.entry.rollout_id, i.history[-1].position) for i in items] == [
        (r, world[r]["boundary"]) for r in ("r0", "r1", "r2")
    ]


async def test_cut_digest_covers_every_event_of_a_scoped_rollout_up_to_p_and_nothing_after(
    store: Store, world: dict[str, Positions]
) -> None:
    base = await make_cut(store, "ck1", SCOPE, RESTARTS)
    # work after r1's boundary but before the next cut's P: same boundary, yet covered by that cut
    await append_one(store, E(session_stream("r1", 0), "mutation_applied", "r1", 0, revision=4, effect={}))
    after_boundary = await make_cut(store, "ck2", SCOPE, RESTARTS)
    assert {s.rollout_id: s.boundary for s in after_boundary.scope} == {s.rollout_id: s.boundary for s in base.scope}
    assert after_boundary.digest != base.digest
    await validate_cut(store, base)  # the older cut still validates: events after its P are not its business


async def test_committed_cut_reads_back_from_the_log(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    await append_one(store, committed_event(cut))
    loaded, phase = await load_cut(store, "ck1")
    assert (loaded, phase) == (cut, "committed")


# ---- validation ----------------------------------------------------------------------------


@ON_BOTH
async def test_validate_refuses_an_altered_event_in_scope_and_names_it(
    store: Store, world: dict[str, Positions]
) -> None:
    # r1's first mutation (session stream version 2) gets a different effect after the commit.
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    await tamper(
        store,
        """UPDATE rollbook.events SET data = data || '{"effect": {"x": 7}}' WHERE position = %(p)s""",
        world["r1"]["rev1"],
        lambda d: {**d, "effect": {"x": 7}},
    )
    with pytest.raises(InvalidCheckpointState, match="session:r1:0@2 does not match") as err:
        await validate_cut(store, cut)
    assert err.value.code == "invalid_checkpoint_state"


@ON_BOTH
@pytest.mark.parametrize(
    "victim",
    [
        "rev1",  # mid-stream: the session stream has a gap
        "rev2",  # the last session event before the boundary: only the chain head shows it
        "start",  # the attempt's first event, alone on its stream below the boundary
        "boundary",  # the boundary itself
    ],
)
async def test_validate_refuses_a_deleted_event_in_scope(
    store: Store, world: dict[str, Positions], victim: str
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    await tamper(store, "DELETE FROM rollbook.events WHERE position = %(p)s", world["r2"][victim], None)
    with pytest.raises(InvalidCheckpointState) as err:
        await validate_cut(store, cut)
    assert err.value.code == "invalid_checkpoint_state"


async def test_validate_refuses_a_boundary_whose_model_call_completes_only_after_the_cut(
    store: Store,
) -> None:
    w = await episode(store, "r0", complete_call=False)
    cut = await make_cut(store, "ck1", [("r0", 0)], [])
    await append_one(store, E(call_stream("r0-c1"), "call_completed", "r0", 0, call_id="r0-c1"))
    with pytest.raises(InvalidCheckpointState, match="r0-c1") as err:
        await validate_cut(store, cut)
    assert err.value.code == "invalid_checkpoint_state"
    assert cut.position < await store.head() and w["boundary"] <= cut.position


async def test_validate_refuses_a_boundary_whose_resources_revision_disagrees_with_the_log(
    store: Store,
) -> None:
    await episode(store, "r0", seen_revision=3)  # the session was at revision 2 at the boundary
    cut = await make_cut(store, "ck1", [("r0", 0)], [])
    with pytest.raises(InvalidCheckpointState, match="revision") as err:
        await validate_cut(store, cut)
    assert err.value.code == "invalid_checkpoint_state"


async def test_validate_refuses_a_cut_whose_digest_was_forged(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    forged = Cut.from_json({**cut.to_json(), "digest": "0" * 64})
    with pytest.raises(InvalidCheckpointState, match="digest"):
        await validate_cut(store, forged)


# ---- restore -------------------------------------------------------------------------------


@ON_BOTH
async def test_restore_with_one_corrupt_rollout_appends_nothing_anywhere(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    # r2 is validated last: r0 and r1 were fine, and still nothing of them may be installed.
    await tamper(
        store,
        """UPDATE rollbook.events SET data = '{"revision": 2}' WHERE position = %(p)s""",
        world["r2"]["rev2"],
        lambda d: {"revision": 2},
    )
    head, before = await store.head(), await statuses(store)
    with pytest.raises(InvalidCheckpointState):
        await restore(store, cut)
    assert await store.head() == head
    assert await statuses(store) == before
    assert all(a == 0 for _, a in before)


async def test_install_fences_attempt_zero_and_starts_attempt_one_of_every_continued_and_fresh_rollout_at_once(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    head = await store.head()
    installed = await restore(store, cut)
    assert [e.position for e in installed] == list(range(head + 1, head + 1 + len(installed)))
    assert await statuses(store) == {
        **{(r, 0): "fenced" for r in ("r0", "r1", "r2", "r3", "r5")},
        **{(r, 1): "live" for r in ("r0", "r1", "r2", "r3", "r5")},
        ("r4", 0): "finished",
    }
    starts = {e.rollout_id: e.data for e in installed if e.kind == ATTEMPT_STARTED}
    assert {r: (d["disposition"], d["origin_position"]) for r, d in starts.items()} == {
        "r0": ("continue", world["r0"]["boundary"]),
        "r1": ("continue", world["r1"]["boundary"]),
        "r2": ("continue", world["r2"]["boundary"]),
        "r3": ("fresh_dispatch", None),
        "r5": ("fresh_dispatch", None),
    }


async def test_install_is_all_or_nothing_when_one_fence_is_refused(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    await validate_cut(store, cut)
    latest = await latest_attempts(store, ["r0", "r1", "r2", "r3", "r5"])
    # Between validation and install, r1's attempt 0 is fenced by someone else (a racing restore).
    await append_one(store, E(rollout_stream("r1"), ATTEMPT_FENCED, "r1", 0, reason="operator"))
    head, before = await store.head(), await statuses(store)
    with pytest.raises(StaleAttempt):
        await store.append(install_request(cut, latest))
    assert (await store.head(), await statuses(store)) == (head, before)


async def test_restored_away_attempt_refuses_appends_and_keeps_its_events_after_the_cut(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    await restore(store, cut)
    with pytest.raises(StaleAttempt) as err:
        await append_one(store, E(session_stream("r0", 0), "mutation_applied", "r0", 0, revision=4))
    assert err.value.code == "stale_attempt"
    kept = [e.position for e in await store.read_rollout("r0", 0) if e.position > world["r0"]["boundary"]]
    assert kept[:2] == [world["r0"]["rev3"], world["r0"]["late_call"]]


async def test_second_restore_fences_the_replacement_and_replays_the_origin_up_to_its_boundary(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    await restore(store, cut)
    await append_one(
        store, E(session_stream("r0", 1), "mutation_applied", "r0", 1, revision=3, effect={"lost": True})
    )
    await restore(store, cut)
    history = await effective_history(store, "r0", 2)
    origin = await store.read_rollout("r0", 0, to=world["r0"]["boundary"])
    own = await store.read_rollout("r0", 2)
    assert history == origin + own
    assert [e.kind for e in own] == [ATTEMPT_STARTED]
    assert {k: v for k, v in (await statuses(store)).items() if k[0] == "r0"} == {
        ("r0", 0): "fenced",
        ("r0", 1): "fenced",
        ("r0", 2): "live",
    }
    with pytest.raises(StaleAttempt):
        await append_one(store, E(session_stream("r0", 1), "mutation_applied", "r0", 1, revision=4))


async def test_checkpoint_of_a_restored_attempt_validates(
    store: Store, world: dict[str, Positions]
) -> None:
    # Attempt 1's first event sits on the rollout stream after attempt 0's: its chain continues
    # attempt 0's, and validation must not mistake that for a missing event.
    await restore(store, await make_cut(store, "ck1", SCOPE, RESTARTS))
    await append_one(store, E(episode_stream("r0", 1), "episode_step", "r0", 1, step="agent"))
    cut = await make_cut(store, "ck2", [("r0", 1)], [])
    items = await validate_cut(store, cut)
    assert [e.kind for e in items[0].history] == [ATTEMPT_STARTED, "episode_step"]


@ON_BOTH
async def test_altered_start_of_a_restored_attempt_is_refused(
    store: Store, world: dict[str, Positions]
) -> None:
    installed = await restore(store, await make_cut(store, "ck1", SCOPE, RESTARTS))
    start = next(e for e in installed if e.kind == ATTEMPT_STARTED and e.rollout_id == "r0")
    cut = await make_cut(store, "ck2", [("r0", 1)], [])
    await tamper(
        store,
        """UPDATE rollbook.events SET data = data || '{"origin_position": 1}' WHERE position = %(p)s""",
        start.position,
        lambda d: {**d, "origin_position": 1},
    )
    with pytest.raises(InvalidCheckpointState):
        await validate_cut(store, cut)


# ---- dispositions --------------------------------------------------------------------------


async def test_a_scoped_execution_that_finished_before_the_cut_is_completed_not_continued(
    store: Store, world: dict[str, Positions]
) -> None:
    # r4 finished before P: a framework that named its running executions a moment earlier (a paused
    # checkpoint lets an episode's last step run on) named it too; it gets one disposition, completed.
    cut = await make_cut(store, "ck1", [*SCOPE, ("r4", 0)], RESTARTS)
    assert "r4" not in {s.rollout_id for s in cut.scope} | {r for r, _ in cut.fresh}
    await validate_cut(store, cut)


async def test_restart_only_execution_in_scope_is_refused(
    store: Store, world: dict[str, Positions]
) -> None:
    with pytest.raises(RestartInScope) as err:
        await make_cut(store, "ck1", [*SCOPE, ("r5", 0)], RESTARTS)
    assert err.value.code == "restart_in_scope"


async def test_fenced_attempt_in_scope_is_refused(
    store: Store, world: dict[str, Positions]
) -> None:
    await append_one(store, E(rollout_stream("r0"), ATTEMPT_FENCED, "r0", 0, reason="operator"))
    with pytest.raises(InvalidCheckpointState, match="r0"):
        await make_cut(store, "ck1", SCOPE, RESTARTS)


async def test_live_execution_outside_the_scope_is_dispatched_fresh(
    store: Store, world: dict[str, Positions]
) -> None:
    # r3 is live and named neither in the scope nor as restart-only; r4 finished.
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    assert set(cut.fresh) == {("r3", 0), ("r5", 0)}


def test_a_scoped_execution_finished_by_p_is_classified_completed_alone() -> None:
    got = classify(live=[("a", 0), ("b", 0)], finished=[("a", 0)], scope=[("a", 0), ("b", 0)], restarts=[])
    assert (got.completed, got.continued, got.fresh_dispatch) == ((("a", 0),), (("b", 0),), ())


@pytest.mark.parametrize("seed", range(25))
def test_every_execution_gets_exactly_one_disposition(seed: int) -> None:
    rng = random.Random(seed)
    executions = [(f"r{i}", rng.randrange(3)) for i in range(rng.randrange(1, 40))]
    role = {k: rng.choice(["finished", "scope", "restart", "live"]) for k in executions}
    got = classify(
        live=executions,
        finished=[k for k in executions if role[k] == "finished"],
        scope=[k for k in executions if role[k] == "scope"],
        restarts=[k for k in executions if role[k] == "restart"],
    )
    sets = [set(got.completed), set(got.continued), set(got.fresh_dispatch)]
    assert sum(len(s) for s in sets) == len(set().union(*sets)) == len(executions)
    assert set().union(*sets) == set(executions)
    assert sets[0] == {k for k in executions if role[k] == "finished"}
    assert sets[1] == {k for k in executions if role[k] == "scope"}


@ON_BOTH
async def test_a_framework_naming_its_run_leaves_other_frameworks_executions_alone(store: Store) -> None:
    # Two collections share the database: run fw owns fw-0..fw-2 and fw-5 (restart-only); run other
    # owns other-3 (live) and other-4 (finished).
    for r in ("fw-0", "fw-1", "fw-2", "fw-5", "other-3", "other-4"):
        await episode(store, r)
    await append_one(store, E(rollout_stream("other-4"), ATTEMPT_FINISHED, "other-4", 0, reward=1.0))
    ours = [("fw-0", 0), ("fw-1", 0), ("fw-2", 0)]
    cut = await make_cut(store, "ck1", ours, [("fw-5", 0), ("other-3", 0)], run="fw")
    assert ({(s.rollout_id, s.attempt) for s in cut.scope}, set(cut.fresh)) == (set(ours), {("fw-5", 0)})
    await validate_cut(store, cut)


@ON_BOTH
async def test_a_cut_is_the_size_of_what_is_in_flight_not_of_what_the_run_finished(store: Store) -> None:
    """The committed record names what it continues and restarts; the run's finished attempts are in
    the log (restore reads them there, engine.checkpoint.complete_at), so a long run's checkpoint
    costs what a short run's does."""
    for r in ("run-0", "run-1"):
        await episode(store, r)
    records = []
    for finished in range(2, 42):
        if finished in (2, 41):
            cut = await make_cut(store, f"ck{finished}", [("run-0", 0), ("run-1", 0)], [], run="run")
            records.append({k: v for k, v in cut.to_json().items() if k not in ("checkpoint_id", "position", "digest")})
        await episode(store, f"run-{finished}")
        await append_one(store, E(rollout_stream(f"run-{finished}"), ATTEMPT_FINISHED, f"run-{finished}", 0, reward=1.0))
    assert records[0] == records[1]  # 39 more finished attempts, not one more entry


async def test_the_view_reads_the_attempts_complete_at_a_cut_from_the_log(dsn: str) -> None:
    """checkpoint_rollouts' `completed` rows for a cut that does not list them: the attempts of its run
    finished at or below P and not fenced there since. v-2 finished and was fenced by P, v-3 finished
    after P, w-1 is another run's."""
    store = PostgresEventStore.connect(dsn, writer="test")
    try:
        for r in ("v-0", "v-1", "v-2", "v-3", "w-1"):
            await episode(store, r)
        for r in ("v-1", "v-2", "w-1"):
            await append_one(store, E(rollout_stream(r), ATTEMPT_FINISHED, r, 0, reward=1.0))
        await append_one(store, E(rollout_stream("v-2"), ATTEMPT_FENCED, "v-2", 0, reason="restore"))
        for ck, run in (("ck-v", "v"), ("ck-all", None)):
            await append_one(store, committed_event(await make_cut(store, ck, [("v-0", 0)], [], run=run)))
        await append_one(store, E(rollout_stream("v-3"), ATTEMPT_FINISHED, "v-3", 0, reward=1.0))
        async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
            rows = await (await conn.execute(
                "SELECT checkpoint_id, rollout_id, disposition FROM rollbook.checkpoint_rollouts ORDER BY 1, 2")).fetchall()
    finally:
        await store.close()
    assert [tuple(r) for r in rows] == [
        ("ck-all", "v-0", "continue"), ("ck-all", "v-1", "completed"), ("ck-all", "v-3", "fresh_dispatch"),
        ("ck-all", "w-1", "completed"),
        ("ck-v", "v-0", "continue"), ("ck-v", "v-1", "completed"), ("ck-v", "v-3", "fresh_dispatch")]


def test_a_cut_committed_by_the_version_that_listed_completed_attempts_is_refused_by_name() -> None:
    old = {"checkpoint_id": "ck-old", "position": 9, "scope": [], "fresh_dispatch": [], "completed": [["r", 0]],
           "digest": "d", "rollouts": None}
    with pytest.raises(InvalidCheckpointState, match="ck-old was committed by an earlier rollbook") as err:
        Cut.from_json(old)
    assert err.value.code == "invalid_checkpoint_state"


# ---- the digest covers everything up to P and the cut's lists -----------------------------


@ON_BOTH
async def test_validate_refuses_an_edited_event_between_the_boundary_and_the_cut(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    assert world["r0"]["boundary"] < world["r0"]["late_call"] <= cut.position
    await tamper(store, """UPDATE rollbook.events SET data = data || '{"edited": true}' WHERE position = %(p)s""",
                 world["r0"]["late_call"], lambda d: {**d, "edited": True})
    with pytest.raises(InvalidCheckpointState, match="does not match its recorded hash"):
        await validate_cut(store, cut)


@pytest.mark.parametrize("edit", ["run", "fresh", "scope_boundary"])
async def test_validate_refuses_a_cut_whose_lists_were_edited(
    store: Store, world: dict[str, Positions], edit: str
) -> None:
    import dataclasses

    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    assert cut.fresh
    edited = {
        "run": dataclasses.replace(cut, run="r0"),
        "fresh": dataclasses.replace(cut, fresh=(*cut.fresh, ("r4", 0))),
        "scope_boundary": dataclasses.replace(cut, scope=(dataclasses.replace(cut.scope[0], boundary=world["r0"]["step"]),
                                                          *cut.scope[1:])),
    }[edit]
    with pytest.raises(InvalidCheckpointState, match="digest"):
        await validate_cut(store, edited)


@ON_BOTH
async def test_load_cut_refuses_an_edited_committed_record(
    store: Store, world: dict[str, Positions]
) -> None:
    cut = await make_cut(store, "ck1", SCOPE, RESTARTS)
    recorded = await append_one(store, committed_event(cut))
    await tamper(store, """UPDATE rollbook.events SET data = jsonb_set(data, '{fresh_dispatch}', '[]') WHERE position = %(p)s""",
                 recorded.position, lambda d: {**d, "fresh_dispatch": []})
    with pytest.raises(InvalidCheckpointState, match="checkpoint:ck1@1 does not match"):
        await load_cut(store, "ck1")


async def test_an_open_checkpoint_past_its_lease_is_aborted_in_the_log_once(store: Store) -> None:
    from engine.coordinator import abort_expired, abort_if_expired
    from engine.phases import CheckpointPhases, checkpoint_started

    for ck, deadline in (("old", 1000.0), ("fresh", 2000.0)):
        await append_one(store, checkpoint_started(ck, deadline=deadline))
        await append_one(store, CheckpointPhases(ck).fire("prepared", restarts=[]))
    assert not await abort_if_expired(store, "old", now=1001.0)  # within the grace
    assert await abort_expired(store, now=1500.0) == ["old"]
    assert await abort_expired(store, now=1500.0) == []  # already aborted: nothing written twice
    kinds = [e.kind for e in await store.read_stream("checkpoint:old")]
    assert kinds == ["checkpoint_started", "checkpoint_prepared", "checkpoint_aborted"]
    assert [e.kind for e in await store.read_stream("checkpoint:fresh")][-1] == "checkpoint_prepared"


@pytest.fixture
def mem() -> MemoryEventStore:
    return MemoryEventStore(writer="test")


@pytest.fixture
async def mem_world(mem: MemoryEventStore) -> dict[str, Positions]:
    w = {r: await episode(mem, r) for r in ("r0", "r1", "r2", "r3", "r4", "r5")}  # type: ignore[arg-type]
    await append_one(mem, E(rollout_stream("r4"), ATTEMPT_FINISHED, "r4", 0, reward=1.0))
    return w


async def test_a_cut_takes_p_at_the_head_and_each_scoped_attempts_latest_boundary(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    assert cut.position == await mem.head()
    assert {(s.rollout_id, s.attempt): s.boundary for s in cut.scope} == {(r, 0): mem_world[r]["boundary"] for r in ("r0", "r1", "r2")}
    assert set(cut.fresh) == {("r3", 0), ("r5", 0)}
    # r4 finished before P: nothing of it is the cut's, so a cut stays the size of what is in flight
    assert cut.run is None and "r4" not in str(cut.to_json())
    assert [i.entry.rollout_id for i in await validate_cut(mem, cut)] == ["r0", "r1", "r2"]


async def test_an_attempt_started_or_finished_after_p_is_not_the_cuts(mem: MemoryEventStore, mem_world: dict[str, Positions]) -> None:
    early = await make_cut(mem, "ck0", SCOPE, RESTARTS)
    await episode(mem, "r6")  # type: ignore[arg-type]
    await append_one(mem, E(rollout_stream("r3"), ATTEMPT_FINISHED, "r3", 0, reward=0.0))
    rows = await mem.attempt_rows(["r3", "r6"])
    # as the log read at the early cut's P: r6 had not started and r3 had not finished
    mem.log.state.position = early.position  # the head as it was: nothing after P is the cut's
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    assert ("r6", 0) not in cut.fresh
    assert ("r3", 0) in cut.fresh  # in flight at P, finished since
    assert rows[("r6", 0)]["started_position"] > early.position


async def test_a_scoped_attempt_without_a_boundary_at_or_below_p_is_refused(mem: MemoryEventStore) -> None:
    start = await append_one(mem, E(rollout_stream("rx"), ATTEMPT_STARTED, "rx", 0))
    await append_one(mem, E(session_stream("rx", 0), "session_opened", "rx", 0, env="math"))
    mem.log.delete(start.position)
    with pytest.raises(InvalidCheckpointState, match="rollout rx attempt 0 has no boundary at or below 2"):
        await make_cut(mem, "ck1", [("rx", 0)], [])


async def test_scope_and_restarts_are_refused_where_they_give_two_dispositions(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    with pytest.raises(RestartInScope):
        await make_cut(mem, "ck1", [*SCOPE, ("r5", 0)], RESTARTS)
    await append_one(mem, E(rollout_stream("r0"), ATTEMPT_FENCED, "r0", 0, reason="operator"))
    with pytest.raises(InvalidCheckpointState, match="unknown or inactive execution r0 attempt 0"):
        await make_cut(mem, "ck1", SCOPE, RESTARTS)


async def test_a_framework_naming_its_run_gets_only_its_rollouts(mem: MemoryEventStore) -> None:
    # fw-9-0 is run fw-9's (engine.identity.run_of), not fw's, though its id starts with "fw-"
    for r in ("fw-0", "fw-1", "fw-2", "fw-3", "fw-9-0", "other-0"):
        await episode(mem, r)
    await append_one(mem, E(rollout_stream("fw-3"), ATTEMPT_FINISHED, "fw-3", 0, reward=1.0))
    cut = await make_cut(mem, "ck1", [("fw-0", 0), ("fw-1", 0)], [("fw-2", 0), ("other-0", 0)], run="fw")
    assert {s.rollout_id for s in cut.scope} == {"fw-0", "fw-1"}
    assert (set(cut.fresh), cut.run) == ({("fw-2", 0)}, "fw")
    await validate_cut(mem, cut)
    assert Cut.from_json(cut.to_json()) == cut


async def test_the_digest_covers_the_lists_and_every_scoped_stream_up_to_p(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    assert (await make_cut(mem, "ck2", SCOPE, RESTARTS)).digest == cut.digest
    await append_one(mem, E(session_stream("r1", 0), "mutation_applied", "r1", 0, revision=4, effect={}))
    assert (await make_cut(mem, "ck3", SCOPE, RESTARTS)).digest != cut.digest
    await validate_cut(mem, cut)  # events after its P are not the older cut's business
    heads = await mem.rollout_heads_at(["r0", "r1", "r2"], cut.position)
    for changed in (dataclasses.replace(cut, position=cut.position + 1), dataclasses.replace(cut, run="r0"),
                    dataclasses.replace(cut, fresh=cut.fresh[:1]), dataclasses.replace(cut, scope=cut.scope[:2])):
        assert cut_digest(heads, changed.scope, position=changed.position, fresh=changed.fresh, run=changed.run) != cut.digest
    with pytest.raises(InvalidCheckpointState, match="checkpoint ck1: the log no longer matches the cut's digest"):
        await validate_cut(mem, dataclasses.replace(cut, run="r0"))


@pytest.mark.parametrize("victim", ["rev1", "rev2", "start", "boundary", "late_call"])
async def test_an_edited_event_in_scope_up_to_p_is_refused(
    mem: MemoryEventStore, mem_world: dict[str, Positions], victim: str
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    mem.log.tamper(mem_world["r2"][victim], edited=True)
    with pytest.raises(InvalidCheckpointState, match="does not match its recorded hash"):
        await validate_cut(mem, cut)
    history = await read_cut(mem, cut, rehash=False)  # a participant re-hashes nothing: the heads still agree
    assert [i.entry.rollout_id for i in history.items] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("victim", ["rev1", "rev2", "start", "boundary"])
async def test_a_deleted_event_in_scope_is_refused_with_or_without_rehashing(
    mem: MemoryEventStore, mem_world: dict[str, Positions], victim: str
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    mem.log.delete(mem_world["r2"][victim])
    for rehash in (True, False):
        with pytest.raises(InvalidCheckpointState):
            await read_cut(mem, cut, rehash=rehash)


async def test_a_boundary_whose_call_completed_only_after_p_is_refused(mem: MemoryEventStore) -> None:
    await episode(mem, "r0", complete_call=False)  # type: ignore[arg-type]
    cut = await make_cut(mem, "ck1", [("r0", 0)], [])
    await append_one(mem, E(call_stream("r0-c1"), "call_completed", "r0", 0, call_id="r0-c1"))
    with pytest.raises(InvalidCheckpointState, match="r0: boundary depends on model call r0-c1, not completed by the cut"):
        await validate_cut(mem, cut)


async def test_a_boundary_that_saw_another_revision_than_the_log_is_refused(mem: MemoryEventStore) -> None:
    await episode(mem, "r0", seen_revision=3)  # type: ignore[arg-type]
    cut = await make_cut(mem, "ck1", [("r0", 0)], [])
    with pytest.raises(InvalidCheckpointState, match="r0: boundary saw session:r0:0 at revision 3, the log has 2"):
        await validate_cut(mem, cut)


async def test_a_scope_entry_whose_boundary_is_not_its_attempts_event_is_refused(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    moved = dataclasses.replace(cut, scope=(dataclasses.replace(cut.scope[0], boundary=mem_world["r1"]["boundary"]),
                                            *cut.scope[1:]))
    with pytest.raises(InvalidCheckpointState, match="the boundary of r0 attempt 0 is missing"):
        await validate_cut(mem, moved)


async def test_an_agent_boundary_whose_delta_does_not_rebuild_is_refused(mem: MemoryEventStore) -> None:
    await append_one(mem, E(rollout_stream("r0"), ATTEMPT_STARTED, "r0", 0))
    boundary = await append_one(mem, E(agent_stream("r0", 0), "agent_boundary", "r0", 0, messages_kept=2, messages_added=[]))
    cut = await make_cut(mem, "ck1", [("r0", 0)], [])
    assert cut.scope[0].boundary == boundary.position
    with pytest.raises(InvalidCheckpointState, match="keeps 2 messages of a boundary before it that is missing"):
        await validate_cut(mem, cut)


async def test_read_cut_hands_each_participant_the_history_it_needs(mem: MemoryEventStore, mem_world: dict[str, Positions]) -> None:
    made = await make_cut(mem, "ck1", [("r0", 0), ("r1", 0)], RESTARTS)
    cut = dataclasses.replace(made, scope=made.scope[::-1])  # the same cut (its digest sorts), listed the other way
    history = await read_cut(mem, cut)
    assert [i.entry.rollout_id for i in history.items] == ["r1", "r0"]  # the cut's order
    assert history.items[1].history[-1].position == mem_world["r0"]["boundary"]
    assert all(e.position <= mem_world["r0"]["boundary"] for e in history.items[1].history)
    assert max(e.position for e in history.events["r0"]) == mem_world["r0"]["late_call"]
    late = await append_one(mem, E(episode_stream("r0", 0), "episode_step", "r0", 0, step="late"))
    assert late.position not in {e.position for e in (await read_cut(mem, cut)).events["r0"]}
    beyond = await read_cut(mem, cut, beyond_cut=True)
    assert late.position in {e.position for e in beyond.events["r0"]}
    assert [e.position for e in beyond.attempt("r0", 0, to=mem_world["r0"]["rev1"])] == [
        mem_world["r0"][n] for n in ("start", "opened", "session", "rev1")]


async def test_a_committed_cut_reads_back_with_its_phase_and_published_refs(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    with pytest.raises(UnknownCheckpoint, match="no checkpoint ck1"):
        await load_cut(mem, "ck1")
    await append_one(mem, E(checkpoint_stream("ck1"), CHECKPOINT_STARTED, checkpoint_id="ck1", deadline=1.0))
    with pytest.raises(InvalidCheckpointState, match="checkpoint ck1 was never committed \\(phase started\\)"):
        await load_cut(mem, "ck1")
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    await append_one(mem, committed_event(cut))
    assert await load_cut(mem, "ck1") == (cut, "committed")
    await append_one(mem, E(checkpoint_stream("ck1"), CHECKPOINT_PUBLISHED, checkpoint_id="ck1", agent_ref="a1",
                            other="x"))
    loaded, phase = await load_cut(mem, "ck1")
    assert (loaded.refs, phase) == ({"agent_ref": "a1"}, "published")


async def test_an_edited_committed_record_is_refused(mem: MemoryEventStore, mem_world: dict[str, Positions]) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    recorded = await append_one(mem, committed_event(cut))
    mem.log.tamper(recorded.position, completed=[])
    with pytest.raises(InvalidCheckpointState, match="checkpoint:ck1@1 does not match"):
        await load_cut(mem, "ck1")


async def test_a_restore_fences_every_attempt_and_starts_the_next_from_its_boundary_or_input(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    head = await mem.head()
    installed = await restore(mem, cut)  # type: ignore[arg-type]
    assert [e.position for e in installed] == list(range(head + 1, head + 1 + len(installed)))
    assert await statuses(mem) == {**{(r, 0): "fenced" for r in ("r0", "r1", "r2", "r3", "r5")},  # type: ignore[arg-type]
                                   **{(r, 1): "live" for r in ("r0", "r1", "r2", "r3", "r5")}, ("r4", 0): "finished"}
    starts = {e.rollout_id: e.data for e in installed if e.kind == ATTEMPT_STARTED}
    assert starts["r0"] == {"parent_attempt": 0, "restored_from": "ck1", "origin_attempt": 0,
                            "origin_position": mem_world["r0"]["boundary"], "disposition": "continue"}
    assert starts["r3"] == {"parent_attempt": 0, "restored_from": "ck1", "origin_attempt": None,
                            "origin_position": None, "disposition": "fresh_dispatch"}
    fences = [e for e in installed if e.kind == ATTEMPT_FENCED]
    assert {e.rollout_id: (e.attempt, e.data) for e in fences}["r0"] == (0, {"reason": "restore", "checkpoint_id": "ck1"})
    assert installed[-1].kind == RESTORE_INSTALLED
    assert installed[-1].data == {"checkpoint_id": "ck1", "continued": 3, "fresh_dispatch": 2, "left_retired": []}
    with pytest.raises(StaleAttempt):
        await append_one(mem, E(session_stream("r0", 0), "mutation_applied", "r0", 0, revision=4))


async def test_a_second_restore_fences_the_replacement_and_replays_the_origin_up_to_its_boundary(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    await restore(mem, cut)  # type: ignore[arg-type]
    await restore(mem, cut)  # type: ignore[arg-type]
    history = await effective_history(mem, "r0", 2)
    origin = await mem.read_rollout("r0", 0, to=mem_world["r0"]["boundary"])
    own = await mem.read_rollout("r0", 2)
    assert history == origin + own
    read = await read_cut(mem, cut, beyond_cut=True)
    assert CutHistory(cut, {"r0": tuple(await mem.read_rollout("r0"))}, ()).effective("r0", 2) == history
    assert read.effective("r0", 0, to=cut.position) == await mem.read_rollout("r0", 0, to=cut.position)
    assert await latest_attempts(mem, ["r0"]) == {"r0": 2}  # type: ignore[arg-type]


async def test_a_checkpoint_of_a_restored_attempt_validates(mem: MemoryEventStore, mem_world: dict[str, Positions]) -> None:
    await restore(mem, await make_cut(mem, "ck1", SCOPE, RESTARTS))  # type: ignore[arg-type]
    await append_one(mem, E(episode_stream("r0", 1), "episode_step", "r0", 1, step="agent"))
    cut = await make_cut(mem, "ck2", [("r0", 1)], [])
    items = await validate_cut(mem, cut)
    assert [e.kind for e in items[0].history] == [ATTEMPT_STARTED, "episode_step"]
    mem.log.delete(items[0].history[0].position - 1)  # the event before it on the rollout stream: its chain's predecessor
    with pytest.raises(InvalidCheckpointState, match="stream rollout:r0 is missing version"):
        await validate_cut(mem, cut)


async def test_started_after_names_the_attempts_the_cut_never_saw(mem: MemoryEventStore) -> None:
    """a is continued and b restarted by the cut; c finished before P; g finished and was fenced
    before P. After P: a, c and g start their next attempt, d starts, e starts and finishes, f starts
    and is fenced, x-1 (run x's) starts."""
    async def start(r: str, n: int = 0) -> None:
        if n:
            await append_one(mem, E(rollout_stream(r), ATTEMPT_FENCED, r, n - 1, reason="test"))
        await append_one(mem, E(rollout_stream(r), ATTEMPT_STARTED, r, n))

    for r in ("a", "b", "c", "g"):
        await start(r)
    await append_one(mem, E(rollout_stream("c"), ATTEMPT_FINISHED, "c", 0, reward=1.0))
    await append_one(mem, E(rollout_stream("g"), ATTEMPT_FINISHED, "g", 0, reward=1.0))
    await append_one(mem, E(rollout_stream("g"), ATTEMPT_FENCED, "g", 0, reason="restore"))
    cut = Cut("ck", await mem.head(), (ScopeEntry("a", 0, 1),), fresh=(("b", 0),), digest="d")
    for r, n in (("a", 1), ("c", 1), ("g", 1), ("d", 0), ("e", 0), ("f", 0), ("x-1", 0)):
        await start(r, n) if r not in ("c", "g") else await append_one(mem, E(rollout_stream(r), ATTEMPT_STARTED, r, n))
    await append_one(mem, E(rollout_stream("e"), ATTEMPT_FINISHED, "e", 0, reward=0.0))
    await append_one(mem, E(rollout_stream("f"), ATTEMPT_FENCED, "f", 0, reason="test"))
    # c was complete at P: its later attempt is not the cut's to fence; g was not (fenced by P)
    assert await started_after(mem, cut) == [("d", 0), ("e", 0), ("g", 1), ("x-1", 0)]
    assert await started_after(mem, dataclasses.replace(cut, run="x")) == [("x-1", 0)]


def test_a_scope_naming_restart_only_executions_is_refused_naming_the_first_and_at_most_ten() -> None:
    bad = [(f"r{i:02d}", 1) for i in range(12)]
    with pytest.raises(RestartInScope, match=r"^12 restart-only execution\(s\) named in the scope, e.g. r00 attempt 1$") as refused:
        classify(live=bad, finished=[], scope=bad, restarts=bad)
    assert refused.value.context == {"executions": [[f"r{i:02d}", 1] for i in range(10)]}


def test_a_restart_reported_for_an_attempt_the_rollout_has_moved_past_names_nothing_of_the_cut() -> None:
    """A server still tracking attempt 1 of r reports it restart-only, while r has moved on to attempt 2,
    which the framework scopes: the cut continues r once. Naming it also to dispatch afresh made the
    install fence r twice in one append and every restore of that cut fail stale_attempt (the random
    fault suite's instances)."""
    got = classify(live=[("r", 2), ("s", 0)], finished=[], scope=[("r", 2)], restarts=[("r", 1), ("s", 0), ("t", 0)])
    assert (got.continued, got.fresh_dispatch) == ((("r", 2),), (("s", 0),))
    cut = Cut("ck", 10, (ScopeEntry("r", 2, 5),), fresh=got.fresh_dispatch, digest="d")
    fenced = [(e.rollout_id, e.attempt) for e in install_request(cut, {"r": 2, "s": 0}).events if e.kind == ATTEMPT_FENCED]
    assert fenced == [("r", 2), ("s", 0)]


def test_refusals_of_a_scope_name_the_first_execution_of_each_kind() -> None:
    with pytest.raises(InvalidCheckpointState, match=r"^scope names unknown or inactive execution c attempt 4$"):
        classify(live=[], finished=[], scope=[("c", 4), ("d", 5)], restarts=[])


async def test_a_framework_that_names_its_rollouts_still_may_not_scope_its_restart_only_ones(
    mem: MemoryEventStore, mem_world: dict[str, Positions]
) -> None:
    with pytest.raises(RestartInScope):
        await make_cut(mem, "ck1", [("r5", 0)], RESTARTS, run="r5")


async def test_an_attempt_started_by_the_last_event_before_the_cut_is_the_cuts(mem: MemoryEventStore) -> None:
    await append_one(mem, E(rollout_stream("r9"), ATTEMPT_STARTED, "r9", 0))
    cut = await make_cut(mem, "ck1", [], [])
    assert cut.position == 1 and cut.fresh == (("r9", 0),)


def test_a_refused_restart_only_scope_names_the_first_executions_attempt() -> None:
    bad = [("a", 4), ("b", 7)]
    with pytest.raises(RestartInScope, match=r"e\.g\. a attempt 4$"):
        classify(live=bad, finished=[], scope=bad, restarts=bad)


async def test_a_rollouts_part_of_a_shared_stream_chains_from_the_event_before_it(mem: MemoryEventStore) -> None:
    await append_one(mem, E(rollout_stream("q"), ATTEMPT_STARTED, "q", 0))
    await append_one(mem, E(rollout_stream("r"), ATTEMPT_STARTED, "r", 0))
    first = await append_one(mem, NewEvent("notes", "test_note", {"n": 1}, "q", 0))
    await append_one(mem, NewEvent("notes", "test_note", {"n": 2}, "r", 0))
    await append_one(mem, NewEvent("notes", "test_note", {"n": 3}, "r", 0))
    await append_one(mem, E(episode_stream("r", 0), "episode_step", "r", 0, step="x"))
    cut = await make_cut(mem, "ck", [("r", 0)], [], run="r")
    assert [i.entry.rollout_id for i in await validate_cut(mem, cut)] == ["r"]
    await read_cut(mem, cut, rehash=False)
    mem.log.delete(first.position)
    for rehash in (True, False):
        with pytest.raises(InvalidCheckpointState, match="stream notes is missing version 1"):
            await read_cut(mem, cut, rehash=rehash)


async def test_a_cut_over_large_floats_validates_as_postgresql_hands_them_back(mem: MemoryEventStore) -> None:
    await append_one(mem, E(rollout_stream("r"), ATTEMPT_STARTED, "r", 0))
    await append_one(mem, E(episode_stream("r", 0), "episode_step", "r", 0, step="x", reward=2e16))
    cut = await make_cut(mem, "ck", [("r", 0)], [])
    assert [i.entry.rollout_id for i in await validate_cut(mem, cut)] == ["r"]


async def test_a_cut_refusing_attempts_without_a_boundary_names_the_first(mem: MemoryEventStore) -> None:
    await append_one(mem, E(rollout_stream("ra"), ATTEMPT_STARTED, "ra", 0))
    await append_one(mem, E(rollout_stream("ra"), ATTEMPT_FENCED, "ra", 0, reason="test"))
    late_start = await append_one(mem, E(rollout_stream("ra"), ATTEMPT_STARTED, "ra", 1))
    rb_start = await append_one(mem, E(rollout_stream("rb"), ATTEMPT_STARTED, "rb", 0))
    await append_one(mem, E(session_stream("rb", 0), "session_opened", "rb", 0, env="math"))
    mem.log.delete(late_start.position)
    mem.log.delete(rb_start.position)
    with pytest.raises(InvalidCheckpointState, match="^rollout ra attempt 1 has no boundary"):
        await make_cut(mem, "ck", [("ra", 1), ("rb", 0)], [])


async def test_a_gap_in_a_scoped_stream_names_the_missing_version(mem: MemoryEventStore, mem_world: dict[str, Positions]) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    mem.log.delete(mem_world["r2"]["rev1"])  # version 2 of session:r2:0
    for rehash in (True, False):
        with pytest.raises(InvalidCheckpointState, match="^stream session:r2:0 is missing version 2$"):
            await read_cut(mem, cut, rehash=rehash)


@ON_BOTH
async def test_an_online_cut_restarts_what_cannot_be_continued_from_its_boundary_and_continues_the_rest(
        store: Store, world: dict[str, Positions]) -> None:
    """Input: besides the world's episodes, rollout ro whose restart-only sandbox session is open at
    its latest boundary. The online cut continues every running episode from its boundary but ro,
    which restarts from its input (on PostgreSQL the cut's one statement decides it)."""
    await store.append(AppendRequest((
        E(rollout_stream("ro"), ATTEMPT_STARTED, "ro", 0, parent_attempt=None),
        E(session_stream("ro", 0), "session_opened", "ro", 0, env="sandbox", state_mode="restart_only"),
        E(agent_stream("ro", 0), "agent_boundary", "ro", 0, turn=0))))
    cut = await make_online_cut(store, "ck-online")
    assert cut.fresh == (("ro", 0),)
    assert [(s.rollout_id, s.boundary) for s in cut.scope] == [(r, world[r]["boundary"]) for r in ("r0", "r1", "r2", "r3", "r5")]

