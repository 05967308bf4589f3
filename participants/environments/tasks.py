"""Deterministic task mixes over the bundled environments."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

from . import blackjack, math_env, sandbox, string_match, workplace
from .base import Task, canonical

GENERATORS: dict[str, Callable[[int], Task]] = {
    "workplace": workplace.make_task,
    "blackjack": blackjack.make_task,
    "math": math_env.make_task,
    "string_match": string_match.make_task,
    "sandbox": sandbox.make_task,
}
DEFAULT_ORDER = ["workplace", "blackjack", "math", "sandbox"]


def _sub_seed(seed: int, index: int, env: str) -> int:
    # A hash rather than seed + index, so neighbouring mixes do not share tasks.
    digest = hashlib.sha256(f"rollbook-task:{seed}:{index}:{env}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def task_id_for(task: Task) -> str:
    """Content-addressed: the same env and params always get the same id."""
    digest = hashlib.sha256(canonical({"env": task.env, "params": task.params}).encode()).hexdigest()
    return f"{task.env}-{digest[:12]}"


def make_task(env: str, seed: int) -> Task:
    if env not in GENERATORS:
        raise ValueError(f"no task generator for {env!r}; known: {sorted(GENERATORS)}")
    task = GENERATORS[env](seed)
    return dataclasses.replace(task, task_id=task_id_for(task))


def make_tasks(n: int, seed: int, envs: list[str] | None = None) -> list[Task]:
    order = list(envs) if envs is not None else DEFAULT_ORDER
    if n < 0:
        raise ValueError("n must be non-negative")
    if not order:
        raise ValueError("envs must name at least one environment")
    return [make_task(order[i % len(order)], _sub_seed(seed, i, order[i % len(order)])) for i in range(n)]
