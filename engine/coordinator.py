"""The coordinator: one checkpoint across every participant, in the order the protocol needs.

Prepare runs in stages (PREPARE_STAGES), the participants of a stage at once, and stops after the
first stage in which one is not ready. Commit and restore fan out to all at once; restore installs
nothing unless every participant staged its part. Resume goes callees first (RESUME_STAGES) and
carries on past failures. Retire and forget go callers first. The HTTP client that
talks to participants is in adapters.participant_client; this module sees only the protocol below.

WHICH PREPARE ORDERINGS ARE REQUIRED, AND WHY. A participant that closes admission refuses new
calls from its callers; a refused caller waits for resume. That is harmless when the caller's
waiting work already counts as parked, and fatal to prepare when it does not:

- environment, model and agent prepare at once. An agent session waiting on the model counts as
  at its boundary, so the model closing (and cutting its generations) never strands an agent
  prepare, and the agent needs nothing from the model's prepare to park. An episode inside its
  agent step counts as parked, so the agent refusing a new activation never strands the
  environment's prepare. The model calls no one.
- resources prepare after all three. Agents (tool rounds) and environments (seed, verify and close
  steps) call the resources server in the middle of work that does not count as parked: a tool
  round is `running`, an episode in `verify` is in a step. Refused there, that work would wait for
  resume while its own server waits for it to park, and prepare would fail at its deadline. So the
  resources server closes only once every caller has parked.

RESUME WAITS FOR ONE ROUND TRIP PER STAGE, AND NOTHING ELSE. Resume reopens callees before their
callers (RESUME_STAGES): model and resources (they call no one) at once, then the agent (it calls
both), then the environment (it calls the agent). The order is a cost argument, not an invariant: a
caller reopened before its callee sends its held work to a server still closed and is refused, which
changes nothing but costs a round trip (and, for a model call, a `call_excluded` append). Each stage
is one round trip because nothing on resume's request path writes to the log unless an invariant
needs it: `participant_resume` is appended right after the reply (participants/base/control_plane.py),
since its one reader (an instance joining while a paused checkpoint is open, adapters/membership.py)
only stays closed a little longer until it lands; what a restored participant's resume installs (a
claim under the rollout's new attempt) stays on the path, since it must be durable before any
request uses it. That append was nearly all of resume's time (the agent's waited ~0.5 s behind the
appends of the sessions its own admission had just reopened) and held the later stages' work parked.
A caller that is refused anyway (a stage that failed, an instance that joined meanwhile) sees a
refusal naming the checkpoint that holds its callee closed (participants/base/app.py); having resumed
from that checkpoint itself, it knows the callee's resume is on its way and asks again after SOON_S,
not after a back-off that grows to a second (engine.admission.Admission.callee_resuming,
engine.patience). All at once instead of in stages, resume measured the same (~20 ms), so the
stages, which spare those refusals, stay.

HOW MANY APPENDS. Two on prepare's path, both the coordinator's, and no fewer: `checkpoint_started`
must be durable before any participant hears of the checkpoint (it holds the lease whose expiry
anyone may record as an abort); `checkpoint_prepared` carries the restart-only list that a commit
from another process (`rollbook checkpoint commit`) reads back, and commits in one group with the
events the participants' prepares handed over (engine.prepare_records: the model's cuts), so that
no participant appends anything while it prepares. Each participant's own `preparing` and
`prepared` go out with its next transition (participants/base/control_plane.py).

TWO MODES: PAUSED AND ONLINE. A cut needs only each rollout's latest boundary at or below P, and
lineage makes every boundary consistent with the sessions and model calls it names, so the log
alone gives a consistent cut with every server running: `checkpoint_online` asks no participant
anything (engine.checkpoint.make_online_cut). What a pause still buys, and when to choose it:
(1) a framework that publishes state of its own under the checkpoint's id (NeMo Gym's) needs that
state to be "as of P": without a pause an episode can finish after P and before the framework
snapshots, and restore would continue a rollout whose result the restored framework already
consumed. A framework whose state is the log (`rollbook run`) reads it as of P and needs no pause.
(2) The model's prepare cuts every generation in flight that has tokens saved, at that durable
prefix, which restore continues; an online cut redoes each from its boundary, and redoes tool calls
made after it.
Restart-only executions are known either way: prepare reports them, and the log records them
(`session_opened.state_mode`, an agent boundary's `continuable: false`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine import catalog as ev
from engine.checkpoint import (
    Cut,
    CutStore,
    committed_event,
    load_cut,
    make_cut,
    make_online_cut,
    started_after,
    validate_cut,
)
from engine.errors import (
    InvalidCheckpointState,
    RollbookError,
    StaleAttempt,
    StaleCheckpoint,
    VersionConflict,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import Key, checkpoint_stream
from engine.install import install_request, retired_since
from engine.phases import (
    LEASE_GRACE_S,
    OPEN_CHECKPOINT_PHASES,
    CheckpointPhases,
    check_deadline,
    checkpoint_lease_expired,
    checkpoint_started,
)
from engine.prepare_records import PrepareRecord

PREPARE_STAGES: tuple[tuple[str, ...], ...] = (("environment", "model", "agent"), ("resources",))
PREPARE_ORDER = tuple(kind for stage in PREPARE_STAGES for kind in stage)
RESUME_STAGES: tuple[tuple[str, ...], ...] = (("model", "resources"), ("agent",), ("environment",))
RETIRE_ORDER = ("environment", "agent", "model", "resources")
INSTALL_TRIES = 5  # reads of the attempts a restore's install is planned on, each overtaken by a restart
ONLINE_LEASE_S = 30.0  # an online checkpoint takes a few reads and two appends; past this anyone may abort it


class ParticipantClient(Protocol):
    name: str
    kind: str

    async def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]: ...


class ParticipantSet(Protocol):
    """Where the participants are: the live instances the log records (apps/participant_set.py)."""

    async def current(self) -> Sequence[ParticipantClient]: ...


class CheckpointStore(CutStore, Protocol):
    async def checkpoints_in_phase(self, phases: Sequence[str]) -> list[str]: ...


class TokenSnapshots(Protocol):
    async def validate(self, ref: dict[str, Any], checkpoint_id: str) -> None: ...


@dataclass
class StepTiming:
    ms: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, started: float) -> None:
        self.ms[name] = round((time.perf_counter() - started) * 1000, 2)


# What a framework publishes a cut with: its own state's reference, the token snapshot's, and the store
# that validates the latter.
Refs = tuple[dict[str, Any], dict[str, Any], TokenSnapshots]
MakeRefs = Callable[[Cut], Awaitable[Refs]]


async def _published(phases: CheckpointPhases, framework_ref: dict[str, Any], token_ref: dict[str, Any],
                     tokens: TokenSnapshots) -> NewEvent:
    """`checkpoint_published`, once both references validate under the checkpoint's id."""
    checkpoint_id = phases.checkpoint_id
    if framework_ref.get("checkpoint_id") != checkpoint_id:
        raise InvalidCheckpointState(
            f"the framework state reference names checkpoint {framework_ref.get('checkpoint_id')!r}, not {checkpoint_id}"
        )
    await tokens.validate(token_ref, checkpoint_id)
    return phases.fire("published", framework_ref=framework_ref, token_snapshot_ref=token_ref)


def _ordered(participants: Sequence[ParticipantClient], order: Sequence[str]) -> list[ParticipantClient]:
    rank = {k: i for i, k in enumerate(order)}
    return sorted(participants, key=lambda p: rank.get(p.kind, len(order)))


def _staged(participants: Sequence[ParticipantClient],
            stages: tuple[tuple[str, ...], ...] = PREPARE_STAGES) -> list[list[ParticipantClient]]:
    """The participants of each stage, in the stage's order; a kind the protocol does not name goes
    last, alone, since nothing says what it may refuse to whom."""
    out = [[p for p in _ordered(participants, stage) if p.kind in stage] for stage in stages]
    known = {k for stage in stages for k in stage}
    out += [[p] for p in participants if p.kind not in known]
    return [s for s in out if s]


async def _prepare_one(p: ParticipantClient, body: dict[str, Any], timing: StepTiming) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        return await p.call("prepare", body)
    except RollbookError as exc:
        return {"ready": False, "error": exc.to_json()["error"]}
    except OSError as exc:  # a participant that does not answer fails prepare, like one that says no
        return {"ready": False, "error": {"code": "participant_unavailable", "detail": str(exc)}}
    finally:
        timing.record(f"prepare:{p.name}", started)  # where a slow prepare spends its time


class Coordinator:
    def __init__(self, store: CutStore, participants: Sequence[ParticipantClient], members: ParticipantSet | None = None) -> None:
        self.store = store
        self.participants = list(participants)
        # Read again after checkpoint_started is in the log: an instance that records itself later
        # sees the open checkpoint and stays closed (participants/base/instances.py), one recorded earlier
        # is in this set and is prepared; either way no instance serves through the cut unseen.
        self.members = members
        self.timing = StepTiming()
        self.restarts: dict[str, list[Key]] = {}

    async def _current(self) -> list[ParticipantClient]:
        """The participants, read again from the members where there are any. A coordinator that did not
        prepare (another process, or a new one after a crash) must still reach every live instance
        when it restores, resumes, retires or forgets, not only the configured ones."""
        if self.members is not None:
            self.participants = list(await self.members.current())
        return self.participants

    def _body(self, checkpoint_id: str, deadline: float, **extra: Any) -> dict[str, Any]:
        return {"checkpoint_id": checkpoint_id, "deadline": deadline, **extra}

    async def _phase(self, checkpoint_id: str) -> CheckpointPhases:
        return (await _checkpoint(self.store, checkpoint_id))[0]

    async def prepare(self, checkpoint_id: str, deadline: float) -> dict[str, Any]:
        """Prepare every participant in order; on the first failure resume those already prepared."""
        started = time.perf_counter()
        check_deadline(deadline, time.time(), f"prepare of {checkpoint_id}")  # before anything is written
        # The span too: a reader on another clock (the database's) judges the deadline by it.
        started_event = checkpoint_started(checkpoint_id, deadline=deadline, span_s=deadline - time.time())
        try:  # expecting an empty stream: a checkpoint id is used once
            await self.store.append(AppendRequest((started_event,), {started_event.stream: 0}))
        except VersionConflict as exc:
            phase = (await self._phase(checkpoint_id)).phase
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} already exists (phase {phase}); use a new id") from exc
        self.timing.record("prepare.started", started)  # the coordinator's first append (benchmark: median_coordinator)
        reading = time.perf_counter()
        await self._current()
        self.timing.record("prepare.members", reading)
        prepared: list[ParticipantClient] = []
        reports: dict[str, Any] = {}
        restarts: set[Key] = set()
        records: list[PrepareRecord] = []
        body = self._body(checkpoint_id, deadline)
        for i, stage in enumerate(_staged(self.participants), 1):
            asking = time.perf_counter()
            replies = await asyncio.gather(*(_prepare_one(p, body, self.timing) for p in stage))
            self.timing.record(f"prepare.stage{i}", asking)  # the stage's wall: its slowest reply
            for p, reply in zip(stage, replies, strict=True):
                reports[p.name] = reply
            failed = next((p for p, reply in zip(stage, replies, strict=True) if not reply.get("ready")), None)
            if failed is not None:
                await self._abort(checkpoint_id, [*prepared, *stage], f"{failed.name} not ready")
                self.timing.record("prepare", started)
                return {"checkpoint_id": checkpoint_id, "ready": False, "failed": failed.name, "reports": reports}
            prepared += stage
            restarts |= {(r["rollout_id"], r["attempt"]) for reply in replies for r in reply.get("restarts", [])}
            records += [PrepareRecord.from_json(r) for reply in replies for r in reply.get("records", [])]
        recording = time.perf_counter()
        # No read of the phase: the append expects the stream as this prepare left it (started alone),
        # so an abort that landed meanwhile (anyone may record an expired lease) refuses it.
        event = CheckpointPhases(checkpoint_id).fire("prepared", restarts=[list(k) for k in sorted(restarts)])
        await self._record_prepared(checkpoint_id, prepared, event, records)
        self.timing.record("prepare.recorded", recording)
        self.restarts[checkpoint_id] = sorted(restarts)
        self.timing.record("prepare", started)
        return {"checkpoint_id": checkpoint_id, "ready": True, "reports": reports, "restarts": [list(k) for k in sorted(restarts)]}

    async def _record_prepared(self, checkpoint_id: str, prepared: Sequence[ParticipantClient],
                               event: NewEvent, records: Sequence[PrepareRecord]) -> None:
        """`checkpoint_prepared` and what the participants' prepares handed over (engine.prepare_records),
        queued together so they commit in one group: one append's wait, not two. A record refused
        `stale_attempt` belongs to an attempt fenced since (nothing of it counts); any other failure
        aborts the checkpoint, so no commit ever fixes P over a missing record. A checkpoint aborted
        meanwhile stays aborted: its records may land all the same, as the participant would append
        them itself on resume."""
        outcomes = await asyncio.gather(*(self.store.append(r.request()) for r in records),
                                        self.store.append(AppendRequest((event,), {event.stream: 1})), return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, StaleAttempt)), None)
        if failed is None:
            return
        if isinstance(failed, VersionConflict):
            await self._resume(checkpoint_id, prepared)
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was aborted while it was being prepared") from failed
        if not isinstance(failed, RollbookError | OSError):
            raise failed  # a bug or a cancellation
        await self._abort(checkpoint_id, prepared, f"could not record the prepared checkpoint: {failed}")
        raise failed

    async def _abort(self, checkpoint_id: str, touched: Sequence[ParticipantClient], reason: str) -> None:
        await abort_checkpoint(self.store, checkpoint_id, reason)
        await self._resume(checkpoint_id, touched)

    async def _restarts_of(self, checkpoint_id: str) -> list[Key]:
        if checkpoint_id in self.restarts:
            return self.restarts[checkpoint_id]
        events = await self.store.read_stream(checkpoint_stream(checkpoint_id))
        return [(k[0], k[1]) for e in events if e.kind == ev.CHECKPOINT_PREPARED for k in e.data.get("restarts", [])]

    async def commit(self, checkpoint_id: str, deadline: float, scope: Sequence[Key] | None = None,
                     run: str | None = None) -> Cut:
        """Fix the cut (engine.checkpoint.make_cut), tell every participant at once, and record the
        commit only once every one of them accepted it: a refusal (a lease that ran out, a crash)
        aborts the checkpoint in the log instead, so the log never says committed for a cut the
        participants did not all hold."""
        started = time.perf_counter()
        check_deadline(deadline, time.time(), f"commit of {checkpoint_id}")
        phases, events = await _checkpoint(self.store, checkpoint_id)
        phases._move("committed")  # validate the transition before anything is sent or written
        if _lease_expired(events, time.time()):
            await self._abort(checkpoint_id, self.participants, "lease expired before commit")
            raise StaleCheckpoint(f"checkpoint {checkpoint_id}: its lease expired before commit; it was aborted")
        cut = await make_cut(self.store, checkpoint_id, scope, await self._restarts_of(checkpoint_id), run)
        body = self._body(checkpoint_id, deadline, scope=[{"rollout_id": s.rollout_id, "attempt": s.attempt} for s in cut.scope])
        results = await asyncio.gather(*(p.call("commit", body) for p in self.participants), return_exceptions=True)
        refused = [(p, r) for p, r in zip(self.participants, results, strict=True) if isinstance(r, BaseException)]
        for _, r in refused:
            if not isinstance(r, RollbookError | OSError):
                raise r  # a bug or a cancellation, not a participant's answer
        if refused:
            name, exc = refused[0][0].name, refused[0][1]
            await self._abort(checkpoint_id, self.participants, f"commit refused by {name}: {exc}")
            if isinstance(exc, RollbookError):
                raise exc
            raise StaleCheckpoint(f"checkpoint {checkpoint_id}: participant {name} did not accept the commit ({exc}); aborted")
        try:  # expecting the stream as read: whoever aborted it meanwhile (an expired lease) wins
            await self.store.append(AppendRequest((committed_event(cut),), {checkpoint_stream(checkpoint_id): len(events)}))
        except VersionConflict as exc:
            await self._resume(checkpoint_id, self.participants)
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was aborted while it was being committed") from exc
        self.timing.record("commit", started)
        return cut

    async def checkpoint_online(self, checkpoint_id: str, run: str | None = None,
                                deadline: float | None = None, refs: MakeRefs | None = None) -> Cut:
        """A checkpoint that pauses no one: the cut comes from the log alone (make_online_cut) and no
        participant is asked anything. `checkpoint_started` lands first (retention leaves alone what
        a cut being made may cover, and its lease lets anyone abort a checkpoint whose coordinator
        died); then prepared and committed in one append, with `published` too where `refs` makes the
        framework's and the token store's references for the cut: a checkpoint every second costs
        two appends, not four."""
        started = time.perf_counter()
        deadline = time.time() + ONLINE_LEASE_S if deadline is None else deadline
        check_deadline(deadline, time.time(), f"online checkpoint {checkpoint_id}")
        started_event = checkpoint_started(checkpoint_id, deadline=deadline, span_s=deadline - time.time(), mode="online")
        try:  # expecting an empty stream: a checkpoint id is used once
            await self.store.append(AppendRequest((started_event,), {started_event.stream: 0}))
        except VersionConflict as exc:
            phase = (await self._phase(checkpoint_id)).phase
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} already exists (phase {phase}); use a new id") from exc
        self.timing.record("online:started", started)  # where an online checkpoint spends its time
        try:
            step = time.perf_counter()
            cut = await make_online_cut(self.store, checkpoint_id, run)
            self.timing.record("online:cut", step)
            phases = CheckpointPhases(checkpoint_id, "started")
            events = [phases.fire("prepared", restarts=[list(k) for k in cut.fresh]), committed_event(cut)]
            phases._move("committed")
            if refs is not None:
                step = time.perf_counter()
                made = await refs(cut)
                self.timing.record("online:refs", step)
                step = time.perf_counter()
                events.append(await _published(phases, *made))
                self.timing.record("online:validate", step)
        except RollbookError as exc:  # nothing was committed: say so now rather than at the lease's end
            with contextlib.suppress(RollbookError):  # the log away: the lease says it later
                await abort_checkpoint(self.store, checkpoint_id, f"online checkpoint failed: {exc}")
            raise
        step = time.perf_counter()
        try:  # expecting the stream as written: whoever aborted it meanwhile (an expired lease) wins
            await self.store.append(AppendRequest(tuple(events), {started_event.stream: 1}))
        except VersionConflict as exc:
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was aborted while it was being committed") from exc
        self.timing.record("online:committed", step)
        self.timing.record("commit", started)
        return cut

    async def publish(self, checkpoint_id: str, framework_ref: dict[str, Any], token_ref: dict[str, Any],
                      tokens: TokenSnapshots) -> dict[str, Any]:
        """Publish only when both references validate under this checkpoint id."""
        event = await _published(await self._phase(checkpoint_id), framework_ref, token_ref, tokens)
        await self.store.append(AppendRequest((event,)))
        return {"checkpoint_id": checkpoint_id, "phase": "published"}

    async def resume(self, checkpoint_id: str) -> dict[str, Any]:
        started = time.perf_counter()
        # Every live instance reopens, one that joined while the checkpoint was open included.
        failures = await self._resume(checkpoint_id, await self._current())
        self.timing.record("resume", started)
        return {"checkpoint_id": checkpoint_id, "failures": failures}

    async def _resume(self, checkpoint_id: str, participants: Sequence[ParticipantClient]) -> dict[str, str]:
        failures: dict[str, str] = {}
        body = self._body(checkpoint_id, time.time() + 30)
        for stage in _staged(participants, RESUME_STAGES):
            results = await asyncio.gather(*(self._resume_one(p, body) for p in stage), return_exceptions=True)
            for p, r in zip(stage, results, strict=True):
                if isinstance(r, RollbookError | OSError):  # keep going: every other participant must reopen
                    failures[p.name] = str(r)
                elif isinstance(r, BaseException):
                    raise r  # a bug or a cancellation, not a participant's answer
        return failures

    async def _resume_one(self, p: ParticipantClient, body: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            return await p.call("resume", body)
        finally:
            self.timing.record(f"resume:{p.name}", started)  # where a slow resume spends its time

    async def restore(self, checkpoint_id: str, deadline: float) -> dict[str, Any]:
        """Validate the whole cut, let every participant stage its part, then install all at once."""
        started = time.perf_counter()
        cut, phase = await load_cut(self.store, checkpoint_id)
        if phase not in ("committed", "published"):
            raise InvalidCheckpointState(f"checkpoint {checkpoint_id} is {phase}; only a committed one can be restored")
        await validate_cut(self.store, cut)
        self.timing.record("restore:validate", started)
        staging = time.perf_counter()
        await self._current()
        body = self._body(checkpoint_id, deadline)
        results = await asyncio.gather(*(p.call("restore", body) for p in self.participants), return_exceptions=True)
        failed = {p.name: r for p, r in zip(self.participants, results, strict=True) if isinstance(r, BaseException)}
        if failed:
            name, exc = next(iter(failed.items()))
            if isinstance(exc, RollbookError):
                raise exc
            raise InvalidCheckpointState(f"participant {name} could not restore: {exc}")
        self.timing.record("restore:participants", staging)
        for tries in range(1, INSTALL_TRIES + 1):
            install, retired, late = await self._install_request(cut)
            try:
                await self.store.append(install)
                break
            except StaleAttempt:
                # An attempt moved on between the read and the append: a server that came back from the
                # crash restarted a rollout under N+1 (engine.recovery) while this restore staged. Read again.
                if tries == INSTALL_TRIES:
                    raise
        self.timing.record("restore", started)
        installed = install.events[-1].data
        return {"checkpoint_id": checkpoint_id, "continued": installed["continued"],
                "fresh_dispatch": sum(1 for r, _ in [*cut.fresh, *late] if r not in retired),
                "left_retired": installed["left_retired"]}

    async def _install_request(self, cut: Cut) -> tuple[AppendRequest, set[str], list[tuple[str, int]]]:
        """The install of `cut` as the log stands now: each rollout's latest attempt fenced, the next
        one started; and the rollouts retired since the cut, and the attempts started after it."""
        late = await started_after(self.store, cut)
        named = {s.rollout_id for s in cut.scope} | {r for r, _ in [*cut.fresh, *late]}
        rows = await self.store.attempt_rows(sorted(named))
        latest: dict[str, int] = {}
        for r, a in rows:
            latest[r] = max(latest.get(r, -1), a)
        retired = set(retired_since(rows))
        return install_request(cut, latest, late, retired), retired, list(late)

    async def retire(self, checkpoint_id: str, rollouts: Sequence[tuple[str, int]]) -> None:
        body = self._body(checkpoint_id, time.time() + 30, rollouts=[{"rollout_id": r, "through": t} for r, t in rollouts])
        for p in _ordered(await self._current(), RETIRE_ORDER):
            await p.call("retire", body)

    async def forget(self, checkpoint_id: str, rollout_ids: Sequence[str]) -> None:
        body = self._body(checkpoint_id, time.time() + 30, rollout_ids=list(rollout_ids))
        for p in _ordered(await self._current(), RETIRE_ORDER):
            await p.call("forget", body)


async def _checkpoint(store: CutStore, checkpoint_id: str) -> tuple[CheckpointPhases, list[RecordedEvent]]:
    events = await store.read_stream(checkpoint_stream(checkpoint_id))
    phase = events[-1].kind.removeprefix("checkpoint_") if events else "started"
    return CheckpointPhases(checkpoint_id, phase), events


def _lease_expired(events: Sequence[RecordedEvent], now: float, grace: float = LEASE_GRACE_S) -> bool:
    if not events:
        return False
    deadline = events[0].data.get("deadline") if events[0].kind == ev.CHECKPOINT_STARTED else None
    return checkpoint_lease_expired(events[-1].kind.removeprefix("checkpoint_"), deadline, now, grace)


async def abort_checkpoint(store: CutStore, checkpoint_id: str, reason: str) -> bool:
    """Record the abort of a checkpoint that has not committed; False when it had already ended
    (committed, published, aborted) or someone else moved it first."""
    phases, events = await _checkpoint(store, checkpoint_id)
    if not events or not phases.can("aborted") or phases.phase not in OPEN_CHECKPOINT_PHASES:
        return False
    try:
        await store.append(AppendRequest((phases.fire("aborted", reason=reason),), {checkpoint_stream(checkpoint_id): len(events)}))
    except VersionConflict:
        return False
    return True


async def abort_if_expired(store: CutStore, checkpoint_id: str, now: float | None = None,
                           grace: float = LEASE_GRACE_S) -> bool:
    """The lease rule, applied by whoever notices first (a server whose lease ran out, `rollbook run`,
    `rollbook checkpoint status`): a checkpoint still started or prepared past its deadline plus the
    grace is aborted in the log, so a coordinator killed after prepare never leaves it open forever."""
    _, events = await _checkpoint(store, checkpoint_id)
    if not _lease_expired(events, time.time() if now is None else now, grace):
        return False
    return await abort_checkpoint(store, checkpoint_id, "lease expired")


async def abort_expired(store: CheckpointStore, now: float | None = None) -> list[str]:
    """Every open checkpoint whose lease expired, aborted in the log; returns their ids."""
    aborted = []
    for checkpoint_id in await store.checkpoints_in_phase(OPEN_CHECKPOINT_PHASES):
        if await abort_if_expired(store, checkpoint_id, now):
            aborted.append(checkpoint_id)
    return aborted
