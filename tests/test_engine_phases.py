"""engine.phases at its edges: only the declared moves exist, and a deadline of exactly now still runs."""

from __future__ import annotations

import pytest

from engine.errors import InvalidPhase
from engine.phases import CheckpointPhases, ParticipantPhases, check_deadline


@pytest.mark.parametrize("trigger", ["to_committed", "to_restored", "to_idle"])
def test_a_participant_has_no_move_outside_the_declared_table(trigger: str) -> None:
    phases = ParticipantPhases("agent", "a1")
    assert not phases.can(trigger)
    with pytest.raises((AttributeError, InvalidPhase)):  # loud, whichever way the machine says it
        phases.fire(trigger, "ck")
    assert phases.phase == "idle"


def test_a_checkpoint_has_no_move_outside_the_declared_table() -> None:
    phases = CheckpointPhases("ck")
    assert not phases.can("to_published")
    with pytest.raises((AttributeError, InvalidPhase)):
        phases.fire("to_published")
    assert phases.phase == "started"


def test_a_deadline_of_exactly_now_has_not_passed() -> None:
    assert check_deadline(100.0, 100.0, "prepare") == 100.0
    assert check_deadline(100, 99.5, "prepare") == 100.0
