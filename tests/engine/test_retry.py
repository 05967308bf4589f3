"""engine.retry: what a caller's attempt means for a rollout, from the log alone.

engine.retry at its edge: a takeover that names no origin position continues from no origin.
"""

from __future__ import annotations

import pytest

from engine import attempts as A
from engine import retry
from engine.errors import StaleAttempt
from engine.events import RecordedEvent
from engine.retry import Takeover, takeover_request


def event(position: int, kind: str, attempt: int = 0, **data: object) -> RecordedEvent:
    return RecordedEvent(position, "s", position, kind, dict(data), "r", attempt, 1, "w", b"")


def test_decide_follows_the_callers_attempt_against_the_recorded_one() -> None:
    assert retry.decide("r", 0, None, finished=False) == "start"
    assert retry.decide("r", 2, 2, finished=False) == "join"
    assert retry.decide("r", 3, 2, finished=False) == "takeover"
    assert retry.decide("r", 0, 5, finished=True) == "answer"  # a finished rollout never runs again
    with pytest.raises(StaleAttempt):
        retry.decide("r", 1, 2, finished=False)


def test_a_takeover_continues_from_the_latest_boundary_unless_the_session_is_restart_only() -> None:
    history = [event(1, A.ATTEMPT_STARTED), event(2, "episode_started"), event(3, "episode_step", step="seed",
               state_mode="exported"), event(4, "agent_boundary"), event(5, "call_accepted")]
    t = retry.takeover("r", 0, history)
    assert (t.disposition, t.origin_position, t.new_attempt) == ("continue", 4, 1)
    fenced, started = retry.takeover_request(t, "caller attempt 1").events
    assert (fenced.kind, fenced.attempt, started.kind, started.attempt) == (A.ATTEMPT_FENCED, 0, A.ATTEMPT_STARTED, 1)
    assert (started.data["origin_attempt"], started.data["origin_position"]) == (0, 4)
    live = [*history[:2], event(3, "episode_step", step="seed", state_mode="restart_only"), event(4, "agent_boundary")]
    fresh = retry.takeover("r", 0, live)
    assert (fresh.disposition, fresh.origin_position) == ("fresh_dispatch", None)
    assert retry.takeover_request(fresh, "x").events[1].data["origin_attempt"] is None


def test_a_continued_takeover_without_an_origin_position_starts_its_successor_from_no_origin() -> None:
    started = takeover_request(Takeover("r", 0, None, "continue"), "caller attempt 1").events[1]
    assert (started.data["origin_attempt"], started.data["origin_position"]) == (None, None)
    assert (started.data["parent_attempt"], started.attempt) == (0, 1)
