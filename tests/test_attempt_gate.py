"""The attempt check every data request makes (engine.attempts), answered from memory while no fence
lands: the rule, the cache's invalidation, the fence position in PostgreSQL, and two servers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from adapters.postgres import PostgresEventStore
from engine.attempts import ATTEMPT_FENCED, AttemptGate, check_current
from engine.catalog import EPISODE_STEP, ROLLOUT_FORGOTTEN, ROLLOUT_RETIRED
from engine.errors import DatabaseUnavailable, StaleAttempt
from engine.events import AppendRequest, NewEvent
from engine.identity import episode_stream, rollout_stream
from engine.retry import Takeover, takeover_request
from tests.resources_harness import AUTH, CONTROL, call, open_session, prefix, serving, start


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
