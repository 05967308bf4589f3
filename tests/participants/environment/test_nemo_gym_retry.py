"""A caller's retry under a newer attempt, on rollbook's environment server (NeMo Gym's /run).

The newer attempt fences the one still running and continues from its latest durable boundary: the
model calls and mutations it recorded are not done again (engine/retry.py; the servers rebuild the
continued attempt's session and agent state from the log, engine/recovery.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from adapters.postgres import PostgresEventStore
from apps.stack import start_stack
from participants.base.nemo_gym_rows import scoped_rollout_id
from participants.model.backends.scripted import ScriptedBackend
from tests.e2e.test_nemo_gym import REPEATED_CALLS, REPEATED_MUTATIONS
from tests.participants.environment.test_nemo_gym import BLACKJACK, episode, post, rows, scalar


class HoldAt(ScriptedBackend):
    """Holds the n-th generation, and every one that arrives while it is held (the counter only moves
    past a released generation), until released: a rollout is then mid-episode, its model call in flight.
    `held` counts the generations waiting; `arrived` is set each time one more arrives."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.reached, self.release = n, asyncio.Event(), asyncio.Event()
        self.held, self.arrived = 0, asyncio.Event()

    async def wait_held(self, count: int, timeout: float = 60.0) -> None:
        async def until() -> None:
            while self.held < count:
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(until(), timeout)

    async def generate(self, request: dict[str, Any], prefix_tokens: list[str]) -> AsyncIterator[str]:
        if self.generations == self.n and not self.release.is_set():
            self.held += 1
            self.reached.set()
            self.arrived.set()
            await self.release.wait()
        async for token in super().generate(request, prefix_tokens):
            yield token


async def test_a_newer_attempt_fences_the_running_one_and_continues_from_its_boundary(
        dsn: str, store: PostgresEventStore) -> None:
    body = episode("blackjack:train", "0-0", BLACKJACK)  # look, hit, stand, answer: mutations at turns 1 and 2
    backend = HoldAt(2)  # the third model call (turn 2), after one mutation
    s = await start_stack(dsn, "takeover", backend)
    try:
        first = asyncio.create_task(post(f"{s.url('environment')}/run", body))
        await asyncio.wait_for(backend.reached.wait(), 30)
        rid = scoped_rollout_id("blackjack:train", "0-0")
        before = await store.read_rollout(rid)
        retry = asyncio.create_task(post(f"{s.url('environment')}/run", {**body, "episode_id": {"rollout_id": "0-0", "attempt": 1}}))
        # Attempt 1's own first call (turn 2 again) held as well proves the takeover fenced attempt 0
        # and went on from its boundary; both calls are held, so nothing else writes to the log now.
        await backend.wait_held(2)
        assert await scalar(store, "SELECT status FROM rollbook.attempts WHERE rollout_id = :r AND attempt = 0",
                            r=rid) == "fenced"
        head = await store.head()
        stale_status, refused = await post(f"{s.url('environment')}/run", body)  # attempt 0 while 1 is under way
        assert (stale_status, refused["error"]["code"]) == (409, "stale_attempt")
        assert await store.head() == head
        backend.release.set()
        status, second = await asyncio.wait_for(retry, 60)
        _, superseded = await asyncio.wait_for(first, 60)
        _, stale = await post(f"{s.url('environment')}/run", body)  # attempt 0 again, after 1 finished
    finally:
        await s.close()
    assert status == 200 and "result" in second, second
    assert superseded["failure"]["failure_kind"] == "rollbook:superseded" and not superseded["failure"]["terminal"]
    assert stale == {**second, "episode_id": {"rollout_id": "0-0", "attempt": 0}}  # finished: answered, not refused
    attempts = {r.attempt: r.status for r in await rows(store, "SELECT attempt, status FROM rollbook.attempts "
                                                              "WHERE rollout_id = :r", r=rid)}
    assert attempts == {0: "fenced", 1: "finished"}
    origin = await scalar(store, "SELECT origin_position FROM rollbook.attempts WHERE rollout_id = :r AND attempt = 1", r=rid)
    boundaries = [e.position for e in before if e.kind in ("attempt_started", "episode_step", "agent_boundary")]
    assert origin == max(boundaries)  # attempt 1 went on from attempt 0's latest durable boundary
    # nothing attempt 0 recorded was done again: no turn generated twice, no revision applied twice
    assert await scalar(store, REPEATED_CALLS) == 0
    assert await scalar(store, REPEATED_MUTATIONS) == 0
    assert second["result"]["rollbook"]["attempt"] == 1
