"""The two state machines of a checkpoint, on `transitions`.

A participant's phases: idle -> preparing -> prepared -> committed, and idle -> restored in a
fresh process; resume returns to idle from any of them, and an expired lease or a failed prepare
aborts back to idle. The checkpoint transaction: started -> prepared -> committed -> published,
or aborted from any phase before published. Every transition returns the event that records it;
an illegal one raises InvalidPhase and changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transitions import Machine, MachineError

from engine import catalog as ev
from engine.errors import DeadlineExceeded, InvalidDeadline, InvalidPhase
from engine.events import NewEvent
from engine.identity import checkpoint_stream, participant_stream

PARTICIPANT_PHASES = ["idle", "preparing", "prepared", "committed", "restored"]
PARTICIPANT_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "prepare", "source": "idle", "dest": "preparing"},
    {"trigger": "prepared", "source": "preparing", "dest": "prepared"},
    {"trigger": "commit", "source": "prepared", "dest": "committed"},
    {"trigger": "restore", "source": "idle", "dest": "restored"},
    {"trigger": "resume", "source": ["preparing", "prepared", "committed", "restored"], "dest": "idle"},
    {"trigger": "abort", "source": ["preparing", "prepared", "committed"], "dest": "idle"},
]

CHECKPOINT_PHASES = ["started", "prepared", "committed", "published", "aborted"]
CHECKPOINT_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "prepared", "source": "started", "dest": "prepared"},
    {"trigger": "committed", "source": "prepared", "dest": "committed"},
    {"trigger": "published", "source": "committed", "dest": "published"},
    {"trigger": "aborted", "source": ["started", "prepared", "committed"], "dest": "aborted"},
]


class _Phases:
    """A transitions Machine whose illegal triggers are loud and whose moves are events."""

    state: str
    trigger: Any  # added by the transitions Machine to its model

    def __init__(self, phases: list[str], transitions: list[dict[str, Any]], initial: str) -> None:
        self._machine = Machine(
            model=self, states=phases, transitions=transitions, initial=initial, auto_transitions=False
        )

    @property
    def phase(self) -> str:
        return self.state

    def _move(self, trigger: str) -> str:
        before = self.state
        try:
            self.trigger(trigger)
        except MachineError as exc:
            raise InvalidPhase(f"cannot {trigger} while {before}", phase=before, operation=trigger) from exc
        return before

    def can(self, trigger: str) -> bool:
        return trigger in self._machine.get_triggers(self.state)


class ParticipantPhases(_Phases):
    def __init__(self, kind: str, instance: str) -> None:
        super().__init__(PARTICIPANT_PHASES, PARTICIPANT_TRANSITIONS, "idle")
        self.kind = kind
        self.instance = instance
        self.checkpoint_id: str | None = None

    def fire(self, trigger: str, checkpoint_id: str, **data: Any) -> NewEvent:
        before = self._move(trigger)
        self.checkpoint_id = None if self.state == "idle" else checkpoint_id
        return NewEvent(
            participant_stream(self.kind, self.instance),
            ev.participant_phase_kind(trigger),
            {"checkpoint_id": checkpoint_id, "from": before, "to": self.state, **data},
        )


class CheckpointPhases(_Phases):
    def __init__(self, checkpoint_id: str, phase: str = "started") -> None:
        super().__init__(CHECKPOINT_PHASES, CHECKPOINT_TRANSITIONS, phase)
        self.checkpoint_id = checkpoint_id

    def fire(self, trigger: str, **data: Any) -> NewEvent:
        self._move(trigger)
        return NewEvent(
            checkpoint_stream(self.checkpoint_id), ev.checkpoint_phase_kind(self.state), {"checkpoint_id": self.checkpoint_id, **data}
        )


def checkpoint_started(checkpoint_id: str, **data: Any) -> NewEvent:
    return NewEvent(checkpoint_stream(checkpoint_id), ev.CHECKPOINT_STARTED, {"checkpoint_id": checkpoint_id, **data})


# The one grace past a checkpoint's deadline: a participant's lease runs out then and it aborts by
# itself, and whoever reads the log (a coordinator, `rollbook checkpoint status`) records the abort.
LEASE_GRACE_S = 2.0


@dataclass(frozen=True)
class Lease:
    """A participant's hold on its paused state: past deadline + grace it aborts by itself."""

    deadline: float  # absolute, seconds since the epoch
    grace: float = LEASE_GRACE_S

    def expired(self, now: float) -> bool:
        return now > self.deadline + self.grace


def check_deadline(deadline: float, now: float, what: str) -> float:
    """Every control operation's deadline, checked before anything changes: a non-finite one is bad
    input (NaN compares false with everything, so it would never pass and never expire), a past
    one has nothing left to run in."""
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not math.isfinite(deadline):
        raise InvalidDeadline(f"the deadline of {what} must be a finite number of seconds since the epoch, got {deadline!r}")
    if deadline < now:
        raise DeadlineExceeded(f"the deadline of {what} has passed ({deadline:.3f} < now {now:.3f})")
    return float(deadline)


def on_this_clock(deadline: float, sent_at: float | None, now: float) -> float:
    """A deadline another host set, as this host's clock reads it. Two hosts' clocks can disagree by
    seconds; the span the sender granted does not: it is counted from receipt here, so it ends no
    earlier than the sender meant (later by the message's transit). Without `sent_at` the deadline is
    taken as it is (a sender that shares this clock)."""
    return deadline if sent_at is None else now + (deadline - sent_at)


# A checkpoint that is only started or prepared is held by a lease; past it (deadline + LEASE_GRACE_S)
# whoever notices first records the abort in the log.
OPEN_CHECKPOINT_PHASES = ("started", "prepared")


def checkpoint_lease_expired(phase: str, deadline: float | None, now: float, grace: float = LEASE_GRACE_S) -> bool:
    if phase not in OPEN_CHECKPOINT_PHASES or deadline is None:
        return False
    return not math.isfinite(deadline) or Lease(deadline, grace).expired(now)
