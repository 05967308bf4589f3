"""How a session replays from its events (engine.sessions), without a database or a server: the one
fold the resources server, `rollbook replay` and the cut's lineage check share.

engine.sessions at its edges: what each event answers, where a replay starts, and which late or
missing sessions diverge (the cases tests/engine/test_sessions.py leaves out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from engine.catalog import AGENT_BOUNDARY, MUTATION_APPLIED, SESSION_CLOSED, SESSION_OPENED, SESSION_VERIFIED
from engine.errors import ReplayDivergence
from engine.events import GENESIS_HASH, RecordedEvent
from engine.identity import agent_stream, session_stream
from engine.sessions import SessionReplay, boundary_disagreement, session_revisions

S0, S1 = session_stream("r", 0), session_stream("r", 1)


class Counter:
    """An environment whose state is a number and whose effects add to it."""

    def __init__(self, name: str = "counter", state_mode: str = "exported") -> None:
        self.name, self.state_mode = name, state_mode

    def apply(self, state: Any, effect: Any) -> Any:
        if not isinstance(effect, int):
            raise ValueError(f"bad effect {effect!r}")
        return state + effect


def opener(data: Mapping[str, Any]) -> tuple[Counter, Any, Any]:
    return Counter(data["env"], data.get("state_mode", "exported")), data["task"], data["task"]["start"]


_position = iter(range(1, 10_000))


def event(stream: str, kind: str, **data: Any) -> RecordedEvent:
    return RecordedEvent(position=next(_position), stream=stream, stream_version=1, kind=kind, data=data, rollout_id="r",
                         attempt=int(stream.rsplit(":", 1)[1]), schema_version=1, writer="t", hash=GENESIS_HASH)


def opened(stream: str = S0, start: int = 10, **extra: Any) -> RecordedEvent:
    return event(stream, SESSION_OPENED, env="counter", task={"start": start}, **extra)


def mutation(revision: int, effect: Any, stream: str = S0) -> RecordedEvent:
    return event(stream, MUTATION_APPLIED, revision=revision, effect=effect)


def fold(*events: RecordedEvent) -> SessionReplay:
    replay = SessionReplay(opener)
    for e in events:
        replay.apply(e)
    return replay


def test_a_session_is_its_initial_state_plus_each_effect_in_order() -> None:
    replay = fold(opened(), mutation(1, 2), event(S0, SESSION_VERIFIED, reward=1.0), mutation(2, 3))
    assert (replay.open, replay.state, replay.revision, replay.revisions) == (True, 15, 2, {S0: 2})


def test_events_of_no_session_are_not_the_sessions_business() -> None:
    assert SessionReplay(opener).apply(event(agent_stream("r", 0), AGENT_BOUNDARY, revisions={S0: 5})) is None


def test_a_mutation_that_skips_a_revision_diverges() -> None:
    with pytest.raises(ReplayDivergence, match="revision 3 follows 1"):
        fold(opened(), mutation(1, 2), mutation(3, 1))


def test_a_mutation_before_any_session_diverges() -> None:
    with pytest.raises(ReplayDivergence, match="mutation before any session_opened"):
        fold(mutation(1, 2))


def test_a_reducer_that_fails_is_a_divergence_at_its_event() -> None:
    bad = mutation(1, "not a number")
    with pytest.raises(ReplayDivergence, match="does not replay: bad effect") as info:
        fold(opened(), bad)
    assert info.value.context["position"] == bad.position


def test_a_restart_only_session_counts_revisions_but_replays_no_state() -> None:
    replay = fold(opened(state_mode="restart_only"), mutation(1, "ls"), mutation(2, "pwd"))
    assert (replay.state, replay.revision) == (10, 2)


def test_a_reopened_session_continues_its_origins_replay_when_they_agree() -> None:
    replay = fold(opened(), mutation(1, 2), opened(S1, restored_from="ck", revision=1), mutation(2, 5, S1))
    assert (replay.state, replay.revision, replay.revisions) == (17, 2, {S0: 1, S1: 2})


@pytest.mark.parametrize("reopen", [
    {"restored_from": "ck", "revision": 2},  # another revision than the origin's replay
    {"recovered": True, "revision": 1, "env": "other"},  # another environment
])
def test_a_reopened_session_that_disagrees_with_its_origin_diverges(reopen: dict[str, Any]) -> None:
    bad = event(S1, SESSION_OPENED, **{"env": "counter", "task": {"start": 10}, **reopen})
    with pytest.raises(ReplayDivergence, match="says it was restored"):
        fold(opened(), mutation(1, 2), bad)


def test_a_session_reopened_after_its_origin_closed_diverges() -> None:
    with pytest.raises(ReplayDivergence, match="no session"):
        fold(opened(), event(S0, SESSION_CLOSED), opened(S1, restored_from="ck", revision=0))


def test_a_closed_session_is_no_longer_open() -> None:
    assert not fold(opened(), mutation(1, 2), event(S0, SESSION_CLOSED)).open


def test_the_recorded_revisions_take_a_reopened_sessions_carried_revision() -> None:
    assert session_revisions([opened(), mutation(1, 1), mutation(2, 1), opened(S1, restored_from="ck", revision=2)]) == {
        S0: 2, S1: 2}


def test_a_boundary_agrees_only_with_the_revisions_the_log_gives_each_session() -> None:
    revisions = {S0: 2, S1: 4}
    assert boundary_disagreement({"revisions": {S0: 2, S1: 4}}, revisions) is None
    assert boundary_disagreement({}, revisions) is None
    assert boundary_disagreement({"revisions": {S1: 3}}, revisions) == (S1, 3, 4)
    assert boundary_disagreement({"revisions": {session_stream("r", 2): 1}}, revisions) == (session_stream("r", 2), 1, 0)


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
