"""Deterministic task mixes over the bundled environments."""

from __future__ import annotations

import dataclasses
import hashlib

from . import ENVIRONMENTS
from .base import Task, canonical

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
    """A task of a registered environment, from its own generator (`Environment.make_task`)."""
    if env not in ENVIRONMENTS:
        raise ValueError(f"no task generator for {env!r}; known: {sorted(ENVIRONMENTS)}")
    task = ENVIRONMENTS[env].make_task(seed)
    return dataclasses.replace(task, task_id=task_id_for(task))


def make_tasks(n: int, seed: int, envs: list[str] | None = None) -> list[Task]:
    order = list(envs) if envs is not None else DEFAULT_ORDER
    if n < 0:
        raise ValueError("n must be non-negative")
    if not order:
        raise ValueError("envs must name at least one environment")
    return [make_task(order[i % len(order)], _sub_seed(seed, i, order[i % len(order)])) for i in range(n)]
