"""The control plane every server mounts: status, prepare, renew, commit, restore, resume, retire, forget.

One module for all four server kinds. The rules of phases live in engine.phases; this module
authenticates, validates bodies (unknown fields refused), keeps the lease, makes repeats
idempotent and records every phase transition in the log. What a prepare or restore *means*
for a given server is its `Participant` subclass's business (participants.base.participant).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from adapters.database import code_revision
from adapters.http_client import CONTROL
from engine import control as C
from engine.checkpoint import load_cut
from engine.coordinator import abort_if_expired
from engine.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidJson,
    InvalidPhase,
    InvalidRequest,
    PayloadTooLarge,
    RestartInScope,
    RollbookError,
    StaleCheckpoint,
    UnknownCheckpoint,
)
from engine.events import AppendRequest, NewEvent
from engine.patience import Patience
from engine.phases import LEASE_GRACE_S, Lease, ParticipantPhases
from participants.base.guard import Body, Route
from participants.base.http_errors import json_reply
from participants.base.participant import Participant, PrepareReport
from participants.base.wire import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    OperationReply,
    PreparedEvent,
    PrepareReply,
    RetireRequest,
    Status,
)

log = logging.getLogger(__name__)

MAX_BLOCKERS = 20


class ControlPlane:
    def __init__(self, participant: Participant, grace: float = LEASE_GRACE_S) -> None:
        self.p = participant
        self.grace = grace
        self.phases = ParticipantPhases(participant.kind, participant.instance)
        self.lease: Lease | None = None
        self.finished: set[str] = set()  # checkpoint ids resumed or aborted here
        self.replies: dict[tuple[str, str], dict[str, Any]] = {}
        self.lock = asyncio.Lock()
        self._unrecorded: list[NewEvent] = []  # deferred transitions, appended with the next one
        self._flushing: asyncio.Task[None] | None = None  # appends a deferred resume (_flush)

    # ---- plumbing -------------------------------------------------------------------------

    async def _record(self, trigger: str, checkpoint_id: str, *, defer: bool = False, **data: Any) -> None:
        # The phase moves only once its event is in the log: while the append waits (a database
        # restart) status still shows the phase the log has, and a failed append changes nothing.
        # Except a deferred transition (into `preparing`, then `prepared`): it moves at once and its
        # event goes out with the next transition (commit, abort or resume), in the same append, so
        # a prepare appends nothing and waits behind no other append (measured at 80 rollouts in
        # flight: the `prepared` append alone took 10-100 ms, queued behind the run's own appends).
        # Nothing reads a participant's `preparing` or `prepared` from the log: a process that dies
        # in them leaves no paused state behind, and the coordinator records the checkpoint's abort.
        # The move out of a checkpoint (`resume`) is deferred too, and flushed right after its reply.
        before, active = self.phases.state, self.phases.checkpoint_id
        event = self.phases.fire(trigger, checkpoint_id, **data)  # checks the transition, builds its event
        if defer:
            self._unrecorded.append(event)
            return
        after, after_active = self.phases.state, self.phases.checkpoint_id
        self.phases._machine.set_state(before)
        self.phases.checkpoint_id = active
        await self.p.store.append(AppendRequest((*self._unrecorded, event)))
        self._unrecorded.clear()
        self.phases._machine.set_state(after)
        self.phases.checkpoint_id = after_active

    def _flush_soon(self) -> None:
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Append the deferred transitions now, retrying while the database is away; any later
        transition's append takes them along instead if it comes first."""
        patience = Patience("recording a resume", limit_s=None)
        while True:
            try:
                async with self.lock:
                    if not self._unrecorded:
                        return  # gone out with a later transition's append
                    await self.p.store.append(AppendRequest(tuple(self._unrecorded)))
                    self._unrecorded.clear()
                    return
            except (RollbookError, OSError) as exc:
                log.warning("could not record a resume (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(patience.next_delay(exc))

    def _reply(self, op: str, checkpoint_id: str, body: dict[str, Any]) -> web.Response:
        self.replies[(op, checkpoint_id)] = body
        return json_reply(body)

    def _guard(self, op: str, req: ControlRequest, *, needs_active: bool = True) -> web.Response | None:
        """Repeats get the same reply; the rest is engine.control.check_operation."""
        cached = self.replies.get((op, req.checkpoint_id))
        if C.check_operation(op, req.checkpoint_id, req.deadline, time.time(), active=self.phases.checkpoint_id,
                             phase=self.phases.phase, finished=self.finished, repeated=cached is not None,
                             needs_active=needs_active):
            return json_reply(cached)
        return None

    # ---- operations -----------------------------------------------------------------------

    async def status(self, request: web.Request, _body: None) -> web.Response:
        return json_reply(
            Status(
                kind=self.p.kind,
                instance=self.p.instance,
                checkpoint_mode=self.p.checkpoint_mode,
                schema_version=code_revision(),
                concurrency=self.p.concurrency,
                checkpoint_id=self.phases.checkpoint_id,
                phase=self.phases.phase,
                lease_deadline=self.lease.deadline if self.lease else None,
                served_sessions=self.p.served_sessions,
                joined=self.p.joined,
            ).model_dump()
        )

    async def prepare(self, request: web.Request, req: ControlRequest) -> web.Response:
        async with self.lock:
            if (early := self._guard("prepare", req, needs_active=False)) is not None:
                return early
            await self._record("prepare", req.checkpoint_id, defer=True, deadline=req.deadline)
            self.lease = Lease(req.deadline, self.grace)
        try:
            report = await asyncio.wait_for(self.p.prepare(req.checkpoint_id, req.deadline), max(0.0, req.deadline - time.time()))
        except (TimeoutError, RollbookError) as exc:
            async with self.lock:
                await self._abort(req.checkpoint_id, reason=f"prepare failed: {exc!r}")
            raise DeadlineExceeded(f"prepare of {req.checkpoint_id} did not finish by its deadline") from exc
        async with self.lock:
            if self.phases.checkpoint_id != req.checkpoint_id:  # the lease ran out while we waited
                return self._reply("prepare", req.checkpoint_id, self._prepare_body(req.checkpoint_id, report, "idle"))
            if report.ready:  # deferred too: a prepare appends nothing of its own (see _record)
                await self._record("prepared", req.checkpoint_id, defer=True, counts=report.counts, restarts=len(report.restarts))
            body = self._prepare_body(req.checkpoint_id, report, self.phases.phase)
            return self._reply("prepare", req.checkpoint_id, body) if report.ready else json_reply(body)

    @staticmethod
    def _prepare_body(checkpoint_id: str, report: PrepareReport, phase: str) -> dict[str, Any]:
        return PrepareReply(
            checkpoint_id=checkpoint_id,
            phase=phase,
            ready=report.ready,
            blockers=report.blockers[:MAX_BLOCKERS],
            blocker_count=len(report.blockers),
            counts=report.counts,
            restarts=report.restarts,
            records=[PreparedEvent(**r.to_json()) for r in report.records],
        ).model_dump()

    async def renew(self, request: web.Request, req: ControlRequest) -> web.Response:
        async with self.lock:
            C.check_renew(req.checkpoint_id, req.deadline, time.time(), active=self.phases.checkpoint_id, finished=self.finished)
            self.lease = Lease(req.deadline, self.grace)
            return json_reply(OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase,
                                             detail={"lease_deadline": req.deadline}).model_dump())

    async def commit(self, request: web.Request, req: CommitRequest) -> web.Response:
        async with self.lock:
            if (early := self._guard("commit", req)) is not None:
                return early
            C.check_transition(self.phases, "commit")
            detail = await self.p.commit(req.checkpoint_id, req.scope)
            await self._record("commit", req.checkpoint_id, scope=len(req.scope))
            body = OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase, detail=detail).model_dump()
            return self._reply("commit", req.checkpoint_id, body)

    async def restore(self, request: web.Request, req: ControlRequest) -> web.Response:
        async with self.lock:
            if (early := self._guard("restore", req, needs_active=False)) is not None:
                return early
            C.check_restore(self.phases, self.p.served_sessions)
            cut, _phase = await load_cut(self.p.store, req.checkpoint_id)
            detail = await self.p.restore(cut)  # validates and stages; raises before any phase change
            await self._record("restore", req.checkpoint_id)
            self.lease = Lease(req.deadline, self.grace)
            body = OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase, detail=detail).model_dump()
            return self._reply("restore", req.checkpoint_id, body)

    async def resume(self, request: web.Request, req: ControlRequest) -> web.Response:
        async with self.lock:
            cached = self.replies.get(("resume", req.checkpoint_id))
            if cached is not None:
                return json_reply(cached)
            C.check_resume(req.checkpoint_id, active=self.phases.checkpoint_id, finished=self.finished)
            restored = self.phases.phase == "restored"
            try:
                detail = await self.p.resume(req.checkpoint_id, restored)
            except Exception as exc:
                # Admission stays closed until a resume succeeds: say so here, not only to the caller,
                # or every session waiting on this server waits without a word.
                log.error("resume of checkpoint %s failed (%s: %s); admission stays closed until a resume succeeds",
                          req.checkpoint_id, type(exc).__name__, exc)
                raise
            # Recorded off the request path: nothing waits for this event. Work reopened the moment
            # the hook opened admission, and what reads it (an instance joining, adapters/membership.py)
            # only stays closed a little longer until it lands. It goes out after this reply, ahead of
            # any later transition of this participant (the flush holds the lock).
            await self._record("resume", req.checkpoint_id, defer=True)
            self._flush_soon()
            self.finished.add(req.checkpoint_id)
            self.lease = None
            body = OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase, detail=detail).model_dump()
            return self._reply("resume", req.checkpoint_id, body)

    async def retire(self, request: web.Request, req: RetireRequest) -> web.Response:
        """All or nothing: every retire mark in one append, and only the marks that move.

        A repeat (or a mark already at or above `through`) appends nothing and answers the same."""
        retirements = [(r.rollout_id, r.through) for r in req.rollouts]
        C.check_retirements(retirements)  # before anything is read
        marks = {r.rollout_id: await self.p.store.retired_through(r.rollout_id) for r in req.rollouts}
        events = C.retire_events(retirements, marks)
        if events:
            await self.p.store.append(AppendRequest(events))
        for r in req.rollouts:
            await self.p.retire(r.rollout_id, r.through)
        return json_reply(OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase,
                                         detail={"retired": len(req.rollouts)}).model_dump())

    async def forget(self, request: web.Request, req: ForgetRequest) -> web.Response:
        """All or nothing: every id is checked by the body model before one append clears the marks."""
        ids = list(dict.fromkeys(req.rollout_ids))
        marks = {rid: await self.p.store.retired_through(rid) for rid in ids}
        events = C.forget_events(ids, marks)
        if events:
            await self.p.store.append(AppendRequest(events))
        for rid in ids:
            await self.p.forget(rid)
        return json_reply(OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase,
                                         detail={"forgotten": len(req.rollout_ids)}).model_dump())

    async def _abort(self, checkpoint_id: str, reason: str) -> None:
        if self.phases.can("abort"):
            await self._record("abort", checkpoint_id, reason=reason)
        await self.p.resume(checkpoint_id, restored=False)
        self.finished.add(checkpoint_id)
        self.lease = None

    async def watch_lease(self) -> None:
        """An expired lease resumes the participant by itself, recorded as an abort. A failure to
        record it (the database is down) is retried on the next tick: the watcher never dies."""
        stranded: str | None = None  # a restored checkpoint whose lease ran out with no resume, said once
        while True:
            await asyncio.sleep(0.2)
            if not C.lease_abort_due(self.lease, self.phases.checkpoint_id, self.phases.phase, time.time()):
                ck = self.phases.checkpoint_id
                if (self.phases.phase == "restored" and self.lease is not None and self.lease.expired(time.time())
                        and ck != stranded):
                    stranded = ck
                    log.warning("restored from checkpoint %s, its lease has run out and no resume came: admission "
                                "stays closed until `rollbook checkpoint resume %s` (or a new restore)", ck, ck)
                continue
            try:
                async with self.lock:  # the same rule again, under the lock: a resume may have ended it meanwhile
                    ck = self.phases.checkpoint_id
                    if ck is None or not C.lease_abort_due(self.lease, ck, self.phases.phase, time.time()):
                        continue
                    await self._abort(ck, reason="lease expired")
                    expired_checkpoint = ck
            except Exception as exc:  # e.g. the database is down: not recorded, so not done; try again
                log.warning("could not record the lease abort (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
                continue
            try:  # and the checkpoint itself, in the log, if no one has ended it yet (engine.coordinator)
                await abort_if_expired(self.p.store, expired_checkpoint, grace=self.grace)
            except (RollbookError, OSError) as exc:  # the next participant or `rollbook run` will record it
                log.warning("could not record the abort of checkpoint %s: %s", expired_checkpoint, exc)

    def routes(self) -> list[Route]:
        common: tuple[type[RollbookError], ...] = (InvalidRequest, InvalidJson, PayloadTooLarge)

        def op(name: str, body: type[Body], reply: type[BaseModel], *errors: type[RollbookError]) -> Route:
            return Route("POST", f"{CONTROL}/{name}", getattr(self, name), body, reply, (*common, *errors), "control")
        return [
            Route("GET", f"{CONTROL}/status", self.status, None, Status, (), "control"),
            op("prepare", ControlRequest, PrepareReply, CheckpointConflict, StaleCheckpoint, DeadlineExceeded),
            op("renew", ControlRequest, OperationReply, CheckpointConflict, StaleCheckpoint),
            op("commit", CommitRequest, OperationReply, CheckpointConflict, StaleCheckpoint, InvalidPhase,
               RestartInScope, DeadlineExceeded, UnknownCheckpoint, InvalidCheckpointState),
            op("restore", ControlRequest, OperationReply, InvalidPhase, UnknownCheckpoint, InvalidCheckpointState,
               StaleCheckpoint, CheckpointConflict, DeadlineExceeded, RestartInScope),
            op("resume", ControlRequest, OperationReply, InvalidPhase, CheckpointConflict, StaleCheckpoint),
            op("retire", RetireRequest, OperationReply),
            op("forget", ForgetRequest, OperationReply),
        ]

__all__ = ["ControlPlane"]
