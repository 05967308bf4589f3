"""An environment from outside rollbook, as a third-party package would ship it.

tests/participants/environments/test_plugins.py installs it by writing its distribution metadata (a dist-info
with one `rollbook.environments` entry point) into a temporary folder on sys.path; nothing in
rollbook names it.
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from participants.environments.base import JSON, StatelessEnvironment, Task, Trajectory
from participants.environments.players import Answer, Player

_PROMPT = re.compile(r"Spell the coin face '(\w+)' backwards\.")


def make_task(seed: int) -> Task:
    word = random.Random(f"coin:{seed}").choice(["heads", "tails", "edge"])
    return Task(env="coin", task_id="", prompt=f"Spell the coin face '{word}' backwards.", params={"expected": word[::-1]})


def _play(prompt: str, history: list, tools: list[dict], seed: int) -> Answer:
    m = _PROMPT.search(prompt)
    return Answer(m.group(1)[::-1] if m else "no idea")


# How rollbook's scripted stand-in model plays it: the package brings that too, nothing in rollbook changes.
PLAYER = Player(5, lambda names, prompt: _PROMPT.search(prompt) is not None, _play)


class CoinEnvironment(StatelessEnvironment):
    name: ClassVar[str] = "coin"
    make_task = staticmethod(make_task)
    scripted = PLAYER

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        # Reads the whole trajectory, as a NeMo Gym verifier reads response.output: the answer counts only
        # in a conversation about this task.
        asked = [m.get("content") for m in trajectory.messages if m.get("role") == "user"]
        answered = (trajectory.final_answer or "").strip() == task.params["expected"]
        return 1.0 if answered and asked == [task.prompt] else 0.0
