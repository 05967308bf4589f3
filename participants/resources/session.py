"""A resources session as this server holds it, and as restore rebuilds it from the log alone."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.agent_replay import numbered_tool_key
from engine.errors import (
    AdmissionClosed,
    InvalidCheckpointState,
    ReplayDivergence,
    RestartInScope,
    ToolCallRefused,
)
from engine.events import NewEvent, RecordedEvent
from engine.identity import (
    session_stream,
)
from engine.sessions import boundary_disagreement
from engine.snapshots import Row, SessionSnapshot, fold_from
from participants.environments import (
    ENVIRONMENTS,
    Environment,
    Task,
    ToolError,
    open_from_log,
)
from participants.environments.base import JSON
from participants.environments.nemo_gym_relay import relayed


@dataclass
class Session:
    rollout_id: str
    attempt: int
    env: Environment
    task: Task
    state: JSON
    revision: int = 0
    stream_version: int = 0  # the writer's view of its stream: appends expect exactly this version
    live: Any = None  # restart-only environments: the live process handle
    opened: bool = False  # session_opened is durable
    verify_status: str | None = None
    verifying: int = 0
    tool_calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> its mutation_applied data
    numbers: dict[int, int] = field(default_factory=dict)  # activation -> the next number the server gives a call
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    verify_idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def stream(self) -> str:
        return session_stream(self.rollout_id, self.attempt)

    def event(self, kind: str, data: dict[str, Any]) -> NewEvent:
        return NewEvent(self.stream, kind, data, self.rollout_id, self.attempt)

    def key_for(self, named: str | None, activation: int) -> str:
        """A tool call's key: the one its agent named, or the next number of its activation (engine.agent_replay)."""
        if named is not None:
            return named
        n = self.numbers.get(activation, 0)
        self.numbers[activation] = n + 1
        return numbered_tool_key(activation, n)

    def refused(self, named: str | None, activation: int, why: str) -> AdmissionClosed:
        """A call refused for a checkpoint changed nothing: a number it took is the next call's again, so
        the agent asking again numbers it as an uninterrupted run would (under the session's lock)."""
        if named is None:
            self.numbers[activation] -= 1
        return AdmissionClosed(why)


@dataclass(frozen=True)
class Staged:
    """A session rebuilt from the log at restore, waiting for its new attempt at resume."""

    rollout_id: str
    origin_attempt: int
    env_name: str
    task: Task
    state: JSON
    revision: int


def rebuild(rollout_id: str, attempt: int, boundary: int, history: list[RecordedEvent], snapshots: Sequence[Row] = (),
            start: SessionSnapshot | None = None) -> tuple[Staged | None, SessionSnapshot | None]:
    """A session's state at a boundary from the log alone (engine.sessions); None when no session
    was open there.

    `history` is the attempt's effective history (its origins' events first), so a session restored
    earlier continues from its origin's replay. The fold starts at the newest of `snapshots` that
    matches (engine.snapshots), or at `start` with `history` the events past it (engine.snapshot_reads),
    and gives the snapshot a long fold leaves, for the caller to store.
    Raises InvalidCheckpointState on anything that does not add up, RestartInScope for a live
    session whose state cannot be rebuilt at all."""
    where = f"{rollout_id} attempt {attempt}"
    try:
        replay, new = fold_from(snapshots, open_from_log, history, start=start)
    except ReplayDivergence as exc:
        raise InvalidCheckpointState(f"{where}: {exc.detail}") from exc
    if not replay.open or replay.env is None:
        return None, new
    if replay.env.state_mode == "restart_only":
        raise RestartInScope(f"{where} holds a live {replay.env.name} session, which cannot be rebuilt",
                             executions=[[rollout_id, attempt]])
    at = next((e for e in history if e.position == boundary), None)
    wrong = boundary_disagreement(at.data, replay.revisions) if at is not None else None
    if wrong is not None:
        stream, seen, logged = wrong
        raise InvalidCheckpointState(f"{where}: the boundary saw {stream} at revision {seen}, the replay reaches {logged}")
    return Staged(rollout_id, attempt, replay.env.name, replay.task, replay.state, replay.revision), new


def live(env: Environment) -> bool:
    """Whether the environment's sessions run in a live process this server holds (`*_live` methods)."""
    return env.state_mode in ("restart_only", "snapshot") or relayed(env)


async def run_live(method: Callable[..., Any], *args: Any) -> Any:
    """An environment's `*_live` method, off the event loop's back either way: awaited where it is a
    coroutine (the relay's HTTP), else run in a thread (a sandbox's Popen and blocking reads)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


def refused(exc: ToolError) -> ToolCallRefused:
    """An environment's refusal of a tool call or a session, as the caller gets it (its code kept)."""
    return ToolCallRefused(exc.message or exc.code, tool_error=exc.code)


def restart_only(env_name: str | None) -> bool:
    env = ENVIRONMENTS.get(env_name or "")
    return env is not None and env.state_mode == "restart_only"
