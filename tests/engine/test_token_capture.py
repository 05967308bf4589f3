"""The rules of a trainer's token capture (engine.token_capture), without a database.

engine.token_capture at its edges: an empty stream's state, and what a refused record quotes.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from engine import token_capture as tc
from engine.errors import CaptureFrozen, CaptureRetired, InvalidIdentifier, TokenEntryConflict
from engine.events import RecordedEvent
from engine.token_capture import CapturedCall, CaptureState, Decision, decide_put, fold

_positions = itertools.count(1)


def ev(kind: str, v: int = 1, attempt: int = 0, position: int | None = None, **data: Any) -> RecordedEvent:
    return RecordedEvent(position=position if position is not None else next(_positions), stream="s",
                         stream_version=v, kind=kind, data=data, rollout_id="r", attempt=attempt,
                         schema_version=1, writer="t", hash=b"")


def state(*events: RecordedEvent) -> tc.CaptureState:
    return tc.fold(list(events))


PUT = dict(model_call_id="c1", entry_digest="d1")


@pytest.mark.parametrize("key, want", [("r", ("r", 0)), ("r-a2", ("r", 2)), ("r-a0", ("r-a0", 0)),
                                       ("r-a12", ("r", 12)), ("1-0-a3", ("1-0", 3))])
def test_gyms_rollout_key_names_rollbooks_rollout_and_attempt(key: str, want: tuple[str, int]) -> None:
    assert tc.split_capture_key(key) == want
    assert tc.capture_key(*want) == key


@pytest.mark.parametrize("key", ["", "a b", "../x", None, "-a1"])
def test_a_key_that_is_no_rollout_id_is_refused(key: object) -> None:
    with pytest.raises(InvalidIdentifier):
        tc.split_capture_key(key)


def test_fold_reads_intents_entries_marks_the_first_freeze_and_the_retirement() -> None:
    s = state(ev(tc.CAPTURE_CALL_BEGUN, 1, model_call_id="c1"), ev(tc.CAPTURE_CALL_BEGUN, 2, model_call_id="c2"),
              ev(tc.CAPTURE_ENTRY_PUT, 3, **PUT), ev(tc.CAPTURE_FROZEN, 4, position=40),
              ev(tc.CAPTURE_FROZEN, 5, position=50), ev(tc.CAPTURE_INCOMPLETE, 6, model_call_id="c3", reason="x"),
              ev(tc.CAPTURE_RETIRED, 7, snapshot_id="r@40", version=6))
    assert (s.version, list(s.entries), s.frozen_position, s.dangling()) == (7, ["c1"], 40, ["c2"])
    assert s.incomplete == [{"model_call_id": "c3", "reason": "x"}] and s.retired == {"snapshot_id": "r@40", "version": 6}


def test_a_dangling_intent_alone_makes_the_capture_incomplete() -> None:
    assert state(ev(tc.CAPTURE_CALL_BEGUN, 1, model_call_id="c1")).is_incomplete()
    assert not state(ev(tc.CAPTURE_CALL_BEGUN, 1, model_call_id="c1"), ev(tc.CAPTURE_ENTRY_PUT, 2, **PUT)).is_incomplete()
    assert state(ev(tc.CAPTURE_INCOMPLETE, 1)).is_incomplete()
    assert not state().is_incomplete()


def test_put_appends_once_then_takes_the_same_bytes_as_a_retry_and_refuses_others() -> None:
    open_ = state(ev(tc.CAPTURE_ENTRY_PUT, 1, **PUT))
    assert tc.decide_put(state(), "r", "c1", "d1") is tc.Decision.APPEND
    assert tc.decide_put(open_, "r", "c1", "d1") is tc.Decision.NOTHING
    assert tc.decide_put(open_, "r", "c2", "d2") is tc.Decision.APPEND
    with pytest.raises(TokenEntryConflict):
        tc.decide_put(open_, "r", "c1", "d2")


def test_after_freeze_put_takes_only_a_retry_of_what_the_snapshot_holds() -> None:
    frozen = state(ev(tc.CAPTURE_ENTRY_PUT, 1, **PUT), ev(tc.CAPTURE_FROZEN, 2))
    assert tc.decide_put(frozen, "r", "c1", "d1") is tc.Decision.NOTHING
    with pytest.raises(CaptureFrozen):
        tc.decide_put(frozen, "r", "c2", "d2")
    with pytest.raises(TokenEntryConflict):
        tc.decide_put(frozen, "r", "c1", "d9")


def test_begin_is_once_per_call_and_refused_after_freeze() -> None:
    begun = state(ev(tc.CAPTURE_CALL_BEGUN, 1, model_call_id="c1"))
    assert tc.decide_begin(state(), "r", "c1") is tc.Decision.APPEND
    assert tc.decide_begin(begun, "r", "c1") is tc.Decision.NOTHING
    assert tc.decide_begin(state(ev(tc.CAPTURE_ENTRY_PUT, 1, **PUT)), "r", "c1") is tc.Decision.NOTHING
    with pytest.raises(CaptureFrozen):
        tc.decide_begin(state(ev(tc.CAPTURE_FROZEN, 1)), "r", "c2")


def test_incomplete_is_written_even_after_freeze_and_freeze_is_written_once() -> None:
    frozen = state(ev(tc.CAPTURE_FROZEN, 1))
    assert tc.decide_incomplete(frozen, "r") is tc.Decision.APPEND
    assert tc.decide_freeze(state(), "r") is tc.Decision.APPEND
    assert tc.decide_freeze(frozen, "r") is tc.Decision.NOTHING


def test_after_retirement_every_write_is_refused() -> None:
    retired = state(ev(tc.CAPTURE_FROZEN, 1), ev(tc.CAPTURE_RETIRED, 2, snapshot_id="x", version=1))
    for decide in (lambda: tc.decide_put(retired, "r", "c1", "d1"), lambda: tc.decide_begin(retired, "r", "c1"),
                   lambda: tc.decide_incomplete(retired, "r"), lambda: tc.decide_freeze(retired, "r")):
        with pytest.raises(CaptureRetired):
            decide()


def test_retirement_takes_exactly_the_frozen_snapshot_at_its_version() -> None:
    frozen = state(ev(tc.CAPTURE_ENTRY_PUT, 1, **PUT), ev(tc.CAPTURE_FROZEN, 2, position=7))
    sid = tc.snapshot_id("r", 0, 7)
    assert sid == "r@7" and tc.snapshot_id("r", 2, 7) == "r-a2@7"
    assert tc.decide_retire(frozen, "r", 0, sid, 2) is tc.Decision.APPEND
    assert tc.decide_retire(frozen, "r", 0, sid, 3) is None
    assert tc.decide_retire(frozen, "r", 0, sid, 1) is None
    assert tc.decide_retire(frozen, "r", 0, "r@8", 2) is None
    assert tc.decide_retire(frozen, "r", 0, sid, 3, late=1) is tc.Decision.APPEND
    assert tc.decide_retire(frozen, "r", 0, sid, 2, late=1) is None
    assert tc.decide_retire(state(ev(tc.CAPTURE_ENTRY_PUT, 1, **PUT)), "r", 0, "r@1", 1) is None  # never frozen
    retired = state(ev(tc.CAPTURE_FROZEN, 1, position=7), ev(tc.CAPTURE_RETIRED, 2, snapshot_id=sid, version=1))
    assert tc.decide_retire(retired, "r", 0, sid, 1) is tc.Decision.NOTHING
    assert tc.decide_retire(retired, "r", 0, sid, 2) is None


def _call(kind: str, call_id: str, position: int, attempt: int = 0, **data: Any) -> RecordedEvent:
    return ev(kind, attempt=attempt, position=position, call_id=call_id, **data)


DONE = dict(receipt={"blob_id": "g"}, prompt_receipt={"blob_id": "p"})


def test_the_served_snapshot_holds_calls_completed_by_the_freeze_and_counts_the_rest() -> None:
    history = [
        _call("call_accepted", "t0", 1, parent_call_id=None),
        _call("call_completed", "t0", 2, **DONE),
        _call("call_accepted", "t1", 3, parent_call_id="t0"),
        _call("call_cut", "t1", 4, receipt={"blob_id": "x"}),
        _call("call_accepted", "t1", 5, parent_call_id="t0"),  # the same call continued after resume
        _call("call_completed", "t1", 6, attempt=1, **DONE),
        _call("call_accepted", "t2", 7),
        _call("call_completed", "old", 8, receipt={"blob_id": "s"}),  # no prompt ids: cannot be trained on
        _call("call_completed", "gym", 9, source="nemo_gym", **DONE),  # the sink's own: in the capture stream
        ev("agent_boundary", position=10),
        _call("call_completed", "t2", 11, **DONE),
        _call("call_failed", "t3", 12),
    ]
    snap = tc.served_snapshot(history, 10, "nemo_gym")
    assert [(c.call_id, c.position, c.attempt) for c in snap.calls] == [("t0", 2, 0), ("t1", 6, 1)]
    assert snap.calls[1].accepted == {"call_id": "t1", "parent_call_id": "t0"}
    assert (snap.missing, snap.late) == (("old", "t2"), 2)
    assert tc.served_snapshot(history, 12, "nemo_gym").missing == ("old", "t3")


def test_an_empty_capture_stream_is_at_version_zero_with_nothing_in_it() -> None:
    state = fold([])
    assert (state.version, state.entries, state.intents, state.incomplete) == (0, {}, {}, [])
    assert not state.frozen and not state.is_incomplete() and state.retired is None


def test_a_conflicting_record_quotes_twelve_characters_of_each_digest() -> None:
    state = CaptureState()
    assert decide_put(state, "r", "c1", "a" * 11 + "Xtail") == Decision.APPEND
    state.entries["c1"] = CapturedCall("c1", "a" * 11 + "Xtail", {}, 3)
    with pytest.raises(TokenEntryConflict) as refused:
        decide_put(state, "r", "c1", "b" * 11 + "Ytail")
    assert f"(digest {'a' * 11}X, this one {'b' * 11}Y)" in str(refused.value)
