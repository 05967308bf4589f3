"""NeMo Gym's gymnasium protocol: a resources server that its agent drives step by step.

A gymnasium-style server (NeMo Gym's `resources_servers.gymnasium.GymnasiumServer`: `wordle`,
`blackjack`, `example_multi_turn_gymnasium`, `grl_sokoban`, ...) serves `POST /reset` (the row in,
the first observation out) and `POST /step` (the row and the model's last response in; observation,
reward, terminated, truncated and the tool outputs out), and neither `/seed_session` nor `/verify`.
NeMo Gym's `gymnasium_agent` drives it from its own `/run`. Under rollbook both routes are relayed
like any tool call (recorded, answered from the log when the agent runs again, sent again to rebuild a
lost live session), so the server's state comes back by replaying its reset and steps. What differs:

- the session is not seeded: the agent's `/reset` is the seed, and the first call of the record;
- each step's reward is kept with the call in the record, and the episode's reward is their sum
  (`engine.tool_replay.rewards`), which is what `gymnasium_agent` reports; nothing is asked at verify.

Which servers speak it is read from the server itself (which of the two routes it serves), never configured.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

from participants.environments.base import ToolError

RESET, STEP = "reset", "step"
GYMNASIUM_AGENT = "responses_api_agents.gymnasium_agent.app"  # NeMo Gym's agent of these servers


# The routes that tell the protocols apart.
PROBED = (f"/{STEP}", "/seed_session")


def served_paths(base_url: str, timeout_s: float) -> frozenset[str]:
    """Which of PROBED a running NeMo Gym server serves. Each is asked with a GET, which a POST route
    answers 405 and a path the server does not serve 404: nothing runs, and no document is built
    (FastAPI builds its OpenAPI document on first request, about a second of CPU for a server with
    Workplace's tools)."""
    served = set()
    for path in PROBED:
        try:
            with urllib.request.urlopen(base_url + path, timeout=timeout_s):
                served.add(path)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                served.add(path)
        except OSError:
            pass
    return frozenset(served)


def speaks(paths: frozenset[str]) -> bool:
    """Whether a server with these paths is gymnasium-style: it steps, and has no session to seed."""
    return f"/{STEP}" in paths and "/seed_session" not in paths


# What names one try of a step rather than what it asks: the model response's id and time and rollbook's
# custody facts (a reply the model server answers from its record goes out under the new call's id, at
# the new time), the ids of its message items (named after that call), and the key NeMo Gym's agent
# draws anew for each step of a server that asks for one.
_RESPONSE_NAMES = ("id", "created_at", "rollbook")
_STEP_KEY = "_ng_step_request_id"


def step_as_recorded(arguments: Any) -> Any:
    """A step's body as it is compared with the step recorded at its place: what it asks, not the names
    of this try (an agent run again after a crash steps with the same replies under new names)."""
    if not isinstance(arguments, dict):
        return arguments
    out = {k: v for k, v in arguments.items() if k != _STEP_KEY}
    response = out.get("response")
    if isinstance(response, dict):
        response = {k: v for k, v in response.items() if k not in _RESPONSE_NAMES}
        if isinstance(response.get("output"), list):
            response["output"] = [{k: v for k, v in item.items() if k != "id"}
                                  if isinstance(item, dict) and item.get("type") == "message" else item
                                  for item in response["output"]]
        out["response"] = response
    return out


def step_reward(reply: Any, route: str = STEP) -> float:
    """The reward one step (or an agent-driven server's verify) gave; a reply without a finite number
    there is the server's error, shown to the agent like any tool error."""
    reward = reply.get("reward", 0.0) if isinstance(reply, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ToolError("gym_bad_reply", f"/{route} answered without a finite reward: {json.dumps(reply)[:300]}")
    return float(reward)


def run_body(row: dict[str, Any], capture: str) -> dict[str, Any]:
    """What a gymnasium agent's `/run` is sent: the row, named with the activation's capture id, which the
    agent carries to its model calls and its `/reset` and `/step` (as `/ng-rollout/<capture>/...`)."""
    return {**row, "_ng_rollout_id": capture}


def run_output(row: dict[str, Any], reply: Any) -> list[dict[str, Any]] | None:
    """The conversation a gymnasium agent's `/run` reply holds beyond the row's own input: the first
    observation (its reset's, which the agent adds to the input) and every item of its response's
    output (model turns, tool outputs, each later observation). None when it is no such reply."""
    if not isinstance(reply, dict):
        return None
    sent = (reply.get("responses_create_params") or {}).get("input")
    output = (reply.get("response") or {}).get("output")
    if not isinstance(sent, list) or not isinstance(output, list):
        return None
    given = (row.get("responses_create_params") or {}).get("input")
    opening = 1 if isinstance(given, str) else len(given or [])
    # An observation is an input message, which may come without its `type`.
    return [{"type": "message", **m} if isinstance(m, dict) and "type" not in m else m for m in [*sent[opening:], *output]]


__all__ = ["GYMNASIUM_AGENT", "RESET", "STEP", "run_body", "run_output", "served_paths", "speaks", "step_as_recorded",
           "step_reward"]
