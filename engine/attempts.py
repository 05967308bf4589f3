"""The rules of attempt liveness, applied to every append.

An append for attempt N is admitted only while N is live: started, not fenced, and above the
rollout's retire mark. The storage runs these checks inside the same critical section as the
fence itself, so a fence and an in-flight append of the same attempt cannot interleave.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.catalog import (
    ATTEMPT_FENCED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    ROLLOUT_FORGOTTEN,
    ROLLOUT_RETIRED,
)
from engine.errors import InvalidIdentifier, StaleAttempt, UnknownAttempt
from engine.events import NewEvent

# "retired" in the projection mirrors the rollout's retire mark, and the mark alone refuses: forget
# clears it, and a late writer of a forgotten rollout is admitted as before its retire.
LIVE_STATUSES = frozenset({"live", "finished", "retired"})


@dataclass
class RolloutState:
    """What the append check needs to know of one rollout, read under the append lock."""

    attempts: dict[int, str]  # attempt -> status
    retired_through: int = -1

    @property
    def latest(self) -> int:
        return max(self.attempts, default=-1)


def admit(event: NewEvent, rollout: RolloutState | None) -> RolloutState | None:
    """Check one event against its rollout's state; return the state after it (for the next
    event of the same batch). Raises StaleAttempt / UnknownAttempt and changes nothing."""
    if event.rollout_id is None:
        if event.attempt is not None:
            raise InvalidIdentifier("an event with an attempt must name its rollout")
        return rollout
    if event.attempt is None:
        raise InvalidIdentifier("an event of a rollout must carry its attempt index")
    state = rollout or RolloutState(attempts={})
    n = event.attempt
    if event.kind == ATTEMPT_STARTED:
        if n in state.attempts or n <= state.latest:
            raise StaleAttempt(
                f"attempt {n} of rollout {event.rollout_id} cannot start: attempt {state.latest} exists",
                rollout_id=event.rollout_id,
                attempt=n,
            )
        if n <= state.retired_through:
            raise StaleAttempt(
                f"attempt {n} of rollout {event.rollout_id} is at or below its retire mark {state.retired_through}",
                rollout_id=event.rollout_id,
                attempt=n,
            )
        return RolloutState({**state.attempts, n: "live"}, state.retired_through)
    if event.kind == ROLLOUT_FORGOTTEN:
        return RolloutState(dict(state.attempts), -1)
    if event.kind == ROLLOUT_RETIRED:
        through = int(event.data["through"])
        return RolloutState(dict(state.attempts), max(state.retired_through, through))
    status = state.attempts.get(n)
    if status is None:
        raise UnknownAttempt(
            f"attempt {n} of rollout {event.rollout_id} was never started", rollout_id=event.rollout_id, attempt=n
        )
    if status not in LIVE_STATUSES or n <= state.retired_through:
        why = "retired" if n <= state.retired_through else status
        raise StaleAttempt(
            f"attempt {n} of rollout {event.rollout_id} is {why}; nothing of it may be written",
            rollout_id=event.rollout_id,
            attempt=n,
        )
    if event.kind == ATTEMPT_FENCED:
        return RolloutState({**state.attempts, n: "fenced"}, state.retired_through)
    if event.kind == ATTEMPT_FINISHED:
        return RolloutState({**state.attempts, n: "finished"}, state.retired_through)
    return state
