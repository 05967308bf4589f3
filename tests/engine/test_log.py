"""The pure planning of an append (engine.log): versions, positions and hashes assigned in order,
expected versions and attempt liveness checked, and a refused request changing nothing."""

from __future__ import annotations

from typing import Any

import pytest

from engine.attempts import RolloutState
from engine.catalog import ATTEMPT_STARTED, EPISODE_STEP
from engine.errors import (
    InvalidIdentifier,
    InvalidPayload,
    PayloadTooLarge,
    StaleAttempt,
    UnknownAttempt,
    VersionConflict,
)
from engine.events import GENESIS_HASH, AppendRequest, NewEvent, chain_hash, encode_payload
from engine.identity import episode_stream, rollout_stream
from engine.log import NEW_STREAM, LogState, StreamHead, append_one, plan_batch, plan_request


def start(rollout: str, attempt: int = 0) -> NewEvent:
    return NewEvent(rollout_stream(rollout), ATTEMPT_STARTED, {}, rollout, attempt)


def step(rollout: str, attempt: int = 0, **data: Any) -> NewEvent:
    return NewEvent(episode_stream(rollout, attempt), EPISODE_STEP, data, rollout, attempt)


def plain(stream: str, **data: Any) -> NewEvent:
    return NewEvent(stream, "test_note", data)


def test_a_new_stream_starts_at_version_zero_under_the_genesis_hash() -> None:
    assert NEW_STREAM == StreamHead(0, GENESIS_HASH)


def test_an_empty_request_plans_nothing_and_leaves_the_state() -> None:
    state = LogState(position=7)
    assert plan_request(AppendRequest(()), state, "w", 1000) == []
    assert state == LogState(position=7)


def test_events_get_the_next_positions_versions_and_chained_hashes() -> None:
    state = LogState(position=10, streams={"a": StreamHead(4, b"\x01" * 32)})
    events = (plain("a", x=1), plain("b", y=2), plain("a", z=3))
    planned = plan_request(AppendRequest(events), state, "writer-1", 1000)
    recorded = [p.event for p in planned]
    assert [(e.position, e.stream, e.stream_version) for e in recorded] == [(11, "a", 5), (12, "b", 1), (13, "a", 6)]
    assert all(e.writer == "writer-1" for e in recorded)
    assert [p.payload for p in planned] == [encode_payload(e.data) for e in events]
    first = chain_hash(b"\x01" * 32, "a", 5, events[0], planned[0].payload)
    assert recorded[0].hash == first
    assert recorded[1].hash == chain_hash(GENESIS_HASH, "b", 1, events[1], planned[1].payload)
    assert recorded[2].hash == chain_hash(first, "a", 6, events[2], planned[2].payload)
    assert state.position == 13
    assert state.streams == {"a": StreamHead(6, recorded[2].hash), "b": StreamHead(1, recorded[1].hash)}


def test_an_expected_version_must_be_the_streams_current_one() -> None:
    state = LogState(position=3, streams={"a": StreamHead(2, GENESIS_HASH)})
    ok = plan_request(AppendRequest((plain("a"),), {"a": 2, "new": 0, "any": None}), state, "w", 1000)
    assert [p.event.stream_version for p in ok] == [3]
    with pytest.raises(VersionConflict, match="stream a is at version 3, the writer expected 2") as refused:
        plan_request(AppendRequest((plain("a"),), {"a": 2}), state, "w", 1000)
    assert refused.value.context == {"stream": "a", "expected": 2, "actual": 3}
    with pytest.raises(VersionConflict, match="stream new is at version 0, the writer expected 1"):
        plan_request(AppendRequest((plain("new"),), {"new": 1}), state, "w", 1000)


def test_a_refused_request_changes_nothing_of_the_state() -> None:
    state = LogState(position=3, streams={"a": StreamHead(2, GENESIS_HASH)},
                     rollouts={"r": RolloutState({0: "live"})})
    before = (state.position, dict(state.streams), dict(state.rollouts))
    for request, refusal in (
        (AppendRequest((plain("a"), step("r", 1))), UnknownAttempt),  # attempt 1 never started
        (AppendRequest((start("q"), plain("a", bad=float("nan")))), InvalidPayload),
        (AppendRequest((plain("a"), plain("a", big="x" * 2000))), PayloadTooLarge),
    ):
        with pytest.raises(refusal):
            plan_request(request, state, "w", 1000)
        assert (state.position, dict(state.streams), dict(state.rollouts)) == before


def test_attempts_are_admitted_in_request_order_and_the_state_remembers_them() -> None:
    state = LogState(position=0)
    plan_request(AppendRequest((start("r"), step("r"), start("r", 1), step("r", 1))), state, "w", 1000)
    assert state.rollouts == {"r": RolloutState({0: "live", 1: "live"})}
    with pytest.raises(StaleAttempt, match="cannot start"):
        plan_request(AppendRequest((start("r", 1),)), state, "w", 1000)


def test_events_outside_any_rollout_leave_the_rollouts_alone() -> None:
    state = LogState(position=0, rollouts={"r": RolloutState({0: "live"})})
    plan_request(AppendRequest((plain("a"),)), state, "w", 1000)
    assert state.rollouts == {"r": RolloutState({0: "live"})}


def test_an_attempt_without_a_rollout_is_refused() -> None:
    with pytest.raises(InvalidIdentifier, match="must name its rollout"):
        plan_request(AppendRequest((NewEvent("a", "test_note", {}, None, 0),)), LogState(position=0), "w", 1000)


def test_a_cataloged_kind_on_another_stream_is_refused() -> None:
    with pytest.raises(InvalidPayload, match="goes to a"):
        plan_request(AppendRequest((NewEvent("a", EPISODE_STEP, {}, "r", 0),)), LogState(position=0), "w", 1000)


def test_a_batch_plans_each_request_on_its_own_and_one_refusal_sinks_no_other() -> None:
    state = LogState(position=0)
    out = list(plan_batch([AppendRequest((plain("a"),)), AppendRequest((step("r"),)), AppendRequest((plain("a"),))],
                          state, "w"))
    assert [p.event.position for p in out[0]] == [1]
    assert isinstance(out[1], UnknownAttempt)
    assert [(p.event.position, p.event.stream_version) for p in out[2]] == [(2, 2)]


def test_a_batch_holds_payloads_to_the_default_limit() -> None:
    out = list(plan_batch([AppendRequest((plain("a", big="x" * (1024 * 1024)),))], LogState(position=0), "w"))
    assert isinstance(out[0], PayloadTooLarge)


class OneStore:
    def __init__(self) -> None:
        self.requests: list[AppendRequest] = []

    async def append(self, request: AppendRequest) -> list[Any]:
        self.requests.append(request)
        return ["recorded"]


async def test_append_one_sends_one_event_with_its_expected_version_when_given() -> None:
    store = OneStore()
    assert await append_one(store, plain("a")) == "recorded"  # type: ignore[arg-type]
    assert await append_one(store, plain("a"), 0) == "recorded"  # type: ignore[arg-type]
    assert [r.expected_versions for r in store.requests] == [{}, {"a": 0}]
    assert [r.events for r in store.requests] == [(plain("a"),), (plain("a"),)]


def test_an_event_of_a_rollout_without_its_attempt_is_refused() -> None:
    with pytest.raises(InvalidIdentifier, match="must carry its attempt index"):
        plan_request(AppendRequest((NewEvent("a", "test_note", {}, "r", None),)), LogState(position=0), "w", 1000)
