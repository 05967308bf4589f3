"""Single-turn string transforms ("Reverse the string 'abcde'"), graded by exact match."""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import ClassVar

from . import players
from .base import JSON, StatelessEnvironment, Task, Trajectory

# op -> (how the prompt phrases it, the transform)
OPERATIONS: dict[str, tuple[str, Callable[[str], str]]] = {
    "reverse": ("Reverse the string", lambda s: s[::-1]),
    "upper": ("Uppercase the string", str.upper),
    "lower": ("Lowercase the string", str.lower),
    "sort": ("Sort the characters of the string", lambda s: "".join(sorted(s))),
    "devowel": ("Remove the vowels from the string", lambda s: "".join(c for c in s if c.lower() not in "aeiou")),
}


def make_task(seed: int) -> Task:
    rng = random.Random(f"string_match:{seed}")
    op = rng.choice(sorted(OPERATIONS))
    text = "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(5, 10)))
    phrase, transform = OPERATIONS[op]
    prompt = f"{phrase} '{text}'. Reply with the result only."
    return Task(env="string_match", task_id="", prompt=prompt,
                params={"seed": seed, "op": op, "text": text, "expected": transform(text)})


class StringMatchEnvironment(StatelessEnvironment):
    name: ClassVar[str] = "string_match"
    make_task = staticmethod(make_task)
    scripted = players.STRING

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        final_answer = trajectory.final_answer
        # Surrounding whitespace is formatting, not content; everything else must match.
        return 1.0 if (final_answer or "").strip() == task.params["expected"] else 0.0
