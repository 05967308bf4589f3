"""The cut and the restore (engine.checkpoint) on the cut store in memory (tests/memory_cut_store.py):
the rules of tests/test_checkpoint_engine.py, fast enough for a mutation run, plus their edges. The
world is that file's: r0-r2 live and scoped, r3 live and named nowhere, r4 finished, r5 restart-only."""

from __future__ import annotations

import dataclasses

import pytest

from engine.attempts import ATTEMPT_FENCED, ATTEMPT_FINISHED, ATTEMPT_STARTED
from engine.catalog import CHECKPOINT_PUBLISHED, CHECKPOINT_STARTED, RESTORE_INSTALLED, ROLLOUT_RETIRED
from engine.checkpoint import (
    Cut,
    CutHistory,
    ScopeEntry,
    classify,
    committed_event,
    cut_digest,
    effective_history,
    install_request,
    load_cut,
    make_cut,
    read_cut,
    restored_targets,
    started_after,
    validate_cut,
)
from engine.errors import InvalidCheckpointState, RestartInScope, StaleAttempt, UnknownCheckpoint
from engine.events import NewEvent
from engine.identity import (
    agent_stream,
    call_stream,
    checkpoint_stream,
    episode_stream,
    rollout_stream,
    session_stream,
)
from engine.log import append_one
from tests.memory_cut_store import MemoryCutStore
from tests.test_checkpoint_engine import (
    RESTARTS,
    SCOPE,
    E,
    Positions,
    episode,
    latest_attempts,
    restore,
    statuses,
)


@pytest.fixture
def mem() -> MemoryCutStore:
    return MemoryCutStore()


@pytest.fixture
async def world(mem: MemoryCutStore) -> dict[str, Positions]:
    w = {r: await episode(mem, r) for r in ("r0", "r1", "r2", "r3", "r4", "r5")}  # type: ignore[arg-type]
    await append_one(mem, E(rollout_stream("r4"), ATTEMPT_FINISHED, "r4", 0, reward=1.0))
    return w


async def test_a_cut_takes_p_at_the_head_and_each_scoped_attempts_latest_boundary(
    mem: MemoryCutStore, world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    assert cut.position == await mem.head()
    assert {(s.rollout_id, s.attempt): s.boundary for s in cut.scope} == {(r, 0): world[r]["boundary"] for r in ("r0", "r1", "r2")}
    assert set(cut.fresh) == {("r3", 0), ("r5", 0)}
    # r4 finished before P: nothing of it is the cut's, so a cut stays the size of what is in flight
    assert cut.run is None and "r4" not in str(cut.to_json())
    assert [i.entry.rollout_id for i in await validate_cut(mem, cut)] == ["r0", "r1", "r2"]


async def test_an_attempt_started_or_finished_after_p_is_not_the_cuts(mem: MemoryCutStore, world: dict[str, Positions]) -> None:
    early = await make_cut(mem, "ck0", SCOPE, RESTARTS)
    await episode(mem, "r6")  # type: ignore[arg-type]
    await append_one(mem, E(rollout_stream("r3"), ATTEMPT_FINISHED, "r3", 0, reward=0.0))
    rows = await mem.attempt_rows(["r3", "r6"])
    # as the log read at the early cut's P: r6 had not started and r3 had not finished
    mem.state.position = early.position  # the head as it was: nothing after P is the cut's
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    assert ("r6", 0) not in cut.fresh
    assert ("r3", 0) in cut.fresh  # in flight at P, finished since
    assert rows[("r6", 0)]["started_position"] > early.position


async def test_a_scoped_attempt_without_a_boundary_at_or_below_p_is_refused(mem: MemoryCutStore) -> None:
    start = await append_one(mem, E(rollout_stream("rx"), ATTEMPT_STARTED, "rx", 0))
    await append_one(mem, E(session_stream("rx", 0), "session_opened", "rx", 0, env="math"))
    mem.delete(start.position)
    with pytest.raises(InvalidCheckpointState, match="rollout rx attempt 0 has no boundary at or below 2"):
        await make_cut(mem, "ck1", [("rx", 0)], [])


async def test_scope_and_restarts_are_refused_where_they_give_two_dispositions(
    mem: MemoryCutStore, world: dict[str, Positions]
) -> None:
    with pytest.raises(RestartInScope):
        await make_cut(mem, "ck1", [*SCOPE, ("r5", 0)], RESTARTS)
    await append_one(mem, E(rollout_stream("r0"), ATTEMPT_FENCED, "r0", 0, reason="operator"))
    with pytest.raises(InvalidCheckpointState, match="unknown or inactive execution r0 attempt 0"):
        await make_cut(mem, "ck1", SCOPE, RESTARTS)


async def test_a_framework_naming_its_run_gets_only_its_rollouts(mem: MemoryCutStore) -> None:
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
    mem: MemoryCutStore, world: dict[str, Positions]
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
    mem: MemoryCutStore, world: dict[str, Positions], victim: str
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    mem.tamper(world["r2"][victim], edited=True)
    with pytest.raises(InvalidCheckpointState, match="does not match its recorded hash"):
        await validate_cut(mem, cut)
    history = await read_cut(mem, cut, rehash=False)  # a participant re-hashes nothing: the heads still agree
    assert [i.entry.rollout_id for i in history.items] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("victim", ["rev1", "rev2", "start", "boundary"])
async def test_a_deleted_event_in_scope_is_refused_with_or_without_rehashing(
    mem: MemoryCutStore, world: dict[str, Positions], victim: str
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    mem.delete(world["r2"][victim])
    for rehash in (True, False):
        with pytest.raises(InvalidCheckpointState):
            await read_cut(mem, cut, rehash=rehash)


async def test_a_boundary_whose_call_completed_only_after_p_is_refused(mem: MemoryCutStore) -> None:
    await episode(mem, "r0", complete_call=False)  # type: ignore[arg-type]
    cut = await make_cut(mem, "ck1", [("r0", 0)], [])
    await append_one(mem, E(call_stream("r0-c1"), "call_completed", "r0", 0, call_id="r0-c1"))
    with pytest.raises(InvalidCheckpointState, match="r0: boundary depends on model call r0-c1, not completed by the cut"):
        await validate_cut(mem, cut)


async def test_a_boundary_that_saw_another_revision_than_the_log_is_refused(mem: MemoryCutStore) -> None:
    await episode(mem, "r0", seen_revision=3)  # type: ignore[arg-type]
    cut = await make_cut(mem, "ck1", [("r0", 0)], [])
    with pytest.raises(InvalidCheckpointState, match="r0: boundary saw session:r0:0 at revision 3, the log has 2"):
        await validate_cut(mem, cut)


async def test_a_scope_entry_whose_boundary_is_not_its_attempts_event_is_refused(
    mem: MemoryCutStore, world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    moved = dataclasses.replace(cut, scope=(dataclasses.replace(cut.scope[0], boundary=world["r1"]["boundary"]),
                                            *cut.scope[1:]))
    with pytest.raises(InvalidCheckpointState, match="the boundary of r0 attempt 0 is missing"):
        await validate_cut(mem, moved)


async def test_an_agent_boundary_whose_delta_does_not_rebuild_is_refused(mem: MemoryCutStore) -> None:
    await append_one(mem, E(rollout_stream("r0"), ATTEMPT_STARTED, "r0", 0))
    boundary = await append_one(mem, E(agent_stream("r0", 0), "agent_boundary", "r0", 0, messages_kept=2, messages_added=[]))
    cut = await make_cut(mem, "ck1", [("r0", 0)], [])
    assert cut.scope[0].boundary == boundary.position
    with pytest.raises(InvalidCheckpointState, match="keeps 2 messages of a boundary before it that is missing"):
        await validate_cut(mem, cut)


async def test_read_cut_hands_each_participant_the_history_it_needs(mem: MemoryCutStore, world: dict[str, Positions]) -> None:
    made = await make_cut(mem, "ck1", [("r0", 0), ("r1", 0)], RESTARTS)
    cut = dataclasses.replace(made, scope=made.scope[::-1])  # the same cut (its digest sorts), listed the other way
    history = await read_cut(mem, cut)
    assert [i.entry.rollout_id for i in history.items] == ["r1", "r0"]  # the cut's order
    assert history.items[1].history[-1].position == world["r0"]["boundary"]
    assert all(e.position <= world["r0"]["boundary"] for e in history.items[1].history)
    assert max(e.position for e in history.events["r0"]) == world["r0"]["late_call"]
    late = await append_one(mem, E(episode_stream("r0", 0), "episode_step", "r0", 0, step="late"))
    assert late.position not in {e.position for e in (await read_cut(mem, cut)).events["r0"]}
    beyond = await read_cut(mem, cut, beyond_cut=True)
    assert late.position in {e.position for e in beyond.events["r0"]}
    assert [e.position for e in beyond.attempt("r0", 0, to=world["r0"]["rev1"])] == [
        world["r0"][n] for n in ("start", "opened", "session", "rev1")]


async def test_a_committed_cut_reads_back_with_its_phase_and_published_refs(
    mem: MemoryCutStore, world: dict[str, Positions]
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


async def test_an_edited_committed_record_is_refused(mem: MemoryCutStore, world: dict[str, Positions]) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    recorded = await append_one(mem, committed_event(cut))
    mem.tamper(recorded.position, completed=[])
    with pytest.raises(InvalidCheckpointState, match="checkpoint:ck1@1 does not match"):
        await load_cut(mem, "ck1")


async def test_a_restore_fences_every_attempt_and_starts_the_next_from_its_boundary_or_input(
    mem: MemoryCutStore, world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    head = await mem.head()
    installed = await restore(mem, cut)  # type: ignore[arg-type]
    assert [e.position for e in installed] == list(range(head + 1, head + 1 + len(installed)))
    assert await statuses(mem) == {**{(r, 0): "fenced" for r in ("r0", "r1", "r2", "r3", "r5")},  # type: ignore[arg-type]
                                   **{(r, 1): "live" for r in ("r0", "r1", "r2", "r3", "r5")}, ("r4", 0): "finished"}
    starts = {e.rollout_id: e.data for e in installed if e.kind == ATTEMPT_STARTED}
    assert starts["r0"] == {"parent_attempt": 0, "restored_from": "ck1", "origin_attempt": 0,
                            "origin_position": world["r0"]["boundary"], "disposition": "continue"}
    assert starts["r3"] == {"parent_attempt": 0, "restored_from": "ck1", "origin_attempt": None,
                            "origin_position": None, "disposition": "fresh_dispatch"}
    fences = [e for e in installed if e.kind == ATTEMPT_FENCED]
    assert {e.rollout_id: (e.attempt, e.data) for e in fences}["r0"] == (0, {"reason": "restore", "checkpoint_id": "ck1"})
    assert installed[-1].kind == RESTORE_INSTALLED
    assert installed[-1].data == {"checkpoint_id": "ck1", "continued": 3, "fresh_dispatch": 2, "left_retired": []}
    with pytest.raises(StaleAttempt):
        await append_one(mem, E(session_stream("r0", 0), "mutation_applied", "r0", 0, revision=4))


async def test_a_second_restore_fences_the_replacement_and_replays_the_origin_up_to_its_boundary(
    mem: MemoryCutStore, world: dict[str, Positions]
) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    await restore(mem, cut)  # type: ignore[arg-type]
    await restore(mem, cut)  # type: ignore[arg-type]
    history = await effective_history(mem, "r0", 2)
    origin = await mem.read_rollout("r0", 0, to=world["r0"]["boundary"])
    own = await mem.read_rollout("r0", 2)
    assert history == origin + own
    read = await read_cut(mem, cut, beyond_cut=True)
    assert CutHistory(cut, {"r0": tuple(await mem.read_rollout("r0"))}, ()).effective("r0", 2) == history
    assert read.effective("r0", 0, to=cut.position) == await mem.read_rollout("r0", 0, to=cut.position)
    assert await latest_attempts(mem, ["r0"]) == {"r0": 2}  # type: ignore[arg-type]


async def test_a_checkpoint_of_a_restored_attempt_validates(mem: MemoryCutStore, world: dict[str, Positions]) -> None:
    await restore(mem, await make_cut(mem, "ck1", SCOPE, RESTARTS))  # type: ignore[arg-type]
    await append_one(mem, E(episode_stream("r0", 1), "episode_step", "r0", 1, step="agent"))
    cut = await make_cut(mem, "ck2", [("r0", 1)], [])
    items = await validate_cut(mem, cut)
    assert [e.kind for e in items[0].history] == [ATTEMPT_STARTED, "episode_step"]
    mem.delete(items[0].history[0].position - 1)  # the event before it on the rollout stream: its chain's predecessor
    with pytest.raises(InvalidCheckpointState, match="stream rollout:r0 is missing version"):
        await validate_cut(mem, cut)


async def test_started_after_names_the_attempts_the_cut_never_saw(mem: MemoryCutStore) -> None:
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


def test_restored_targets_name_the_latest_live_attempt_the_restore_installed() -> None:
    rows = {("a", 0): {"status": "fenced"}, ("a", 1): {"status": "fenced", "restored_from": "ck"},
            ("a", 2): {"status": "live", "restored_from": "ck"}, ("b", 0): {"status": "fenced"},
            ("b", 1): {"status": "live", "restored_from": "other"}, ("c", 0): {"status": "live", "retired_through": 0},
            ("d", 3): {"status": "live", "restored_from": "ck"}}
    assert restored_targets(rows, [("a", 0), ("c", 0)], "ck") == {("a", 0): 2}
    with pytest.raises(InvalidCheckpointState, match="rollout d"):
        restored_targets(rows, [("d", 3)], "ck")  # only an attempt above the origin was installed over it
    with pytest.raises(InvalidCheckpointState, match="checkpoint ck is not installed: rollout b has no live attempt"):
        restored_targets(rows, [("b", 0)], "ck")


def test_an_install_leaves_rollouts_retired_since_the_cut_and_says_so() -> None:
    cut = Cut("ck", 10, (ScopeEntry("kept", 0, 5), ScopeEntry("gone", 0, 6)), fresh=(("fresh", 0), ("gone2", 0)),
              digest="d")
    request = install_request(cut, {"kept": 2}, late=[("late", 0)], retired={"gone", "gone2"})
    fenced = [(e.rollout_id, e.attempt) for e in request.events if e.kind == ATTEMPT_FENCED]
    assert fenced == [("kept", 2), ("fresh", 0), ("late", 0)]
    assert request.events[-1].data == {"checkpoint_id": "ck", "continued": 1, "fresh_dispatch": 1,
                                       "left_retired": ["gone", "gone2"]}
    assert not any(e.kind == ROLLOUT_RETIRED for e in request.events)


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
    mem: MemoryCutStore, world: dict[str, Positions]
) -> None:
    with pytest.raises(RestartInScope):
        await make_cut(mem, "ck1", [("r5", 0)], RESTARTS, run="r5")


async def test_an_attempt_started_by_the_last_event_before_the_cut_is_the_cuts(mem: MemoryCutStore) -> None:
    await append_one(mem, E(rollout_stream("r9"), ATTEMPT_STARTED, "r9", 0))
    cut = await make_cut(mem, "ck1", [], [])
    assert cut.position == 1 and cut.fresh == (("r9", 0),)


def test_a_refused_restart_only_scope_names_the_first_executions_attempt() -> None:
    bad = [("a", 4), ("b", 7)]
    with pytest.raises(RestartInScope, match=r"e\.g\. a attempt 4$"):
        classify(live=bad, finished=[], scope=bad, restarts=bad)


async def test_a_rollouts_part_of_a_shared_stream_chains_from_the_event_before_it(mem: MemoryCutStore) -> None:
    await append_one(mem, E(rollout_stream("q"), ATTEMPT_STARTED, "q", 0))
    await append_one(mem, E(rollout_stream("r"), ATTEMPT_STARTED, "r", 0))
    first = await append_one(mem, NewEvent("notes", "test_note", {"n": 1}, "q", 0))
    await append_one(mem, NewEvent("notes", "test_note", {"n": 2}, "r", 0))
    await append_one(mem, NewEvent("notes", "test_note", {"n": 3}, "r", 0))
    await append_one(mem, E(episode_stream("r", 0), "episode_step", "r", 0, step="x"))
    cut = await make_cut(mem, "ck", [("r", 0)], [], run="r")
    assert [i.entry.rollout_id for i in await validate_cut(mem, cut)] == ["r"]
    await read_cut(mem, cut, rehash=False)
    mem.delete(first.position)
    for rehash in (True, False):
        with pytest.raises(InvalidCheckpointState, match="stream notes is missing version 1"):
            await read_cut(mem, cut, rehash=rehash)


async def test_a_cut_over_large_floats_validates_as_postgresql_hands_them_back(mem: MemoryCutStore) -> None:
    await append_one(mem, E(rollout_stream("r"), ATTEMPT_STARTED, "r", 0))
    await append_one(mem, E(episode_stream("r", 0), "episode_step", "r", 0, step="x", reward=2e16))
    cut = await make_cut(mem, "ck", [("r", 0)], [])
    assert [i.entry.rollout_id for i in await validate_cut(mem, cut)] == ["r"]


async def test_a_cut_refusing_attempts_without_a_boundary_names_the_first(mem: MemoryCutStore) -> None:
    await append_one(mem, E(rollout_stream("ra"), ATTEMPT_STARTED, "ra", 0))
    await append_one(mem, E(rollout_stream("ra"), ATTEMPT_FENCED, "ra", 0, reason="test"))
    late_start = await append_one(mem, E(rollout_stream("ra"), ATTEMPT_STARTED, "ra", 1))
    rb_start = await append_one(mem, E(rollout_stream("rb"), ATTEMPT_STARTED, "rb", 0))
    await append_one(mem, E(session_stream("rb", 0), "session_opened", "rb", 0, env="math"))
    mem.delete(late_start.position)
    mem.delete(rb_start.position)
    with pytest.raises(InvalidCheckpointState, match="^rollout ra attempt 1 has no boundary"):
        await make_cut(mem, "ck", [("ra", 1), ("rb", 0)], [])


async def test_a_gap_in_a_scoped_stream_names_the_missing_version(mem: MemoryCutStore, world: dict[str, Positions]) -> None:
    cut = await make_cut(mem, "ck1", SCOPE, RESTARTS)
    mem.delete(world["r2"]["rev1"])  # version 2 of session:r2:0
    for rehash in (True, False):
        with pytest.raises(InvalidCheckpointState, match="^stream session:r2:0 is missing version 2$"):
            await read_cut(mem, cut, rehash=rehash)
