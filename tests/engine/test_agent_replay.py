"""engine.agent_replay: which recorded call a numbered call of a continued attempt replays."""

from __future__ import annotations

from typing import Any

import pytest

from engine import catalog as ev
from engine.agent_replay import (
    next_tool_numbers,
    numbered_tool_key,
    recorded_calls,
    replayed_call,
    replayed_tool,
    tool_diverged,
)
from engine.errors import AgentDiverged
from engine.events import GENESIS_HASH, RecordedEvent
from engine.identity import call_stream, server_call_id


def event(position: int, attempt: int, number: int, kind: str, digest: str = "d", activation: int = 0,
          rollout: str = "r.a1") -> RecordedEvent:
    call_id = server_call_id(rollout, attempt, activation, number)
    data = {"call_id": call_id, **({"request_digest": digest} if kind == ev.CALL_ACCEPTED else {}),
            **({"reason": "admission_closed"} if kind == ev.CALL_EXCLUDED else {})}
    return RecordedEvent(position=position, stream=call_stream(call_id), stream_version=1, kind=kind, data=data,
                         rollout_id=rollout, attempt=attempt, schema_version=1, writer="t", hash=GENESIS_HASH)


def test_each_place_holds_the_newest_attempts_call_of_the_lineage_and_the_attempts_own_are_left_out() -> None:
    """Input: attempt 0 made m0 to m2 (m2 still in flight at the boundary), attempt 1 replayed m0 and
    cut m1, attempt 2 (the one being numbered) made m0; activation 1 and a rollout whose id extends
    this one's are in the history too. The rollout id ends in `.a1` on purpose: ids are parsed from the end."""
    history = [
        event(1, 0, 0, ev.CALL_ACCEPTED), event(2, 0, 0, ev.CALL_COMPLETED),
        event(3, 0, 1, ev.CALL_ACCEPTED), event(4, 0, 1, ev.CALL_COMPLETED),
        event(5, 0, 2, ev.CALL_ACCEPTED),
        event(6, 1, 0, ev.CALL_ACCEPTED), event(7, 1, 0, ev.CALL_COMPLETED),
        event(8, 1, 1, ev.CALL_ACCEPTED), event(9, 1, 1, ev.CALL_CUT),
        event(10, 2, 0, ev.CALL_ACCEPTED),
        event(11, 1, 0, ev.CALL_ACCEPTED, activation=1),
        event(12, 0, 7, ev.CALL_ACCEPTED, rollout="r.a1.0"),
    ]
    got = {n: (r.call_id, r.status.value) for n, r in recorded_calls(history, "r.a1", 2, 0).items()}
    assert got == {0: ("r.a1.1.a0.m0", "completed"), 1: ("r.a1.1.a0.m1", "cut"), 2: ("r.a1.0.a0.m2", "accepted")}


def test_a_completed_or_cut_call_with_the_same_request_is_replayed_and_another_request_diverges() -> None:
    """Input: a completed, a cut, an in-flight and an excluded record, and no record at all."""
    records = recorded_calls([event(1, 0, 0, ev.CALL_ACCEPTED, "a"), event(2, 0, 0, ev.CALL_COMPLETED),
                              event(3, 0, 1, ev.CALL_ACCEPTED, "b"), event(4, 0, 1, ev.CALL_CUT),
                              event(5, 0, 2, ev.CALL_ACCEPTED, "c"),
                              event(6, 0, 3, ev.CALL_EXCLUDED)], "r.a1", 1, 0)
    assert replayed_call(records[0], "a", "x") == "r.a1.0.a0.m0"
    assert replayed_call(records[1], "b", "x") == "r.a1.0.a0.m1"
    assert replayed_call(records[2], "c", "x") is None  # in flight at the boundary: past the prefix
    assert replayed_call(records[3], "d", "x") is None  # refused, never answered: nothing to replay
    assert replayed_call(records.get(4), "e", "x") is None
    with pytest.raises(AgentDiverged) as info:
        replayed_call(records[0], "other", "r.a1.1.a0.m0")
    assert info.value.context == {"call_id": "r.a1.1.a0.m0", "diverges_from": "r.a1.0.a0.m0"}


def mutation(key: str | None) -> RecordedEvent:
    return RecordedEvent(position=1, stream="session:r:0", stream_version=1, kind=ev.MUTATION_APPLIED,
                         data={"revision": 1, "tool": "t", "tool_call": key}, rollout_id="r", attempt=0,
                         schema_version=1, writer="t", hash=GENESIS_HASH)


def test_tool_numbers_go_on_after_the_numbered_mutations_and_ignore_keys_agents_named() -> None:
    """Input: numbered keys out of order in two activations, an agent's own key and an unkeyed mutation."""
    events = [mutation("a0.s2"), mutation("a0.s0"), mutation("a1.s0"), mutation("a0.t7.0"), mutation(None)]
    assert next_tool_numbers(events) == {0: 3, 1: 1}
    assert numbered_tool_key(4, 9) == "a4.s9"


def test_a_numbered_tool_call_is_answered_from_its_record_only_if_it_asks_the_same() -> None:
    """Input: the recorded call again, another tool, other arguments; and an agent-named key with other arguments."""
    recorded = {"tool": "send", "arguments": {"to": "a@b"}}
    assert replayed_tool(recorded, "send", {"to": "a@b"}, "a0.s1") is None
    for tool, arguments in (("read", {"to": "a@b"}), ("send", {"to": "c@d"})):
        diverged = replayed_tool(recorded, tool, arguments, "a0.s1")
        assert diverged == {"tool_call": "a0.s1", "tool": tool, "arguments": arguments, "reason": "agent_divergence",
                            "diverges_from": recorded}
        refusal = tool_diverged(diverged)
        assert isinstance(refusal, AgentDiverged) and refusal.context["call_id"] == "a0.s1"
    assert replayed_tool(recorded, "send", {"to": "c@d"}, "a0.t1.0") is None  # a key the agent named: its own promise


def test_a_numbered_tool_call_replays_when_it_asks_what_was_recorded_as_the_environment_compares_it() -> None:
    """Input: a call whose arguments differ from the record only in a field the environment's comparison
    leaves out (a per-try key), then in one it keeps."""
    recorded = {"tool": "step", "arguments": {"a": 1, "try": "k1"}}
    def without_try(_tool: str, args: Any) -> Any:
        return {k: v for k, v in args.items() if k != "try"}
    assert replayed_tool(recorded, "step", {"a": 1, "try": "k2"}, "a0.s1", without_try) is None
    assert replayed_tool(recorded, "step", {"a": 1, "try": "k2"}, "a0.s1") is not None  # compared whole by default
    diverged = replayed_tool(recorded, "step", {"a": 2, "try": "k1"}, "a0.s1", without_try)
    assert diverged is not None and diverged["diverges_from"] == {"tool": "step", "arguments": {"a": 1, "try": "k1"}}
