"""engine.control at its edge: an operation needs an active checkpoint unless it says otherwise."""

from __future__ import annotations

import pytest

from engine.catalog import ROLLOUT_FORGOTTEN
from engine.control import check_operation, forget_events
from engine.errors import InvalidPhase


def test_an_operation_needs_an_active_checkpoint_unless_it_says_otherwise() -> None:
    with pytest.raises(InvalidPhase, match="cannot commit checkpoint ck while idle"):
        check_operation("commit", "ck", 200.0, 100.0, active=None, phase="idle", finished=(), repeated=False)
    assert check_operation("commit", "ck", 200.0, 100.0, active="ck", phase="prepared", finished=(), repeated=False) is False


def test_forget_clears_a_mark_at_attempt_zero_and_skips_a_rollout_never_retired() -> None:
    events = forget_events(["a", "never"], {"a": 0})
    assert [(e.rollout_id, e.attempt, e.kind) for e in events] == [("a", 0, ROLLOUT_FORGOTTEN)]
