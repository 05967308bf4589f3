"""A relayed session's state is the replay of its recorded tool calls.

rollbook relays some environments it did not write (a NeMo Gym resources server, unchanged): their
state lives in another process, out of reach of a reducer. What rollbook does hold is every tool call
it sent there and the reply it got, recorded as the session's mutations. For a server that declares
itself deterministic (`replay`), that record is the state: a fresh session is seeded and the calls
are sent again in order, and each reply must equal the recorded one. The rules, once:

- A server declares `replay` (its replies are a function of the calls before them), `stateless`
  (nothing to rebuild: it only verifies) or `restart_only`; one that declares nothing is
  `restart_only`, restarted and never continued.
- A session's record is a list of calls, each `{tool, arguments, digest, tool_call}`, the digest a
  SHA-256 of the reply's canonical JSON; the record grows by one entry per call (`record`), so the
  replay costs one request per recorded call, whatever the size of the state behind them.
- `replay` sends the record again through `send`; the first reply whose digest is not the recorded
  one stops it with a ReplayDivergence naming the call. Nothing after a divergence is sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from engine.errors import InvalidRequest, ReplayDivergence

Declaration = Literal["replay", "restart_only", "stateless"]
DECLARATIONS: tuple[Declaration, ...] = ("replay", "restart_only", "stateless")
UNDECLARED: Declaration = "restart_only"
# What a recovery records when the replay does not give back what was recorded (rollbook.episode_history,
# rollout_recovered's reason): the rollout alone starts over from its input.
DIVERGENCE_REASON = "replay_divergence"


def declared(declaration: str | None) -> Declaration:
    """A server's state declaration; none is `restart_only`, an unknown one is refused."""
    if declaration is None:
        return UNDECLARED
    for d in DECLARATIONS:
        if d == declaration:
            return d
    raise InvalidRequest(f"state declaration {declaration!r} is none of {', '.join(DECLARATIONS)}")


def continues(declaration: Declaration) -> bool:
    """Whether a session whose live process is gone can go on (rebuilt by replay, or nothing to rebuild)."""
    return declaration != "restart_only"


def reply_digest(reply: Any) -> str:
    text = json.dumps(reply, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def entry(tool: str, arguments: dict[str, Any], reply: Any, tool_call: str | None,
          reward: float | None = None) -> dict[str, Any]:
    """One call as the record keeps it (the session mutation's effect); `reward`, the reward the reply
    gave, for a server that scores each call (a gymnasium step) rather than verifying the episode."""
    out = {"tool": tool, "arguments": arguments, "digest": reply_digest(reply), "tool_call": tool_call}
    return out if reward is None else {**out, "reward": reward}


def record(calls: Sequence[dict[str, Any]], effect: dict[str, Any]) -> list[dict[str, Any]]:
    """The reducer of a relayed session: the record with one more call. Never edits `calls`."""
    if not isinstance(effect, dict) or not isinstance(effect.get("tool"), str) or not isinstance(effect.get("digest"), str):
        raise ReplayDivergence(f"a relayed call's effect needs a tool and a digest, got {effect!r}"[:300])
    kept = {k: effect.get(k) for k in ("tool", "arguments", "digest", "tool_call")}
    return [*calls, {**kept, "reward": effect["reward"]} if "reward" in effect else kept]


def rewards(calls: Sequence[dict[str, Any]]) -> float | None:
    """The episode's reward from a record whose calls were scored one by one: their sum; None when no
    call of the record was scored."""
    scored = [float(c["reward"]) for c in calls if isinstance(c.get("reward"), int | float)]
    return sum(scored) if scored else None


async def replay(calls: Sequence[dict[str, Any]], send: Callable[[str, dict[str, Any]], Awaitable[Any]]) -> int:
    """Send every recorded call again, in order, checking each reply; returns how many were sent.
    Raises ReplayDivergence at the first reply that is not the recorded one."""
    for n, call in enumerate(calls):
        reply = await send(call["tool"], dict(call.get("arguments") or {}))
        got = reply_digest(reply)
        if got != call["digest"]:
            raise ReplayDivergence(
                f"call {n} ({call['tool']}, key {call.get('tool_call')}) replied {got[:12]}, the log recorded "
                f"{call['digest'][:12]}: the server does not replay", call=n, tool=call["tool"])
    return len(calls)
