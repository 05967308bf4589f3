"""An environment from outside rollbook, as a third-party package would ship it.

tests/test_environment_plugins.py installs it by writing its distribution metadata (a dist-info
with one `rollbook.environments` entry point) into a temporary folder on sys.path; nothing in
rollbook names it.
"""

from __future__ import annotations

import random
from typing import ClassVar

from participants.environments.base import JSON, StatelessEnvironment, Task


def make_task(seed: int) -> Task:
    word = random.Random(f"coin:{seed}").choice(["heads", "tails", "edge"])
    return Task(env="coin", task_id="", prompt=f"Reverse the string '{word}'. Reply with the result only.",
                params={"expected": word[::-1]})


class CoinEnvironment(StatelessEnvironment):
    name: ClassVar[str] = "coin"
    make_task = staticmethod(make_task)

    def verify(self, task: Task, state: JSON, final_answer: str | None) -> float:
        return 1.0 if (final_answer or "").strip() == task.params["expected"] else 0.0
