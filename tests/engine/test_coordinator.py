"""The coordinator (engine.coordinator) against participants in memory and the cut store in memory:
the order of each fan-out, what a refusal or a silence does, and what the log records."""

from __future__ import annotations

import time
from typing import Any

import pytest

from adapters.memory_store import MemoryEventStore
from engine.catalog import CALL_CUT, CHECKPOINT_ABORTED, CHECKPOINT_PREPARED, CHECKPOINT_STARTED
from engine.coordinator import (
    PREPARE_ORDER,
    Coordinator,
    StepTiming,
    abort_checkpoint,
    abort_expired,
    abort_if_expired,
)
from engine.errors import (
    AdmissionClosed,
    DatabaseUnavailable,
    InvalidCheckpointState,
    InvalidPhase,
    StaleCheckpoint,
)
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, checkpoint_stream
from engine.log import append_one
from engine.phases import CheckpointPhases, checkpoint_started
from engine.prepare_records import PrepareRecord
from engine.recovery import Recovery, recovery_request
from tests.engine.test_checkpoint import episode


class Participant:
    """A participant that answers from a script and writes down every call, in one shared journal."""

    def __init__(self, kind: str, journal: list[tuple[str, str]], name: str | None = None) -> None:
        self.kind, self.name, self.journal = kind, name or kind, journal
        self.replies: dict[str, Any] = {}
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    async def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        self.journal.append((operation, self.name))
        self.bodies.append((operation, body))
        reply = self.replies.get(operation, {"ready": True} if operation == "prepare" else {})
        if isinstance(reply, BaseException):
            raise reply
        return dict(reply)


def four(journal: list[tuple[str, str]]) -> list[Participant]:
    return [Participant(k, journal) for k in ("resources", "agent", "environment", "model")]


def kinds(store: MemoryEventStore, checkpoint_id: str) -> list[str]:
    return [e.kind for e in store.log.events if e.stream == checkpoint_stream(checkpoint_id)]


async def test_prepare_runs_the_callers_first_and_the_resources_last_then_records_prepared() -> None:
    journal: list[tuple[str, str]] = []
    store, parts = MemoryEventStore(writer="test"), four(journal)
    parts[1].replies["prepare"] = {"ready": True, "restarts": [{"rollout_id": "r9", "attempt": 1}]}
    reply = await Coordinator(store, parts).prepare("ck", time.time() + 30)
    assert reply["ready"] and reply["restarts"] == [["r9", 1]]
    assert set(reply["reports"]) == set(PREPARE_ORDER)
    assert {n for _, n in journal[:3]} == {"environment", "model", "agent"} and journal[3] == ("prepare", "resources")
    assert kinds(store, "ck") == [CHECKPOINT_STARTED, CHECKPOINT_PREPARED]
    assert store.log.events[-1].data["restarts"] == [["r9", 1]]


def cut_record(checkpoint_id: str, rollout_id: str, attempt: int) -> dict[str, Any]:
    call = f"{rollout_id}-c1"
    return PrepareRecord.of(checkpoint_id, NewEvent(call_stream(call), CALL_CUT, {"call_id": call, "tokens": 3},
                                                    rollout_id, attempt)).to_json()


async def test_the_records_a_prepare_hands_over_land_with_prepared_once_and_a_fenced_attempts_alone_is_refused() -> None:
    """The model's cuts (engine.prepare_records) are in the log before prepare returns, so below any P
    a commit fixes. r1's attempt 0 was fenced since its cut was made: that record alone is refused,
    the checkpoint is prepared, and a repeat of a record under its key writes no second copy."""
    store, parts = MemoryEventStore(writer="test"), four([])
    await episode(store, "r0", complete_call=False)
    await episode(store, "r1", complete_call=False)
    await store.append(recovery_request(Recovery("r1", 0, "continue", None, True, "call")))  # fences r1's attempt 0
    records = [cut_record("ck", "r0", 0), cut_record("ck", "r1", 0)]
    parts[3].replies["prepare"] = {"ready": True, "records": records}  # the model
    reply = await Coordinator(store, parts).prepare("ck", time.time() + 30)
    assert reply["ready"] and kinds(store, "ck") == [CHECKPOINT_STARTED, CHECKPOINT_PREPARED]
    assert [e.kind for e in await store.read_stream(call_stream("r0-c1"))][-1] == CALL_CUT
    assert CALL_CUT not in [e.kind for e in await store.read_stream(call_stream("r1-c1"))]
    again = await store.append(PrepareRecord.from_json(records[0]).request())  # the model, after an abort
    assert [e.kind for e in await store.read_stream(call_stream("r0-c1"))].count(CALL_CUT) == 1
    assert again[0].kind == CALL_CUT


async def test_a_record_that_cannot_be_appended_aborts_the_checkpoint_and_resumes_every_participant() -> None:
    journal: list[tuple[str, str]] = []
    store, parts = MemoryEventStore(writer="test"), four(journal)
    await episode(store, "r0", complete_call=False)
    parts[3].replies["prepare"] = {"ready": True, "records": [cut_record("ck", "r0", 0)]}
    append = store.append

    async def database_gone(request: AppendRequest) -> Any:
        if request.events[0].kind == CALL_CUT:
            raise DatabaseUnavailable("the database went away")
        return await append(request)

    store.append = database_gone  # type: ignore[method-assign]
    with pytest.raises(DatabaseUnavailable):
        await Coordinator(store, parts).prepare("ck", time.time() + 30)
    assert kinds(store, "ck")[-1] == CHECKPOINT_ABORTED
    assert {n for op, n in journal if op == "resume"} == {"resources", "agent", "environment", "model"}


async def test_a_participant_of_an_unknown_kind_prepares_last_alone() -> None:
    journal: list[tuple[str, str]] = []
    parts = [Participant("custom", journal), *four(journal)]
    coordinator = Coordinator(MemoryEventStore(writer="test"), parts)
    await coordinator.prepare("ck", time.time() + 30)
    assert journal[-1] == ("prepare", "custom")
    # Each step's time is recorded, in a stage of its own (the benchmark's prepare_ms.median_coordinator).
    assert {"prepare.started", "prepare.members", "prepare.stage1", "prepare.stage2", "prepare.stage3",
            "prepare.recorded", "prepare"} <= set(coordinator.timing.ms)
    assert "prepare.stage4" not in coordinator.timing.ms


@pytest.mark.parametrize("refusal", [{"ready": False}, AdmissionClosed("closed"), OSError("connection refused")])
async def test_a_stage_that_is_not_ready_aborts_and_resumes_what_it_touched_and_prepares_no_further(refusal: Any) -> None:
    journal: list[tuple[str, str]] = []
    store, parts = MemoryEventStore(writer="test"), four(journal)
    parts[1].replies["prepare"] = refusal  # the agent
    reply = await Coordinator(store, parts).prepare("ck", time.time() + 30)
    assert (reply["ready"], reply["failed"]) == (False, "agent")
    assert ("prepare", "resources") not in journal
    resumed = [n for op, n in journal if op == "resume"]
    assert resumed == ["model", "agent", "environment"]  # callees first; resources never prepared
    assert kinds(store, "ck") == [CHECKPOINT_STARTED, CHECKPOINT_ABORTED]
    assert store.log.events[-1].data["reason"] == "agent not ready"
    if not isinstance(refusal, dict):
        assert reply["reports"]["agent"]["ready"] is False and reply["reports"]["agent"]["error"]["code"]


async def test_a_checkpoint_id_is_used_once_and_a_past_deadline_writes_nothing() -> None:
    store = MemoryEventStore(writer="test")
    coordinator = Coordinator(store, four([]))
    await coordinator.prepare("ck", time.time() + 30)
    with pytest.raises(StaleCheckpoint, match="checkpoint ck already exists \\(phase prepared\\); use a new id"):
        await coordinator.prepare("ck", time.time() + 30)
    head = await store.head()
    with pytest.raises(Exception, match="deadline"):
        await coordinator.prepare("ck2", time.time() - 1)
    assert await store.head() == head


async def world(store: MemoryEventStore) -> None:
    for r in ("r0", "r1", "r5"):
        await episode(store, r)  # type: ignore[arg-type]


async def test_commit_scopes_every_live_attempt_but_the_restart_only_ones_and_records_the_cut() -> None:
    journal: list[tuple[str, str]] = []
    store, parts = MemoryEventStore(writer="test"), four(journal)
    await world(store)
    parts[3].replies["prepare"] = {"ready": True, "restarts": [{"rollout_id": "r5", "attempt": 0}]}
    await Coordinator(store, parts).prepare("ck", time.time() + 30)
    cut = await Coordinator(store, parts).commit("ck", time.time() + 30)  # a new coordinator reads the restarts back
    assert [(s.rollout_id, s.attempt) for s in cut.scope] == [("r0", 0), ("r1", 0)]
    assert cut.fresh == (("r5", 0),)
    assert sorted(n for op, n in journal if op == "commit") == sorted(PREPARE_ORDER)
    assert kinds(store, "ck")[-1] == "checkpoint_committed"
    assert store.log.events[-1].data["digest"] == cut.digest


async def test_commit_of_a_named_scope_and_run() -> None:
    store = MemoryEventStore(writer="test")
    await world(store)
    for r in ("fw-0", "fw-1"):
        await episode(store, r)  # type: ignore[arg-type]
    coordinator = Coordinator(store, four([]))
    await coordinator.prepare("ck", time.time() + 30)
    cut = await coordinator.commit("ck", time.time() + 30, scope=[("fw-1", 0)], run="fw")
    assert ([(s.rollout_id, s.attempt) for s in cut.scope], cut.run, cut.fresh) == ([("fw-1", 0)], "fw", (("fw-0", 0),))


@pytest.mark.parametrize("refusal", [AdmissionClosed("lease expired"), OSError("gone")])
async def test_a_refused_commit_aborts_and_reopens_every_participant(refusal: Exception) -> None:
    journal: list[tuple[str, str]] = []
    store, parts = MemoryEventStore(writer="test"), four(journal)
    await world(store)
    coordinator = Coordinator(store, parts)
    await coordinator.prepare("ck", time.time() + 30)
    parts[0].replies["commit"] = refusal
    with pytest.raises((AdmissionClosed, StaleCheckpoint)) as raised:
        await coordinator.commit("ck", time.time() + 30)
    assert isinstance(raised.value, type(refusal)) or "did not accept the commit" in str(raised.value)
    assert kinds(store, "ck")[-1] == CHECKPOINT_ABORTED
    assert store.log.events[-1].data["reason"].startswith("commit refused by resources")
    assert sorted(n for op, n in journal if op == "resume") == sorted(PREPARE_ORDER)


async def test_a_participant_that_fails_with_a_bug_fails_the_commit_as_it_is() -> None:
    store, parts = MemoryEventStore(writer="test"), four([])
    await world(store)
    coordinator = Coordinator(store, parts)
    await coordinator.prepare("ck", time.time() + 30)
    parts[2].replies["commit"] = KeyError("bug")
    with pytest.raises(KeyError):
        await coordinator.commit("ck", time.time() + 30)
    assert kinds(store, "ck")[-1] == CHECKPOINT_PREPARED


async def test_commit_after_the_lease_expired_aborts_instead() -> None:
    store, journal = MemoryEventStore(writer="test"), []  # type: ignore[var-annotated]
    await append_one(store, checkpoint_started("ck", deadline=time.time() - 10))
    await append_one(store, CheckpointPhases("ck").fire("prepared", restarts=[]))
    with pytest.raises(StaleCheckpoint, match="its lease expired before commit; it was aborted"):
        await Coordinator(store, four(journal)).commit("ck", time.time() + 30)
    assert kinds(store, "ck")[-1] == CHECKPOINT_ABORTED
    assert [op for op, _ in journal] == ["resume"] * 4


async def test_commit_of_a_checkpoint_that_is_not_prepared_is_an_illegal_phase() -> None:
    store = MemoryEventStore(writer="test")
    await append_one(store, checkpoint_started("ck", deadline=time.time() + 30))
    with pytest.raises(InvalidPhase):
        await Coordinator(store, four([])).commit("ck", time.time() + 30)


async def test_an_abort_that_lands_during_the_commit_wins() -> None:
    store, journal = MemoryEventStore(writer="test"), []  # type: ignore[var-annotated]
    await world(store)
    parts = four(journal)
    coordinator = Coordinator(store, parts)
    await coordinator.prepare("ck", time.time() + 30)

    class Aborting(Participant):
        async def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
            if operation == "commit":
                assert await abort_checkpoint(store, "ck", "someone else")
            return await super().call(operation, body)

    coordinator.participants[0] = Aborting("resources", journal)
    with pytest.raises(StaleCheckpoint, match="was aborted while it was being committed"):
        await coordinator.commit("ck", time.time() + 30)
    assert kinds(store, "ck")[-1] == CHECKPOINT_ABORTED
    assert [op for op, _ in journal].count("resume") == 4


@pytest.mark.parametrize("when", ["stage", "append"])
async def test_an_abort_that_lands_during_the_prepare_wins(when: str) -> None:
    """Anyone may record an expired lease's abort while the participants prepare, or between their
    replies and the prepared append; the log then ends aborted, never `prepared` after `aborted`, and
    every participant reopens."""
    store, journal = MemoryEventStore(writer="test"), []  # type: ignore[var-annotated]
    parts = four(journal)
    append = store.append

    async def aborted_first(request: AppendRequest) -> Any:
        if request.events[0].kind == CHECKPOINT_PREPARED:
            assert await abort_checkpoint(store, "ck", "lease expired")
        return await append(request)

    class Aborting(Participant):
        async def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
            if operation == "prepare":
                assert await abort_checkpoint(store, "ck", "lease expired")
            return await super().call(operation, body)

    if when == "stage":
        parts[0] = Aborting("resources", journal)
    else:
        store.append = aborted_first  # type: ignore[method-assign]
    with pytest.raises(StaleCheckpoint, match="was aborted while it was being prepared"):
        await Coordinator(store, parts).prepare("ck", time.time() + 30)
    assert kinds(store, "ck") == [CHECKPOINT_STARTED, CHECKPOINT_ABORTED]
    assert {n for op, n in journal if op == "resume"} == {"resources", "agent", "environment", "model"}


async def test_resume_reopens_callees_first_and_goes_on_past_failures() -> None:
    journal: list[tuple[str, str]] = []
    parts = four(journal)
    parts[0].replies["resume"] = OSError("gone")
    parts[1].replies["resume"] = AdmissionClosed("no")
    reply = await Coordinator(MemoryEventStore(writer="test"), parts).resume("ck")
    assert [n for _, n in journal][:2] in (["model", "resources"], ["resources", "model"])
    assert [n for _, n in journal][2:] == ["agent", "environment"]
    assert reply == {"checkpoint_id": "ck", "failures": {"resources": "gone", "agent": "no"}}
    parts[2].replies["resume"] = KeyError("bug")
    with pytest.raises(KeyError):
        await Coordinator(MemoryEventStore(writer="test"), parts).resume("ck")


class Tokens:
    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], str]] = []

    async def validate(self, ref: dict[str, Any], checkpoint_id: str) -> None:
        self.seen.append((ref, checkpoint_id))


async def test_publish_needs_the_frameworks_reference_to_name_this_checkpoint() -> None:
    store = MemoryEventStore(writer="test")
    await world(store)
    coordinator = Coordinator(store, four([]))
    await coordinator.prepare("ck", time.time() + 30)
    await coordinator.commit("ck", time.time() + 30)
    tokens = Tokens()
    with pytest.raises(InvalidCheckpointState, match="names checkpoint 'other', not ck"):
        await coordinator.publish("ck", {"checkpoint_id": "other"}, {"t": 1}, tokens)
    assert tokens.seen == []
    assert await coordinator.publish("ck", {"checkpoint_id": "ck"}, {"t": 1}, tokens) == {"checkpoint_id": "ck",
                                                                                          "phase": "published"}
    assert tokens.seen == [({"t": 1}, "ck")]
    assert store.log.events[-1].data == {"checkpoint_id": "ck", "framework_ref": {"checkpoint_id": "ck"},
                                     "token_snapshot_ref": {"t": 1}}


class CountingAppends(MemoryEventStore):
    def __init__(self) -> None:
        super().__init__()
        self.appends: list[list[str]] = []

    async def append(self, request: AppendRequest) -> Any:
        self.appends.append([e.kind for e in request.events])
        return await super().append(request)

    async def latest_boundaries(self, keys: Any, position: int, kinds: Any) -> Any:
        self.boundary_reads = getattr(self, "boundary_reads", 0) + 1
        return await super().latest_boundaries(keys, position, kinds)


async def test_an_online_checkpoint_asks_no_one_and_commits_and_publishes_in_the_append_after_started() -> None:
    store, journal = CountingAppends(), []
    await world(store)
    tokens, cuts = Tokens(), []

    async def refs(cut: Any) -> Any:
        cuts.append(cut)
        return {"checkpoint_id": cut.checkpoint_id, "position": cut.position}, {"t": 1}, tokens

    store.appends.clear()
    coordinator = Coordinator(store, four(journal))
    cut = await coordinator.checkpoint_online("ck", None, time.time() + 30, refs=refs)
    # Each running attempt's boundary is read once, for the restart-only check and the cut alike;
    # each step's time is recorded (the benchmark's online_ms.median_steps).
    assert store.boundary_reads == 1
    assert {"online:started", "online:cut", "online:refs", "online:validate", "online:committed", "commit"} <= \
        set(coordinator.timing.ms)
    # Two appends, whatever the run's size: the lease first, then the rest at once (a crash leaves no
    # online checkpoint committed and unpublished).
    assert store.appends == [["checkpoint_started"],
                             ["checkpoint_prepared", "checkpoint_committed", "checkpoint_published"]]
    assert journal == [] and cuts == [cut] and tokens.seen == [({"t": 1}, "ck")]
    assert [(s.rollout_id, s.attempt) for s in cut.scope] == [("r0", 0), ("r1", 0), ("r5", 0)]
    assert store.log.events[-1].data["framework_ref"] == {"checkpoint_id": "ck", "position": cut.position}


@pytest.mark.parametrize("bad", ["framework ref of another checkpoint", "token snapshot refused", "refs fail"])
async def test_an_online_checkpoint_whose_references_do_not_validate_is_aborted_at_once(bad: str) -> None:
    store = MemoryEventStore(writer="test")
    await world(store)

    class Refusing(Tokens):
        async def validate(self, ref: dict[str, Any], checkpoint_id: str) -> None:
            raise InvalidCheckpointState("token blob sha256-0 is missing")

    async def refs(cut: Any) -> Any:
        if bad == "refs fail":
            raise InvalidCheckpointState("cannot snapshot checkpoint ck: 1 token blob(s) missing")
        named = "other" if bad == "framework ref of another checkpoint" else cut.checkpoint_id
        return {"checkpoint_id": named}, {"t": 1}, Refusing() if bad == "token snapshot refused" else Tokens()

    with pytest.raises(InvalidCheckpointState):
        await Coordinator(store, four([])).checkpoint_online("ck", None, time.time() + 30, refs=refs)
    assert kinds(store, "ck") == [CHECKPOINT_STARTED, CHECKPOINT_ABORTED]  # not left open until its lease runs out


async def test_restore_stages_every_participant_then_installs_the_cut() -> None:
    journal: list[tuple[str, str]] = []
    store, parts = MemoryEventStore(writer="test"), four(journal)
    await world(store)
    coordinator = Coordinator(store, parts)
    for ck in ("ck", "gone"):
        await coordinator.prepare(ck, time.time() + 30)
        await coordinator.commit(ck, time.time() + 30, scope=[("r0", 0)])
    await append_one(store, CheckpointPhases("gone", "committed").fire("aborted", reason="operator"))
    with pytest.raises(InvalidCheckpointState, match="checkpoint gone is aborted; only a committed one can be restored"):
        await coordinator.restore("gone", time.time() + 30)
    await episode(store, "r7")  # type: ignore[arg-type]  # started after the cut: fenced and started afresh
    reply = await coordinator.restore("ck", time.time() + 30)
    assert reply == {"checkpoint_id": "ck", "continued": 1, "fresh_dispatch": 3, "left_retired": []}
    assert sorted(n for op, n in journal if op == "restore") == sorted(PREPARE_ORDER)
    latest = {r: a for r, a in (await store.attempt_rows(["r0", "r1", "r5", "r7"]))}
    assert latest == {"r0": 1, "r1": 1, "r5": 1, "r7": 1}


async def test_a_restart_that_lands_between_the_restores_read_and_its_install_is_fenced_too() -> None:
    """A server back from the crash restarts r0 under attempt 1 (engine.recovery) after the restore read
    the attempts and before it installs: the install, planned on attempt 0, is refused as stale; the
    restore reads again and installs over attempt 1 instead of failing the whole restore."""
    store = MemoryEventStore(writer="test")
    await world(store)
    coordinator = Coordinator(store, four([]))
    await coordinator.prepare("ck", time.time() + 30)
    await coordinator.commit("ck", time.time() + 30, scope=[("r0", 0)])
    read = store.attempt_rows
    restarts: list[str] = []

    async def read_then_restart(ids: Any) -> Any:
        rows = await read(ids)
        if not restarts:
            restarts.append("r0")
            await store.append(recovery_request(Recovery("r0", 0, "continue", None, True, "call")))
        return rows

    store.attempt_rows = read_then_restart  # type: ignore[method-assign]
    reply = await coordinator.restore("ck", time.time() + 30)
    assert (reply["continued"], reply["fresh_dispatch"]) == (1, 2) and restarts == ["r0"]
    rows = await read(["r0"])
    assert {a: row["status"] for (_, a), row in rows.items()} == {0: "fenced", 1: "fenced", 2: "live"}
    started = [e for e in await store.read_stream("rollout:r0") if e.kind == "attempt_started"][-1]
    assert started.attempt == 2 and started.data["restored_from"] == "ck" and started.data["origin_attempt"] == 0


async def test_restore_of_a_framework_that_named_its_run_touches_only_its_rollouts() -> None:
    store = MemoryEventStore(writer="test")
    await world(store)  # r0, r1, r5: no framework's run
    for r in ("fw-0", "fw-1"):
        await episode(store, r)  # type: ignore[arg-type]
    coordinator = Coordinator(store, four([]))
    await coordinator.prepare("ck", time.time() + 30)
    await coordinator.commit("ck", time.time() + 30, scope=[("fw-0", 0)], run="fw")
    for r in ("r7", "fw-7"):  # started after the cut: another framework's, and this run's
        await episode(store, r)  # type: ignore[arg-type]
    reply = await coordinator.restore("ck", time.time() + 30)
    assert (reply["continued"], reply["fresh_dispatch"]) == (1, 2)  # fw-1 restarts; fw-7 was never dispatched at P
    rows = await store.attempt_rows(["r5", "r7", "fw-7"])
    assert set(rows) == {("r5", 0), ("r7", 0), ("fw-7", 0), ("fw-7", 1)}


@pytest.mark.parametrize("refusal", [InvalidCheckpointState("staging failed"), OSError("gone")])
async def test_a_participant_that_cannot_stage_installs_nothing(refusal: Exception) -> None:
    store, parts = MemoryEventStore(writer="test"), four([])
    await world(store)
    coordinator = Coordinator(store, parts)
    await coordinator.prepare("ck", time.time() + 30)
    await coordinator.commit("ck", time.time() + 30)
    head = await store.head()
    parts[1].replies["restore"] = refusal
    with pytest.raises(InvalidCheckpointState, match="staging failed|participant agent could not restore: gone"):
        await coordinator.restore("ck", time.time() + 30)
    assert await store.head() == head


async def test_retire_and_forget_go_callers_first() -> None:
    journal: list[tuple[str, str]] = []
    coordinator = Coordinator(MemoryEventStore(writer="test"), four(journal))
    await coordinator.retire("ck", [("r0", 0)])
    await coordinator.forget("ck", ["r0"])
    order = ["environment", "agent", "model", "resources"]
    assert journal == [("retire", n) for n in order] + [("forget", n) for n in order]


class Members:
    """The live instances the log records (apps/participant_set.py), here a list the test changes."""

    def __init__(self, participants: list[Participant]) -> None:
        self.participants = participants

    async def current(self) -> list[Participant]:
        return list(self.participants)


async def test_a_coordinator_that_did_not_prepare_resumes_retires_and_forgets_every_recorded_instance() -> None:
    """A second instance of a kind is known only from the log: a coordinator built after a crash, or in
    another process, that resumes, retires or forgets must reach it too, not only the configured four."""
    journal: list[tuple[str, str]] = []
    configured = four(journal)
    second = Participant("model", journal, name="model:second")
    members = Members([*configured, second])
    for operation, call in (("resume", lambda c: c.resume("ck")), ("retire", lambda c: c.retire("ck", [("r0", 0)])),
                            ("forget", lambda c: c.forget("ck", ["r0"]))):
        await call(Coordinator(MemoryEventStore(writer="test"), configured, members))
        assert (operation, "model:second") in journal, (operation, journal)
    members.participants.remove(second)  # its lease ran out: no longer driven
    journal.clear()
    await Coordinator(MemoryEventStore(writer="test"), configured, members).resume("ck")
    assert {n for _, n in journal} == {"resources", "agent", "environment", "model"}


async def test_an_open_checkpoint_past_its_lease_is_aborted_once_and_a_closed_one_never() -> None:
    store = MemoryEventStore(writer="test")
    for ck, deadline in (("old", 1000.0), ("fresh", 2000.0), ("done", 1000.0)):
        await append_one(store, checkpoint_started(ck, deadline=deadline))
    await append_one(store, CheckpointPhases("old").fire("prepared", restarts=[]))
    assert not await abort_if_expired(store, "old", now=1001.0)  # within the grace
    assert not await abort_if_expired(store, "nothing", now=1e9)
    assert await abort_checkpoint(store, "done", "operator")
    assert not await abort_checkpoint(store, "done", "again")
    assert not await abort_checkpoint(store, "nothing", "none")
    assert await abort_expired(store, now=1500.0) == ["old"]
    assert await abort_expired(store, now=1500.0) == []
    assert kinds(store, "old") == [CHECKPOINT_STARTED, CHECKPOINT_PREPARED, CHECKPOINT_ABORTED]
    assert store.log.events[-1].data["reason"] == "lease expired"
    assert kinds(store, "fresh") == [CHECKPOINT_STARTED]
    assert await abort_expired(store, now=2002.5) == ["fresh"]


async def test_a_committed_checkpoint_is_never_aborted() -> None:
    store = MemoryEventStore(writer="test")
    await world(store)
    coordinator = Coordinator(store, four([]))
    await coordinator.prepare("ck", time.time() + 30)
    await coordinator.commit("ck", time.time() + 30)
    assert not await abort_checkpoint(store, "ck", "late")
    assert not await abort_if_expired(store, "ck", now=time.time() + 1e6)


def test_a_step_is_timed_in_milliseconds_to_two_decimals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "perf_counter", lambda: 10.0)
    timing = StepTiming()
    timing.record("prepare", 10.0 - 0.1234567)
    assert timing.ms == {"prepare": 123.46}


async def test_when_several_refuse_a_commit_the_first_participants_refusal_is_the_answer() -> None:
    store, parts = MemoryEventStore(writer="test"), four([])
    await world(store)
    coordinator = Coordinator(store, parts)
    await coordinator.prepare("ck", time.time() + 30)
    parts[0].replies["commit"] = AdmissionClosed("resources said no")
    parts[2].replies["commit"] = AdmissionClosed("environment said no")
    with pytest.raises(AdmissionClosed, match="resources said no"):
        await coordinator.commit("ck", time.time() + 30)
    assert store.log.events[-1].data["reason"] == "commit refused by resources: resources said no"


async def test_resume_retire_and_forget_give_each_participant_thirty_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    parts = four([])
    coordinator = Coordinator(MemoryEventStore(writer="test"), parts)
    await coordinator.resume("ck")
    await coordinator.retire("ck", [("r0", 2)])
    await coordinator.forget("ck", ["r0"])
    assert parts[0].bodies == [
        ("resume", {"checkpoint_id": "ck", "deadline": 1030.0}),
        ("retire", {"checkpoint_id": "ck", "deadline": 1030.0, "rollouts": [{"rollout_id": "r0", "through": 2}]}),
        ("forget", {"checkpoint_id": "ck", "deadline": 1030.0, "rollout_ids": ["r0"]}),
    ]


async def test_an_abort_that_loses_the_race_to_another_writer_says_so_and_writes_nothing() -> None:
    class Racing(MemoryEventStore):
        async def read_stream(self, stream: str, after_version: int = 0) -> list[Any]:
            events = await super().read_stream(stream, after_version)
            if events and not getattr(self, "raced", False):
                self.raced = True  # another coordinator commits the checkpoint right after this read
                await MemoryEventStore.append(self, AppendRequest((CheckpointPhases("ck", "prepared").fire("aborted",
                                                                                                          reason="other"),)))
            return events

    store = Racing()
    await append_one(store, checkpoint_started("ck", deadline=1.0))
    await append_one(store, CheckpointPhases("ck").fire("prepared", restarts=[]))
    store.raced = False
    assert not await abort_checkpoint(store, "ck", "mine")
    assert [e.data.get("reason") for e in store.log.events if e.kind == CHECKPOINT_ABORTED] == ["other"]


async def test_a_participants_own_refusal_of_a_restore_is_the_answer() -> None:
    store, parts = MemoryEventStore(writer="test"), four([])
    await world(store)
    coordinator = Coordinator(store, parts)
    await coordinator.prepare("ck", time.time() + 30)
    await coordinator.commit("ck", time.time() + 30)
    parts[2].replies["restore"] = AdmissionClosed("this process already served sessions")
    with pytest.raises(AdmissionClosed, match="this process already served sessions"):
        await coordinator.restore("ck", time.time() + 30)
