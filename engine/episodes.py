"""An attempt's episode as the environment server records it: the payload of each episode event, built
here alone, and what an episode's recorded steps say (where it stands, its reward).

Every writer of `episode_started`, `episode_continued` and `episode_step` (the environment server,
its NeMo Gym front through it, a fork's plan) takes its payload from these functions, so the fields
and their order are those of every log already stored. The reward is recorded once, by the verify
step; the close step, `attempt_finished` and every answer derive it from that record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from engine import catalog as ev
from engine.events import RecordedEvent

STEPS = ev.EPISODE_STEPS


def started(task: Mapping[str, Any], seed: int, max_steps: int, *, instance: str | None = None,
            gym: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`episode_started`: the episode's input (`task` as Task.to_json writes it), its owner, its caller."""
    data: dict[str, Any] = {"env": task["env"], "task_id": task["task_id"], "task": dict(task), "seed": seed,
                            "max_steps": max_steps, "status": "running"}
    return _claimed(data, instance, gym)


def continued(env: str, task_id: str, next_step: str | None, *, origin_attempt: int | None = None,
              forked_from: str | None = None, restored_from: str | None = None, recovered: bool = False,
              instance: str | None = None, gym: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`episode_continued`: the episode goes on at `next_step` from an earlier attempt's steps."""
    data: dict[str, Any] = {"env": env, "task_id": task_id}
    if origin_attempt is not None:
        data["origin_attempt"] = origin_attempt
    if forked_from is not None:
        data["forked_from"] = forked_from
    data["next_step"] = next_step
    if restored_from is not None:
        data["restored_from"] = restored_from
    if recovered:
        data["recovered"] = True
    data["status"] = "running"
    return _claimed(data, instance, gym)


def step(name: str, done: Mapping[str, Any]) -> dict[str, Any]:
    """`episode_step`: what step `name` did; the close step ends the episode."""
    return {"step": name, **done, "status": "finished" if name == STEPS[-1] else "running"}


def finished(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`attempt_finished`, and the close step, of an episode whose steps are `steps`: its reward is the
    verify step's."""
    return {"reward": reward(steps)}


def _claimed(data: dict[str, Any], instance: str | None, gym: Mapping[str, Any] | None) -> dict[str, Any]:
    if instance is not None:
        data["instance"] = instance
    if gym is not None:
        data["gym"] = dict(gym)
    return data


def recorded_steps(history: Sequence[RecordedEvent]) -> list[dict[str, Any]]:
    """The data of each `episode_step` in `history`, in log order."""
    return [dict(e.data) for e in history if e.kind == ev.EPISODE_STEP]


def recorded(steps: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((d for d in steps if d["step"] == name), None)


def next_step(steps: Sequence[Mapping[str, Any]]) -> str | None:
    """The first step not yet recorded; None once the episode is closed."""
    return next((s for s in STEPS if recorded(steps, s) is None), None)


def reward(steps: Sequence[Mapping[str, Any]]) -> float | None:
    """The episode's reward: the one its verify step recorded (None before it)."""
    verified = recorded(steps, "verify")
    return None if verified is None else cast("float | None", verified.get("reward"))


__all__ = ["STEPS", "continued", "finished", "next_step", "recorded", "recorded_steps", "reward", "started", "step"]
