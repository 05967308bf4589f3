"""An agent rollbook did not write, continued by replay: its calls answered from the log.

Such an agent cannot say where it stands, so after a crash or at a restore it is started again from
the start of its episode, under the new attempt. A deterministic agent then asks, call by call, what
it asked before: the model server answers each call from the log while it equals the call its
lineage recorded at the same place, and the agent is back where it was without anything generated
again. The rules, once (the environments' counterpart is engine.tool_replay):

- The place of a call is its number on its activation (engine.calls.CallNumbering). The recorded
  call at a place is the one the attempt's lineage holds there as its participants replay it
  (engine.lineage.effective_history: the origin's events up to its boundary, recursively): the
  newest attempt's of the lineage that numbered that place.
- A recorded call that completed is answered from the log (linked: its reply, no generation); one a
  checkpoint cut is continued from its cut. Either only while the request is the recorded one (the
  same request digest); a different request is a divergence (`AgentDiverged`), recorded as the
  call's `call_excluded` with reason `agent_divergence`, and nothing later is answered from the log.
- A place the lineage holds nothing at, or holds a call that was still in flight at its boundary, is
  past the recorded prefix: the call is generated live.
- Tool calls are numbered the same way, per session and activation, under keys of their own
  (`a<activation>.s<n>`, never a key an agent names). A session continued from its lineage holds
  the mutations recorded under those keys: the n-th call gets the recorded answer and changes
  nothing, while its tool and arguments are the recorded ones; others are a divergence. A call that
  changed nothing was not recorded and runs again, on the state the session holds now: an agent
  that read something before the boundary that reads otherwise now asks the model something else,
  and diverges there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from engine import catalog as ev
from engine.calls import CallRecord, CallState, call_records
from engine.errors import AgentDiverged
from engine.events import RecordedEvent
from engine.identity import server_call_number

DIVERGENCE_REASON = "agent_divergence"


def recorded_calls(history: Iterable[RecordedEvent], rollout_id: str, attempt: int, activation: int) -> dict[int, CallRecord]:
    """The lineage's recorded call at each place of `activation`, from `attempt`'s effective history
    (its own calls left out: they are the ones being numbered)."""
    out: dict[int, tuple[int, CallRecord]] = {}
    for call_id, record in call_records(history).items():
        place = server_call_number(call_id, rollout_id)
        if place is None or place[1] != activation or place[0] >= attempt:
            continue
        made_by, _, number = place
        if number not in out or made_by > out[number][0]:
            out[number] = (made_by, record)
    return {number: record for number, (_, record) in out.items()}


def calls_made(events: Iterable[RecordedEvent], rollout_id: str, attempt: int, activation: int) -> int:
    """How many calls `activation` numbered under `attempt` itself (its own events: `read_rollout`).
    An activation of such an agent that made any cannot be run again under the same attempt (its
    numbers are taken, and its answers are the lineage's only from the next attempt on): it goes on
    under a new attempt that continues from all of this one."""
    return len({e.stream for e in events if e.kind == ev.CALL_ACCEPTED
                and _activation_of(e.stream.removeprefix("call:"), rollout_id) == (attempt, activation)})


def _activation_of(call_id: str, rollout_id: str) -> tuple[int, int] | None:
    """(attempt, activation) of a call the server numbered; None for one its caller named."""
    place = server_call_number(call_id, rollout_id)
    return None if place is None else (place[0], place[1])


def replayed_call(recorded: CallRecord | None, digest: str, call_id: str) -> str | None:
    """The recorded call that `call_id` (request digest `digest`) replays; None: it goes live."""
    if recorded is None or recorded.status not in (CallState.COMPLETED, CallState.CUT):
        return None
    if recorded.accepted.get("request_digest") != digest:
        raise AgentDiverged(f"call {call_id} is not the call {recorded.call_id} its lineage recorded at this place: the "
                            "agent asked for something else, so nothing recorded after it can be answered",
                            call_id=call_id, diverges_from=recorded.call_id)
    return recorded.call_id


_TOOL_KEY = re.compile(r"a([0-9]+)\.s([0-9]+)")


def numbered_tool_key(activation: int, number: int) -> str:
    return f"a{activation}.s{number}"


def next_tool_numbers(events: Iterable[RecordedEvent]) -> dict[int, int]:
    """The next number of each activation, after the numbered mutations a session's own stream holds."""
    out: dict[int, int] = {}
    for e in events:
        m = _TOOL_KEY.fullmatch(str(e.data.get("tool_call") or ""))
        if m:
            out[int(m.group(1))] = max(out.get(int(m.group(1)), 0), int(m.group(2)) + 1)
    return out


def replayed_tool(recorded: dict[str, Any], tool: str, arguments: Any, key: str,
                  as_recorded: Callable[[str, Any], Any] = lambda _tool, args: args) -> dict[str, Any] | None:
    """A numbered tool call answered from the record of its place: only if it asks what was recorded
    there (both read through `as_recorded`: what of the arguments must match). Otherwise the data of its
    `tool_call_diverged` (the caller records it, then refuses the call with `AgentDiverged`); None when
    it replays."""
    if _TOOL_KEY.fullmatch(key) and (recorded.get("tool"), as_recorded(tool, recorded.get("arguments"))) != \
            (tool, as_recorded(tool, arguments)):
        return {"tool_call": key, "tool": tool, "arguments": arguments, "reason": DIVERGENCE_REASON,
                "diverges_from": {"tool": recorded.get("tool"), "arguments": recorded.get("arguments")}}
    return None


def tool_diverged(diverged: dict[str, Any]) -> AgentDiverged:
    """The refusal of a tool call whose `tool_call_diverged` (replayed_tool's) is recorded."""
    return AgentDiverged(f"tool call {diverged['tool_call']} ({diverged['tool']}) is not the call its lineage recorded at "
                         f"this place ({diverged['diverges_from']['tool']}): the agent asked for something else",
                         call_id=diverged["tool_call"], diverges_from=diverged["tool_call"])


def divergence(events: Iterable[RecordedEvent], rollout_id: str, attempt: int, activation: int) -> RecordedEvent | None:
    """The event that recorded `activation`'s divergence under `attempt` (a model call's `call_excluded`
    or a tool call's `tool_call_diverged`), or the attempt's session that could not be rebuilt by replay
    (`session_replay_failed`), if either happened."""
    for e in events:
        if e.kind == ev.SESSION_REPLAY_FAILED and e.attempt == attempt:
            return e
        if e.kind == ev.CALL_EXCLUDED and e.data.get("reason") == DIVERGENCE_REASON \
                and _activation_of(str(e.data.get("call_id")), rollout_id) == (attempt, activation):
            return e
        m = _TOOL_KEY.fullmatch(str(e.data.get("tool_call"))) if e.kind == ev.TOOL_CALL_DIVERGED else None
        if m and e.attempt == attempt and int(m.group(1)) == activation:
            return e
    return None
