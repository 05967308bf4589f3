"""The environment server: its participant, with the routes and the control operations around the
episode lifecycle (participants/environment/lifecycle.py).

`POST /episodes` runs a rollout's episode through the lifecycle and answers when it is done; a
finished rollout is answered from the log. Prepare does not wait for a step in progress: the cut
takes the episode's latest boundary at or below P, and a restore does the step again on the state
rebuilt there. Only a `wait` verification is waited for, since its answer may not be asked for
twice. A restore stages each scoped episode at its boundary and resume continues it under its new
attempt. A fork (engine/forks.py) is recorded in one append and driven like a dispatched rollout.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from aiohttp import web
from pydantic import BaseModel, Field

from adapters.http_client import CONTROL
from engine import catalog as ev
from engine.admission import drain
from engine.capability import capability
from engine.checkpoint import Cut, ParticipantStore, read_cut
from engine.errors import (
    AdmissionClosed,
    Forbidden,
    InvalidIdentifier,
    InvalidJson,
    InvalidRequest,
    NotABoundary,
    NotFound,
    ParticipantUnavailable,
    RequestConflict,
    RestartOnlyBoundary,
    StaleAttempt,
    ToolCallRefused,
    UnknownRollout,
    VersionConflict,
)
from engine.forks import MAX_FORKS, ForkPlan, Origin, plan_forks
from engine.identity import Key, episode_stream, rollout_stream, validate_id
from engine.install import restored_attempt
from engine.lineage import effective_history
from participants.base.guard import Body, Identifier, Int64, Route
from participants.base.http_errors import json_reply
from participants.base.owners import CLAIM_TRIES, FIRST_POLL_S, LAST_POLL_S
from participants.base.participant import PrepareReport
from participants.base.routing import EPISODE_ATTEMPT
from participants.base.wire import TaskBody
from participants.environment.episode import Episode, episode_from_history, replayable_verify, same_task
from participants.environment.lifecycle import STEPS, EpisodeLifecycle
from participants.environments import Task, enabled_environments


class EpisodeRequest(Body):
    rollout_id: Identifier
    task: TaskBody
    seed: Int64 = 0
    max_steps: int = Field(default=16, ge=1, le=1000)


class ForkRequest(Body):
    rollout_id: Identifier
    attempt: int = Field(ge=0, le=2**31 - 1)
    position: int = Field(ge=1, le=2**63 - 1, description="the log position of the boundary to fork from")
    count: int = Field(ge=1, le=MAX_FORKS, description="how many rollouts to start")
    group: Identifier | None = Field(default=None, description=(
        "the fork group; fork i is rollout GROUP.i (default ROLLOUT.fPOSITION: asking again names the same forks)"))
    seed: Int64 | None = Field(default=None, description="fork i samples with seed + i (default: one from its id)")


class ForkedRollout(BaseModel):
    rollout_id: str
    index: int
    seed: int


class ForkReply(BaseModel):
    origin_rollout_id: str
    origin_attempt: int
    origin_position: int
    group: str
    existing: bool = Field(description="true: the group already held these forks and nothing was written")
    forks: list[ForkedRollout]
    launched: int = Field(description="forks this server started driving now (the others run or have finished)")


class EpisodeResult(BaseModel):
    rollout_id: str
    attempt: int
    reward: float | None
    steps: list[str]


class EpisodeStatus(BaseModel):
    status: str
    attempt: int
    reward: float | None
    step: str | None = None
    steps: list[str] | None = None
    error: str | None = None
    capability: str | None = Field(default=None, description=(
        "the current attempt's capability (engine.capability): it opens that attempt's data routes and "
        "nothing else, so a client that drives this rollout alone (an OpenAI SDK on the model server's "
        "/rollouts/{rollout_id}/attempts/{attempt}/v1) need not hold the data credential"))


class EnvironmentParticipant(EpisodeLifecycle):
    kind: ClassVar[str] = "environment"
    concurrency: ClassVar[str] = "steps serialized per episode; control operations serialized"

    def __init__(self, store: ParticipantStore, instance: str, data_token: str | None, agent_url: str,
                 resources_url: str, environments: frozenset[str] = enabled_environments(sandbox=False)) -> None:
        super().__init__(store, instance, data_token, agent_url, resources_url, environments)
        self.staged: dict[str, Episode] = {}
        self.staged_from: str | None = None

    # ---- data plane ---------------------------------------------------------------------------

    def _check_task(self, body: TaskBody) -> Task:
        """Everything about the task that can be refused is refused here, before any event."""
        return self.admit_task(body.task())

    async def start_episode(self, request: web.Request, req: EpisodeRequest) -> web.Response:
        rid = req.rollout_id
        requested = self._check_task(req.task)
        async with self.locks(rid):
            task = self.tasks.get(rid)
            running = self.episodes.get(rid)
            if task is not None and not task.done() and running is not None and running.task != requested:
                raise RequestConflict(f"rollout {rid} is running another task; a rollout id names one task")
            tries = 0
            while task is None or task.done():
                rows = await self._held_elsewhere(rid)  # the rollout's attempts, read once for the questions below
                done = await self._from_log(rid, requested, rows)
                if done is not None:
                    return json_reply(done)  # already finished: its result, never a second run
                self.admission.require_open("a new episode")
                try:
                    task = await self.run_episode(rid, requested, req.seed, req.max_steps, rows=rows)
                except VersionConflict:
                    tries += 1  # another instance claimed it first: wait for its result instead
                    if tries == CLAIM_TRIES:
                        raise
        return json_reply(await asyncio.shield(task))

    async def _held_elsewhere(self, rid: str) -> dict[Key, dict[str, Any]]:
        """Wait while another live instance drives the rollout's live episode (engine/ownership.py); its
        outcome or death ends the wait, and the log then says what is left to run here. Its last read."""
        delay = FIRST_POLL_S
        while True:
            rows = await self.store.attempt_rows([rid])
            if not rows or rows[(rid, attempt := max(a for _, a in rows))]["status"] != "live":
                return rows
            if not await self._claimed_elsewhere(await self.store.read_stream(episode_stream(rid, attempt))):
                return rows
            await asyncio.sleep(delay)
            delay = min(delay * 2, LAST_POLL_S)

    async def _from_log(self, rid: str, requested: Task, rows: dict[Key, dict[str, Any]]) -> dict[str, Any] | None:
        if not rows:
            return None
        attempt = max(a for _, a in rows)
        if rows[(rid, attempt)]["status"] != "finished":
            return None
        history = await effective_history(self.store, rid, attempt)
        ep = episode_from_history(rid, attempt, history, history)
        same_task(rid, ep, requested)
        if ep is None:
            return {"rollout_id": rid, "attempt": attempt, "reward": rows[(rid, attempt)]["reward"], "steps": []}
        return ep.result()

    async def episode_status(self, request: web.Request, _body: None) -> web.Response:
        rid = validate_id(request.match_info["rollout_id"], "rollout id")
        ep = self.episodes.get(rid)
        if ep is not None:
            return json_reply({**ep.status_json(), **self._capability(rid, ep.attempt)})
        rows = await self.store.attempt_rows([rid])
        if not rows:
            raise NotFound(f"no episode for rollout {rid}")
        attempt = max(a for _, a in rows)
        row = rows[(rid, attempt)]
        status = {"finished": "finished", "live": "not_running"}.get(row["status"], row["status"])
        body = {"status": status, "attempt": attempt, "reward": row["reward"]}
        if status == "finished":  # as the episode said it in memory: the steps it ran, its verify step's reward
            history = await effective_history(self.store, rid, attempt)
            ep = episode_from_history(rid, attempt, history, history)
            if ep is not None:
                body = {**ep.status_json(), "status": status, "attempt": attempt}
        return json_reply({**body, **self._capability(rid, attempt)})

    def _capability(self, rollout_id: str, attempt: int) -> dict[str, str]:
        return {"capability": capability(self.secret, rollout_id, attempt)} if self.secret else {}

    def in_flight(self) -> int:
        return sum(1 for task in self.tasks.values() if not task.done())

    # ---- forks (engine/forks.py) ----------------------------------------------------------------

    async def fork(self, request: web.Request, req: ForkRequest) -> web.Response:
        """Record the forks (one append, or nothing when any is refused) and drive each like a dispatched
        rollout. Asked again with the same group, it writes nothing and drives the forks that are
        neither finished nor running here (after this server restarted, say)."""
        self.admission.require_open("a fork")
        async with self.locks(f"fork:{req.rollout_id}"):
            plan = await self._fork_plan(req)
            if not plan.existing:
                await self.store.append(plan.request())
            launched = 0
            for f in plan.forks:
                launched += await self._drive_fork(f.rollout_id)
        return json_reply({**plan.to_json(), "launched": launched})

    async def _fork_plan(self, req: ForkRequest) -> ForkPlan:
        origin = Origin(req.rollout_id, req.attempt, req.position)
        started = await self.store.attempt_rows([req.rollout_id])
        known = (req.rollout_id, req.attempt) in started
        own = await self.store.read_rollout(req.rollout_id, req.attempt) if known else []
        prefix = await effective_history(self.store, req.rollout_id, req.attempt, to=req.position) if known else []
        kw: dict[str, Any] = {"started": started, "own": own, "prefix": prefix, "group": req.group, "seed": req.seed}
        plan = plan_forks(origin, req.count, **kw)
        rows = await self.store.attempt_rows([f.rollout_id for f in plan.forks])
        if not rows:
            return plan
        taken: dict[str, dict[str, Any] | None] = {}
        for rid in sorted({r for r, _ in rows}):
            forked = [e for e in await self.store.read_stream(rollout_stream(rid)) if e.kind == ev.ROLLOUT_FORKED]
            taken[rid] = dict(forked[0].data) if forked else None
        return plan_forks(origin, req.count, taken=taken, **kw)

    async def _drive_fork(self, rid: str) -> int:
        """Drive fork `rid` here unless it has finished or is running; 1 when it was launched."""
        async with self.locks(rid):
            task = self.tasks.get(rid)
            if task is not None and not task.done():
                return 0
            rows = await self.store.attempt_rows([rid])
            attempt = max(a for _, a in rows)
            if rows[(rid, attempt)]["status"] != "live":
                return 0
            history = await effective_history(self.store, rid, attempt)
            ep = episode_from_history(rid, attempt, history, history)
            if ep is None:
                raise InvalidRequest(f"fork {rid} has no episode input in its lineage")
            self._launch(ep)
            return 1

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/episodes", self.start_episode, EpisodeRequest, EpisodeResult,
                  (Forbidden, RequestConflict, AdmissionClosed, StaleAttempt, ToolCallRefused, ParticipantUnavailable)),
            Route("GET", "/episodes/{rollout_id}", self.episode_status, None, EpisodeStatus, (NotFound,)),
            Route("POST", f"{CONTROL}/fork", self.fork, ForkRequest, ForkReply,
                  (InvalidRequest, InvalidJson, InvalidIdentifier, UnknownRollout, NotABoundary, RestartOnlyBoundary, RequestConflict, AdmissionClosed, StaleAttempt), "control"),
        ]

    # ---- control plane hooks --------------------------------------------------------------------

    def _live(self) -> list[Episode]:
        return [ep for rid, ep in self.episodes.items() if ep.status not in ("finished", "failed")
                and rid in self.tasks and not self.tasks[rid].done()]

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        await super().prepare(checkpoint_id, deadline)
        # A step in progress is no blocker: what it does lands in the log after the episode's latest
        # boundary, and a restore of the cut does it again from there. A `wait` verification is the
        # exception: its environment says its answer may not be asked for twice.
        blockers = await drain(lambda: [ep for ep in self._live() if ep.status != "parked" and ep.step == "verify"
                                        and not replayable_verify(ep)], deadline)
        live = self._live()
        return PrepareReport(
            ready=not blockers,
            blockers=[f"{ep.rollout_id}:{ep.attempt} in step {ep.step}" for ep in blockers],
            counts={"episodes": len(live), "parked": sum(1 for ep in live if ep.status == "parked"),
                    "in_agent": sum(1 for ep in live if ep.status != "parked" and ep.step == "agent"),
                    "in_step": sum(1 for ep in live if ep.status != "parked" and ep.step not in (None, "agent"))},
        )

    async def restore(self, cut: Cut) -> dict[str, Any]:
        """Stage every scoped episode at its boundary; it runs again only at resume."""
        staged: dict[str, Episode] = {}
        # One read for the whole scope; past P too, since an episode's input may land after its first boundary.
        read = await read_cut(self.store, cut, rehash=False, beyond_cut=True)
        for entry in cut.scope:
            upto = read.effective(entry.rollout_id, entry.attempt, to=entry.boundary)
            inputs = read.effective(entry.rollout_id, entry.attempt)
            ep = episode_from_history(entry.rollout_id, entry.attempt, inputs, upto)
            if ep is not None and ep.recorded("close") is None:
                staged[entry.rollout_id] = ep
        self.staged, self.staged_from = staged, cut.checkpoint_id
        return {"staged": len(staged)}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        continued = 0
        if restored and self.staged_from == checkpoint_id and self.staged:
            rows = await self.store.attempt_rows(sorted(self.staged))
            for rid, ep in self.staged.items():
                target = restored_attempt(rows, rid, ep.attempt, checkpoint_id)
                # Every live environment worker staged the cut; only the one the rollout's dispatch routes to
                # continues it, so it runs once.
                if target is None or not await self.routed_here(rid, EPISODE_ATTEMPT):
                    continue
                continued += await self._continue_restored(ep, target, checkpoint_id)
            self.staged, self.staged_from = {}, None
        await super().resume(checkpoint_id, restored)
        return {"continued": continued}

    async def retire(self, rollout_id: str, through: int) -> None:
        ep, task = self.episodes.get(rollout_id), self.tasks.get(rollout_id)
        if ep is not None and ep.attempt <= through and task is not None and not task.done():
            task.cancel()
        staged = self.staged.get(rollout_id)
        if staged is not None and staged.attempt <= through:
            del self.staged[rollout_id]

    async def forget(self, rollout_id: str) -> None:
        task = self.tasks.get(rollout_id)
        if task is None or task.done():
            self.episodes.pop(rollout_id, None)
            self.tasks.pop(rollout_id, None)

    async def close(self) -> None:
        await self.client.close()

    async def stop(self) -> None:
        running = [t for t in self.tasks.values() if not t.done()]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)


__all__ = ["STEPS", "EnvironmentParticipant", "Episode", "EpisodeRequest"]
