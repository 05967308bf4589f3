"""A rollout's attempts as lanes on one time axis, and what each later attempt kept or redid of its origin.

Built from the rows `adapters.ui_reads` returns (public views only). A mark's turn is the `turn` of
the latest agent boundary before it in its attempt: the agent writes a boundary before each model
call, so that is the turn the call (and the tool calls it asked for) belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from adapters.ui_reads import Rollout
from engine import catalog as ev

CALL_ENDS = (ev.CALL_COMPLETED, ev.CALL_CUT, ev.CALL_FAILED, ev.CALL_EXCLUDED)


@dataclass
class Call:
    call_id: str
    turn: int
    start: datetime
    end: datetime | None
    accepted_position: int
    status: str  # generated, linked, cut, failed, excluded, in flight
    tokens: int | None
    replaces: str | None

    @property
    def duration_ms(self) -> float | None:
        return (self.end - self.start).total_seconds() * 1000 if self.end else None


@dataclass
class Mark:
    kind: str  # boundary, step, mutation, fence, recovered, finished, started, session
    at: datetime
    position: int
    label: str
    turn: int


@dataclass
class Lane:
    attempt: int
    status: str
    reward: float | None
    origin_attempt: int | None
    origin_position: int | None
    restored_from: str | None
    disposition: str | None
    calls: list[Call] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    @property
    def start(self) -> datetime | None:
        times = [m.at for m in self.marks] + [c.start for c in self.calls]
        return min(times) if times else None

    @property
    def end(self) -> datetime | None:
        times = [m.at for m in self.marks] + [c.end or c.start for c in self.calls]
        return max(times) if times else None


@dataclass
class TurnFate:
    turn: int
    fate: str  # kept, redone, dropped (a call not asked again), undone (a tool call past the boundary)
    detail: str


@dataclass
class Lineage:
    attempt: int
    origin_attempt: int | None
    origin_position: int | None
    how: str
    turns: list[TurnFate]


def _mark(e: dict[str, Any], turn: int) -> Mark | None:
    kind, d = e["kind"], e["data"]
    if kind == ev.AGENT_BOUNDARY:
        return Mark("boundary", e["recorded_at"], e["position"], f"turn {d.get('turn')} {d.get('state', '')}", turn)
    labels = {
        ev.EPISODE_STEP: ("step", f"step {d.get('step')}"),
        ev.MUTATION_APPLIED: ("mutation", f"{d.get('tool')} -> revision {d.get('revision')}"),
        ev.ATTEMPT_FENCED: ("fence", f"fenced ({d.get('reason')})"),
        ev.ROLLOUT_RECOVERED: ("recovered", f"recovered: {d.get('disposition')} ({d.get('reason')})"),
        ev.ATTEMPT_FINISHED: ("finished", f"finished, reward {d.get('reward')}"),
        ev.ATTEMPT_STARTED: ("started", "started" + (f" from {d['restored_from']}" if d.get("restored_from") else "")),
        ev.SESSION_OPENED: ("session", "session opened" + (f" at revision {d['revision']}" if "revision" in d else "")),
    }
    if kind not in labels:
        return None
    k, label = labels[kind]
    return Mark(k, e["recorded_at"], e["position"], label, turn)


def lanes(r: Rollout) -> list[Lane]:
    starts = {e["attempt"]: e["data"] for e in r.events if e["kind"] == ev.ATTEMPT_STARTED}
    out: dict[int, Lane] = {}
    for a in r.attempts:
        out[a["attempt"]] = _lane(a, starts.get(a["attempt"], {}), r.rollout_id)
    turn: dict[int, int] = {}
    calls: dict[str, Call] = {}
    for e in r.events:
        lane = out.get(e["attempt"])
        if lane is None:
            continue
        d = e["data"]
        if e["kind"] == ev.AGENT_BOUNDARY:
            turn[lane.attempt] = int(d.get("turn") or 0)
        t = turn.get(lane.attempt, 0)
        if e["kind"] == ev.CALL_ACCEPTED:
            calls[d["call_id"]] = Call(d["call_id"], t, e["recorded_at"], None, e["position"], "in flight", None,
                                       d.get("replaces"))
            lane.calls.append(calls[d["call_id"]])
        elif e["kind"] in CALL_ENDS and d.get("call_id") in calls:
            c = calls[d["call_id"]]
            c.end, c.tokens = e["recorded_at"], d.get("tokens")
            c.status = d.get("disposition") or e["kind"].removeprefix("call_")
        else:
            m = _mark(e, t)
            if m is not None:
                lane.marks.append(m)
    for lane in out.values():
        for c in lane.calls:
            if c.status == "in flight" and lane.status != "live":
                c.status = "lost"  # its attempt ended with no end of the call in the log
    return [out[k] for k in sorted(out)]


def _lane(a: dict[str, Any], start: dict[str, Any], rollout_id: str) -> Lane:
    origin = start.get("origin_attempt")
    if origin is None or origin >= a["attempt"] or start.get("origin_rollout_id", rollout_id) != rollout_id:
        origin = None  # no earlier attempt of this rollout to draw from (a fresh start, or a fork of another)
    return Lane(a["attempt"], a["status"], a["reward"], origin, a["origin_position"] if origin is not None else None,
                a["restored_from_checkpoint"], start.get("disposition"))


def lineage(ls: list[Lane]) -> list[Lineage]:
    """For each attempt after the first: the turns of its origin it kept (at or below the boundary it
    continued from) and those it redid, and whether a redone model call was generated again or its
    recorded reply delivered (`linked`)."""
    by = {lane.attempt: lane for lane in ls}
    out = []
    for lane in ls:
        if lane.attempt == 0:
            continue
        origin = by.get(lane.origin_attempt) if lane.origin_attempt is not None else None
        if origin is None or lane.origin_position is None:
            prev = by.get(lane.attempt - 1)
            turns = sorted({c.turn for c in prev.calls}) if prev else []
            out.append(Lineage(lane.attempt, None, None, "restarted from its input: nothing kept",
                               [TurnFate(t, "redone", "restarted from the input") for t in turns]))
            continue
        fates = _fates(origin, lane, lane.origin_position)
        how = (f"continued from attempt {origin.attempt}'s boundary at position {lane.origin_position}"
               + (f" (checkpoint {lane.restored_from})" if lane.restored_from else ""))
        out.append(Lineage(lane.attempt, origin.attempt, lane.origin_position, how, fates))
    return out


def _fates(origin: Lane, lane: Lane, boundary: int) -> list[TurnFate]:
    """Each model call of `origin`: kept (at or below the boundary `lane` continued from), redone by
    `lane` (generated again, continued from its cut, or its recorded reply delivered), or dropped;
    and each tool call of `origin` past the boundary, undone by the restore."""
    mine = {c.turn: c for c in lane.calls}
    fates: list[TurnFate] = []
    for c in sorted(origin.calls, key=lambda c: c.accepted_position):
        if c.accepted_position <= boundary:
            fates.append(TurnFate(c.turn, "kept", f"{c.call_id} ({c.status}) kept"))
        elif c.turn in mine:
            again = mine[c.turn]
            how = "its recorded reply delivered, nothing generated" if again.status == "linked" else (
                f"continued from the cut ({again.status})" if c.status == "cut" else f"generated again ({again.status})")
            fates.append(TurnFate(c.turn, "redone", f"{c.call_id} ({c.status}) -> {again.call_id}: {how}"))
        else:
            fates.append(TurnFate(c.turn, "dropped", f"{c.call_id} ({c.status}) after the boundary, not asked again"))
    for m in origin.marks:
        if m.kind == "mutation" and m.position > boundary:
            fates.append(TurnFate(m.turn, "undone", f"tool call {m.label} after the boundary: undone, the session "
                                                    "went back to the boundary's revision"))
    return fates
