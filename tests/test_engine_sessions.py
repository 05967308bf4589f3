"""engine.sessions at its edges: what each event answers, where a replay starts, and which late or
missing sessions diverge (the cases tests/test_session_rules.py leaves out)."""

from __future__ import annotations

import pytest

from engine.catalog import SESSION_CLOSED, SESSION_VERIFIED
from engine.errors import ReplayDivergence
from engine.identity import session_stream
from engine.sessions import SessionReplay, boundary_disagreement, session_revisions
from tests.test_session_rules import S0, S1, event, fold, mutation, opened, opener


def test_a_fresh_replay_is_closed_at_revision_zero_with_nothing_seen() -> None:
    replay = SessionReplay(opener)
    assert (replay.open, replay.revision, replay.revisions, replay.env, replay.state) == (False, 0, {}, None, None)


def test_each_event_says_what_it_did() -> None:
    replay = SessionReplay(opener)
    assert [replay.apply(e) for e in (opened(), mutation(1, 2), event(S0, SESSION_VERIFIED, reward=1.0),
                                      opened(S1, restored_from="ck", revision=1), event(S1, SESSION_CLOSED))] == [
        "opened", "mutated", "recorded", "restored", "closed"]


def test_a_session_opened_without_a_revision_is_at_revision_zero() -> None:
    assert session_revisions([opened()]) == {S0: 0}
    assert fold(opened()).revisions == {S0: 0}


def test_a_boundary_that_saw_revision_zero_of_a_session_the_log_never_changed_agrees() -> None:
    assert boundary_disagreement({"revisions": {session_stream("r", 5): 0}}, {}) is None


def test_a_reopened_session_with_no_origin_replayed_diverges_saying_so() -> None:
    with pytest.raises(ReplayDivergence, match="the replay of its origin is at no session"):
        fold(opened(S1, restored_from="ck", revision=0))


def test_a_mutation_after_the_session_closed_diverges() -> None:
    with pytest.raises(ReplayDivergence, match="mutation before any session_opened"):
        fold(opened(), mutation(1, 2), event(S0, SESSION_CLOSED), mutation(2, 2))
