"""rollbook's own wire: the paths, headers and bodies the servers and their callers share.

The control plane's requests and replies, a task as the data planes receive it, the error body
every route answers with, and the headers one server sends and another reads (the agent sends
the model's call ids and the resources server's tool call keys; the environment server sends the
agent's activation index). The pydantic models here are the ones `participants.base.guard.read_body`
validates with and the OpenAPI documents (participants.base.openapi) describe.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.http_client import CONTROL, PREFIX
from engine.errors import InvalidIdentifier
from engine.identity import ATTEMPT_PATTERN, parse_attempt, validate_id
from engine.phases import on_this_clock
from participants.base.guard import AttemptIndex, Body, Header, Identifier
from participants.environments import Task

OPENAPI_PATH = f"{PREFIX}/openapi.json"
MAX_ITEMS = 10_000  # rollouts in one retire or forget, executions in one commit scope
# 2100-01-01: a deadline is a wall-clock time, and a larger one only overflows the timers.
MAX_DEADLINE = 4_102_444_800.0

# From the agent to the model server: the call's id (a repeat with the same body gets the same
# reply), the call before it in the rollout, and the calls it continues, newest first.
CALL_ID_HEADER = "X-Rollbook-Call-Id"
PARENT_HEADER = "X-Rollbook-Parent-Call-Id"
REPLACES_HEADER = "X-Rollbook-Replaces-Call-Id"
# From the agent to the resources server: its name for one tool call (activation, turn, index in the
# reply). A call whose mutation the log already holds under this key is answered from the log, never
# applied again.
TOOL_CALL_HEADER = "X-Rollbook-Tool-Call"
# From the environment server to the agent: the activation index, so a repeat is answered from the log;
# from an agent to the model and resources servers, the activation its unnamed calls are numbered in.
ACTIVATION_HEADER = "X-Rollbook-Activation"
NUMBERED_IN = Header(ACTIVATION_HEADER, ATTEMPT_PATTERN, required=False,
                     description="the agent's activation, for calls numbered by the server (default 0)")


def activation_of(request: web.Request) -> int:
    """The activation a call the agent did not name is numbered in (engine.agent_replay)."""
    capture = _capture(request)
    if capture is not None:
        return parse_capture(capture)[2]
    return parse_attempt(request.headers.get(ACTIVATION_HEADER) or "0", f"activation ({ACTIVATION_HEADER})")


# NeMo Gym's agents name their rollout in their model calls' path (`/ng-rollout/<id>/v1/responses`,
# the id taken from the path they were called on) and carry the cookies they were called with to their
# resources server's tools: rollbook gives a NeMo Gym agent's activation one id for both.
NG_ROLLOUT = "/ng-rollout/{capture}"
CAPTURE_COOKIE = "rollbook_activation"


def capture_id(rollout_id: str, attempt: int, activation: int = 0) -> str:
    """The id a NeMo Gym agent carries for one activation of an attempt: `<rollout>.<attempt>.<activation>`."""
    return f"{rollout_id}.{attempt}.{activation}"


def parse_capture(value: object) -> tuple[str, int, int]:
    parts = value.rsplit(".", 2) if isinstance(value, str) else []
    if len(parts) != 3:
        raise InvalidIdentifier(f"{str(value)[:60]!r} is no rollbook activation id (<rollout>.<attempt>.<activation>)")
    return validate_id(parts[0], "rollout id"), parse_attempt(parts[1]), parse_attempt(parts[2], "activation")


def _capture(request: web.Request) -> str | None:
    if "capture" in request.match_info:
        return request.match_info["capture"]
    return None if "rollout_id" in request.match_info else request.cookies.get(CAPTURE_COOKIE)


def identity(request: web.Request) -> tuple[str, int]:
    """Rollout identity from the path prefix /rollouts/{rollout_id}/attempts/{attempt}/, or from the
    activation id a NeMo Gym agent carries (NG_ROLLOUT, CAPTURE_COOKIE)."""
    capture = _capture(request)
    if capture is not None:
        return parse_capture(capture)[:2]
    rollout_id = validate_id(request.match_info.get("rollout_id"), "rollout id")
    return rollout_id, parse_attempt(request.match_info.get("attempt"))


def data_path(suffix: str) -> str:
    return "/rollouts/{rollout_id}/attempts/{attempt}" + suffix


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
    agent: Identifier | None = Field(default=None, description=(
        "the agent that runs the task: a `[nemo_gym_agent.<name>]` of the agent server; absent: rollbook's own"))

    @field_validator("sampling")
    @classmethod
    def _known_sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(TASK_SAMPLING))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {list(TASK_SAMPLING)}")
        return value

    def task(self) -> Task:
        """The task, its params as validated (a NeMo Gym row's are most of its bytes): a dump through
        pydantic would walk every value typed Any once more, per server."""
        return Task(self.env, self.task_id, self.prompt, dict(self.params), dict(self.sampling), self.agent)


class ControlRequest(Body):
    checkpoint_id: Identifier
    deadline: float = Field(gt=0, le=MAX_DEADLINE, description="absolute deadline, seconds since the Unix epoch")
    sent_at: float | None = Field(default=None, gt=0, le=MAX_DEADLINE, description=(
        "the sender's clock when it sent this: the deadline is then judged as the span between the two, "
        "from receipt, on the receiver's clock (hosts' clocks disagree)"))

    @model_validator(mode="after")
    def _on_this_clock(self) -> ControlRequest:
        if self.sent_at is not None:
            self.deadline, self.sent_at = min(on_this_clock(self.deadline, self.sent_at, time.time()), MAX_DEADLINE), None
        return self


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


class PolicyVersionRequest(BaseModel):
    """The model server's policy version, set by a trainer's weight sync."""

    model_config = ConfigDict(extra="forbid")
    policy_version: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$")
    source: str = Field(default="weight_sync", max_length=64)


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
    # Recorded in the log as a member of the deployment (engine/membership.py); until then it admits nothing.
    joined: bool = True


class PreparedEvent(BaseModel):
    """An event a prepare hands over: the coordinator appends it, under `key`, with
    `checkpoint_prepared` (engine.prepare_records)."""

    key: str
    stream: str
    kind: str
    data: dict[str, Any]
    rollout_id: str | None
    attempt: int | None


class PrepareReply(BaseModel):
    checkpoint_id: str
    phase: str
    ready: bool
    blockers: list[str]
    blocker_count: int
    counts: dict[str, int]
    restarts: list[Execution]
    records: list[PreparedEvent] = Field(default_factory=list)


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


__all__ = [
    "ACTIVATION_HEADER", "CALL_ID_HEADER", "CONTROL", "OPENAPI_PATH", "PARENT_HEADER", "PREFIX", "REPLACES_HEADER",
    "TOOL_CALL_HEADER", "CommitRequest", "ControlRequest", "ErrorReply", "Execution", "ForgetRequest",
    "OperationReply", "PreparedEvent", "PrepareReply", "RetireRequest", "Status", "TaskBody", "data_path", "identity",
]
