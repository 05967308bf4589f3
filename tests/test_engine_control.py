"""engine.control at its edge: an operation needs an active checkpoint unless it says otherwise."""

from __future__ import annotations

import pytest

from engine.control import check_operation
from engine.errors import InvalidPhase


def test_an_operation_needs_an_active_checkpoint_unless_it_says_otherwise() -> None:
    with pytest.raises(InvalidPhase, match="cannot commit checkpoint ck while idle"):
        check_operation("commit", "ck", 200.0, 100.0, active=None, phase="idle", finished=(), repeated=False)
    assert check_operation("commit", "ck", 200.0, 100.0, active="ck", phase="prepared", finished=(), repeated=False) is False
