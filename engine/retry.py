"""A caller's retry of a rollout under a newer attempt of its own numbering.

Frameworks number their tries of a rollout themselves (NeMo Gym's `episode_id.attempt`, taken from
`_ng_attempt_index` after a failure). Their numbering and rollbook's need not agree: rollbook may
already have moved a rollout to a new attempt on its own (a checkpoint restore, a recovery). The
rules here map one onto the other, from the log alone:

- A caller attempt below the one recorded for the rollout is stale: an older try of a caller that
  has moved on. It is refused and changes nothing.
- The recorded caller attempt, asked again, is the same episode: a finished rollout answers its
  recorded result; an unfinished one goes on under rollbook's current attempt (a lost reply, or a
  crash of the server that was running it).
- A newer caller attempt on an unfinished rollout fences rollbook's current attempt N and starts
  N+1 whose origin is N's latest durable boundary, so what N recorded (model calls, mutations, steps)
  is not done again. A rollout whose open session is `restart_only` cannot carry a live process
  over to a new attempt: N+1 is a fresh dispatch from the task's input instead.
- A finished rollout is never run again, whatever the caller's attempt: it answers its result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engine import catalog as ev
from engine.checkpoint import BOUNDARY_KINDS
from engine.errors import StaleAttempt
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import rollout_stream

Decision = Literal["start", "answer", "join", "takeover"]


@dataclass(frozen=True)
class Takeover:
    """Attempt `attempt` fenced; `attempt + 1` continues from `origin_position` (None: from input)."""

    rollout_id: str
    attempt: int
    origin_position: int | None
    disposition: Literal["continue", "fresh_dispatch"]

    @property
    def new_attempt(self) -> int:
        return self.attempt + 1


def decide(rollout_id: str, caller_attempt: int, recorded_caller_attempt: int | None, finished: bool) -> Decision:
    """What a caller's request for `caller_attempt` means, given what the log records."""
    if finished:
        return "answer"
    if recorded_caller_attempt is None:
        return "start"
    if caller_attempt < recorded_caller_attempt:
        raise StaleAttempt(
            f"rollout {rollout_id}: the caller's attempt {caller_attempt} is older than its attempt "
            f"{recorded_caller_attempt} already under way", rollout_id=rollout_id, attempt=caller_attempt)
    return "join" if caller_attempt == recorded_caller_attempt else "takeover"


def latest_boundary(history: Sequence[RecordedEvent]) -> int | None:
    return next((e.position for e in reversed(history) if e.kind in BOUNDARY_KINDS), None)


def restart_only_session(history: Sequence[RecordedEvent]) -> bool:
    """Whether the episode seeded a `restart_only` session (a live process no log can rebuild)."""
    return any(e.kind == ev.EPISODE_STEP and e.data.get("step") == "seed" and e.data.get("state_mode") == "restart_only"
               for e in history)


def takeover(rollout_id: str, attempt: int, history: Sequence[RecordedEvent]) -> Takeover:
    """Where attempt N+1 of a caller's retry starts, from attempt N's effective history."""
    if restart_only_session(history):
        return Takeover(rollout_id, attempt, None, "fresh_dispatch")
    return Takeover(rollout_id, attempt, latest_boundary(history), "continue")


def takeover_request(t: Takeover, reason: str) -> AppendRequest:
    """Fence N and start N+1 in one request: after it commits nothing of N can land."""
    stream = rollout_stream(t.rollout_id)
    origin = t.attempt if t.disposition == "continue" and t.origin_position is not None else None
    return AppendRequest((
        NewEvent(stream, ev.ATTEMPT_FENCED, {"reason": reason, "disposition": t.disposition}, t.rollout_id, t.attempt),
        NewEvent(stream, ev.ATTEMPT_STARTED, {
            "parent_attempt": t.attempt, "restored_from": None, "origin_attempt": origin,
            "origin_position": t.origin_position if origin is not None else None, "disposition": t.disposition,
            "reason": reason,
        }, t.rollout_id, t.new_attempt),
    ))
