"""The two checkpoint state machines: legal moves are events, illegal ones are loud and change nothing.

engine.phases at its edges: only the declared moves exist, and a deadline of exactly now still runs.
"""

from __future__ import annotations

import pytest

from engine.errors import DeadlineExceeded, InvalidDeadline, InvalidPhase
from engine.events import NewEvent
from engine.identity import checkpoint_stream, participant_stream
from engine.phases import (
    CHECKPOINT_PHASES,
    CHECKPOINT_TRANSITIONS,
    PARTICIPANT_PHASES,
    PARTICIPANT_TRANSITIONS,
    CheckpointPhases,
    Lease,
    ParticipantPhases,
    check_deadline,
    checkpoint_lease_expired,
)

CK = "ck-1"


def _legal(transitions: list[dict]) -> dict[tuple[str, str], str]:
    """(phase, trigger) -> destination, from the declared table."""
    out: dict[tuple[str, str], str] = {}
    for t in transitions:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for s in sources:
            out[(s, t["trigger"])] = t["dest"]
    return out


PARTICIPANT_LEGAL = _legal(PARTICIPANT_TRANSITIONS)
CHECKPOINT_LEGAL = _legal(CHECKPOINT_TRANSITIONS)
PARTICIPANT_TRIGGERS = sorted({t["trigger"] for t in PARTICIPANT_TRANSITIONS})
CHECKPOINT_TRIGGERS = sorted({t["trigger"] for t in CHECKPOINT_TRANSITIONS})

PARTICIPANT_ILLEGAL = [
    (p, t) for p in PARTICIPANT_PHASES for t in PARTICIPANT_TRIGGERS if (p, t) not in PARTICIPANT_LEGAL
]
CHECKPOINT_ILLEGAL = [
    (p, t) for p in CHECKPOINT_PHASES for t in CHECKPOINT_TRIGGERS if (p, t) not in CHECKPOINT_LEGAL
]

# The paths that put a fresh participant into each phase.
PATH_TO = {
    "idle": [],
    "preparing": ["prepare"],
    "prepared": ["prepare", "prepared"],
    "committed": ["prepare", "prepared", "commit"],
    "restored": ["restore"],
}


def participant_in(phase: str) -> ParticipantPhases:
    p = ParticipantPhases("agent", "a1")
    for trigger in PATH_TO[phase]:
        p.fire(trigger, CK)
    assert p.phase == phase
    return p


# ---- participant ---------------------------------------------------------------------------


def test_participant_walks_prepare_commit_resume_and_each_move_is_an_event() -> None:
    p = ParticipantPhases("agent", "a1")
    events = [p.fire(t, CK) for t in ("prepare", "prepared", "commit", "resume")]
    assert [(e.data["from"], e.data["to"]) for e in events] == [
        ("idle", "preparing"),
        ("preparing", "prepared"),
        ("prepared", "committed"),
        ("committed", "idle"),
    ]
    assert all(isinstance(e, NewEvent) and e.stream == participant_stream("agent", "a1") for e in events)
    assert [e.kind for e in events] == [
        "participant_prepare",
        "participant_prepared",
        "participant_commit",
        "participant_resume",
    ]
    assert all(e.data["checkpoint_id"] == CK for e in events)
    assert p.phase == "idle"


def test_participant_holds_the_checkpoint_id_until_it_is_idle_again() -> None:
    p = ParticipantPhases("agent", "a1")
    p.fire("prepare", CK)
    held = p.checkpoint_id
    p.fire("abort", CK)
    assert (held, p.checkpoint_id) == (CK, None)


def test_fire_carries_extra_data_into_the_event() -> None:
    p = ParticipantPhases("env", "e1")
    p.fire("prepare", CK)
    event = p.fire("prepared", CK, blockers=[], restart_only=[["r1", 0]])
    assert event.data == {
        "checkpoint_id": CK,
        "from": "preparing",
        "to": "prepared",
        "blockers": [],
        "restart_only": [["r1", 0]],
    }


def test_fresh_participant_restores_from_idle_and_resumes() -> None:
    p = ParticipantPhases("env", "e1")
    restored = p.fire("restore", CK)
    resumed = p.fire("resume", CK)
    assert (restored.data["from"], restored.data["to"]) == ("idle", "restored")
    assert (resumed.data["from"], resumed.data["to"]) == ("restored", "idle")
    assert p.phase == "idle"


@pytest.mark.parametrize("phase", ["preparing", "prepared", "committed"])
def test_abort_returns_a_checkpointing_participant_to_idle(phase: str) -> None:
    p = participant_in(phase)
    event = p.fire("abort", CK)
    assert (event.data["from"], event.data["to"], p.phase) == (phase, "idle", "idle")


@pytest.mark.parametrize(("phase", "trigger"), PARTICIPANT_ILLEGAL)
def test_illegal_participant_trigger_raises_and_leaves_the_phase(phase: str, trigger: str) -> None:
    # e.g. commit while idle, prepare while committed, abort while restored
    p = participant_in(phase)
    held = p.checkpoint_id
    with pytest.raises(InvalidPhase) as err:
        p.fire(trigger, "ck-other")
    assert err.value.code == "invalid_phase"
    assert err.value.context == {"phase": phase, "operation": trigger}
    assert (p.phase, p.checkpoint_id) == (phase, held)
    assert not p.can(trigger)


def test_the_illegal_table_is_not_empty_for_any_phase() -> None:
    # Guards the parametrization above: a table that allowed everything would test nothing.
    assert {p for p, _ in PARTICIPANT_ILLEGAL} == set(PARTICIPANT_PHASES)
    assert {p for p, _ in CHECKPOINT_ILLEGAL} == set(CHECKPOINT_PHASES)


# ---- checkpoint ----------------------------------------------------------------------------


def test_checkpoint_walks_to_published_and_each_move_is_an_event() -> None:
    c = CheckpointPhases(CK)
    events = [c.fire(t) for t in ("prepared", "committed", "published")]
    assert [e.kind for e in events] == ["checkpoint_prepared", "checkpoint_committed", "checkpoint_published"]
    assert all(e.stream == checkpoint_stream(CK) and e.data["checkpoint_id"] == CK for e in events)
    assert c.phase == "published"


@pytest.mark.parametrize("phase", ["started", "prepared", "committed"])
def test_checkpoint_aborts_from_any_phase_before_published(phase: str) -> None:
    c = CheckpointPhases(CK, phase)
    event = c.fire("aborted", reason="deadline")
    assert (event.kind, event.data, c.phase) == (
        "checkpoint_aborted",
        {"checkpoint_id": CK, "reason": "deadline"},
        "aborted",
    )


def test_published_checkpoint_cannot_abort() -> None:
    c = CheckpointPhases(CK, "published")
    with pytest.raises(InvalidPhase) as err:
        c.fire("aborted")
    assert (err.value.code, c.phase) == ("invalid_phase", "published")


@pytest.mark.parametrize(("phase", "trigger"), CHECKPOINT_ILLEGAL)
def test_illegal_checkpoint_trigger_raises_and_leaves_the_phase(phase: str, trigger: str) -> None:
    # e.g. published while started (skipping commit), committed after aborted
    c = CheckpointPhases(CK, phase)
    with pytest.raises(InvalidPhase) as err:
        c.fire(trigger)
    assert err.value.code == "invalid_phase"
    assert c.phase == phase


# ---- lease ---------------------------------------------------------------------------------


def test_lease_expires_only_after_deadline_plus_grace() -> None:
    lease = Lease(deadline=1000.0, grace=5.0)
    assert [lease.expired(t) for t in (999.0, 1000.0, 1005.0, 1005.001)] == [False, False, False, True]


def test_lease_default_grace_is_applied() -> None:
    assert (Lease(100.0).expired(101.9), Lease(100.0).expired(102.1)) == (False, True)  # LEASE_GRACE_S, the one grace


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), float("-inf"), "soon", True])
def test_a_non_finite_or_non_numeric_deadline_is_invalid(deadline: object) -> None:
    with pytest.raises(InvalidDeadline):
        check_deadline(deadline, 1000.0, "prepare of ck")  # type: ignore[arg-type]


def test_a_past_deadline_is_exceeded_and_a_future_one_passes() -> None:
    with pytest.raises(DeadlineExceeded):
        check_deadline(999.0, 1000.0, "prepare of ck")
    assert check_deadline(1001, 1000.0, "prepare of ck") == 1001.0


@pytest.mark.parametrize("phase, now, expired", [
    ("started", 1003.0, True), ("prepared", 1003.0, True), ("prepared", 1001.5, False),
    ("committed", 1e9, False), ("published", 1e9, False), ("aborted", 1e9, False),
])
def test_only_an_open_checkpoint_past_its_deadline_and_grace_has_an_expired_lease(phase: str, now: float, expired: bool) -> None:
    assert checkpoint_lease_expired(phase, 1000.0, now, grace=2.0) is expired


@pytest.mark.parametrize("trigger", ["to_committed", "to_restored", "to_idle"])
def test_a_participant_has_no_move_outside_the_declared_table(trigger: str) -> None:
    phases = ParticipantPhases("agent", "a1")
    assert not phases.can(trigger)
    with pytest.raises((AttributeError, InvalidPhase)):  # loud, whichever way the machine says it
        phases.fire(trigger, "ck")
    assert phases.phase == "idle"


def test_a_checkpoint_has_no_move_outside_the_declared_table() -> None:
    phases = CheckpointPhases("ck")
    assert not phases.can("to_published")
    with pytest.raises((AttributeError, InvalidPhase)):
        phases.fire("to_published")
    assert phases.phase == "started"


def test_a_deadline_of_exactly_now_has_not_passed() -> None:
    assert check_deadline(100.0, 100.0, "prepare") == 100.0
    assert check_deadline(100, 99.5, "prepare") == 100.0


def test_a_deadline_sent_from_another_clock_is_the_span_it_grants_counted_on_this_one() -> None:
    """Input: a coordinator 30 s ahead sends deadline = its now + 10 at its now; this host reads now.
    Taken as an instant it would be 20 s past here; as a span it ends 10 s from receipt, whichever
    way the clocks disagree. Without `sent_at` (a sender on this clock) it is taken as it is."""
    from engine.phases import on_this_clock

    assert on_this_clock(1030.0 + 10, sent_at=1030.0, now=1000.0) == 1010.0
    assert on_this_clock(970.0 + 10, sent_at=970.0, now=1000.0) == 1010.0
    assert on_this_clock(1234.5, sent_at=None, now=1000.0) == 1234.5


def test_an_instance_stops_before_its_lease_can_end_on_any_clock() -> None:
    """The lease lasts at least lease_s from the send of its last landed renewal; the fence comes
    first, by the share it keeps for stopping."""
    from engine.membership import FENCE_SHARE, fenced_at

    assert fenced_at(100.0, 10.0) == 100.0 + 10.0 * FENCE_SHARE
    assert 100.0 < fenced_at(100.0, 10.0) < 110.0
