"""The append rule of engine.attempts on its own, without a store: which event of which attempt is
admitted, what state it leaves for the next event of the batch, and how the gate bounds its memory.

The attempt check every data request makes (engine.attempts), answered from memory while no fence
lands: the rule, the cache's invalidation, the fence position in PostgreSQL, and two servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from adapters.postgres import PostgresEventStore
from engine.attempts import AttemptGate, RolloutState, admit, check_current
from engine.catalog import (
    ATTEMPT_FENCED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    EPISODE_STEP,
    ROLLOUT_FORGOTTEN,
    ROLLOUT_RETIRED,
)
from engine.errors import DatabaseUnavailable, InvalidIdentifier, StaleAttempt, UnknownAttempt
from engine.events import AppendRequest, NewEvent
from engine.identity import episode_stream, rollout_stream
from engine.retry import Takeover, takeover_request
from tests.resources_harness import AUTH, CONTROL, call, open_session, prefix, serving, start


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


class FakeAttempts:
    """An AttemptStore in memory that counts its reads; `moves` are fence positions that land while
    the gate reads the attempt (after its fence read)."""

    def __init__(self) -> None:
        self.fence = 0
        self.status: dict[tuple[str, int], str] = {}
        self.marks: dict[str, int] = {}
        self.reads = 0
        self.fence_reads = 0
        self.moves: list[tuple[int, tuple[str, int], str]] = []

    async def fence_position(self) -> int:
        self.fence_reads += 1
        return self.fence

    async def attempt_status(self, rollout_id: str, attempt: int) -> tuple[str | None, int]:
        self.reads += 1
        if self.moves:
            self.fence, key, status = self.moves.pop(0)
            self.status[key] = status
        return self.status.get((rollout_id, attempt)), self.marks.get(rollout_id, -1)

    async def attempt_reading(self, rollout_id: str, attempt: int) -> tuple[int, str | None, int]:
        status, mark = await self.attempt_status(rollout_id, attempt)  # one snapshot: `moves` land before it
        return self.fence, status, mark


@pytest.mark.parametrize("status, mark, why", [(None, -1, "unknown"), ("fenced", -1, "fenced"), ("live", 0, "retired"),
                                               ("finished", 3, "retired"), ("retired", 0, "retired")])
def test_check_current_refuses_an_unknown_fenced_or_retired_attempt(status: str | None, mark: int, why: str) -> None:
    with pytest.raises(StaleAttempt, match=f"attempt 0 of rollout r is {why}"):
        check_current("r", 0, status, mark)


@pytest.mark.parametrize("status, mark", [("live", -1), ("finished", -1), ("live", 0), ("retired", 0)])
def test_check_current_admits_a_live_or_finished_attempt_above_the_retire_mark(status: str, mark: int) -> None:
    check_current("r", 1, status, mark)


async def test_gate_reads_an_attempt_once_while_the_fence_position_stays() -> None:
    store = FakeAttempts()
    store.status[("r", 0)] = "live"
    gate = AttemptGate(store)
    for _ in range(3):
        await gate.check("r", 0)
    assert store.reads == 1


async def test_gate_refuses_a_fenced_attempt_once_the_fence_position_moves() -> None:
    store = FakeAttempts()
    store.status[("r", 0)] = store.status[("q", 0)] = "live"
    gate = AttemptGate(store)
    await gate.check("r", 0)
    await gate.check("q", 0)
    store.status[("r", 0)], store.fence = "fenced", 7
    with pytest.raises(StaleAttempt):
        await gate.check("r", 0)
    await gate.check("q", 0)  # another rollout is read again too, and still admitted
    assert store.reads == 4


async def test_gate_never_remembers_a_refusal() -> None:
    store = FakeAttempts()
    gate = AttemptGate(store)
    with pytest.raises(StaleAttempt, match="unknown"):
        await gate.check("r", 0)
    store.status[("r", 0)] = "live"  # started since: no fence moved, and the attempt is admitted
    await gate.check("r", 0)


async def test_an_attempt_not_found_live_before_is_read_together_with_the_fence_position() -> None:
    # One snapshot for both: a fence cannot land between the position and the attempt and be
    # remembered under the older position, and the first request of an attempt costs one read.
    store = FakeAttempts()
    store.fence = 5
    store.moves = [(6, ("r", 0), "fenced")]  # lands as the gate reads: the reading holds both
    gate = AttemptGate(store)
    with pytest.raises(StaleAttempt):
        await gate.check("r", 0)
    store.status[("r", 1)] = "live"
    for _ in range(3):
        await gate.check("r", 1)
    assert (store.reads, store.fence_reads) == (2, 2)  # the later checks of attempt 1: the position alone


async def test_the_fence_position_moves_with_fences_and_retire_marks_only(store: PostgresEventStore) -> None:
    assert await store.fence_position() == 0
    await start(store, "g1")
    await store.append(AppendRequest((NewEvent(episode_stream("g1", 0), EPISODE_STEP, {"step": "seed"}, "g1", 0),)))
    assert await store.fence_position() == 0
    assert await store.attempt_status("g1", 0) == ("live", -1)
    assert await store.attempt_status("g1", 1) == (None, -1)
    (fenced,) = await store.append(AppendRequest((NewEvent(rollout_stream("g1"), ATTEMPT_FENCED, {}, "g1", 0),)))
    assert await store.fence_position() == fenced.position
    assert await store.attempt_status("g1", 0) == ("fenced", -1)
    (retired,) = await store.append(AppendRequest((NewEvent(rollout_stream("g1"), ROLLOUT_RETIRED, {"through": 0}, "g1", 0),)))
    assert await store.fence_position() == retired.position
    assert await store.attempt_status("g1", 0) == ("fenced", 0)
    await store.append(AppendRequest((NewEvent(rollout_stream("g1"), ROLLOUT_FORGOTTEN, {}, "g1", 0),)))
    assert await store.fence_position() == retired.position


@pytest.mark.parametrize("how", ["retire", "takeover"])
async def test_a_fence_by_one_server_is_refused_by_the_other_on_its_very_next_request(dsn: str, store: PostgresEventStore,
                                                                                      how: str) -> None:
    await start(store, "g2")
    async with serving(dsn, "resources-a") as (http_a, a), serving(dsn, "resources-b") as (http_b, b):
        await open_session(http_b, "g2", "workplace", 2)
        reads = 0
        status_of = b.store.attempt_reading

        async def counted(rollout_id: str, attempt: int) -> tuple[int, str | None, int]:
            nonlocal reads
            reads += 1
            return await status_of(rollout_id, attempt)

        b.store.attempt_reading = counted  # type: ignore[method-assign]
        for _ in range(2):
            status, _reply = await call(http_b, "GET", f"{prefix('g2', 0)}/state")
            assert status == 200
        assert reads == 0  # answered from B's memory: the open already found attempt 0 live
        if how == "retire":  # server A's control plane moves the retire mark
            status, _ = await call(http_a, "POST", f"{CONTROL}/retire", {"checkpoint_id": "g", "deadline": 4e9,
                                                                        "rollouts": [{"rollout_id": "g2", "through": 0}]}, AUTH)
            assert status == 200
        else:  # server A's process fences attempt 0 and starts attempt 1 (a caller's retry)
            await a.store.append(takeover_request(Takeover("g2", 0, None, "fresh_dispatch"), "test"))
        status, reply = await call(http_b, "GET", f"{prefix('g2', 0)}/state")
        assert (status, reply["error"]["code"]) == (409, "stale_attempt")
        assert reads == 1


class SlowFence(FakeAttempts):
    """Each fence read waits until the test lets it finish, and answers the position at its start."""

    def __init__(self) -> None:
        super().__init__()
        self.fence_reads = 0
        self.gates: list[asyncio.Event] = []

    async def fence_position(self) -> int:
        self.fence_reads += 1
        at = self.fence
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return at


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_concurrent_checks_share_one_fence_read_that_began_after_they_arrived() -> None:
    store = SlowFence()
    store.status[("r", 0)] = "live"
    gate = AttemptGate(store)
    await gate.check("r", 0)  # found live: from here on its checks read the fence position alone
    first = asyncio.ensure_future(gate.check("r", 0))
    await until(lambda: len(store.gates) == 1)  # the first read is under way
    later = [asyncio.ensure_future(gate.check("r", 0)) for _ in range(5)]
    await asyncio.sleep(0)
    store.gates[0].set()
    await first
    await until(lambda: len(store.gates) == 2)  # one more read serves the five that came during the first
    store.gates[1].set()
    await asyncio.gather(*later)
    assert store.fence_reads == 2


async def test_a_check_that_arrives_during_a_fence_read_waits_for_the_next_read() -> None:
    store = SlowFence()
    store.status[("r", 0)] = "live"
    gate = AttemptGate(store)
    await gate.check("r", 0)  # attempt 0 found live at fence position 0
    first = asyncio.ensure_future(gate.check("r", 0))
    await until(lambda: len(store.gates) == 1)  # its read is under way and will answer position 0
    # The fence lands now; a check that arrives after it must not take the answer of a read that began before.
    store.fence, store.status[("r", 0)] = 3, "fenced"
    second = asyncio.ensure_future(gate.check("r", 0))
    store.gates[0].set()
    await first  # arrived before the fence: admitted from memory, as it may be
    await until(lambda: len(store.gates) == 2)
    store.gates[1].set()
    with pytest.raises(StaleAttempt):
        await second


async def test_a_failed_fence_read_fails_each_check_waiting_on_it() -> None:
    class Down(FakeAttempts):
        down = False

        async def fence_position(self) -> int:
            if self.down:
                raise DatabaseUnavailable("the database did not answer")
            return await super().fence_position()

    store = Down()
    store.status[("r", 0)] = "live"
    gate = AttemptGate(store)
    await gate.check("r", 0)  # found live: its next checks wait on the shared fence read
    store.down = True
    for outcome in await asyncio.gather(gate.check("r", 0), gate.check("r", 0), return_exceptions=True):
        assert isinstance(outcome, DatabaseUnavailable)
