"""NeMo Gym's wire format (0.7.0), spoken by rollbook's environment and agent servers.

Environment server, `POST /run`: NeMo Gym's episode protocol (`nemo_gym/episode_types.py`), the
request `{episode_id: {rollout_id, attempt}, task: {task_id: {taskset, task_id}, task_input}}` and
the response `{episode_id, task_id, result | failure}`, every model `extra="forbid"` as there.
`task_input` selects a rollbook environment (`GymTaskInput`). The rollout is recorded under a
rollbook rollout id scoped by its taskset (`scoped_rollout_id`), so `0-0` of two tasksets are two
rollouts; the caller's attempt numbering maps onto rollbook's by `engine.retry`.

Agent server, `POST /run`: the flat rows NeMo Gym's `legacy_agent` environment server relays
(`responses_create_params`, `agent_ref`, `_ng_task_index`, `_ng_rollout_index`, ...). The row becomes
an episode request (`flat_row_task`, the per-row rule) and is answered with the row's fields plus a
Responses-API `response` and a `reward`, like a NeMo Gym agent's verify response.

Both servers answer `POST /aggregate_metrics` (NeMo Gym's `AggregateMetrics`), which the collector
calls at the end of a collection.

Every one of these routes is a data-plane route behind the guard (participants.guard): the data
credential, as a bearer token or, since NeMo Gym's client can set an address but no header, as the
password of HTTP Basic (`http://rollbook:<data credential>@host:port` in NeMo Gym's config). The
bodies are parsed by the models below before anything runs, and the environment a task names must
be one this deployment serves (the sandbox only when configured). The fronts are mounted beside each
server's own routes by whoever builds its app (participants.servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections import defaultdict
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from engine import catalog as ev
from engine import retry
from engine.boundaries import completed_activations
from engine.checkpoint import effective_history
from engine.errors import (
    EpisodeFailed,
    Forbidden,
    InvalidRequest,
    ParticipantUnavailable,
    RolloutIdRequired,
    StaleAttempt,
    TaskConflict,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import MAX_ID_LENGTH, episode_stream, rollout_stream
from participants.agent_server import AgentParticipant
from participants.environment_server import STEPS, EnvironmentParticipant, Episode
from participants.environments import Task, ToolError, get_environment
from participants.environments.base import canonical
from participants.environments.tasks import make_task
from participants.guard import Route

FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]
STAGE_OF_STEP: dict[str, FailureStage] = {"seed": "seed", "agent": "agent", "verify": "verification", "close": "cleanup"}
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
JOIN_WAIT_S = 10.0  # a join is one append; past this the instance is not coming, and the row fails as before
TASKSET_SLUG_LENGTH = 40
TASKSET_HASH_LENGTH = 12


# ---- the 0.7.0 models -------------------------------------------------------------------------


class EpisodeId(BaseModel):
    """One physical attempt of a logical rollout (nemo_gym.episode_types.EpisodeId)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1, pattern=ROLLOUT_ID_PATTERN)
    attempt: int = Field(default=0, ge=0)

    @field_validator("rollout_id")
    @classmethod
    def reserve_attempt_suffix(cls, rollout_id: str) -> str:
        # NeMo Gym derives `<rollout_id>-a<N>` capture keys; an id ending so would collide with one.
        if re.search(r"-a[1-9][0-9]*$", rollout_id):
            raise ValueError("rollout_id must not end with the reserved attempt suffix '-a<N>'")
        return rollout_id


class TaskId(BaseModel):
    """One task within a run-qualified taskset (nemo_gym.episode_types.TaskId)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


class GymTaskInput(BaseModel):
    """rollbook's `task_input`: which environment, and either an explicit task or a generated one.

    `{"env": "math", "prompt": "What is 2 + 3?", "params": {"expression": "2 + 3", "answer": 5}}` runs
    that task; `{"env": "blackjack", "generate": 6}` runs the environment's own task generated from
    seed 6. `seed` is the episode seed handed to the agent and model, `max_steps` caps its turns.
    """

    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1)
    prompt: str | None = None
    params: dict[str, Any] | None = None
    generate: int | None = Field(default=None, ge=0)
    seed: int = Field(default=0, ge=0)
    max_steps: int = Field(default=16, ge=1, le=1000)

    @model_validator(mode="after")
    def one_task(self) -> GymTaskInput:
        if (self.prompt is None) == (self.generate is None):
            raise ValueError("give exactly one of prompt (with params) or generate (a task generator seed)")
        if self.generate is not None and self.params is not None:
            raise ValueError("params go with prompt; a generated task makes its own")
        return self


class MaterializedTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: TaskId
    task_input: GymTaskInput


class EpisodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    task: MaterializedTask


class EpisodeFailure(BaseModel):
    """A handled failure (nemo_gym.episode_types.EpisodeFailure); kind and stage are omitted when None."""

    model_config = ConfigDict(extra="forbid")

    failure_reason: str = Field(max_length=2000)
    terminal: bool
    failure_kind: str | None = None
    stage: FailureStage | None = None

    @model_serializer(mode="wrap")
    def _omit_unknown(self, handler: Any) -> Any:
        out = handler(self)
        for key in ("failure_kind", "stage"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class EpisodeResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    task_id: TaskId
    result: dict[str, Any] | None = None
    failure: EpisodeFailure | None = None

    @model_validator(mode="after")
    def exactly_one(self) -> EpisodeResponse:
        if (self.result is None) == (self.failure is None):
            raise ValueError("exactly one of result or failure is required")
        return self


class AggregateMetricsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verify_responses: list[dict[str, Any]]


class AggregateMetricsReply(BaseModel):
    """What rollbook fills of NeMo Gym's AggregateMetrics."""

    agent_metrics: dict[str, Any]
    key_metrics: dict[str, Any]
    group_level_metrics: list[dict[str, Any]]


class FlatRow(BaseModel):
    """A flat NeMo Gym row as legacy_agent relays it: these fields, and any others, which come back as sent.

    `rollbook` (a `GymTaskInput`) or `expected_answer` picks the task (`flat_row_task`); the rollout id is
    `_ng_rollout_id`, else `<_ng_task_index>-<_ng_rollout_index>`, the caller's attempt `_ng_attempt_index`."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: dict[str, Any] | None = None
    expected_answer: Any = None
    rollbook: dict[str, Any] | None = None


class FlatRowReply(BaseModel):
    """The row as sent, plus the episode's Responses-API `response`, its `reward` and rollbook's identity."""

    model_config = ConfigDict(extra="allow")

    response: dict[str, Any] | None
    reward: float | None
    rollbook: dict[str, Any] | None


# ---- identity --------------------------------------------------------------------------------


def scoped_rollout_id(taskset: str, rollout_id: str) -> str:
    """rollbook's rollout id of NeMo Gym's (taskset, rollout_id): `<slug>.<hash>.<rollout_id>`.

    `slug` is the taskset with every character outside [A-Za-z0-9_-] made `_` (cut to 40), `hash`
    the first 12 hex digits of its SHA-256. The slug holds no `.` and the hash has a fixed length, so
    the id splits back into exactly one (taskset hash, rollout id) pair: two tasksets never share a
    rollout, whatever their rollout ids."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", taskset)[:TASKSET_SLUG_LENGTH]
    if not slug[:1].isalnum():
        slug = "t" + slug[: TASKSET_SLUG_LENGTH - 1]
    digest = hashlib.sha256(taskset.encode()).hexdigest()[:TASKSET_HASH_LENGTH]
    scoped = f"{slug}.{digest}.{rollout_id}"
    if len(scoped) > MAX_ID_LENGTH:
        raise InvalidRequest(f"rollout_id {rollout_id[:40]!r} is too long: scoped by its taskset it would be "
                             f"{len(scoped)} characters, over {MAX_ID_LENGTH}")
    return scoped


def task_for(task_id: TaskId, task_input: GymTaskInput) -> Task:
    """The rollbook task a `task_input` names; an unknown environment is a 400 naming it."""
    try:
        get_environment(task_input.env)
    except ToolError as exc:
        raise InvalidRequest(f"task_input.env: {exc.message}") from exc
    if task_input.generate is not None:
        generated = make_task(task_input.env, task_input.generate)
        return Task(task_input.env, task_id.task_id, generated.prompt, generated.params)
    return Task(task_input.env, task_id.task_id, task_input.prompt or "", dict(task_input.params or {}))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def flat_row_task(row: dict[str, Any]) -> tuple[TaskId, GymTaskInput]:
    """The per-row rule that picks the environment of a flat NeMo Gym row, in order:

    1. `row["rollbook"]`, an object of the `task_input` schema (`GymTaskInput`): that task.
    2. `row["expected_answer"]`: `string_match`, the prompt being the last user message of
       `responses_create_params.input` and the reward 1 when the final answer equals it exactly.
    3. Anything else is refused (400 `invalid_request`), naming the row's task index.

    The task's taskset is `flat:<digest>`, the digest (16 hex digits of SHA-256) covering the chosen
    `task_input`: rows with different tasks never share a rollout, whatever their indices."""
    selector = row.get("rollbook")
    if selector is not None:
        if not isinstance(selector, dict):
            raise InvalidRequest(f"row {row.get('_ng_task_index')}: `rollbook` must be an object of the task_input schema")
        task_input = GymTaskInput.model_validate(selector)
    elif "expected_answer" in row:
        params = row.get("responses_create_params")
        raw = params.get("input") if isinstance(params, dict) else None
        if isinstance(raw, str):
            prompt = raw
        else:
            users = [m for m in (raw or []) if isinstance(m, dict) and m.get("role") == "user"]
            prompt = _text_of(users[-1].get("content")) if users else ""
        if not prompt:
            raise InvalidRequest(f"row {row.get('_ng_task_index')}: responses_create_params.input has no user message")
        task_input = GymTaskInput(env="string_match", prompt=prompt, params={"expected": str(row["expected_answer"])})
    else:
        raise InvalidRequest(
            f"row {row.get('_ng_task_index')}: no rule picks its environment; add a `rollbook` object "
            '({"env": ..., "prompt": ..., "params": ...}) or an `expected_answer`')
    digest = hashlib.sha256(canonical(task_input.model_dump(mode="json")).encode()).hexdigest()[:16]
    return TaskId(taskset=f"flat:{digest}", task_id=digest), task_input


def flat_row_episode(row: dict[str, Any]) -> EpisodeRequest:
    """The episode request a flat row stands for: its rollout id as NeMo Gym spells it
    (`_ng_rollout_id`, else `<_ng_task_index>-<_ng_rollout_index>`), its attempt `_ng_attempt_index`."""
    rid = row.get("_ng_rollout_id")
    if not isinstance(rid, str):
        if "_ng_task_index" not in row or "_ng_rollout_index" not in row:
            raise RolloutIdRequired("a flat row needs _ng_rollout_id, or _ng_task_index and _ng_rollout_index")
        rid = f"{row['_ng_task_index']}-{row['_ng_rollout_index']}"
    task_id, task_input = flat_row_task(row)
    return EpisodeRequest.model_validate({
        "episode_id": {"rollout_id": rid, "attempt": row.get("_ng_attempt_index", 0)},
        "task": {"task_id": task_id.model_dump(), "task_input": task_input.model_dump(exclude_none=True)},
    })


# ---- the trajectory as the Responses API shows it ------------------------------------------


def responses_output(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's turns after its input, as Responses-API output items (what NeMo Gym verifiers read)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                out.append({"type": "function_call", "id": f"fc_{tc.get('id')}", "call_id": tc.get("id"),
                            "name": fn.get("name"), "arguments": fn.get("arguments") or "{}", "status": "completed"})
            if m.get("content"):
                out.append({"type": "message", "id": f"msg_{i}", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": m["content"], "annotations": []}]})
        elif role == "tool":
            out.append({"type": "function_call_output", "call_id": m.get("tool_call_id"), "output": m.get("content")})
    return out


def responses_object(rollout_id: str, messages: list[dict[str, Any]], usage: dict[str, Any],
                     created_at: float) -> dict[str, Any]:
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    completion_tokens = int(usage.get("completion_tokens") or 0)
    return {
        "id": f"resp_{rollout_id}", "object": "response", "created_at": int(created_at), "model": "rollbook",
        "status": "completed", "output": responses_output(messages), "parallel_tool_calls": False,
        "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def aggregate(verify_responses: list[dict[str, Any]]) -> dict[str, Any]:
    """NeMo Gym's AggregateMetrics over the rewards: overall, and per task (`_ng_task_index`)."""
    rewards = [float(r["reward"]) for r in verify_responses if isinstance(r.get("reward"), (int, float))]
    by_task: dict[Any, list[float]] = defaultdict(list)
    for r in verify_responses:
        if isinstance(r.get("reward"), (int, float)):
            index = r.get("_ng_task_index")
            # A task index is a number; anything else a caller sends is grouped by its JSON text.
            key = index if isinstance(index, str | int | float) or index is None else canonical(index)
            by_task[key].append(float(r["reward"]))
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    return {
        "agent_metrics": {"mean/reward": mean, "rollouts": len(rewards)},
        "key_metrics": {"mean/reward": mean},
        "group_level_metrics": [{"_ng_task_index": k, "mean/reward": sum(v) / len(v), "rollouts": len(v)}
                                for k, v in by_task.items()],
    }


async def aggregate_metrics(request: web.Request, body: AggregateMetricsRequest) -> web.Response:
    return web.json_response(aggregate(body.verify_responses))


def aggregate_route() -> Route:
    return Route("POST", "/aggregate_metrics", aggregate_metrics, AggregateMetricsRequest, AggregateMetricsReply,
                 basic=True, name="gym_aggregate_metrics")


# ---- the environment server's /run -------------------------------------------------------------



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
        return web.json_response(reply.model_dump(mode="json", exclude_none=True))

    async def episode(self, req: EpisodeRequest) -> EpisodeResponse:
        rid = scoped_rollout_id(req.task.task_id.taskset, req.episode_id.rollout_id)
        task = task_for(req.task.task_id, req.task.task_input)
        p = self.p
        p.admit_task(task)  # known, enabled here, and its params fit: refused before anything is written
        async with p.locks(rid):
            events = await p.store.read_rollout(rid)
            recorded = _gym_record(events)
            _check_same_task(req, rid, task, events, recorded)
            finished = await self._finished(rid)
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
            running = await self._running(rid, req, task, decision)
        return await self._outcome(req, rid, running)

    async def _running(self, rid: str, req: EpisodeRequest, task: Task, decision: str) -> asyncio.Task[Any]:
        """The episode task this request waits for: a new one, a takeover, or the one already running."""
        p = self.p
        running = p.tasks.get(rid)
        if running is not None and running.done():
            running = None
        if decision == "start":
            return p._launch(await self._start(rid, req, task))
        if decision == "takeover":
            if running is not None:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
            return p._launch(await self._take_over(rid, req, task))
        if running is None:
            # Asked again, and this process does not run it (it crashed, or another took over):
            # the live attempt goes on from where the log leaves it.
            return p._launch(await p._open_episode(rid, task, req.task.task_input.seed, req.task.task_input.max_steps))
        return running

    async def _outcome(self, req: EpisodeRequest, rid: str, running: asyncio.Task[Any]) -> EpisodeResponse:
        try:
            await asyncio.shield(running)
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
        done = await self._finished(rid)
        if done is None:  # finished in memory but not in the log: cannot happen, the close step appends both
            return _failure(req, "the episode ended without a recorded result", "rollbook:episode_failed", "cleanup")
        return self._result(req, rid, done)

    async def _finished(self, rid: str) -> dict[str, Any] | None:
        rows = await self.p.store.attempt_rows([rid])
        done = [(a, row) for (_, a), row in rows.items() if row["status"] == "finished"]
        if not done:
            return None
        attempt, row = max(done, key=lambda x: x[0])
        history = await effective_history(self.p.store, rid, attempt)
        return {"attempt": attempt, "reward": row["reward"], "history": history}

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

    def _started(self, rid: str, attempt: int, req: EpisodeRequest, task: Task) -> NewEvent:
        ti = req.task.task_input
        return NewEvent(episode_stream(rid, attempt), ev.EPISODE_STARTED, {
            "env": task.env, "task_id": task.task_id, "task": task.to_json(), "seed": ti.seed,
            "max_steps": ti.max_steps, "status": "running", "gym": self._gym(req)}, rid, attempt)

    async def _start(self, rid: str, req: EpisodeRequest, task: Task) -> Episode:
        # One request: the attempt never exists without its episode's input and its caller's identity.
        await self.p.store.append(AppendRequest((
            NewEvent(rollout_stream(rid), ev.ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),
            self._started(rid, 0, req, task))))
        return Episode(rid, 0, task, req.task.task_input.seed, req.task.task_input.max_steps)

    async def _take_over(self, rid: str, req: EpisodeRequest, task: Task) -> Episode:
        """A newer caller attempt: fence rollbook's current attempt, continue under the next one."""
        store = self.p.store
        rows = await store.attempt_rows([rid])
        current = max(a for _, a in rows)
        history = await effective_history(store, rid, current)
        t = retry.takeover(rid, current, history)
        await store.append(retry.takeover_request(t, f"caller attempt {req.episode_id.attempt}"))
        ti = req.task.task_input
        ep = Episode(rid, t.new_attempt, task, ti.seed, ti.max_steps)
        if t.disposition == "fresh_dispatch":
            await store.append(AppendRequest((self._started(rid, t.new_attempt, req, task),)))
            return ep
        inherited = await effective_history(store, rid, t.new_attempt)
        ep.done = [dict(e.data) for e in inherited if e.kind == ev.EPISODE_STEP]
        nxt = next((s for s in STEPS if ep.recorded(s) is None), None)
        await store.append(AppendRequest((NewEvent(episode_stream(rid, t.new_attempt), ev.EPISODE_CONTINUED, {
            "env": task.env, "task_id": task.task_id, "origin_attempt": current, "next_step": nxt,
            "status": "running", "gym": self._gym(req)}, rid, t.new_attempt),)))
        return ep


def _failure(req: EpisodeRequest, reason: str, kind: str, stage: FailureStage | None) -> EpisodeResponse:
    return EpisodeResponse(episode_id=req.episode_id, task_id=req.task.task_id,
                           failure=EpisodeFailure(failure_reason=reason[:2000], terminal=False, failure_kind=kind,
                                                  stage=stage))


# ---- the agent server's /run (flat rows through legacy_agent) ---------------------------------


class AgentFront:
    """NeMo Gym's legacy agent `/run` on rollbook's agent server: one flat row, one episode."""

    def __init__(self, p: AgentParticipant) -> None:
        self.p = p

    def routes(self) -> list[Route]:
        return [Route("POST", "/run", self.run, FlatRow, FlatRowReply,
                      (RolloutIdRequired, TaskConflict, Forbidden, EpisodeFailed, ParticipantUnavailable),
                      basic=True, name="gym_flat_row"),
                aggregate_route()]

    async def run(self, request: web.Request, body: FlatRow) -> web.Response:
        row = body.model_dump(mode="json", exclude_unset=True)
        if body.responses_create_params is None:
            # Not a NeMo Gym row: rollbook's own agent route needs the identity in its path.
            raise RolloutIdRequired("POST /run takes a NeMo Gym row (responses_create_params, _ng_task_index, "
                                    "_ng_rollout_index); rollbook's own activations go to "
                                    "/rollouts/{rollout_id}/attempts/{attempt}/run")
        episode = flat_row_episode(row)
        if not self.p.environment_url:
            raise InvalidRequest("this agent server has no environment server configured to run NeMo Gym rows")
        reply = await self.p.client.post(f"{self.p.environment_url.rstrip('/')}/run", episode.model_dump(mode="json"))
        out = EpisodeResponse.model_validate(reply)
        if out.failure is not None:
            raise EpisodeFailed(out.failure.failure_reason, failure_kind=out.failure.failure_kind, stage=out.failure.stage)
        result = out.result or {}
        return web.json_response({**row, "response": result.get("response"), "reward": result.get("reward"),
                                  "rollbook": result.get("rollbook")})


__all__ = [
    "AgentFront", "AggregateMetricsReply", "EnvironmentFront", "EpisodeFailure", "EpisodeId", "EpisodeRequest",
    "EpisodeResponse", "FlatRow", "FlatRowReply", "GymTaskInput", "TaskId", "aggregate", "flat_row_episode", "flat_row_task", "responses_output",
    "scoped_rollout_id", "task_for",
]
