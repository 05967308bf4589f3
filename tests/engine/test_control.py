"""The control plane's rules (engine.control), without HTTP: which operation may run when, restore's
guards, the lease, and the retire and forget marks.

engine.control at its edge: an operation needs an active checkpoint unless it says otherwise.
"""

from __future__ import annotations

import pytest

from engine.catalog import ROLLOUT_FORGOTTEN, ROLLOUT_RETIRED
from engine.control import (
    check_operation,
    check_renew,
    check_restore,
    check_resume,
    check_transition,
    forget_events,
    lease_abort_due,
    retire_events,
)
from engine.errors import CheckpointConflict, DeadlineExceeded, InvalidPhase, InvalidRequest, StaleCheckpoint
from engine.phases import Lease, ParticipantPhases

NOW = 1000.0


def op(checkpoint_id: str = "ck", *, active: str | None = "ck", finished: set[str] | None = None, repeated: bool = False,
       deadline: float = NOW + 10, needs_active: bool = True) -> bool:
    return check_operation("commit", checkpoint_id, deadline, NOW, active=active, phase="prepared",
                           finished=finished or set(), repeated=repeated, needs_active=needs_active)


def test_an_operation_on_a_checkpoint_that_ended_here_is_stale_even_as_a_repeat() -> None:
    with pytest.raises(StaleCheckpoint):
        op(finished={"ck"}, repeated=True)


def test_a_repeat_is_answered_from_its_reply_even_past_its_deadline() -> None:
    assert op(repeated=True, deadline=NOW - 5) is True


def test_another_active_checkpoint_is_a_conflict_naming_it() -> None:
    with pytest.raises(CheckpointConflict, match="checkpoint other is active"):
        op(active="other")


def test_an_operation_that_needs_an_active_checkpoint_is_an_illegal_phase_while_idle() -> None:
    with pytest.raises(InvalidPhase, match="while idle"):
        op(active=None)
    assert op(active=None, needs_active=False) is False  # prepare and restore start from idle


def test_a_deadline_that_passed_is_refused_before_anything_changes() -> None:
    with pytest.raises(DeadlineExceeded):
        op(deadline=NOW - 1)


def test_renew_is_for_the_active_checkpoint_only() -> None:
    check_renew("ck", NOW + 1, NOW, active="ck", finished=set())
    with pytest.raises(CheckpointConflict):
        check_renew("ck", NOW + 1, NOW, active=None, finished=set())
    with pytest.raises(StaleCheckpoint):
        check_renew("ck", NOW + 1, NOW, active=None, finished={"ck"})
    with pytest.raises(DeadlineExceeded):
        check_renew("ck", NOW - 1, NOW, active="ck", finished=set())


def test_restore_is_refused_in_a_process_that_served_sessions_or_is_not_idle() -> None:
    phases = ParticipantPhases("agent", "a-0")
    check_restore(phases, served_sessions=False)
    with pytest.raises(InvalidPhase, match="served sessions"):
        check_restore(phases, served_sessions=True)
    phases.fire("prepare", "ck")
    with pytest.raises(InvalidPhase, match="cannot restore while preparing"):
        check_restore(phases, served_sessions=False)
    with pytest.raises(InvalidPhase, match="cannot commit while preparing"):
        check_transition(phases, "commit")


def test_resume_ends_the_active_checkpoint_only() -> None:
    check_resume("ck", active="ck", finished=set())
    with pytest.raises(StaleCheckpoint):
        check_resume("ck", active=None, finished={"ck"})
    with pytest.raises(InvalidPhase):
        check_resume("ck", active=None, finished=set())
    with pytest.raises(CheckpointConflict):
        check_resume("ck", active="other", finished=set())


def test_an_expired_lease_aborts_unless_the_participant_was_restored() -> None:
    lease = Lease(deadline=NOW - 3, grace=2)
    assert lease_abort_due(lease, "ck", "prepared", NOW)
    assert not lease_abort_due(lease, "ck", "restored", NOW)
    assert not lease_abort_due(Lease(deadline=NOW - 1, grace=2), "ck", "prepared", NOW)
    assert not lease_abort_due(None, "ck", "prepared", NOW)
    assert not lease_abort_due(lease, None, "idle", NOW)


def test_retire_records_only_the_marks_that_move() -> None:
    events = retire_events([("a", 2), ("b", 1), ("c", 0)], {"a": 1, "b": 1})
    assert [(e.rollout_id, e.attempt, e.kind, e.data) for e in events] == [
        ("a", 2, ROLLOUT_RETIRED, {"through": 2}), ("c", 0, ROLLOUT_RETIRED, {"through": 0})]


def test_retire_naming_a_rollout_twice_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="named once"):
        retire_events([("a", 1), ("a", 2)], {})


def test_forget_clears_only_marks_that_are_set_once_each() -> None:
    events = forget_events(["a", "b", "a"], {"a": 3, "b": -1})
    assert [(e.rollout_id, e.attempt, e.kind) for e in events] == [("a", 3, ROLLOUT_FORGOTTEN)]


def test_an_operation_needs_an_active_checkpoint_unless_it_says_otherwise() -> None:
    with pytest.raises(InvalidPhase, match="cannot commit checkpoint ck while idle"):
        check_operation("commit", "ck", 200.0, 100.0, active=None, phase="idle", finished=(), repeated=False)
    assert check_operation("commit", "ck", 200.0, 100.0, active="ck", phase="prepared", finished=(), repeated=False) is False


def test_forget_clears_a_mark_at_attempt_zero_and_skips_a_rollout_never_retired() -> None:
    events = forget_events(["a", "never"], {"a": 0})
    assert [(e.rollout_id, e.attempt, e.kind) for e in events] == [("a", 0, ROLLOUT_FORGOTTEN)]
