"""engine.retry at its edge: a takeover of an attempt that recorded no boundary continues from nothing."""

from __future__ import annotations

from engine import catalog as ev
from engine.events import GENESIS_HASH, RecordedEvent
from engine.retry import Takeover, takeover, takeover_request


def test_a_takeover_of_an_attempt_with_no_boundary_starts_its_successor_from_no_origin() -> None:
    history = [RecordedEvent(1, "rollout:r", 1, ev.ATTEMPT_STARTED, {}, "r", 0, 1, "t", GENESIS_HASH)]
    t = takeover("r", 0, history)
    assert t == Takeover("r", 0, None, "continue")
    started = takeover_request(t, "caller attempt 1").events[1]
    assert (started.data["origin_attempt"], started.data["origin_position"]) == (None, None)
    assert (started.data["parent_attempt"], started.attempt) == (0, 1)
