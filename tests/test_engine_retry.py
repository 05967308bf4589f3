"""engine.retry at its edge: a takeover that names no origin position continues from no origin."""

from __future__ import annotations

from engine.retry import Takeover, takeover_request


def test_a_continued_takeover_without_an_origin_position_starts_its_successor_from_no_origin() -> None:
    started = takeover_request(Takeover("r", 0, None, "continue"), "caller attempt 1").events[1]
    assert (started.data["origin_attempt"], started.data["origin_position"]) == (None, None)
    assert (started.data["parent_attempt"], started.attempt) == (0, 1)
