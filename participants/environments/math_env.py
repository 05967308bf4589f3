"""Single-turn arithmetic: "What is 37 * 12 + 5?", graded on the last number in the answer."""

from __future__ import annotations

import random
import re
from typing import ClassVar

from . import players
from .arithmetic import evaluate
from .base import JSON, StatelessEnvironment, Task, Trajectory

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str | None) -> float | None:
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


def make_task(seed: int) -> Task:
    rng = random.Random(f"math:{seed}")
    terms = [str(rng.randint(2, 99)) for _ in range(rng.choice([2, 3, 3]))]
    expression = terms[0]
    for term in terms[1:]:
        expression += f" {rng.choice(['+', '-', '*'])} {term}"
    prompt = f"What is {expression}? End your reply with the number."
    return Task(env="math", task_id="", prompt=prompt,
                params={"seed": seed, "expression": expression, "answer": evaluate(expression)})


class MathEnvironment(StatelessEnvironment):
    name: ClassVar[str] = "math"
    make_task = staticmethod(make_task)
    scripted = players.MATH

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        final_answer = trajectory.final_answer
        got = last_number(final_answer)
        return 1.0 if got is not None and got == float(task.params["answer"]) else 0.0
