"""Forks: new rollouts started from a boundary of another rollout's attempt.

A fork of attempt A of rollout R at position P is a new rollout whose attempt 0 has the origin
(R, A, P): its effective history (engine.lineage.effective_history) is A's up to P, then its own,
so every server rebuilds its part from the log exactly as for a restored attempt: the environment
its recorded steps, the agent its conversation from the boundary, the resources its session from
the recorded mutations, the model the call lineage (the fork's first call names the origin's last
one as its parent). What the fork generates after P is its own: it samples with a seed of its own.

The rule, in one place:

- One can fork from an `episode_step` or an `agent_boundary` of attempt A itself, before its
  episode closed (`fork_boundaries`). An attempt's start is no such boundary (nothing is shared
  yet: dispatch the task again), nor is a boundary an earlier attempt recorded (fork that attempt),
  nor the close step (nothing is left to generate). Anything else is `not_a_boundary`.
- A boundary at which a restart-only session is open (the sandbox: its state is a live process, not
  a replay) cannot be rebuilt for another rollout: `restart_only_boundary`.
- An attempt the log never started is `unknown_rollout`; a count outside 1..MAX_FORKS is
  `invalid_request`.
- The K forks of one request form a group; fork i of group G is rollout `G.i`, and its seed is
  `seed + i` when the caller gives one, else one derived from its id. Forking again into a group
  that holds the same forks of the same origin changes nothing and names them (a retry after a
  lost answer); into a group that holds anything else it is a `conflict`.
- Every fork is one atomic append: `attempt_started` (attempt 0, with its origin and seed),
  `rollout_forked` (the record the public view rollbook.forks reads) and `episode_continued` (the
  first step it has to run). Nothing is written when any fork of the request is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine import catalog as ev
from engine import episodes
from engine.errors import InvalidRequest, NotABoundary, RequestConflict, RestartOnlyBoundary, UnknownRollout
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import Key, episode_stream, rollout_stream, validate_id
from engine.sessions import open_session_restart

MAX_FORKS = 256
FORKABLE_KINDS = (ev.EPISODE_STEP, ev.AGENT_BOUNDARY)


@dataclass(frozen=True)
class Origin:
    rollout_id: str
    attempt: int
    position: int

    def to_json(self) -> dict[str, Any]:
        return {"origin_rollout_id": self.rollout_id, "origin_attempt": self.attempt, "origin_position": self.position}


@dataclass(frozen=True)
class Fork:
    rollout_id: str
    index: int
    seed: int


@dataclass(frozen=True)
class ForkPlan:
    origin: Origin
    group: str
    forks: tuple[Fork, ...]
    env: str
    task_id: str
    next_step: str | None
    existing: bool = False  # the group already holds exactly these forks: nothing to append

    def request(self) -> AppendRequest:
        """Every fork of the group in one append: all of them start, or none."""
        events: list[NewEvent] = []
        for f in self.forks:
            stream = rollout_stream(f.rollout_id)
            events += [
                NewEvent(stream, ev.ATTEMPT_STARTED, {"parent_attempt": None, **self.origin.to_json(),
                                                      "seed": f.seed, "disposition": "fork"}, f.rollout_id, 0),
                NewEvent(stream, ev.ROLLOUT_FORKED, {**self.origin.to_json(), "group": self.group, "index": f.index,
                                                     "count": len(self.forks), "seed": f.seed}, f.rollout_id, 0),
                NewEvent(episode_stream(f.rollout_id, 0), ev.EPISODE_CONTINUED, episodes.continued(
                    self.env, self.task_id, self.next_step, origin_attempt=self.origin.attempt,
                    forked_from=self.origin.rollout_id), f.rollout_id, 0),
            ]
        return AppendRequest(tuple(events))

    def to_json(self) -> dict[str, Any]:
        return {**self.origin.to_json(), "group": self.group, "existing": self.existing,
                "forks": [{"rollout_id": f.rollout_id, "index": f.index, "seed": f.seed} for f in self.forks]}


def fork_boundaries(own: Sequence[RecordedEvent]) -> list[int]:
    """The positions one can fork attempt `own` from: its own episode steps and agent boundaries
    before its close step, in log order. `own` holds only that attempt's events."""
    out: list[int] = []
    for e in own:
        if e.kind == ev.EPISODE_STEP and e.data.get("step") == "close":
            break
        if e.kind in FORKABLE_KINDS:
            out.append(e.position)
    return out


def default_group(origin: Origin) -> str:
    """The group a request names none of: one per boundary, so asking again is answered, not doubled."""
    return f"{origin.rollout_id}.f{origin.position}"


def fork_seed_for(rollout_id: str, index: int, seed: int | None) -> int:
    if seed is not None:
        return seed + index
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:6], "big")


def plan_forks(origin: Origin, count: int, *, started: Container[Key], own: Sequence[RecordedEvent],
               prefix: Sequence[RecordedEvent], group: str | None = None, seed: int | None = None,
               taken: Mapping[str, Mapping[str, Any] | None] | None = None) -> ForkPlan:
    """The forks a request asks for, or the refusal that writes nothing.

    `started`: the attempts the log holds (at least the origin's); `own`: the origin attempt's own
    events; `prefix`: its effective history up to the origin position; `taken`: for each fork id of
    the group that already names a rollout, its `rollout_forked` data (None: a rollout that is no
    fork, or a fork of something else)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
        raise InvalidRequest(f"a fork asks for 1 to {MAX_FORKS} rollouts, not {count!r}"[:120])
    if (origin.rollout_id, origin.attempt) not in started:
        raise UnknownRollout(f"rollout {origin.rollout_id} has no attempt {origin.attempt} in the log",
                             rollout_id=origin.rollout_id, attempt=origin.attempt)
    boundaries = fork_boundaries(own)
    if origin.position not in boundaries:
        raise NotABoundary(f"position {origin.position} is not a boundary of {origin.rollout_id} attempt "
                           f"{origin.attempt} one can fork from", rollout_id=origin.rollout_id,
                           attempt=origin.attempt, boundaries=boundaries[:50])
    why = open_session_restart(prefix)
    if why is not None:
        raise RestartOnlyBoundary(f"{origin.rollout_id} attempt {origin.attempt} cannot be forked at position "
                                  f"{origin.position}: {why}",
                                  rollout_id=origin.rollout_id, attempt=origin.attempt)
    name = validate_id(group if group is not None else default_group(origin), "fork group")
    forks = tuple(Fork(validate_id(f"{name}.{i}", "fork rollout id"), i, 0) for i in range(count))
    forks = tuple(Fork(f.rollout_id, f.index, fork_seed_for(f.rollout_id, f.index, seed)) for f in forks)
    started_input = next((e for e in prefix if e.kind == ev.EPISODE_STARTED), None)
    if started_input is None:  # cannot happen at an episode step or an agent boundary of a dispatched episode
        raise NotABoundary(f"no episode input precedes position {origin.position}", rollout_id=origin.rollout_id)
    plan = ForkPlan(origin, name, forks, str(started_input.data["env"]), str(started_input.data["task_id"]),
                    episodes.next_step(episodes.recorded_steps(prefix)))
    return _against_group(plan, taken or {})


def _against_group(plan: ForkPlan, taken: Mapping[str, Mapping[str, Any] | None]) -> ForkPlan:
    if not taken:
        return plan
    mine = {f.rollout_id for f in plan.forks}
    same = set(taken) == mine and all(
        d is not None and Origin(d["origin_rollout_id"], d["origin_attempt"], d["origin_position"]) == plan.origin
        and d.get("group") == plan.group and d.get("count") == len(plan.forks) for d in taken.values())
    if not same:
        raise RequestConflict(f"fork group {plan.group} already names other rollouts ({len(taken)} of them); "
                              "name another group", group=plan.group)
    seeds = {rid: int(d["seed"]) for rid, d in taken.items() if d is not None}
    return ForkPlan(plan.origin, plan.group, tuple(Fork(f.rollout_id, f.index, seeds[f.rollout_id]) for f in plan.forks),
                    plan.env, plan.task_id, plan.next_step, existing=True)


def fork_seed(history: Sequence[RecordedEvent], rollout_id: str) -> int | None:
    """The sampling seed of fork `rollout_id` from an effective history of one of its attempts (None:
    not a fork). Its attempt 0's start carries it, and every attempt's lineage holds that start."""
    for e in history:
        if e.rollout_id == rollout_id and e.kind == ev.ATTEMPT_STARTED and e.data.get("disposition") == "fork":
            return int(e.data["seed"])
    return None


def inherited_boundary(boundary: RecordedEvent, rollout_id: str) -> dict[str, Any]:
    """An inherited agent boundary's data as an attempt of `rollout_id` continues it. A fork's is
    another rollout's boundary, and the fork samples its own reply: the origin's pending call is not
    continued (that call, and any link to its reply, stay the origin's)."""
    if boundary.rollout_id == rollout_id:
        return boundary.data
    return {**boundary.data, "pending_call_id": None, "replaces_call_id": None}


def generated_by(rollout_id: str, e: RecordedEvent) -> bool:
    """Whether `rollout_id` generated this event of its effective history, or inherited it from a
    fork origin (the shared prefix a trainer masks)."""
    return e.rollout_id == rollout_id
