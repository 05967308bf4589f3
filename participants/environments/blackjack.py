"""Blackjack on gymnasium's own ``Blackjack-v1`` rules.

gymnasium keeps the deck in the env's numpy Generator, so the exported state
carries the bit generator's state next to the hands: a rebuilt env draws the
very cards the live one would have drawn. Each call builds a throwaway
gymnasium env from the JSON state, steps it once and exports it again.

gymnasium and numpy are imported on first use, not with the module: every server loads every
registered environment at start, and these two cost 0.16 s of CPU there.
"""

from __future__ import annotations

import copy
import functools
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

from . import players
from .base import (
    JSON,
    Environment,
    StateMode,
    Task,
    ToolError,
    ToolOutcome,
    Trajectory,
    Verification,
    function_tool,
    read_args,
)

if TYPE_CHECKING:
    import numpy as np
    from gymnasium.envs.toy_text.blackjack import BlackjackEnv


@functools.cache
def _gym() -> ModuleType:
    from gymnasium.envs.toy_text import blackjack

    return blackjack


@functools.cache
def _spec_kwargs() -> dict[str, bool]:
    """The registered variant's rules (sab/natural), so scores match gymnasium.make("Blackjack-v1")."""
    import gymnasium

    return {k: bool(v) for k, v in gymnasium.spec("Blackjack-v1").kwargs.items()}

_STATE_KEYS = frozenset({"seed", "sab", "natural", "player", "dealer", "dealer_top_card", "done", "reward", "rng"})

PROMPT = (
    "Play one hand of blackjack against the dealer. Call `look` to see your cards, `hit` to draw "
    "another card and `stand` to end your turn; the dealer then draws to 17. Finish closer to 21 "
    "than the dealer without going over. When the hand is over, report the result."
)


def _plain(value: object) -> JSON:
    """numpy's state dict may hold numpy scalars; JSON wants plain ints (big ones are fine)."""
    import numpy as np

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | str | float):
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    raise TypeError(f"cannot export RNG state value of type {type(value).__name__}")


def export_rng(generator: np.random.Generator) -> JSON:
    return _plain(generator.bit_generator.state)


def import_rng(state: JSON) -> np.random.Generator:
    import numpy as np

    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = copy.deepcopy(state)
    return np.random.Generator(bit_generator)


def _export(env: BlackjackEnv, base: JSON, done: bool, reward: float | None) -> JSON:
    return {
        "seed": base["seed"],
        "sab": base["sab"],
        "natural": base["natural"],
        "player": [int(c) for c in env.player],
        "dealer": [int(c) for c in env.dealer],
        "dealer_top_card": str(env.dealer_top_card_value_str) + str(env.dealer_top_card_suit),
        "done": done,
        "reward": None if reward is None else float(reward),
        "rng": export_rng(env.np_random),
    }


def restore_env(state: JSON, with_rng: bool = True) -> BlackjackEnv:
    """A gymnasium env positioned exactly at ``state``.

    ``with_rng=False`` re-seeds from the task seed instead, which is what a
    rebuild that forgot the RNG would do; the tests use it as a negative control.
    """
    import numpy as np

    env = _gym().BlackjackEnv(sab=state["sab"], natural=state["natural"])
    env.np_random = import_rng(state["rng"]) if with_rng else np.random.default_rng(state["seed"])
    env.player = list(state["player"])
    env.dealer = list(state["dealer"])
    top = state["dealer_top_card"]
    env.dealer_top_card_value_str, env.dealer_top_card_suit = top[:-1], top[-1]
    return env


def view(state: JSON) -> JSON:
    """What the player is allowed to see: the dealer's hole card stays hidden until the end."""
    gym_blackjack = _gym()
    player = state["player"]
    out: dict[str, JSON] = {
        "player_hand": list(player),
        "player_sum": int(gym_blackjack.sum_hand(player)),
        "usable_ace": bool(gym_blackjack.usable_ace(player)),
        "dealer_showing": state["dealer"][0],
        "done": state["done"],
        "reward": state["reward"],
    }
    if state["done"]:
        out["dealer_hand"] = list(state["dealer"])
        out["dealer_sum"] = int(gym_blackjack.sum_hand(state["dealer"]))
    return out


def make_task(seed: int) -> Task:
    return Task(env="blackjack", task_id="", prompt=PROMPT, params={"seed": seed, **_spec_kwargs()})


class BlackjackEnvironment(Environment):
    name: ClassVar[str] = "blackjack"
    make_task = staticmethod(make_task)
    scripted = players.BLACKJACK
    conformance_seed: ClassVar[int] = 6  # look, hit, stand, answer: two mutations
    state_mode: ClassVar[StateMode] = "exported"
    verification: ClassVar[Verification] = "replay"

    def tools(self) -> list[dict]:
        return [
            function_tool("look", "Show your hand and the dealer's face-up card.", {}, []),
            function_tool("hit", "Draw one more card.", {}, []),
            function_tool("stand", "Stop drawing; the dealer plays out and the hand is scored.", {}, []),
        ]

    def initial_state(self, task: Task) -> JSON:
        params = {**_spec_kwargs(), **task.params}
        env = _gym().BlackjackEnv(sab=bool(params["sab"]), natural=bool(params["natural"]))
        env.reset(seed=int(params["seed"]))
        base = {"seed": int(params["seed"]), "sab": bool(params["sab"]), "natural": bool(params["natural"])}
        return _export(env, base, done=False, reward=None)

    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        if name not in ("look", "hit", "stand"):
            raise ToolError("unknown_tool", f"no tool named {name!r}")
        read_args(arguments, {})
        if name == "look":
            return ToolOutcome(output=view(state), effect=None, done=state["done"])
        if state["done"]:
            raise ToolError("episode_over", "the hand is finished")
        env = restore_env(state)
        _, reward, terminated, _, _ = env.step(1 if name == "hit" else 0)
        new_state = _export(env, state, done=bool(terminated), reward=float(reward) if terminated else None)
        return ToolOutcome(output=view(new_state), effect=new_state, done=bool(terminated))

    def apply(self, state: JSON, effect: JSON) -> JSON:
        # The effect is the whole (small) next state, so replay needs no gymnasium at all.
        if not isinstance(effect, dict) or set(effect) != _STATE_KEYS:
            raise ToolError("bad_effect", "a blackjack effect is a full exported state")
        return copy.deepcopy(effect)

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        # An abandoned hand scores like a push: it neither won nor was played out.
        return float(state["reward"]) if state["done"] else 0.0
