"""The rules of the control plane: which operation a participant may run, when, and what it records.

participants.base.control_plane authenticates, parses bodies, keeps the replies of repeats and appends;
every decision it takes about a checkpoint operation is one of these functions. The phases
themselves (which transition is legal) are engine.phases; so are the lease and the deadline.

- A checkpoint that has ended here (resumed or aborted) is stale for every operation.
- A repeat of an operation that succeeded gets its recorded reply, even after its deadline.
- Another checkpoint while one is active is a conflict; an operation that needs an active
  checkpoint (commit, resume) is an illegal phase while idle.
- The deadline is checked before anything changes.
- Restore runs only in a process that has served no sessions (its memory would mix with the
  restored state) and only from idle.
- A lease that expires aborts the checkpoint, unless the participant was restored: a restored
  process has nothing to go back to and waits for its resume.
- Retire moves each named rollout's retire mark, only forward, all in one append; forget clears the
  marks that are set.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from engine import catalog as ev
from engine.errors import CheckpointConflict, InvalidPhase, InvalidRequest, StaleCheckpoint
from engine.events import NewEvent
from engine.identity import rollout_stream
from engine.phases import Lease, ParticipantPhases, check_deadline


def check_operation(op: str, checkpoint_id: str, deadline: float, now: float, *, active: str | None, phase: str,
                    finished: Container[str], repeated: bool, needs_active: bool = True) -> bool:
    """Whether `op` for `checkpoint_id` may run now. True: it is a repeat of one that succeeded,
    answer with its recorded reply. Raises StaleCheckpoint, CheckpointConflict, InvalidPhase, or
    the deadline's errors, before anything changes."""
    if checkpoint_id in finished:
        raise StaleCheckpoint(f"checkpoint {checkpoint_id} has already been resumed here")
    if repeated:
        return True
    if active is not None and active != checkpoint_id:
        raise CheckpointConflict(f"checkpoint {active} is active ({phase}); {checkpoint_id} must wait")
    if needs_active and active is None:
        raise InvalidPhase(f"cannot {op} checkpoint {checkpoint_id} while idle", phase="idle", operation=op)
    check_deadline(deadline, now, f"{op} for {checkpoint_id}")
    return False


def check_renew(checkpoint_id: str, deadline: float, now: float, *, active: str | None, finished: Container[str]) -> None:
    """A renew extends the lease of the active checkpoint only."""
    if checkpoint_id in finished:
        raise StaleCheckpoint(f"checkpoint {checkpoint_id} has already been resumed here")
    if active != checkpoint_id:
        raise CheckpointConflict(f"checkpoint {checkpoint_id} is not the active one")
    check_deadline(deadline, now, f"renew for {checkpoint_id}")


def check_transition(phases: ParticipantPhases, op: str) -> None:
    if not phases.can(op):
        raise InvalidPhase(f"cannot {op} while {phases.phase}", phase=phases.phase, operation=op)


def check_restore(phases: ParticipantPhases, served_sessions: bool) -> None:
    """Restore installs state from the log into an empty process, never beside state it served."""
    if served_sessions:
        raise InvalidPhase("restore refused: this process has already served sessions; start a fresh one",
                           phase=phases.phase, operation="restore")
    check_transition(phases, "restore")


def check_resume(checkpoint_id: str, *, active: str | None, finished: Container[str]) -> None:
    """Resume ends the active checkpoint; a repeat of a resume that succeeded is answered before this."""
    if active == checkpoint_id:
        return
    if checkpoint_id in finished:
        raise StaleCheckpoint(f"checkpoint {checkpoint_id} has already ended here")
    if active is None:
        raise InvalidPhase(f"cannot resume {checkpoint_id} while idle", phase="idle", operation="resume")
    raise CheckpointConflict(f"checkpoint {active} is active, not {checkpoint_id}")


def lease_abort_due(lease: Lease | None, active: str | None, phase: str, now: float) -> bool:
    """Whether the participant must abort its active checkpoint by itself: its lease ran out and it
    was not restored."""
    return active is not None and lease is not None and lease.expired(now) and phase != "restored"


def check_retirements(retirements: Sequence[tuple[str, int]]) -> None:
    """Each rollout may be named once in a retire: the request is all or nothing."""
    if len({rid for rid, _ in retirements}) != len(retirements):
        raise InvalidRequest("each rollout may be named once in a retire")


def retire_events(retirements: Sequence[tuple[str, int]], marks: Mapping[str, int]) -> tuple[NewEvent, ...]:
    """One event per retire mark that moves (a repeat, or a mark already at or above, moves none)."""
    check_retirements(retirements)
    return tuple(NewEvent(rollout_stream(rid), ev.ROLLOUT_RETIRED, {"through": through}, rid, through)
                 for rid, through in retirements if through > marks.get(rid, -1))


def forget_events(rollout_ids: Sequence[str], marks: Mapping[str, int]) -> tuple[NewEvent, ...]:
    """One event per rollout whose retire mark is set: forget clears it (a late writer is admitted again)."""
    return tuple(NewEvent(rollout_stream(rid), ev.ROLLOUT_FORGOTTEN, {}, rid, marks[rid])
                 for rid in dict.fromkeys(rollout_ids) if marks.get(rid, -1) >= 0)
