"""NeMo Gym's wire format (0.7.0): the episode and flat-row models and the rules that read them.

The environment server's `POST /run` speaks NeMo Gym's episode protocol (`nemo_gym/episode_types.py`):
the request `{episode_id: {rollout_id, attempt}, task: {task_id: {taskset, task_id}, task_input}}`
and the response `{episode_id, task_id, result | failure}`, every model `extra="forbid"` as there.
`task_input` selects a rollbook environment (`GymTaskInput`). The rollout is recorded under a
rollbook rollout id scoped by its taskset (`scoped_rollout_id`), so `0-0` of two tasksets are two
rollouts.

The agent server's `POST /run` takes the flat rows NeMo Gym's `legacy_agent` relays
(`responses_create_params`, `agent_ref`, `_ng_task_index`, `_ng_rollout_index`, ...); a row becomes an
episode request (`flat_row_task`, the per-row rule). Both servers answer `POST /aggregate_metrics`.

The fronts that serve these routes live beside their servers (participants.environment.nemo_gym,
participants.agent.nemo_gym); this module is what they share, and knows no server.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from engine.errors import InvalidRequest, RolloutIdRequired
from engine.identity import MAX_ID_LENGTH
from participants.base.guard import Route
from participants.base.http_errors import json_reply
from participants.environments import Task, ToolError, get_environment
from participants.environments.base import canonical
from participants.environments.tasks import make_task

FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
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
    `agent` names a `[nemo_gym_agent.<name>]` to run it (docs/agents.md); absent, rollbook's own.
    """

    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1)
    prompt: str | None = None
    params: dict[str, Any] | None = None
    generate: int | None = Field(default=None, ge=0)
    seed: int = Field(default=0, ge=0)
    max_steps: int = Field(default=16, ge=1, le=1000)
    agent: str | None = Field(default=None, pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")

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
        return Task(task_input.env, task_id.task_id, generated.prompt, generated.params, agent=task_input.agent)
    return Task(task_input.env, task_id.task_id, task_input.prompt or "", dict(task_input.params or {}),
                agent=task_input.agent)


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


def flat_row_rollout_id(row: dict[str, Any]) -> str | None:
    """A flat row's rollout id as NeMo Gym spells it: `_ng_rollout_id`, else
    `<_ng_task_index>-<_ng_rollout_index>`; None when it has neither."""
    rid = row.get("_ng_rollout_id")
    if isinstance(rid, str):
        return rid
    if "_ng_task_index" not in row or "_ng_rollout_index" not in row:
        return None
    return f"{row['_ng_task_index']}-{row['_ng_rollout_index']}"


def flat_row_episode(row: dict[str, Any]) -> dict[str, Any]:
    """The episode request a flat row stands for, as JSON an `EpisodeRequest` validates (checked here,
    so a bad row is refused by the server it came to): its rollout id (flat_row_rollout_id), its attempt
    `_ng_attempt_index`."""
    rid = flat_row_rollout_id(row)
    if rid is None:
        raise RolloutIdRequired("a flat row needs _ng_rollout_id, or _ng_task_index and _ng_rollout_index")
    task_id, task_input = flat_row_task(row)
    episode = {"episode_id": {"rollout_id": rid, "attempt": row.get("_ng_attempt_index", 0)},
               "task": {"task_id": task_id.model_dump(), "task_input": task_input.model_dump(exclude_none=True)}}
    EpisodeRequest.model_validate(episode)
    return episode


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
    return json_reply(aggregate(body.verify_responses))


def aggregate_route() -> Route:
    return Route("POST", "/aggregate_metrics", aggregate_metrics, AggregateMetricsRequest, AggregateMetricsReply,
                 basic=True, name="gym_aggregate_metrics")
