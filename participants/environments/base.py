"""The environment interface shared by every bundled environment.

The engine never keeps live environment objects between turns: a session's
state is plain JSON, rebuilt from the event log as
``reduce(env.apply, effects, env.initial_state(task))``. That rebuild has to
equal the live state byte for byte (canonical JSON), so every method here is
a pure function of its JSON arguments.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import reduce
from typing import Any, ClassVar, Literal

from engine.events import canonical_json
from engine.file_blobs import Blob

from .players import Player

JSON = Any  # dict/list/str/int/float/bool/None only: no tuples, no numpy scalars
StateMode = Literal["stateless", "exported", "restart_only", "replay", "snapshot"]
Verification = Literal["replay", "wait"]


class ToolError(Exception):
    """A tool call that was refused; raising it never changes the state."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"error": self.code, "message": self.message}


@dataclass(frozen=True)
class Task:
    env: str
    task_id: str
    prompt: str
    params: dict[str, JSON] = field(default_factory=dict)
    sampling: dict[str, JSON] = field(default_factory=dict)  # sent with every model call of the task
    agent: str | None = None  # a `[nemo_gym_agent.<name>]` of the agent server; None: rollbook's own agent

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"env": self.env, "task_id": self.task_id, "prompt": self.prompt, "params": self.params}
        if self.sampling:  # absent when empty: tasks without it keep the wire form they always had
            out["sampling"] = self.sampling
        if self.agent is not None:
            out["agent"] = self.agent
        return out

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> Task:
        return cls(env=d["env"], task_id=d["task_id"], prompt=d["prompt"], params=dict(d.get("params") or {}),
                   sampling=dict(d.get("sampling") or {}), agent=d.get("agent"))


@dataclass(frozen=True)
class Trajectory:
    """What a verifier reads: the whole conversation (the prompt, every model turn, every tool call and
    its output, as chat messages) and the final answer, the way NeMo Gym verifiers read
    `response.output`."""

    messages: list[dict[str, JSON]] = field(default_factory=list)
    final_answer: str | None = None

    def tool_calls(self) -> list[dict[str, JSON]]:
        """Every tool call the agent made, in order: {"name", "arguments"} (arguments as sent)."""
        return [{"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
                for m in self.messages if m.get("role") == "assistant" for c in (m.get("tool_calls") or [])]


@dataclass(frozen=True)
class ToolOutcome:
    output: JSON
    effect: JSON | None  # None marks a read-only call: nothing is logged for apply()
    done: bool = False
    # A live session's snapshot blobs the effect names: stored before the effect is logged.
    blobs: tuple[Blob, ...] = ()
    unrestorable: str | None = None  # why no snapshot holds the live state after this call


def canonical(value: JSON) -> str:
    """The form two states are compared in, and tasks digested in; also rejects non-JSON values early.
    json's sorted, compact spelling with every non-ASCII character escaped (task ids are digests of it,
    so it never changes): the log's own spelling (canonical_json) where that is ASCII, the same text."""
    text = canonical_json(value)
    return text if text.isascii() else json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def roundtrip(value: JSON) -> JSON:
    return json.loads(canonical(value))


def function_tool(name: str, description: str, properties: dict[str, JSON], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def prompt_messages(task: Task) -> list[dict[str, Any]]:
    """A task's prompt as the one user message a rollout opens with (what most environments do)."""
    return [{"role": "user", "content": task.prompt}]


class Environment(ABC):
    """One environment. It is registered by one entry point of the group `rollbook.environments`
    (name = its `name`, value = `module:Class`), and that is all: the registry, the task generator
    (`make_task`), the scripted policy (`scripted`) and the conformance suite (`conformance_seed`)
    read it from the class."""

    name: ClassVar[str]
    state_mode: ClassVar[StateMode]
    verification: ClassVar[Verification]
    # The seed of the task the conformance suite runs (one with few turns under the scripted policy).
    conformance_seed: ClassVar[int] = 0
    # How the scripted stand-in model plays it (participants/environments/players.py), one player or
    # several; None: like any request no player recognises.
    scripted: ClassVar[Player | tuple[Player, ...] | None] = None

    @staticmethod
    def make_task(seed: int) -> Task:
        """A task of this environment, deterministic from `seed` (task_id is filled in by the caller)."""
        raise NotImplementedError("this environment has no task generator")

    @abstractmethod
    def tools(self) -> list[dict]:
        """OpenAI function-tool schemas."""

    @abstractmethod
    def initial_state(self, task: Task) -> JSON:
        """Deterministic from ``task.params``."""

    @abstractmethod
    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        """Must not mutate ``state``; the change travels as ``effect``."""

    @abstractmethod
    def apply(self, state: JSON, effect: JSON) -> JSON:
        """Pure reducer, used both live and when replaying the log."""

    @abstractmethod
    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        """The episode's reward, from the final state and the whole trajectory."""

    def task_messages(self, task: Task) -> list[dict[str, Any]]:
        """The conversation a rollout of `task` opens with, after the agent's own system prompt."""
        return prompt_messages(task)

    def task_sampling(self, task: Task) -> dict[str, Any]:
        """The sampling parameters sent with every model call of a rollout of `task`."""
        return dict(task.sampling)

    def rebuild(self, task: Task, effects: list[JSON]) -> JSON:
        return reduce(self.apply, effects, self.initial_state(task))

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools()]

    def as_recorded(self, name: str, arguments: Any) -> Any:
        """What of a tool call's arguments must match the call recorded at its place for the record to
        answer it when an agent runs again: all of them, unless the environment knows parts that only
        name one try."""
        return arguments


class StatelessEnvironment(Environment):
    """Single-turn question/answer environments: no tools, nothing to rebuild."""

    state_mode: ClassVar[StateMode] = "stateless"
    verification: ClassVar[Verification] = "replay"

    def tools(self) -> list[dict]:
        return []

    def initial_state(self, task: Task) -> JSON:
        return {}

    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        raise ToolError("unknown_tool", f"{self.name} has no tools; answer directly")

    def apply(self, state: JSON, effect: JSON) -> JSON:
        # No tool ever produces an effect here, so one showing up means a corrupt log.
        raise ToolError("bad_effect", f"{self.name} is stateless and has no effects")


_ARG_KINDS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def read_args(arguments: JSON, spec: dict[str, tuple[str, bool]]) -> dict[str, JSON]:
    """Check tool arguments against ``{name: (kind, required)}``; kinds: str/int/float/bool/list[str].

    Checked before anything else so a refused call cannot leave a partial effect.
    """
    if not isinstance(arguments, dict):
        raise ToolError("bad_arguments", "arguments must be a JSON object")
    unknown = sorted(set(arguments) - set(spec))
    if unknown:
        raise ToolError("bad_arguments", f"unknown argument(s): {', '.join(unknown)}")
    out: dict[str, JSON] = {}
    for key, (kind, required) in spec.items():
        if key not in arguments or arguments[key] is None:
            if required:
                raise ToolError("bad_arguments", f"missing argument: {key}")
            continue
        value = arguments[key]
        if kind == "list[str]":
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            # bool is an int subclass in Python, but True is not a valid count or amount.
            ok = isinstance(value, _ARG_KINDS[kind]) and (kind == "bool" or not isinstance(value, bool))
        if not ok:
            raise ToolError("bad_arguments", f"{key} must be {kind}, got {type(value).__name__}")
        if kind == "float":
            value = float(value)
            if not math.isfinite(value):
                raise ToolError("bad_arguments", f"{key} must be a finite number")
        out[key] = value
    return out
