"""The model-call identity and replacement rules (engine.calls), the lookup of the attempt a restore
installed and an attempt's lineage (engine.checkpoint), without HTTP or a database."""

from __future__ import annotations

from typing import Any

import pytest

from engine.calls import (
    CUSTODY,
    CallState,
    Replacements,
    call_records,
    check_owner,
    check_replaceable,
    check_same_request,
)
from engine.catalog import (
    ATTEMPT_STARTED,
    CALL_ACCEPTED,
    CALL_COMPLETED,
    CALL_CUT,
    CALL_EXCLUDED,
    CALL_FAILED,
    EPISODE_STEP,
)
from engine.checkpoint import Cut, CutHistory
from engine.errors import InvalidIdentifier, InvalidPhase, RequestConflict
from engine.events import GENESIS_HASH, RecordedEvent
from engine.identity import call_stream
from engine.lineage import origin_of


def accepted(call_id: str, replaces: str | None, kind: str = CALL_ACCEPTED) -> RecordedEvent:
    return RecordedEvent(position=1, stream=call_stream(call_id), stream_version=1, kind=kind,
                         data={"call_id": call_id, "replaces": replaces}, rollout_id="r", attempt=1, schema_version=1,
                         writer="t", hash=GENESIS_HASH)


def test_a_call_id_belongs_to_the_attempt_that_first_used_it() -> None:
    check_owner("c1", "r", 0, "r", 0)
    for rollout, attempt in (("r", 1), ("q", 0)):
        with pytest.raises(InvalidIdentifier, match="belongs to rollout r attempt 0"):
            check_owner("c1", "r", 0, rollout, attempt)


def test_a_call_id_names_one_request() -> None:
    check_same_request("c1", "d1", "d1")
    check_same_request("c1", None, "d1")  # accepted before requests carried a digest
    with pytest.raises(RequestConflict):
        check_same_request("c1", "d1", "d2")


def test_a_call_is_replaced_only_from_its_rollout_and_its_attempt_or_a_later_one() -> None:
    check_replaceable("c1", "r", 0, "r", 0)
    check_replaceable("c1", "r", 0, "r", 2)
    with pytest.raises(InvalidIdentifier, match="cannot be replaced"):
        check_replaceable("c1", "r", 2, "r", 1)
    with pytest.raises(InvalidIdentifier, match="cannot be replaced"):
        check_replaceable("c1", "q", 0, "r", 0)


def test_one_call_per_attempt_may_replace_a_given_call() -> None:
    r = Replacements()
    claim = r.claim("old", 1, "new-a")
    assert r.claim("old", 1, "new-a") == claim  # the same call asking again keeps it
    with pytest.raises(InvalidPhase, match="already linked to call new-a of attempt 1"):
        r.claim("old", 1, "new-b")
    r.claim("old", 2, "new-b")  # another attempt may replace it once too


def test_a_replacement_another_server_accepted_is_learned_from_the_log() -> None:
    r = Replacements()
    assert r.needs_log("old", 1, "new-b")
    r.learn("old", 1, "new-b", [accepted("other", "x"), accepted("new-a", "old", CALL_COMPLETED), accepted("new-a", "old"),
                                accepted("new-b", "old")])
    assert not r.needs_log("old", 1, "new-b")
    with pytest.raises(InvalidPhase, match="already linked to call new-a"):
        r.claim("old", 1, "new-b")


def test_a_released_claim_lets_another_call_replace() -> None:
    r = Replacements()
    claim = r.claim("old", 1, "new-a")
    r.release(claim, "new-b")  # only the holder releases
    with pytest.raises(InvalidPhase):
        r.claim("old", 1, "new-b")
    r.release(claim, "new-a")
    r.claim("old", 1, "new-b")


def started(attempt: int, position: int, **data: Any) -> RecordedEvent:
    return RecordedEvent(position=position, stream="rollout:r", stream_version=attempt + 1, kind=ATTEMPT_STARTED,
                         data=data, rollout_id="r", attempt=attempt, schema_version=1, writer="t", hash=GENESIS_HASH)


def step(attempt: int, position: int) -> RecordedEvent:
    return RecordedEvent(position=position, stream=f"episode:r:{attempt}", stream_version=position, kind=EPISODE_STEP,
                         data={"step": "seed"}, rollout_id="r", attempt=attempt, schema_version=1, writer="t",
                         hash=GENESIS_HASH)


def test_an_attempts_lineage_continues_from_its_origins_boundary_or_starts_from_input() -> None:
    assert origin_of([started(0, 1, parent_attempt=None)]) is None
    assert origin_of([started(1, 5, parent_attempt=0, origin_attempt=None, origin_position=None)]) is None  # fresh dispatch
    assert origin_of([started(1, 5, origin_attempt=0, origin_position=3)]) == (0, 3)
    assert origin_of([started(1, 5, origin_attempt=0)]) == (0, None)  # no boundary yet: all of the origin
    assert origin_of([step(1, 6)]) is None


def test_the_effective_history_is_the_origins_events_up_to_its_boundary_then_the_attempts_own() -> None:
    events = (started(0, 1, parent_attempt=None), step(0, 2), step(0, 3), step(0, 4),
              started(1, 5, origin_attempt=0, origin_position=3), step(1, 6),
              started(2, 7, origin_attempt=1, origin_position=6), step(2, 8))
    read = CutHistory(Cut("ck", 8, (), (), (), ""), {"r": events}, ())
    assert [e.position for e in read.effective("r", 2)] == [1, 2, 3, 5, 6, 7, 8]
    assert [e.position for e in read.effective("r", 1, to=5)] == [1, 2, 3, 5]


def test_only_an_acceptance_under_another_id_tells_of_a_replacement() -> None:
    claims = Replacements()
    claims.learn("old", 1, "mine", [accepted("other", "old", kind=CALL_COMPLETED), accepted("mine", "old"),
                                    accepted("third", "older")])
    assert claims.needs_log("old", 1, "mine")
    claims.learn("old", 1, "mine", [accepted("other", "old")])
    assert not claims.needs_log("old", 1, "mine")


def custody(call_id: str, *kinds: str, attempt: int = 0) -> list[RecordedEvent]:
    return [RecordedEvent(position=i + 1, stream=call_stream(call_id), stream_version=i + 1, kind=k,
                          data={"call_id": call_id, "step": i}, rollout_id="r", attempt=attempt, schema_version=1,
                          writer="t", hash=GENESIS_HASH) for i, k in enumerate(kinds)]


def test_a_calls_custody_is_its_last_custody_event_with_the_acceptance_before_it() -> None:
    records = call_records([*custody("c1", CALL_ACCEPTED, CALL_CUT), *custody("c2", CALL_ACCEPTED),
                            *custody("c3", CALL_ACCEPTED, CALL_FAILED)])
    assert {c: (r.status, r.accepted["step"]) for c, r in records.items()} == {
        "c1": (CallState.CUT, 0), "c2": (CallState.ACCEPTED, 0), "c3": (CallState.FAILED, 0)}
    assert records["c1"].data["step"] == 1 and (records["c1"].rollout_id, records["c1"].attempt) == ("r", 0)


def test_an_exclusion_after_a_durable_reply_changes_nothing_and_before_one_ends_the_call() -> None:
    """A retry refused while admission was closed (`call_excluded`) leaves a cut prefix or a completed
    reply standing: a replacement still starts from it."""
    assert call_records(custody("c", CALL_ACCEPTED, CALL_CUT, CALL_EXCLUDED))["c"].status == CallState.CUT
    assert call_records(custody("c", CALL_ACCEPTED, CALL_COMPLETED, CALL_EXCLUDED))["c"].status == CallState.COMPLETED
    assert call_records(custody("c", CALL_ACCEPTED, CALL_EXCLUDED))["c"].status == CallState.EXCLUDED


def test_only_a_completed_or_cut_call_has_a_durable_reply() -> None:
    assert {s for s in CallState if s.durable_reply} == {CallState.COMPLETED, CallState.CUT}
    assert set(CallState) == {CallState(k.removeprefix("call_")) for k in CUSTODY}
