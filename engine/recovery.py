"""Recovery from the log: where each live attempt stands after a crash, and what happens to it.

Every boundary of a rollout is durable when it happens, so after any crash (one server, all of
them, the coordinator, the database) the log alone says where each unfinished rollout stands. The
rules below classify one attempt from its events; the servers and `rollbook run` call them and
nothing else decides:

- `finished`: its `attempt_finished` is in the log. Its result stands; it never runs again.
- `continue` (same attempt): every part of it can go on from its latest durable boundary. The
  environment continues at its next unrecorded step, the agent at its last boundary of the running
  activation (`resume_point`), the resources session replays its own mutations, and a model call
  whose reply was recorded is delivered again, never generated. A tool call recorded in the log is
  answered from the log, never applied again (`tool_call_outcomes`).
- `continue` under attempt N+1: a part of it is gone but the boundary before it is intact (a model
  call the log says was accepted, whose reply was never recorded, and whose server is gone). The
  rollout alone fences N and starts N+1 whose origin is N's latest boundary.
- `continue` under attempt N+1 from all of N: its agent is one continued by replay
  (engine.agent_replay) whose run was interrupted after it made calls. It runs again from its
  episode's start under N+1, and every call N recorded answers it from the log.
- `fresh_dispatch` under attempt N+1: its state cannot be rebuilt (a restart-only session whose live
  process died, a relayed session whose replay diverged: reason `replay_divergence`, or an agent
  continued by replay that asked something else than its lineage recorded: `agent_divergence`). The rollout
  alone starts over from its input.

A restart to N+1 is one atomic append: `rollout_recovered` (the classification, on attempt N),
`attempt_fenced` of N, `attempt_started` of N+1 (`recovery_request`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine import catalog as ev
from engine.boundaries import full_boundary
from engine.catalog import ACTIVATION_COMPLETED, AGENT_BOUNDARY, ROLLOUT_RECOVERED
from engine.checkpoint import BOUNDARY_KINDS
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import rollout_stream
from engine.ownership import Verdict
from engine.sessions import open_session_restart
from engine.tool_replay import DIVERGENCE_REASON

Disposition = Literal["finished", "continue", "fresh_dispatch"]
# What the caller knows is gone: the live process of a restart-only session, or a model call that
# was accepted by a server that no longer has it and whose reply was never recorded, or a relayed
# session whose replay did not give back the recorded replies (engine.tool_replay), or the run of an
# agent continued by replay (engine.agent_replay), interrupted after it made calls.
Lost = Literal["session", "call", "divergence", "agent"]


@dataclass(frozen=True)
class Recovery:
    rollout_id: str
    attempt: int
    disposition: Disposition
    boundary: int | None  # log position it continues from (continue), else None
    new_attempt: bool  # True: the rollout restarts under attempt + 1
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "disposition": self.disposition, "boundary": self.boundary,
                "new_attempt": self.new_attempt, "reason": self.reason}


def latest_boundary(history: Sequence[RecordedEvent]) -> RecordedEvent | None:
    return next((e for e in reversed(history) if e.kind in BOUNDARY_KINDS), None)


def classify(rollout_id: str, attempt: int, history: Sequence[RecordedEvent], lost: Lost | None = None,
             why: str | None = None) -> Recovery:
    """One disposition for one attempt, from its effective history (its origins' events up to the
    boundary it continued from, then its own) and what the caller knows was lost (`why`: the
    caller's words for it, recorded as the reason)."""
    if any(e.kind == ev.ATTEMPT_FINISHED and e.attempt == attempt for e in history):
        return Recovery(rollout_id, attempt, "finished", None, False, "its result is in the log")
    boundary = latest_boundary(history)
    at = boundary.position if boundary is not None else None
    if lost == "divergence":
        return Recovery(rollout_id, attempt, "fresh_dispatch", None, True, why or DIVERGENCE_REASON)
    if lost == "agent":
        # All of the attempt, not its latest boundary: every call it recorded is the prefix the
        # agent's next run is answered from, and every change it made is in its session's state.
        return Recovery(rollout_id, attempt, "continue", None, True,
                        "its agent, continued by replay, was interrupted; it runs again from its episode's start "
                        "under a new attempt, answered from the log")
    if lost == "session":
        return Recovery(rollout_id, attempt, "fresh_dispatch", None, True,
                        why or "its restart-only session lost its live process; it starts over from its input")
    if lost == "call":
        cannot = open_session_restart([e for e in history if at is None or e.position <= at])
        if cannot is not None:
            return Recovery(rollout_id, attempt, "fresh_dispatch", None, True,
                            f"a model call's reply was never recorded and {cannot}; it starts over from its input")
        return Recovery(rollout_id, attempt, "continue", at, True,
                        "a model call was accepted by a server that is gone and its reply was never recorded; "
                        "a new attempt continues from the boundary before it")
    return Recovery(rollout_id, attempt, "continue", at, False, "every part can go on from its latest boundary")


def recovery_request(r: Recovery) -> AppendRequest:
    """Record the classification, fence the attempt and start the next one, in one request."""
    if not r.new_attempt:
        raise ValueError(f"{r.rollout_id} attempt {r.attempt} continues as it is; there is nothing to fence")
    stream = rollout_stream(r.rollout_id)
    origin = r.attempt if r.disposition == "continue" else None
    return AppendRequest((
        NewEvent(stream, ROLLOUT_RECOVERED, r.to_json(), r.rollout_id, r.attempt),
        NewEvent(stream, ev.ATTEMPT_FENCED, {"reason": "recovery", "disposition": r.disposition}, r.rollout_id, r.attempt),
        NewEvent(stream, ev.ATTEMPT_STARTED, {
            "parent_attempt": r.attempt, "restored_from": None, "recovered": True,
            "origin_attempt": origin, "origin_position": r.boundary if origin is not None else None,
            "disposition": r.disposition,
        }, r.rollout_id, r.attempt + 1),
    ))


def resume_point(history: Sequence[RecordedEvent], activation: int) -> RecordedEvent | None:
    """The agent boundary an activation goes on from: the last boundary of `activation` in the
    attempt's effective history, if that activation had not completed. None: start it afresh.
    Its data holds the whole conversation, rebuilt from the deltas before it (engine.boundaries)."""
    if any(e.kind == ACTIVATION_COMPLETED and e.data.get("index") == activation for e in history):
        return None
    last = next((e for e in reversed(history) if e.kind == AGENT_BOUNDARY), None)
    if last is None or last.data.get("activation", 0) != activation:
        return None
    return full_boundary(history, last)


def tool_call_outcomes(history: Iterable[RecordedEvent]) -> dict[str, dict[str, Any]]:
    """Tool calls whose effect is in the log, by the caller's key: asked again, they get the
    recorded answer and change nothing (a mutation is applied once per session, whoever asks)."""
    return {str(e.data["tool_call"]): e.data for e in history
            if e.kind == ev.MUTATION_APPLIED and e.data.get("tool_call") is not None}


def call_lost(status: str | None, owner: Verdict) -> bool:
    """A model call the log says was accepted (never completed, cut or failed) whose owner is gone
    (engine.ownership: `orphaned`): its reply can never be recorded. One a live instance holds is
    not lost, whichever instance is asked about it."""
    return status == "accepted" and owner == "orphaned"


def run_dispositions(rows: Mapping[tuple[str, int], Mapping[str, Any]], rollout_ids: Iterable[str]) -> dict[str, str]:
    """Where each rollout of a run stands, from its attempt rows: `finished`, `continue` (a live
    attempt goes on from the log), `not_started`, or `stale` (every attempt fenced or retired:
    the rollout was taken out of the run)."""
    out: dict[str, str] = {}
    for rid in rollout_ids:
        mine = {a: row for (r, a), row in rows.items() if r == rid}
        if not mine:
            out[rid] = "not_started"
        elif any(row["status"] == "finished" for row in mine.values()):
            out[rid] = "finished"
        elif mine[max(mine)]["status"] == "live":
            out[rid] = "continue"
        else:
            out[rid] = "stale"
    return out
