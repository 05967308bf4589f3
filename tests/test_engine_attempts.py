"""The append rule of engine.attempts on its own, without a store: which event of which attempt is
admitted, what state it leaves for the next event of the batch, and how the gate bounds its memory."""

from __future__ import annotations

import asyncio

import pytest

from engine.attempts import AttemptGate, RolloutState, admit
from engine.catalog import (
    ATTEMPT_FENCED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    EPISODE_STEP,
    ROLLOUT_FORGOTTEN,
    ROLLOUT_RETIRED,
)
from engine.errors import InvalidIdentifier, StaleAttempt, UnknownAttempt
from engine.events import NewEvent
from engine.identity import rollout_stream


def ev(kind: str, attempt: int | None, rollout: str | None = "r", **data: object) -> NewEvent:
    return NewEvent(stream=rollout_stream(rollout or "x"), kind=kind, data=dict(data), rollout_id=rollout,
                    attempt=attempt)


def run(*events: NewEvent, state: RolloutState | None = None) -> RolloutState | None:
    for event in events:
        state = admit(event, state)
    return state


def test_an_event_outside_any_rollout_passes_and_leaves_the_state_as_it_was() -> None:
    state = RolloutState({0: "live"}, 2)
    assert admit(NewEvent(stream="control", kind="anything"), state) is state
    assert admit(NewEvent(stream="control", kind="anything"), None) is None


def test_an_event_with_an_attempt_but_no_rollout_is_refused() -> None:
    with pytest.raises(InvalidIdentifier, match="must name its rollout"):
        admit(NewEvent(stream="control", kind=EPISODE_STEP, attempt=0), None)


def test_an_event_of_a_rollout_without_an_attempt_is_refused() -> None:
    with pytest.raises(InvalidIdentifier, match="must carry its attempt index"):
        admit(ev(EPISODE_STEP, None), RolloutState({0: "live"}))


def test_the_first_attempt_of_a_new_rollout_starts_live() -> None:
    state = run(ev(ATTEMPT_STARTED, 0))
    assert state == RolloutState({0: "live"}, -1)
    assert state.latest == 0


def test_a_new_rollout_has_no_attempt_and_no_retire_mark() -> None:
    state = RolloutState(attempts={})
    assert (state.latest, state.retired_through) == (-1, -1)
    assert run(ev(ATTEMPT_STARTED, 0), ev(EPISODE_STEP, 0)) == RolloutState({0: "live"}, -1)


def test_a_later_attempt_starts_beside_the_earlier_ones() -> None:
    state = run(ev(ATTEMPT_STARTED, 0), ev(ATTEMPT_FENCED, 0), ev(ATTEMPT_STARTED, 2))
    assert state == RolloutState({0: "fenced", 2: "live"}, -1)
    assert state.latest == 2


@pytest.mark.parametrize("again", [0, 1, 2])
def test_an_attempt_cannot_start_twice_or_below_the_latest(again: int) -> None:
    state = run(ev(ATTEMPT_STARTED, 0), ev(ATTEMPT_STARTED, 2))
    with pytest.raises(StaleAttempt, match=f"attempt {again} of rollout r cannot start: attempt 2 exists"):
        admit(ev(ATTEMPT_STARTED, again), state)


def test_an_attempt_cannot_start_at_or_below_the_retire_mark_of_a_forgotten_history() -> None:
    state = RolloutState(attempts={}, retired_through=3)
    for n in (2, 3):
        with pytest.raises(StaleAttempt, match=f"attempt {n} of rollout r is at or below its retire mark 3"):
            admit(ev(ATTEMPT_STARTED, n), state)
    assert admit(ev(ATTEMPT_STARTED, 4), state) == RolloutState({4: "live"}, 3)


def test_an_event_of_an_attempt_never_started_is_refused() -> None:
    with pytest.raises(UnknownAttempt, match="attempt 1 of rollout r was never started"):
        run(ev(ATTEMPT_STARTED, 0), ev(EPISODE_STEP, 1))


def test_a_fenced_attempt_writes_nothing_more() -> None:
    state = run(ev(ATTEMPT_STARTED, 0), ev(ATTEMPT_FENCED, 0))
    assert state == RolloutState({0: "fenced"}, -1)
    with pytest.raises(StaleAttempt, match="attempt 0 of rollout r is fenced; nothing of it may be written"):
        admit(ev(EPISODE_STEP, 0), state)


def test_a_finished_attempt_is_still_admitted() -> None:
    state = run(ev(ATTEMPT_STARTED, 0), ev(ATTEMPT_FINISHED, 0))
    assert state == RolloutState({0: "finished"}, -1)
    assert admit(ev(EPISODE_STEP, 0), state) is state


def test_a_retire_mark_refuses_the_attempts_it_reaches_and_never_moves_back() -> None:
    state = run(ev(ATTEMPT_STARTED, 0), ev(ATTEMPT_STARTED, 1), ev(ROLLOUT_RETIRED, 1, through=0))
    assert state == RolloutState({0: "live", 1: "live"}, 0)
    with pytest.raises(StaleAttempt, match="attempt 0 of rollout r is retired"):
        admit(ev(EPISODE_STEP, 0), state)
    assert admit(ev(EPISODE_STEP, 1), state) is state
    # A mark at or below the current one is refused, not logged: logged, the projection would write
    # the lower mark and every reader of the log would see it moved back.
    for through in (0, -1):
        with pytest.raises(StaleAttempt, match="already retired through 0"):
            admit(ev(ROLLOUT_RETIRED, 1, through=through), state)


def test_forgetting_a_rollout_lifts_its_retire_mark_and_keeps_its_attempts() -> None:
    state = run(ev(ATTEMPT_STARTED, 0), ev(ROLLOUT_RETIRED, 0, through=0), ev(ROLLOUT_FORGOTTEN, 0))
    assert state == RolloutState({0: "live"}, -1)
    assert admit(ev(EPISODE_STEP, 0), state) is state


class Reads:
    """An AttemptStore whose fence never moves and whose every attempt is live; it counts reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def fence_position(self) -> int:
        return 0

    async def attempt_status(self, rollout_id: str, attempt: int) -> tuple[str | None, int]:
        self.reads += 1
        return "live", -1

    async def attempt_reading(self, rollout_id: str, attempt: int) -> tuple[int, str | None, int]:
        return (await self.fence_position(), *await self.attempt_status(rollout_id, attempt))


async def test_the_gate_remembers_at_most_max_entries_attempts() -> None:
    store = Reads()
    gate = AttemptGate(store, max_entries=2)
    for attempt in (0, 1):
        await gate.check("r", attempt)
    await gate.check("r", 0)
    await gate.check("r", 1)
    assert store.reads == 2  # both remembered
    await gate.check("r", 2)  # a third: the memory is emptied, then holds this one
    assert store.reads == 3
    await gate.check("r", 2)
    assert store.reads == 3
    await gate.check("r", 0)
    assert store.reads == 4


async def test_a_default_gate_remembers_65536_attempts_and_empties_its_memory_for_the_next() -> None:
    store = Reads()
    gate = AttemptGate(store)
    for attempt in range(65_536):
        await gate.check("r", attempt)
    await gate.check("r", 0)
    assert store.reads == 65_536  # all remembered
    await gate.check("r", 65_536)
    await gate.check("r", 0)
    assert store.reads == 65_538


async def test_a_fence_read_cut_short_by_a_shutdown_reports_nothing_to_the_loop() -> None:
    """A server that stops cancels its tasks, the gate's read among them: the checks that waited on
    it are cancelled with it, and the loop is told of no error."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        never = asyncio.Event()

        class Hanging(Reads):
            hang = False

            async def fence_position(self) -> int:
                if self.hang:
                    await never.wait()
                return 0

        store = Hanging()
        gate = AttemptGate(store)
        await gate.check("r", 0)  # found live: its next check reads the fence position alone, in the gate's reader
        store.hang = True
        check = asyncio.ensure_future(gate.check("r", 0))
        await asyncio.sleep(0.01)
        reader = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "AttemptGate._read"]
        assert len(reader) == 1
        reader[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await check
        for _ in range(3):
            await asyncio.sleep(0)
        assert reader[0].cancelled()  # it ends as cancelled, as a shutdown that awaits it expects
    finally:
        loop.set_exception_handler(previous)
    assert reported == []
