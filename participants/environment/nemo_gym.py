"""NeMo Gym's episode protocol on rollbook's environment server: `POST /run` (0.7.0).

The request and response models and the rules that read them are in participants.base.nemo_gym_rows;
the caller's attempt numbering maps onto rollbook's by `engine.retry`. The route is a data-plane
route behind the guard (participants.base.guard): the data credential, as a bearer token or, since
NeMo Gym's client can set an address but no header, as the password of HTTP Basic
(`http://rollbook:<data credential>@host:port` in NeMo Gym's config). The environment a task names
must be one this deployment serves (the sandbox only when configured).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from adapters.openai_wire import responses_object
from engine import catalog as ev
from engine import episodes, retry
from engine.boundaries import completed_activations
from engine.errors import Forbidden, ParticipantUnavailable, StaleAttempt, TaskConflict
from engine.events import RecordedEvent
from engine.lineage import effective_history
from participants.base.guard import Route
from participants.base.http_errors import json_reply
from participants.base.nemo_gym_rows import (
    EpisodeFailure,
    EpisodeRequest,
    EpisodeResponse,
    FailureStage,
    aggregate_route,
    scoped_rollout_id,
    task_for,
)
from participants.environment.server import EnvironmentParticipant
from participants.environments import Task

STAGE_OF_STEP: dict[str, FailureStage] = {"seed": "seed", "agent": "agent", "verify": "verification", "close": "cleanup"}
# What an episode's answer is read from (`_finished`, `_result`): its steps (the reward, their names) and its
# agent's boundaries and completed activations (the reply); the rest of the episode's history is not read.
RESULT_KINDS = (ev.EPISODE_STEP, ev.AGENT_BOUNDARY, ev.ACTIVATION_COMPLETED)
JOIN_WAIT_S = 10.0  # a join is one append; past this the instance is not coming, and the row fails as before


def _check_same_task(req: EpisodeRequest, rid: str, task: Task, events: list[RecordedEvent],
                     recorded: dict[str, Any] | None) -> None:
    """Checked before anything is answered: another task's result is never handed out under this id."""
    started = next((e for e in events if e.kind == ev.EPISODE_STARTED), None)
    if started is not None and started.data.get("task") != task.to_json():
        raise TaskConflict(f"rollout {req.episode_id.rollout_id} of taskset {req.task.task_id.taskset!r} "
                           "was recorded with a different task", rollout_id=rid)
    if events and recorded is None:
        raise TaskConflict(f"rollout {rid} was not started through NeMo Gym's /run", rollout_id=rid)

def _gym_record(events: list[RecordedEvent]) -> dict[str, Any] | None:
    """The caller identity most recently recorded for a rollout (on episode_started / _continued)."""
    return next((e.data["gym"] for e in reversed(events)
                 if e.kind in (ev.EPISODE_STARTED, ev.EPISODE_CONTINUED) and isinstance(e.data.get("gym"), dict)), None)


class EnvironmentFront:
    """NeMo Gym's episode protocol on one environment participant."""

    def __init__(self, p: EnvironmentParticipant) -> None:
        self.p = p

    def routes(self) -> list[Route]:
        return [Route("POST", "/run", self.run, EpisodeRequest, EpisodeResponse,
                      (TaskConflict, Forbidden, ParticipantUnavailable), basic=True, name="gym_episode"),
                aggregate_route()]

    async def run(self, request: web.Request, req: EpisodeRequest) -> web.Response:
        reply = await self.episode(req)
        return json_reply(reply.model_dump(mode="json", exclude_none=True))

    async def episode(self, req: EpisodeRequest) -> EpisodeResponse:
        rid = scoped_rollout_id(req.task.task_id.taskset, req.episode_id.rollout_id)
        task = task_for(req.task.task_id, req.task.task_input)
        p = self.p
        p.admit_task(task)  # known, enabled here, and its params fit: refused before anything is written
        async with p.locks(rid):
            events = await p.store.read_rollout(rid)
            recorded = _gym_record(events)
            _check_same_task(req, rid, task, events, recorded)
            finished = await self._finished(rid) if events else None  # a rollout the log has not seen has no result
            if finished is not None:
                return self._result(req, rid, finished)
            decision = retry.decide(rid, req.episode_id.attempt, None if recorded is None else recorded["attempt"],
                                    finished=False)
            if decision != "join" and p.admission.joining:
                # Gym's collector records a refused row as failed and moves on, so a /run that reaches a
                # fresh instance before it is in the log waits out the join instead of being refused.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.admission.wait_open(), JOIN_WAIT_S)
            if decision != "join" and not p.admission_open:
                return _failure(req, "a checkpoint is in progress; new work waits for resume",
                                "rollbook:admission_closed", "admission")
            running = await self._running(rid, req, task, decision, unseen=not events)
        return await self._outcome(req, rid, running)

    async def _running(self, rid: str, req: EpisodeRequest, task: Task, decision: str, unseen: bool) -> asyncio.Task[Any]:
        """The episode task this request waits for, through the participant's lifecycle: for a newer
        caller attempt a takeover; else the rollout's episode, started, joined, or (where this process
        does not run it: it crashed, or another took over) continued from where the log leaves it.
        `unseen`: the log held nothing of the rollout when read under its lock."""
        ti = req.task.task_input
        if decision == "takeover":
            return await self.p.continue_episode(rid, task, ti.seed, ti.max_steps, gym=self._gym(req),
                                                 reason=f"caller attempt {req.episode_id.attempt}")
        # Only a start records the caller; a join names it already.
        return await self.p.run_episode(rid, task, ti.seed, ti.max_steps,
                                        gym=self._gym(req) if decision == "start" else None, unseen=unseen)

    async def _outcome(self, req: EpisodeRequest, rid: str, running: asyncio.Task[Any]) -> EpisodeResponse:
        try:
            ran = await asyncio.shield(running)
        except asyncio.CancelledError:
            if not running.cancelled():
                raise  # the caller went away; the episode goes on without it
            return _failure(req, "superseded by a newer attempt of the same rollout", "rollbook:superseded", None)
        except StaleAttempt as exc:
            return _failure(req, exc.detail, "rollbook:stale_attempt", None)
        except Exception as exc:  # noqa: BLE001 - every failure of the episode is the caller's to see, not a 500
            ep = self.p.episodes.get(rid)
            stage = STAGE_OF_STEP.get(ep.step or "") if ep is not None else None
            return _failure(req, f"{type(exc).__name__}: {exc}", "rollbook:episode_failed", stage)
        done = await self._finished(rid, ran["attempt"])
        if done is None:  # finished in memory but not in the log: cannot happen, the close step appends both
            return _failure(req, "the episode ended without a recorded result", "rollbook:episode_failed", "cleanup")
        return self._result(req, rid, done)

    async def _finished(self, rid: str, ran: int | None = None) -> dict[str, Any] | None:
        """The rollout's answer from its finished attempt (None: none finished). `ran`: the attempt the
        episode just finished here, whose own `attempt_finished` is then the log's word (no attempt
        rows are read)."""
        attempt = ran
        if attempt is None:
            rows = await self.p.store.attempt_rows([rid])
            attempt = max((a for (_, a), row in rows.items() if row["status"] == "finished"), default=None)
            if attempt is None:
                return None
        history = await effective_history(self.p.store, rid, attempt, kinds=(*RESULT_KINDS, ev.ATTEMPT_FINISHED))
        if ran is not None and not any(e.kind == ev.ATTEMPT_FINISHED and e.attempt == ran for e in history):
            return None
        # The reward its verify step recorded, the one every copy of it derives from.
        return {"attempt": attempt, "reward": episodes.reward(episodes.recorded_steps(history)), "history": history}

    def _result(self, req: EpisodeRequest, rid: str, done: dict[str, Any]) -> EpisodeResponse:
        history: list[RecordedEvent] = done["history"]
        replies = completed_activations(history)
        reply = replies[max(replies)] if replies else {}
        started = next((e for e in history if e.kind == ev.ATTEMPT_STARTED), None)
        created = started.recorded_at.timestamp() if started is not None and started.recorded_at else time.time()
        result = {
            "reward": done["reward"],
            "response": responses_object(rid, list(reply.get("messages") or []), dict(reply.get("usage") or {}), created),
            "rollbook": {"rollout_id": rid, "attempt": done["attempt"],
                         "steps": [e.data["step"] for e in history if e.kind == ev.EPISODE_STEP]},
        }
        return EpisodeResponse(episode_id=req.episode_id, task_id=req.task.task_id, result=result)

    def _gym(self, req: EpisodeRequest) -> dict[str, Any]:
        return {"rollout_id": req.episode_id.rollout_id, "attempt": req.episode_id.attempt,
                "taskset": req.task.task_id.taskset, "task_id": req.task.task_id.task_id}


def _failure(req: EpisodeRequest, reason: str, kind: str, stage: FailureStage | None) -> EpisodeResponse:
    return EpisodeResponse(episode_id=req.episode_id, task_id=req.task.task_id,
                           failure=EpisodeFailure(failure_reason=reason[:2000], terminal=False, failure_kind=kind,
                                                  stage=stage))


__all__ = ["EnvironmentFront"]
