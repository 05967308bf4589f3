"""An episode as the environment server holds it in memory, and as the log rebuilds it.

The steps it has done are the data of its `episode_step` events, in order; what they say (the next
step, the reward) is read by engine.episodes, the one place that writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import catalog as ev
from engine import episodes
from engine.errors import RequestConflict
from engine.events import RecordedEvent
from engine.forks import fork_seed
from participants.environments import Task


@dataclass
class Episode:
    rollout_id: str
    attempt: int
    task: Task
    seed: int
    max_steps: int
    done: list[dict[str, Any]] = field(default_factory=list)  # the data of each recorded step, in order
    status: str = "running"  # running | parked | finished | failed
    step: str | None = None  # the step in progress
    error: str | None = None
    closed_by_verify: int | None = None  # the attempt whose session its verify closed

    def recorded(self, step: str) -> Mapping[str, Any] | None:
        return episodes.recorded(self.done, step)

    @property
    def next_step(self) -> str | None:
        return episodes.next_step(self.done)

    @property
    def reward(self) -> float | None:
        return episodes.reward(self.done)

    def result(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt, "reward": self.reward,
                "steps": [d["step"] for d in self.done]}

    def status_json(self) -> dict[str, Any]:
        return {"status": self.status, "attempt": self.attempt, "reward": self.reward, "step": self.step,
                "steps": [d["step"] for d in self.done], "error": self.error}


def episode_from_history(rollout_id: str, attempt: int, inputs: Sequence[RecordedEvent],
                         upto: Sequence[RecordedEvent]) -> Episode | None:
    """An episode as the log has it: its input from `inputs`, its recorded steps from `upto`.

    The input never changes, so it may come from past the boundary (attempt_started is a boundary
    and episode_started lands right after it); the steps come only from up to the boundary."""
    started = next((e for e in inputs if e.kind == ev.EPISODE_STARTED), None)
    if started is None:
        return None
    d = started.data
    ep = Episode(rollout_id, attempt, Task.from_json(d["task"]), int(d.get("seed", 0)), int(d.get("max_steps", 16)))
    ep.done = episodes.recorded_steps(upto)
    own_seed = fork_seed(inputs, rollout_id)  # a fork samples with its own seed, not its origin's
    if own_seed is not None:
        ep.seed = own_seed
    return ep


def replayable_verify(ep: Episode) -> bool:
    """The episode's session said at seed that its verification is `replay`: asked again after a
    restore, it gives the same answer, so a checkpoint need not wait for it."""
    return (ep.recorded("seed") or {}).get("verification") == "replay"


def same_task(rid: str, ep: Episode | None, requested: Task) -> None:
    """A rollout id names one task: asking for it with another is a conflict, answered before any write."""
    if ep is not None and ep.task != requested:
        raise RequestConflict(f"rollout {rid} was started with another task; a rollout id names one task")


def episode_holder(events: Sequence[RecordedEvent]) -> str | None:
    """The instance that claimed an unfinished episode: its latest start or continuation names it."""
    if any(e.data.get("status") in ("finished", "failed") for e in events):
        return None
    claims = [e for e in events if e.kind in (ev.EPISODE_STARTED, ev.EPISODE_CONTINUED)]
    return str(claims[-1].data["instance"]) if claims and claims[-1].data.get("instance") else None


__all__ = ["Episode", "episode_from_history", "episode_holder", "replayable_verify", "same_task"]
