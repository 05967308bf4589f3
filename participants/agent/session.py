"""One activation of rollbook's agent as data: what it was asked (`RunRequest`), where its turn loop
stands (`Session`), and how one begins afresh, continues an origin's boundary or resumes its own.

The turn loop that drives a session is participants/agent/server.py; a NeMo Gym agent's activation
(participants/agent/external.py) ends in the same completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from adapters.openai_wire import ToolSpec
from engine.boundaries import boundary_messages
from engine.catalog import ACTIVATION_CLAIMED, ACTIVATION_COMPLETED, AGENT_BOUNDARY
from engine.errors import InvalidRequest
from engine.events import NewEvent, RecordedEvent
from engine.forks import inherited_boundary
from engine.identity import Key, agent_stream
from engine.recovery import resume_point
from participants.base.guard import Body, Int64
from participants.base.wire import TaskBody
from participants.environments import ENVIRONMENTS, ToolError, get_environment
from participants.environments.base import prompt_messages


class RunRequest(Body):
    """One activation. The model and resources servers it talks to come from the configuration only:
    a request never names an address (it could name one that collects the data credential)."""

    task: TaskBody
    max_steps: int = Field(default=16, ge=1, le=1000)
    seed: Int64 = 0
    model: str = Field(default="policy", max_length=256)
    system_prompt: str | None = None
    tools: list[ToolSpec] | None = Field(default=None, description="the session's tools; default: the environment's")


class RunReply(BaseModel):
    final_answer: str | None
    messages: list[dict[str, Any]]
    usage: dict[str, int]
    turns: int


class SessionRow(BaseModel):
    rollout_id: str
    attempt: int
    activation: int
    state: str
    turn: int


class SessionList(BaseModel):
    sessions: list[SessionRow]


@dataclass
class Session:
    """One activation's turn loop. `turn` is the next turn to run."""

    rollout_id: str
    attempt: int
    index: int
    request: RunRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    sampling: dict[str, Any] = field(default_factory=dict)  # sent with every model call (the environment's task_sampling)
    turn: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # calls completed under this attempt (lineage checks its own log)
    last_call_id: str | None = None
    # The origin's pending call, continued by this attempt's first model call, then the calls that one
    # was itself continuing (newest first): a pending call a crash left unanswered points further back.
    replaces: str | None = None
    revisions: dict[str, int] = field(default_factory=dict)  # session stream -> revision, once changed in this attempt
    revision_seen: int = 0
    done: bool = False  # a tool said the episode is over: the next reply is the final answer
    finished: bool = False
    final_answer: str | None = None
    state: str = "running"
    policy_version: str | None = None  # of the latest reply: every boundary says which policy brought it there
    resumed: bool = False  # goes on from a boundary of its own attempt, already in the log: not recorded again
    recorded: int | None = None  # messages in the stream's latest boundary (None: none yet): the next one is a delta on it

    @property
    def key(self) -> Key:
        return (self.rollout_id, self.attempt)

    def boundary_data(self, state: str, turn: int, pending: str | None) -> dict[str, Any]:
        """The boundary's data; from now on the session counts it as the latest boundary of its stream."""
        messages = boundary_messages(self.messages, self.recorded)
        self.recorded = len(self.messages)
        return {
            "turn": turn, **messages, "usage": self.usage, "cookies": {}, "last_call_id": self.last_call_id,
            "pending_call_id": pending, "replaces_call_id": self.replaces if pending else None, "calls": self.calls,
            "revisions": self.revisions, "revision_seen": self.revision_seen, "state": state, "activation": self.index,
            "done": self.done, "finished": self.finished, "final_answer": self.final_answer,
            "policy_version": self.policy_version,
        }

    def reply(self) -> dict[str, Any]:
        return {"final_answer": self.final_answer, "messages": self.messages, "usage": self.usage, "turns": self.turn}

    def completed(self) -> NewEvent:
        """The activation's completion: its reply less the conversation, which is the boundary appended
        just before it (engine.boundaries.completed_activations), so no conversation is ever stored
        whole in one event, however long it grows."""
        reply = {k: v for k, v in self.reply().items() if k != "messages"}
        return NewEvent(agent_stream(*self.key), ACTIVATION_COMPLETED, {"index": self.index, "reply": reply}, *self.key)


def tool_call_key(activation: int, turn: int, index: int) -> str:
    """A tool call's key within its session: the agent derives it from where the call stands, never
    from anything the model said, and the resources server accepts no other shape (TOOL_CALL_KEY)."""
    return f"a{activation}.t{turn}.{index}"


def offered_tools(tools: list[dict[str, Any]]) -> set[str]:
    """The names of the function tools a session offers its model (the only ones it may call)."""
    return {str(t["function"]["name"]) for t in tools
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")}


def fresh_session(key: Key, index: int, req: RunRequest) -> Session:
    # An environment this process does not know is allowed when the request names the tools (`run`):
    # its task opens as any task does, with its prompt.
    env = get_environment(req.task.env) if req.task.env in ENVIRONMENTS else None
    task = req.task.task()
    try:
        opening = env.task_messages(task) if env is not None else prompt_messages(task)
        sampling = env.task_sampling(task) if env is not None else dict(task.sampling)
    except ToolError as exc:  # the task's own content (a NeMo Gym row with an image part): the caller's input
        raise InvalidRequest(f"task {task.task_id} of {task.env}: {exc}", task_error=exc.code) from None
    messages = ([{"role": "system", "content": req.system_prompt}] if req.system_prompt else []) + opening
    tools = ([t.model_dump(exclude_none=True) for t in req.tools] if req.tools is not None
             else env.tools() if env is not None else [])
    return Session(key[0], key[1], index, req, messages, tools, sampling=sampling)


def continued_session(key: Key, index: int, req: RunRequest, boundary: dict[str, Any]) -> Session:
    """A session of a new attempt that goes on from its origin's boundary: nothing before it is redone."""
    s = fresh_session(key, index, req)
    s.messages = [dict(m) for m in boundary["messages"]]
    s.usage = dict(boundary.get("usage") or {})
    s.last_call_id = boundary.get("last_call_id")
    s.revision_seen = int(boundary.get("revision_seen") or 0)
    s.done = bool(boundary.get("done"))
    s.policy_version = boundary.get("policy_version")
    if boundary["state"] == "before_model":
        s.turn = int(boundary["turn"])
        chain = [boundary.get("pending_call_id"), *(boundary.get("replaces_call_id") or "").split(",")]
        s.replaces = ",".join(dict.fromkeys(c for c in chain if c)) or None
    else:  # after_turn: the turn and all its tool calls are in the messages
        s.turn = int(boundary["turn"]) + 1
        s.finished = bool(boundary.get("finished"))
        s.final_answer = boundary.get("final_answer")
    return s


def resumed_session(key: Key, index: int, req: RunRequest, boundary: dict[str, Any]) -> Session:
    """The same attempt going on from its own last boundary after this server restarted."""
    s = continued_session(key, index, req, boundary)
    s.calls = list(boundary.get("calls") or [])
    s.revisions = dict(boundary.get("revisions") or {})
    # The pending call is asked for again under its own id, with the chain it was first sent with.
    s.replaces = boundary.get("replaces_call_id") if boundary["state"] == "before_model" else None
    s.resumed = boundary["state"] == "before_model"
    s.recorded = len(s.messages)  # that boundary is the latest of this attempt's stream
    return s


def session_for(key: Key, index: int, req: RunRequest, history: Sequence[RecordedEvent], staged: dict[str, Any] | None,
                continues: bool) -> Session:
    """How activation `index` of attempt `key` begins, given the attempt's effective history and the
    boundary a restore staged for it here (if any). This attempt's own last boundary comes first: a
    restore stages the origin's boundary on every instance of the kind, so when the instance that went
    on from it died, another one holds the same staged boundary, and going on from that would record
    again the turns the dead one had recorded. Then the staged boundary, or the inherited one the log
    holds (the same boundary, read back); else afresh. A restart-only agent always starts afresh."""
    if not continues:
        return fresh_session(key, index, req)
    last = resume_point(history, index)
    if last is not None and (last.rollout_id, last.attempt) == key:
        return resumed_session(key, index, req, last.data)
    boundary = staged if staged is not None else inherited_boundary(last, key[0]) if last is not None else None
    if boundary is not None and boundary.get("activation", 0) == index:
        return continued_session(key, index, req, boundary)
    return fresh_session(key, index, req)


def activation_holder(index: int) -> Callable[[Sequence[RecordedEvent]], str | None]:
    """The instance that claimed activation `index` of a stream while it has not completed: the one
    its latest claiming boundary names (participants.base.owners.settled)."""
    def holder(events: Sequence[RecordedEvent]) -> str | None:
        if any(e.kind == ACTIVATION_COMPLETED and e.data.get("index") == index for e in events):
            return None
        claims = [e for e in events if e.kind == ACTIVATION_CLAIMED and e.data["index"] == index
                  or e.kind == AGENT_BOUNDARY and e.data.get("activation", 0) == index and e.data.get("instance")]
        return str(claims[-1].data["instance"]) if claims else None
    return holder
