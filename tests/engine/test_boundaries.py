"""Agent boundaries stored as deltas (engine.boundaries): what a writer stores, what a reader gets
back, and which broken chains are refused."""

from __future__ import annotations

from typing import Any

import pytest

from engine.boundaries import boundary_messages, completed_activations, full_boundary, is_delta, with_messages
from engine.catalog import ACTIVATION_COMPLETED, AGENT_BOUNDARY, EPISODE_STEP
from engine.errors import InvalidCheckpointState
from engine.events import RecordedEvent

M = [{"role": "user", "content": str(i)} for i in range(5)]


def rec(position: int, kind: str, data: dict[str, Any], stream: str = "agent:r:0", version: int | None = None) -> RecordedEvent:
    return RecordedEvent(position, stream, version if version is not None else position, kind, data, "r", 0, 1, "t",
                         b"\x00" * 32)


def test_the_first_boundary_of_a_stream_holds_the_whole_list() -> None:
    assert boundary_messages(M[:2], None) == {"messages": M[:2]}


def test_a_later_boundary_holds_what_it_keeps_and_what_it_adds() -> None:
    assert boundary_messages(M[:5], 2) == {"messages_kept": 2, "messages_added": M[2:5]}
    assert boundary_messages(M[:2], 2) == {"messages_kept": 2, "messages_added": []}


def test_a_boundary_shorter_than_the_one_before_holds_the_whole_list() -> None:
    assert boundary_messages(M[:2], 3) == {"messages": M[:2]}


def test_a_delta_is_a_boundary_with_a_kept_count_and_no_whole_list() -> None:
    assert is_delta({"messages_kept": 0, "messages_added": []})
    assert not is_delta({"messages": [], "messages_kept": 0})
    assert not is_delta({"messages": []})
    assert not is_delta({})


def test_readers_get_every_boundary_whole_and_other_events_as_they_are() -> None:
    step = rec(2, EPISODE_STEP, {"x": 1}, stream="episode:r:0")
    events = [
        rec(1, AGENT_BOUNDARY, {"messages": M[:2], "turn": 1}),
        step,
        rec(3, AGENT_BOUNDARY, {"messages_kept": 2, "messages_added": M[2:4], "turn": 2}),
        rec(4, AGENT_BOUNDARY, {"messages_kept": 3, "messages_added": [M[4]], "turn": 3}),
    ]
    out = with_messages(events)
    assert out[0] is events[0]
    assert out[1] is step
    assert out[2].data == {"messages": M[:4], "turn": 2}
    assert out[3].data == {"messages": M[:3] + [M[4]], "turn": 3}
    assert [e.position for e in out] == [1, 2, 3, 4]


def test_each_stream_is_rebuilt_from_its_own_boundaries() -> None:
    events = [
        rec(1, AGENT_BOUNDARY, {"messages": M[:1]}, stream="agent:a:0", version=1),
        rec(2, AGENT_BOUNDARY, {"messages": M[:3]}, stream="agent:b:0", version=1),
        rec(3, AGENT_BOUNDARY, {"messages_kept": 1, "messages_added": [M[4]]}, stream="agent:a:0", version=2),
    ]
    assert with_messages(events)[2].data == {"messages": [M[0], M[4]]}


def test_a_first_delta_that_keeps_nothing_is_its_whole_list() -> None:
    out = with_messages([rec(1, AGENT_BOUNDARY, {"messages_kept": 0, "messages_added": M[:2]})])
    assert out[0].data == {"messages": M[:2]}


def test_a_boundary_without_a_conversation_passes_and_a_delta_after_it_has_nothing_to_keep() -> None:
    bare = rec(1, AGENT_BOUNDARY, {"turn": 1})
    assert with_messages([bare]) == [bare]
    with pytest.raises(InvalidCheckpointState, match="keeps 1 messages of a boundary before it that is missing"):
        with_messages([bare, rec(2, AGENT_BOUNDARY, {"messages_kept": 1, "messages_added": []})])
    assert with_messages([bare, rec(2, AGENT_BOUNDARY, {"messages_kept": 0, "messages_added": M[:1]})])[1].data == {
        "messages": M[:1]}


@pytest.mark.parametrize("data", [
    {"messages_kept": -1, "messages_added": []}, {"messages_kept": True, "messages_added": []},
    {"messages_kept": "1", "messages_added": []}, {"messages_kept": 0, "messages_added": "x"},
    {"messages_added": []},
])
def test_a_boundary_with_neither_a_list_nor_a_delta_is_refused(data: dict[str, Any]) -> None:
    with pytest.raises(InvalidCheckpointState, match="holds neither its messages nor a delta"):
        with_messages([rec(1, AGENT_BOUNDARY, {"messages": M[:1]}), rec(2, AGENT_BOUNDARY, data)])


def test_a_delta_that_keeps_more_than_its_predecessor_had_is_refused() -> None:
    with pytest.raises(InvalidCheckpointState, match=r"keeps 3 messages of the boundary before it \(agent:r:0@1\), which has 2"):
        with_messages([rec(1, AGENT_BOUNDARY, {"messages": M[:2]}), rec(2, AGENT_BOUNDARY, {"messages_kept": 3,
                                                                                            "messages_added": []})])
    kept_all = with_messages([rec(1, AGENT_BOUNDARY, {"messages": M[:2]}),
                              rec(2, AGENT_BOUNDARY, {"messages_kept": 2, "messages_added": []})])
    assert kept_all[1].data == {"messages": M[:2]}


@pytest.mark.parametrize("version", [1, 0])
def test_a_delta_on_a_boundary_that_is_not_before_it_in_its_stream_is_refused(version: int) -> None:
    with pytest.raises(InvalidCheckpointState, match="keeps 1 messages of the boundary before it"):
        with_messages([rec(1, AGENT_BOUNDARY, {"messages": M[:2]}, version=1),
                       rec(2, AGENT_BOUNDARY, {"messages_kept": 1, "messages_added": []}, version=version)])


def test_full_boundary_rebuilds_one_boundary_from_the_earlier_ones_of_its_stream() -> None:
    history = [
        rec(1, AGENT_BOUNDARY, {"messages": M[:1]}, version=1),
        rec(2, AGENT_BOUNDARY, {"messages": M[:3]}, stream="agent:other:0", version=1),
        rec(3, AGENT_BOUNDARY, {"messages_kept": 1, "messages_added": [M[1]]}, version=2),
        rec(4, AGENT_BOUNDARY, {"messages_kept": 2, "messages_added": [M[2]]}, version=3),
        rec(5, AGENT_BOUNDARY, {"messages_kept": 0, "messages_added": [M[4]]}, version=4),
    ]
    assert full_boundary(history, history[3]).data == {"messages": M[:3]}
    assert full_boundary(history, history[2]).data == {"messages": M[:2]}
    assert full_boundary(history, history[0]) is history[0]
    step = rec(6, EPISODE_STEP, {"messages_kept": 1})
    assert full_boundary(history, step) is step


def test_completed_activations_carry_the_conversation_of_the_boundary_before_them() -> None:
    history = [
        rec(1, AGENT_BOUNDARY, {"messages": M[:1]}),
        rec(2, ACTIVATION_COMPLETED, {"index": "0", "reply": {"text": "a"}}, stream="agent:r:0"),
        rec(3, AGENT_BOUNDARY, {"messages_kept": 1, "messages_added": M[1:3]}),
        rec(4, ACTIVATION_COMPLETED, {"index": 1, "reply": {"text": "b", "messages": ["kept"]}}),
        rec(5, EPISODE_STEP, {"messages": ["not a boundary"]}),
        rec(6, ACTIVATION_COMPLETED, {"index": 2, "reply": {"text": "c"}}),
    ]
    assert completed_activations(history) == {
        0: {"text": "a", "messages": M[:1]},
        1: {"text": "b", "messages": ["kept"]},
        2: {"text": "c", "messages": M[:3]},
    }
    assert completed_activations([rec(1, ACTIVATION_COMPLETED, {"index": 0, "reply": {}})]) == {0: {"messages": []}}


def test_a_whole_boundary_or_another_event_needs_nothing_before_it() -> None:
    broken = rec(1, AGENT_BOUNDARY, {"messages_kept": 4, "messages_added": []}, version=1)  # predecessor missing
    whole = rec(2, AGENT_BOUNDARY, {"messages": M[:1]}, version=2)
    assert full_boundary([broken, whole], whole) is whole
    step = rec(3, EPISODE_STEP, {"x": 1}, version=3)
    assert full_boundary([broken, whole, step], step) is step
