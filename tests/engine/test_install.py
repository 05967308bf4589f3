"""What a restore installs (engine.install): the one append that fences and starts, the rollouts it
leaves retired, and the attempt each participant hands its staged state to."""

from __future__ import annotations

from typing import Any

import pytest

from engine.catalog import ATTEMPT_FENCED, ROLLOUT_RETIRED
from engine.checkpoint import Cut, ScopeEntry
from engine.errors import InvalidCheckpointState
from engine.install import install_request, restored_attempt, restored_targets, retired_since


def row(status: str, restored_from: str | None) -> dict[str, Any]:
    return {"status": status, "restored_from": restored_from}


def test_the_attempt_a_restore_installed_is_the_latest_live_one_above_the_origin_restored_from_it() -> None:
    rows = {("r", 0): row("fenced", None), ("r", 1): row("fenced", "ck"), ("r", 2): row("live", "ck"),
            ("q", 3): row("live", "ck"), ("s", 1): row("live", "other"), ("t", 1): row("finished", "ck")}
    assert restored_attempt(rows, "r", 0, "ck") == 2
    assert restored_attempt(rows, "r", 2, "ck") is None  # nothing above the origin
    assert restored_attempt(rows, "s", 0, "ck") is None  # restored from another checkpoint
    assert restored_attempt(rows, "t", 0, "ck") is None  # not live
    assert restored_attempt(rows, "u", 0, "ck") is None


def test_an_install_leaves_every_rollout_retired_since_the_cut_as_it_is() -> None:
    """Continued, restarted from input or started after the cut: a rollout retired since is neither
    fenced (its retire mark refuses the write, which used to fail the whole restore) nor restarted;
    the rest are, and the install names what it left."""
    cut = Cut("ck", 10, (ScopeEntry("kept", 0, 5), ScopeEntry("gone-scoped", 0, 6)),
              fresh=(("fresh", 0), ("gone-fresh", 0)), digest="d")
    rows = {(r, 0): {"retired_through": 0 if r.startswith("gone") else None} for r in
            ("kept", "gone-scoped", "fresh", "gone-fresh", "gone-late")}
    retired = retired_since(rows)
    assert retired == {"gone-scoped", "gone-fresh", "gone-late"}
    request = install_request(cut, {r: 0 for r, _ in rows}, late=[("gone-late", 0)], retired=retired)
    touched = {e.rollout_id for e in request.events if e.rollout_id is not None}
    assert touched == {"kept", "fresh"}
    assert request.events[-1].data == {"checkpoint_id": "ck", "continued": 1, "fresh_dispatch": 1,
                                       "left_retired": ["gone-fresh", "gone-late", "gone-scoped"]}


def test_restored_targets_name_the_latest_live_attempt_the_restore_installed() -> None:
    rows = {("a", 0): {"status": "fenced"}, ("a", 1): {"status": "fenced", "restored_from": "ck"},
            ("a", 2): {"status": "live", "restored_from": "ck"}, ("b", 0): {"status": "fenced"},
            ("b", 1): {"status": "live", "restored_from": "other"}, ("c", 0): {"status": "live", "retired_through": 0},
            ("d", 3): {"status": "live", "restored_from": "ck"}}
    assert restored_targets(rows, [("a", 0), ("c", 0)], "ck") == {("a", 0): 2}
    with pytest.raises(InvalidCheckpointState, match="rollout d"):
        restored_targets(rows, [("d", 3)], "ck")  # only an attempt above the origin was installed over it
    with pytest.raises(InvalidCheckpointState, match="checkpoint ck is not installed: rollout b has no live attempt"):
        restored_targets(rows, [("b", 0)], "ck")


def test_an_install_leaves_rollouts_retired_since_the_cut_and_says_so() -> None:
    cut = Cut("ck", 10, (ScopeEntry("kept", 0, 5), ScopeEntry("gone", 0, 6)), fresh=(("fresh", 0), ("gone2", 0)),
              digest="d")
    request = install_request(cut, {"kept": 2}, late=[("late", 0)], retired={"gone", "gone2"})
    fenced = [(e.rollout_id, e.attempt) for e in request.events if e.kind == ATTEMPT_FENCED]
    assert fenced == [("kept", 2), ("fresh", 0), ("late", 0)]
    assert request.events[-1].data == {"checkpoint_id": "ck", "continued": 1, "fresh_dispatch": 1,
                                       "left_retired": ["gone", "gone2"]}
    assert not any(e.kind == ROLLOUT_RETIRED for e in request.events)
