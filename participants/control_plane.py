"""The control plane every server mounts: status, prepare, renew, commit, restore, resume, retire, forget.

One module for all four server kinds. The rules of phases live in engine.phases; this module
authenticates, validates bodies (unknown fields refused), keeps the lease, makes repeats
idempotent and records every phase transition in the log. What a prepare or restore *means*
for a given server is its `Participant` subclass's business.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, ClassVar, Literal

from aiohttp import web
from pydantic import BaseModel, Field, field_validator

from adapters.database import code_revision
from adapters.http_client import CONTROL, PREFIX
from engine import attempts as A
from engine import control as C
from engine.checkpoint import Cut, ParticipantStore, load_cut
from engine.coordinator import abort_if_expired
from engine.errors import (
    DeadlineExceeded,
    RollbookError,
)
from engine.events import AppendRequest, NewEvent
from engine.identity import parse_attempt, validate_id
from engine.phases import Lease, ParticipantPhases
from participants.guard import (
    MAX_BODY_BYTES,
    AttemptIndex,
    Body,
    Credentials,
    Empty,
    Identifier,
    Int64,
    Route,
    authenticate,
)
from participants.http_errors import error_response, errors_as_json

log = logging.getLogger(__name__)

OPENAPI_PATH = f"{PREFIX}/openapi.json"
MAX_BLOCKERS = 20
MAX_ITEMS = 10_000  # rollouts in one retire or forget, executions in one commit scope
# 2100-01-01: a deadline is a wall-clock time, and a larger one only overflows the timers.
MAX_DEADLINE = 4_102_444_800.0


TASK_SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "logprobs", "top_logprobs",
                 "response_format", "presence_penalty", "frequency_penalty")


class TaskBody(Body):
    """A task on the wire (participants.environments.Task as JSON), shared by the data planes."""

    env: Identifier
    task_id: str = Field(max_length=256)
    prompt: str
    params: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] = Field(default_factory=dict, description=(
        "per-task sampling parameters the agent sends with every model call of the task: "
        + ", ".join(TASK_SAMPLING)))

    @field_validator("sampling")
    @classmethod
    def _known_sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(TASK_SAMPLING))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {list(TASK_SAMPLING)}")
        return value


class ControlRequest(Body):
    checkpoint_id: Identifier
    deadline: float = Field(gt=0, le=MAX_DEADLINE, description="absolute deadline, seconds since the Unix epoch")


class Execution(Body):
    rollout_id: Identifier
    attempt: AttemptIndex


class CommitRequest(ControlRequest):
    scope: list[Execution] = Field(default_factory=list, max_length=MAX_ITEMS)


class Retirement(Body):
    rollout_id: Identifier
    through: AttemptIndex


class RetireRequest(ControlRequest):
    rollouts: list[Retirement] = Field(max_length=MAX_ITEMS)


class ForgetRequest(ControlRequest):
    rollout_ids: list[Identifier] = Field(max_length=MAX_ITEMS)


class Status(BaseModel):
    kind: str
    instance: str
    checkpoint_mode: Literal["native", "restart_only"]
    schema_version: str
    concurrency: str
    checkpoint_id: str | None
    phase: str
    lease_deadline: float | None
    served_sessions: bool


class PrepareReply(BaseModel):
    checkpoint_id: str
    phase: str
    ready: bool
    blockers: list[str]
    blocker_count: int
    counts: dict[str, int]
    restarts: list[Execution]


class OperationReply(BaseModel):
    checkpoint_id: str
    phase: str
    detail: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    code: str
    detail: str
    message: str = Field(description="the same as detail, where OpenAI's clients look for it")
    type: str = Field(description="OpenAI's error type for the status")
    context: dict[str, Any] | None = None


class ErrorReply(BaseModel):
    error: ErrorBody


class PrepareReport(BaseModel):
    """What a participant says after parking its work."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[Execution] = Field(default_factory=list)


class Participant:
    """A server's part in a checkpoint. Subclasses override the hooks; defaults do nothing."""

    kind: ClassVar[str] = "participant"
    checkpoint_mode: ClassVar[Literal["native", "restart_only"]] = "native"
    concurrency: ClassVar[str] = "sessions serialized per rollout attempt; control operations serialized"

    def __init__(self, store: ParticipantStore, instance: str) -> None:
        self.store = store
        self.instance = instance
        self.attempts = A.AttemptGate(store)
        self.served_sessions = False
        self.admission_open = True

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        self.admission_open = False
        return PrepareReport(ready=True)

    async def commit(self, checkpoint_id: str, scope: list[Execution]) -> dict[str, Any]:
        return {}

    async def restore(self, cut: Cut) -> dict[str, Any]:
        """Validate and stage the state of every execution in the cut; install nothing live."""
        return {}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        self.admission_open = True
        return {}

    async def retire(self, rollout_id: str, through: int) -> None:
        return None

    async def stop(self) -> None:
        """At shutdown: cancel work in flight (the server waits for open handlers, which wait on it)."""
        return None

    async def close(self) -> None:
        """At cleanup: release clients and connections the participant opened."""
        return None

    async def forget(self, rollout_id: str) -> None:
        return None

    def in_flight(self) -> int:
        """Rollout attempts with work in progress here (the `rollbook_rollouts_in_flight` gauge)."""
        return 0

    def routes(self) -> list[Route]:
        """The server's data routes (participants.guard.Route): mounted and documented alike."""
        return []

    async def check_attempt(self, rollout_id: str, attempt: int) -> None:
        """Fencing lives in the database, so every server refuses the same attempts at once; the
        gate answers from memory while no fence has landed (engine.attempts.AttemptGate)."""
        await self.attempts.check(rollout_id, attempt)


def identity(request: web.Request) -> tuple[str, int]:
    """Rollout identity from the path prefix /rollouts/{rollout_id}/attempts/{attempt}/."""
    rollout_id = validate_id(request.match_info.get("rollout_id"), "rollout id")
    return rollout_id, parse_attempt(request.match_info.get("attempt"))


def data_path(suffix: str) -> str:
    return "/rollouts/{rollout_id}/attempts/{attempt}" + suffix


class ControlPlane:
    def __init__(self, participant: Participant, grace: float = 2.0) -> None:
        self.p = participant
        self.grace = grace
        self.phases = ParticipantPhases(participant.kind, participant.instance)
        self.lease: Lease | None = None
        self.finished: set[str] = set()  # checkpoint ids resumed or aborted here
        self.replies: dict[tuple[str, str], dict[str, Any]] = {}
        self.lock = asyncio.Lock()
        self._unrecorded: list[NewEvent] = []  # deferred transitions, appended with the next one

    # ---- plumbing -------------------------------------------------------------------------

    async def _record(self, trigger: str, checkpoint_id: str, *, defer: bool = False, **data: Any) -> None:
        # The phase moves only once its event is in the log: while the append waits (a database
        # restart) status still shows the phase the log has, and a failed append changes nothing.
        # Except a deferred transition (the move into `preparing`): it moves at once and its event
        # goes out with the next one, in the same append, so a prepare costs one append, not two.
        # Nothing reads `preparing` from the log while it lasts: a process that dies in it
        # leaves no paused state behind, and the coordinator records the checkpoint's abort.
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

    def _reply(self, op: str, checkpoint_id: str, body: dict[str, Any]) -> web.Response:
        self.replies[(op, checkpoint_id)] = body
        return web.json_response(body)

    def _guard(self, op: str, req: ControlRequest, *, needs_active: bool = True) -> web.Response | None:
        """Repeats get the same reply; the rest is engine.control.check_operation."""
        cached = self.replies.get((op, req.checkpoint_id))
        if C.check_operation(op, req.checkpoint_id, req.deadline, time.time(), active=self.phases.checkpoint_id,
                             phase=self.phases.phase, finished=self.finished, repeated=cached is not None,
                             needs_active=needs_active):
            return web.json_response(cached)
        return None

    # ---- operations -----------------------------------------------------------------------

    async def status(self, request: web.Request, _body: None) -> web.Response:
        return web.json_response(
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
            if report.ready:
                await self._record("prepared", req.checkpoint_id, counts=report.counts, restarts=len(report.restarts))
            body = self._prepare_body(req.checkpoint_id, report, self.phases.phase)
            return self._reply("prepare", req.checkpoint_id, body) if report.ready else web.json_response(body)

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
        ).model_dump()

    async def renew(self, request: web.Request, req: ControlRequest) -> web.Response:
        async with self.lock:
            C.check_renew(req.checkpoint_id, req.deadline, time.time(), active=self.phases.checkpoint_id, finished=self.finished)
            self.lease = Lease(req.deadline, self.grace)
            return web.json_response(OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase,
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
                return web.json_response(cached)
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
            await self._record("resume", req.checkpoint_id)
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
        return web.json_response(OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase,
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
        return web.json_response(OperationReply(checkpoint_id=req.checkpoint_id, phase=self.phases.phase,
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
        common = ("invalid_request", "invalid_json", "payload_too_large")
        def op(name: str, body: type[Body], reply: type[BaseModel], *errors: str) -> Route:
            return Route("POST", f"{CONTROL}/{name}", getattr(self, name), body, reply, (*common, *errors), "control")
        return [
            Route("GET", f"{CONTROL}/status", self.status, None, Status, (), "control"),
            op("prepare", ControlRequest, PrepareReply, "checkpoint_conflict", "stale_checkpoint", "deadline_exceeded"),
            op("renew", ControlRequest, OperationReply, "checkpoint_conflict", "stale_checkpoint"),
            op("commit", CommitRequest, OperationReply, "checkpoint_conflict", "stale_checkpoint", "invalid_phase",
               "restart_in_scope", "deadline_exceeded", "unknown_checkpoint", "invalid_checkpoint_state"),
            op("restore", ControlRequest, OperationReply, "invalid_phase", "unknown_checkpoint", "invalid_checkpoint_state",
               "stale_checkpoint", "checkpoint_conflict", "deadline_exceeded", "restart_in_scope"),
            op("resume", ControlRequest, OperationReply, "invalid_phase", "checkpoint_conflict", "stale_checkpoint"),
            op("retire", RetireRequest, OperationReply),
            op("forget", ForgetRequest, OperationReply),
        ]


PARTICIPANT: web.AppKey[Participant] = web.AppKey("participant", Participant)


def build_app(participant: Participant, credentials: Credentials, grace: float = 2.0) -> web.Application:
    """An aiohttp app with the control plane, the participant's own routes and their OpenAPI document.

    Every route, the document included, needs a credential (participants.guard)."""
    from participants.observability import observe
    from participants.openapi import document

    plane = ControlPlane(participant, grace)
    app = web.Application(middlewares=[errors_as_json, authenticate(credentials)], client_max_size=MAX_BODY_BYTES)
    app[PARTICIPANT] = participant

    @functools.cache
    def doc() -> dict[str, Any]:
        # Built on first request: pydantic's schemas take 40 ms of CPU, at every start of every server.
        return document(f"rollbook {participant.kind} server", routes)

    async def openapi(request: web.Request, _body: None) -> web.Response:
        return web.json_response(doc())

    # Metrics and spans (participants.observability): phases and calls wrapped, GET /metrics added.
    routes = observe(app, [*plane.routes(), *participant.routes(),
                           Route("GET", OPENAPI_PATH, openapi, None, None, (), "any", name="openapi")],
                     participant, plane.phases)
    app.add_routes([r.mount() for r in routes])

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(plane.watch_lease())
        yield
        task.cancel()

    async def stop(app: web.Application) -> None:
        await participant.stop()

    async def close(app: web.Application) -> None:
        await participant.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(stop)
    app.on_cleanup.append(close)
    return app


__all__ = ["PARTICIPANT", "Participant", "TaskBody", "ControlPlane", "build_app", "identity", "data_path", "error_response", "PrepareReport",
           "Execution", "CONTROL", "OPENAPI_PATH", "Body", "Empty", "Route", "Credentials", "Identifier", "AttemptIndex", "Int64"]
