"""An error's JSON (engine.errors): its code and detail, and its context only when it has one."""

from __future__ import annotations

from engine.errors import StaleAttempt


def test_an_error_answers_its_code_and_detail_and_its_context_only_when_it_has_one() -> None:
    assert StaleAttempt("gone").to_json() == {"error": {"code": "stale_attempt", "detail": "gone"}}
    assert StaleAttempt("gone", rollout_id="r", attempt=1).to_json() == {
        "error": {"code": "stale_attempt", "detail": "gone", "context": {"rollout_id": "r", "attempt": 1}}}
