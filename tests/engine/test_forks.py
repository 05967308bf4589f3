"""The fork rule (engine.forks) and a fork's lineage (engine.checkpoint), without HTTP or a database."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import catalog as ev
from engine.checkpoint import Cut, CutHistory
from engine.errors import (
    InvalidIdentifier,
    InvalidRequest,
    NotABoundary,
    RequestConflict,
    RestartOnlyBoundary,
    UnknownRollout,
)
from engine.events import GENESIS_HASH, NewEvent, RecordedEvent
from engine.forks import (
    MAX_FORKS,
    Origin,
    default_group,
    fork_boundaries,
    fork_seed,
    generated_by,
    inherited_boundary,
    plan_forks,
)
from engine.identity import agent_stream, call_stream, episode_stream, rollout_stream, session_stream
from engine.lineage import lineage_origin

TASK = {"env": "math", "task_id": "m1", "prompt": "1+1", "params": {}}


class Log:
    """A log being written: each event gets the next position and its stream's next version."""

    def __init__(self) -> None:
        self.events: list[RecordedEvent] = []
        self.versions: dict[str, int] = {}

    def add(self, stream: str, kind: str, data: dict[str, Any], rollout_id: str, attempt: int) -> RecordedEvent:
        version = self.versions.get(stream, 0) + 1
        self.versions[stream] = version
        e = RecordedEvent(position=len(self.events) + 1, stream=stream, stream_version=version, kind=kind, data=data,
                          rollout_id=rollout_id, attempt=attempt, schema_version=1, writer="t", hash=GENESIS_HASH)
        self.events.append(e)
        return e

    def append(self, events: tuple[NewEvent, ...]) -> list[RecordedEvent]:
        return [self.add(e.stream, e.kind, e.data, str(e.rollout_id), int(e.attempt or 0)) for e in events]

    def own(self, rollout_id: str, attempt: int) -> list[RecordedEvent]:
        return [e for e in self.events if e.rollout_id == rollout_id and e.attempt == attempt]

    def read(self) -> CutHistory:
        by: dict[str, list[RecordedEvent]] = {}
        for e in self.events:
            by.setdefault(str(e.rollout_id), []).append(e)
        return CutHistory(Cut("c", len(self.events), (), (), (), ""), {r: tuple(v) for r, v in by.items()}, ())


def episode(log: Log, rid: str = "r", state_mode: str = "exported", turns: int = 2, close: bool = True) -> Log:
    """One attempt-0 episode as the servers write it: start, input, session, seed step, agent turns, verify, close."""
    log.add(rollout_stream(rid), ev.ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0)
    log.add(episode_stream(rid, 0), ev.EPISODE_STARTED, {"env": "math", "task_id": "m1", "task": TASK, "seed": 3}, rid, 0)
    log.add(session_stream(rid, 0), ev.SESSION_OPENED, {"env": "math", "task": TASK, "state_mode": state_mode}, rid, 0)
    log.add(episode_stream(rid, 0), ev.EPISODE_STEP, {"step": "seed", "state_mode": state_mode}, rid, 0)
    for t in range(turns):
        log.add(agent_stream(rid, 0), ev.AGENT_BOUNDARY, {"turn": t, "state": "before_model", "activation": 0,
                                                          "pending_call_id": f"{rid}.0.t{t}", "messages": []}, rid, 0)
        log.add(call_stream(f"{rid}.0.t{t}"), ev.CALL_COMPLETED, {"call_id": f"{rid}.0.t{t}"}, rid, 0)
        log.add(agent_stream(rid, 0), ev.AGENT_BOUNDARY, {"turn": t, "state": "after_turn", "activation": 0,
                                                          "messages": []}, rid, 0)
    log.add(episode_stream(rid, 0), ev.EPISODE_STEP, {"step": "agent"}, rid, 0)
    log.add(episode_stream(rid, 0), ev.EPISODE_STEP, {"step": "verify", "reward": 1.0}, rid, 0)
    if close:
        log.add(session_stream(rid, 0), ev.SESSION_CLOSED, {}, rid, 0)
        log.add(episode_stream(rid, 0), ev.EPISODE_STEP, {"step": "close"}, rid, 0)
        log.add(rollout_stream(rid), ev.ATTEMPT_FINISHED, {"reward": 1.0}, rid, 0)
    return log


def plan(log: Log, rid: str, attempt: int, position: int, count: int, **kw: Any):  # type: ignore[no-untyped-def]
    started = {(str(e.rollout_id), int(e.attempt or 0)) for e in log.events if e.kind == ev.ATTEMPT_STARTED}
    prefix = log.read().effective(rid, attempt, to=position) if (rid, attempt) in started else []
    return plan_forks(Origin(rid, attempt, position), count, started=started, own=log.own(rid, attempt),
                      prefix=prefix, **kw)


def test_the_boundaries_one_forks_from_are_the_attempts_own_steps_and_agent_boundaries_before_its_close() -> None:
    log = episode(Log())
    kinds = {e.position: (e.kind, e.data.get("step")) for e in log.events}
    got = fork_boundaries(log.own("r", 0))
    assert [kinds[p] for p in got] == [(ev.EPISODE_STEP, "seed"), *[(ev.AGENT_BOUNDARY, None)] * 4,
                                       (ev.EPISODE_STEP, "agent"), (ev.EPISODE_STEP, "verify")]


@pytest.mark.parametrize("count", [0, -1, MAX_FORKS + 1, True])
def test_a_count_out_of_range_is_refused(count: int) -> None:
    log = episode(Log())
    with pytest.raises(InvalidRequest, match=f"1 to {MAX_FORKS}"):
        plan(log, "r", 0, fork_boundaries(log.own("r", 0))[1], count)


def test_an_unknown_rollout_or_attempt_is_refused() -> None:
    log = episode(Log())
    for rid, attempt in (("nope", 0), ("r", 1)):
        with pytest.raises(UnknownRollout) as caught:
            plan(log, rid, attempt, 5, 2)
        assert caught.value.code == "unknown_rollout" and caught.value.status == 404


def test_a_position_that_is_not_a_forkable_boundary_of_the_attempt_is_refused() -> None:
    log = episode(Log())
    start = next(e.position for e in log.events if e.kind == ev.ATTEMPT_STARTED)
    call = next(e.position for e in log.events if e.kind == ev.CALL_COMPLETED)
    close = next(e.position for e in log.events if e.data.get("step") == "close")
    for position in (start, call, close, 10_000):
        with pytest.raises(NotABoundary) as caught:
            plan(log, "r", 0, position, 2)
        assert caught.value.code == "not_a_boundary" and caught.value.context["boundaries"] == fork_boundaries(log.own("r", 0))


def test_a_boundary_of_another_rollouts_attempt_is_not_a_boundary_of_this_one() -> None:
    log = episode(episode(Log(), "q"), "r")
    with pytest.raises(NotABoundary):
        plan(log, "r", 0, fork_boundaries(log.own("q", 0))[1], 1)


def test_a_boundary_with_a_live_restart_only_session_is_refused() -> None:
    log = episode(Log(), state_mode="restart_only")
    with pytest.raises(RestartOnlyBoundary) as caught:
        plan(log, "r", 0, fork_boundaries(log.own("r", 0))[2], 2)
    assert caught.value.code == "restart_only_boundary"


def test_a_fork_is_one_append_per_request_recording_its_origin_and_its_own_seed() -> None:
    log = episode(Log())
    at = fork_boundaries(log.own("r", 0))[2]
    p = plan(log, "r", 0, at, 3)
    assert p.group == default_group(Origin("r", 0, at)) == f"r.f{at}" and p.next_step == "agent" and not p.existing
    request = p.request()
    assert [e.kind for e in request.events] == [ev.ATTEMPT_STARTED, ev.ROLLOUT_FORKED, ev.EPISODE_CONTINUED] * 3
    assert {(e.rollout_id, e.attempt) for e in request.events} == {(f"r.f{at}.{i}", 0) for i in range(3)}
    forked = [e.data for e in request.events if e.kind == ev.ROLLOUT_FORKED]
    assert [(d["origin_rollout_id"], d["origin_attempt"], d["origin_position"], d["index"], d["count"]) for d in forked] \
        == [("r", 0, at, i, 3) for i in range(3)]
    assert len({d["seed"] for d in forked}) == 3
    for e in log.append(request.events):
        assert ev.problems(e) == []  # every event conforms to the catalog
    assert [f.seed for f in plan(log, "r", 0, at, 2, group="g", seed=40).forks] == [40, 41]


def test_forking_again_into_the_same_group_names_the_same_forks_and_anything_else_is_a_conflict() -> None:
    log = episode(Log())
    at = fork_boundaries(log.own("r", 0))[2]
    first = plan(log, "r", 0, at, 2)
    log.append(first.request().events)
    taken = {e.rollout_id: dict(e.data) for e in log.events if e.kind == ev.ROLLOUT_FORKED}
    again = plan(log, "r", 0, at, 2, taken=taken)
    assert again.existing and again.forks == first.forks
    with pytest.raises(RequestConflict):
        plan(log, "r", 0, at, 3, taken=taken)  # the group holds 2
    other = fork_boundaries(log.own("r", 0))[3]
    with pytest.raises(RequestConflict):
        plan(log, "r", 0, other, 2, group=first.group, taken=taken)  # the group holds forks of another boundary
    with pytest.raises(RequestConflict):
        plan(log, "r", 0, at, 1, group="x", taken={"x.0": None})  # a rollout that is no fork


def test_a_group_whose_fork_ids_would_be_too_long_is_refused() -> None:
    log = episode(Log())
    with pytest.raises(InvalidIdentifier):
        plan(log, "r", 0, fork_boundaries(log.own("r", 0))[0], 1, group="g" * 127)


def test_a_forks_effective_history_is_its_origins_prefix_then_its_own_and_a_fork_of_a_fork_goes_back_through_both() -> None:
    log = episode(Log())
    at = fork_boundaries(log.own("r", 0))[2]
    fork = plan(log, "r", 0, at, 1).forks[0].rollout_id
    log.append(plan(log, "r", 0, at, 1).request().events)
    prefix = [e for e in log.own("r", 0) if e.position <= at]
    read = log.read()
    assert lineage_origin(fork, log.own(fork, 0)) == ("r", 0, at)
    assert read.effective(fork, 0) == prefix + log.own(fork, 0)
    # the fork goes on: a boundary of its own, from which a second fork starts
    b = log.add(agent_stream(fork, 0), ev.AGENT_BOUNDARY, {"turn": 1, "state": "before_model", "activation": 0,
                                                          "messages": []}, fork, 0)
    second = plan(log, fork, 0, b.position, 1)
    log.append(second.request().events)
    fork2 = second.forks[0].rollout_id
    assert log.read().effective(fork2, 0) == prefix + log.own(fork, 0)[:4] + log.own(fork2, 0)
    assert fork_seed(log.read().effective(fork2, 0), fork2) == second.forks[0].seed
    assert fork_seed(log.read().effective(fork2, 0), fork) == plan(log, "r", 0, at, 1).forks[0].seed
    assert fork_seed(prefix, "r") is None


def test_an_inherited_boundary_of_another_rollout_continues_no_pending_call() -> None:
    log = episode(Log())
    before = next(e for e in log.events if e.kind == ev.AGENT_BOUNDARY and e.data.get("pending_call_id"))
    assert inherited_boundary(before, "r") is before.data  # a restore or a recovery continues the pending call
    mine = inherited_boundary(before, "r.f1.0")
    assert mine["pending_call_id"] is None and mine["replaces_call_id"] is None and mine["turn"] == before.data["turn"]
    assert generated_by("r", before) and not generated_by("r.f1.0", before)


# ---- the rule as a property ---------------------------------------------------------------------

KINDS = st.sampled_from(["boundary", "call", "step_agent", "step_verify", "mutation"])


@settings(max_examples=200, deadline=None)
@given(body=st.lists(KINDS, max_size=12), restart_only=st.booleans(), close=st.booleans(),
       pick=st.integers(min_value=0, max_value=60), count=st.integers(min_value=-2, max_value=MAX_FORKS + 2),
       attempt=st.integers(min_value=0, max_value=1))
def test_a_fork_is_planned_exactly_when_the_rule_allows_it_and_shares_the_origins_prefix_event_for_event(
        body: list[str], restart_only: bool, close: bool, pick: int, count: int, attempt: int) -> None:
    log = Log()
    mode = "restart_only" if restart_only else "exported"
    log.add(rollout_stream("r"), ev.ATTEMPT_STARTED, {"parent_attempt": None}, "r", 0)
    log.add(episode_stream("r", 0), ev.EPISODE_STARTED, {"env": "math", "task_id": "m1", "task": TASK}, "r", 0)
    log.add(session_stream("r", 0), ev.SESSION_OPENED, {"env": "math", "task": TASK, "state_mode": mode}, "r", 0)
    log.add(episode_stream("r", 0), ev.EPISODE_STEP, {"step": "seed"}, "r", 0)
    for i, kind in enumerate(body):
        if kind == "boundary":
            log.add(agent_stream("r", 0), ev.AGENT_BOUNDARY, {"turn": i, "state": "after_turn", "activation": 0}, "r", 0)
        elif kind == "call":
            log.add(call_stream(f"r.0.t{i}"), ev.CALL_COMPLETED, {"call_id": f"r.0.t{i}"}, "r", 0)
        elif kind == "mutation":
            log.add(session_stream("r", 0), ev.MUTATION_APPLIED, {"revision": i, "tool": "t"}, "r", 0)
        else:
            log.add(episode_stream("r", 0), ev.EPISODE_STEP, {"step": kind.removeprefix("step_")}, "r", 0)
    if close:
        log.add(session_stream("r", 0), ev.SESSION_CLOSED, {}, "r", 0)
        log.add(episode_stream("r", 0), ev.EPISODE_STEP, {"step": "close"}, "r", 0)
    position = pick % (len(log.events) + 2) + 1
    allowed = (attempt == 0 and 1 <= count <= MAX_FORKS
               and any(e.position == position and e.kind in (ev.EPISODE_STEP, ev.AGENT_BOUNDARY)
                       and e.data.get("step") != "close" for e in log.events)
               and not restart_only)
    try:
        p = plan(log, "r", attempt, position, count)
    except (InvalidRequest, UnknownRollout, NotABoundary, RestartOnlyBoundary) as exc:
        assert not allowed, f"refused what the rule allows: {exc.code}"
        return
    assert allowed, "planned a fork the rule refuses"
    before = list(log.events)
    log.append(p.request().events)
    assert log.events[:len(before)] == before  # a fork adds; it changes nothing of its origin
    read = log.read()
    prefix = [e for e in before if e.attempt == 0 and e.position <= position]
    for f in p.forks:
        own = log.own(f.rollout_id, 0)
        assert read.effective(f.rollout_id, 0) == prefix + own  # the shared prefix is the origin's, event for event
        assert [e for e in read.effective(f.rollout_id, 0) if not generated_by(f.rollout_id, e)] == prefix
