"""engine.token_capture at its edges: an empty stream's state, and what a refused record quotes."""

from __future__ import annotations

import pytest

from engine.errors import TokenEntryConflict
from engine.token_capture import CapturedCall, CaptureState, Decision, decide_put, fold


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
