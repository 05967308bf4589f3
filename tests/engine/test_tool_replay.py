"""The replay rule of relayed sessions (engine.tool_replay) and what a divergence means for recovery."""

from __future__ import annotations

from typing import Any

import pytest

from engine import catalog as ev
from engine import tool_replay
from engine.errors import InvalidRequest, ReplayDivergence
from engine.recovery import classify, recovery_request


def test_a_server_that_declares_nothing_is_restart_only_and_only_it_cannot_continue() -> None:
    assert tool_replay.declared(None) == "restart_only"
    assert [tool_replay.declared(d) for d in ("replay", "stateless", "restart_only")] == ["replay", "stateless", "restart_only"]
    assert [tool_replay.continues(d) for d in tool_replay.DECLARATIONS] == [True, False, True]
    with pytest.raises(InvalidRequest):
        tool_replay.declared("deterministic")


def test_the_record_grows_by_one_entry_per_call_and_never_edits_the_old_one() -> None:
    first = tool_replay.entry("email_search_emails", {"query": "x"}, {"output": [1, 2]}, "a0.t0.0")
    one = tool_replay.record([], first)
    two = tool_replay.record(one, tool_replay.entry("email_reply_email", {"email_id": "1"}, {"output": "ok"}, "a0.t1.0"))
    assert one == [first] and len(two) == 2 and two[0] == first
    assert first["digest"] == tool_replay.reply_digest({"output": [1, 2]}) != tool_replay.reply_digest({"output": [2, 1]})
    # The digest is of canonical JSON: key order is not a difference.
    assert tool_replay.reply_digest({"a": 1, "b": 2}) == tool_replay.reply_digest({"b": 2, "a": 1})
    with pytest.raises(ReplayDivergence):
        tool_replay.record(one, {"tool": "x"})  # no digest: a corrupt log, not a call


def calls(*replies: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n, reply in enumerate(replies):
        out = tool_replay.record(out, tool_replay.entry(f"t{n}", {"n": n}, reply, f"a0.t{n}.0"))
    return out


async def test_replay_sends_every_recorded_call_in_order_once() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    replies = {"t0": {"output": 0}, "t1": {"output": [1]}, "t2": "two"}

    async def send(tool: str, arguments: dict[str, Any]) -> Any:
        sent.append((tool, arguments))
        return replies[tool]

    assert await tool_replay.replay(calls(*replies.values()), send) == 3
    assert sent == [("t0", {"n": 0}), ("t1", {"n": 1}), ("t2", {"n": 2})]
    assert await tool_replay.replay([], send) == 0


async def test_a_reply_that_is_not_the_recorded_one_stops_the_replay_there() -> None:
    sent: list[str] = []

    async def send(tool: str, arguments: dict[str, Any]) -> Any:
        sent.append(tool)
        return {"output": "changed"} if tool == "t1" else {"output": tool}

    with pytest.raises(ReplayDivergence) as caught:
        await tool_replay.replay(calls({"output": "t0"}, {"output": "t1"}, {"output": "t2"}), send)
    assert sent == ["t0", "t1"]  # nothing after the divergence is sent
    assert caught.value.context == {"call": 1, "tool": "t1"}


async def test_the_replays_cost_is_one_request_per_call_whatever_the_size_of_the_replies() -> None:
    big = {"output": "x" * 1_000_000}
    requests = 0

    async def send(tool: str, arguments: dict[str, Any]) -> Any:
        nonlocal requests
        requests += 1
        return big

    record = calls(*([big] * 7))
    assert await tool_replay.replay(record, send) == requests == 7
    assert all(len(str(entry)) < 300 for entry in record)  # the record keeps digests, not the replies


def test_a_divergence_restarts_that_rollout_alone_from_its_input_recorded_as_replay_divergence() -> None:
    r = classify("r1", 2, [], "divergence")
    assert (r.disposition, r.new_attempt, r.boundary, r.reason) == ("fresh_dispatch", True, None, "replay_divergence")
    recovered, fenced, started = recovery_request(r).events
    assert recovered.kind == ev.ROLLOUT_RECOVERED and recovered.data["reason"] == "replay_divergence"
    assert fenced.kind == ev.ATTEMPT_FENCED and fenced.attempt == 2
    assert started.attempt == 3 and started.data["origin_attempt"] is None


def test_a_scored_calls_reward_stays_in_the_record_and_the_episodes_reward_is_their_sum() -> None:
    reset = tool_replay.entry("reset", {"row": 1}, {"observation": "go"}, "a0.s0")
    assert "reward" not in reset and "reward" not in tool_replay.record([], reset)[0]  # an unscored call's record as before
    calls: list[dict[str, Any]] = tool_replay.record([], reset)
    for n, reward in enumerate((0.0, 0.25, 1.0)):
        calls = tool_replay.record(calls, tool_replay.entry("step", {"n": n}, {"reward": reward}, f"a0.s{n + 1}", reward))
    assert [c.get("reward") for c in calls] == [None, 0.0, 0.25, 1.0]
    assert tool_replay.rewards(calls) == 1.25
    assert tool_replay.rewards(calls[:1]) is None  # reset only: never stepped, no reward at all (not 0)
    assert tool_replay.rewards(calls[:2]) == 0.0
