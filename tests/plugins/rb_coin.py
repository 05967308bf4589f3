"""An environment from outside rollbook, as a third-party package would ship it.

tests/test_environment_plugins.py installs it by writing its distribution metadata (a dist-info
with one `rollbook.environments` entry point) into a temporary folder on sys.path; nothing in
rollbook names it.
"""

from __future__ import annotations

import random
from typing import ClassVar

from participants.environments.base import JSON, StatelessEnvironment, Task, Trajectory


def make_task(seed: int) -> Task:
    word = random.Random(f"coin:{seed}").choice(["heads", "tails", "edge"])
    return Task(env="coin", task_id="", prompt=f"Reverse the string '{word}'. Reply with the result only.",
                params={"expected": word[::-1]})


class CoinEnvironment(StatelessEnvironment):
    name: ClassVar[str] = "coin"
    make_task = staticmethod(make_task)

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        # Reads the whole trajectory, as a NeMo Gym verifier reads response.output: the answer counts only
        # in a conversation about this task.
        asked = [m.get("content") for m in trajectory.messages if m.get("role") == "user"]
        answered = (trajectory.final_answer or "").strip() == task.params["expected"]
        return 1.0 if answered and asked == [task.prompt] else 0.0
