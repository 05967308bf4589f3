"""The rules of attempt liveness, applied to every append.

An append for attempt N is admitted only while N is live: started, not fenced, and above the
rollout's retire mark. The storage runs these checks inside the same critical section as the
fence itself, so a fence and an in-flight append of the same attempt cannot interleave.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from engine.catalog import (
    ATTEMPT_FENCED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    ROLLOUT_EXPORTED,
    ROLLOUT_FORGOTTEN,
    ROLLOUT_RETIRED,
)
from engine.errors import InvalidIdentifier, RolloutNotFinished, StaleAttempt, UnknownAttempt
from engine.events import NewEvent
from engine.identity import Key

# "retired" in the projection mirrors the rollout's retire mark, and the mark alone refuses: forget
# clears it, and a late writer of a forgotten rollout is admitted as before its retire.
LIVE_STATUSES = frozenset({"live", "finished", "retired"})


@dataclass
class RolloutState:
    """What the append check needs to know of one rollout, read under the append lock."""

    attempts: dict[int, str]  # attempt -> status
    retired_through: int = -1

    @property
    def latest(self) -> int:
        return max(self.attempts, default=-1)


def not_live(attempt: int, status: str, retired_through: int) -> str | None:
    """Why a started attempt may write nothing ("retired", "fenced"), or None while it is live."""
    if attempt <= retired_through:
        return "retired"
    return None if status in LIVE_STATUSES else status


def admit(event: NewEvent, rollout: RolloutState | None) -> RolloutState | None:
    """Check one event against its rollout's state; return the state after it (for the next
    event of the same batch). Raises StaleAttempt / UnknownAttempt and changes nothing."""
    if event.rollout_id is None:
        if event.attempt is not None:
            raise InvalidIdentifier("an event with an attempt must name its rollout")
        return rollout
    if event.attempt is None:
        raise InvalidIdentifier("an event of a rollout must carry its attempt index")
    state = rollout or RolloutState(attempts={})
    n = event.attempt
    if event.kind == ATTEMPT_STARTED:
        if n in state.attempts or n <= state.latest:
            raise StaleAttempt(
                f"attempt {n} of rollout {event.rollout_id} cannot start: attempt {state.latest} exists",
                rollout_id=event.rollout_id,
                attempt=n,
            )
        if n <= state.retired_through:
            raise StaleAttempt(
                f"attempt {n} of rollout {event.rollout_id} is at or below its retire mark {state.retired_through}",
                rollout_id=event.rollout_id,
                attempt=n,
            )
        return RolloutState({**state.attempts, n: "live"}, state.retired_through)
    if event.kind == ROLLOUT_FORGOTTEN:
        return RolloutState(dict(state.attempts), -1)
    if event.kind == ROLLOUT_RETIRED:
        # A mark only moves up. The event carries the mark it sets (the projection writes it as is), so
        # one at or below the current mark is refused rather than logged: logged, it would lower the
        # mark every reader of the log sees, and a retired attempt could write again. Two retirers that
        # both read the old mark race here; the later one hears it and has nothing left to do.
        through = int(event.data["through"])
        if through <= state.retired_through:
            raise StaleAttempt(
                f"rollout {event.rollout_id} is already retired through {state.retired_through}",
                rollout_id=event.rollout_id,
                attempt=n,
            )
        return RolloutState(dict(state.attempts), through)
    status = state.attempts.get(n)
    if status is None:
        raise UnknownAttempt(
            f"attempt {n} of rollout {event.rollout_id} was never started", rollout_id=event.rollout_id, attempt=n
        )
    why = not_live(n, status, state.retired_through)
    if why is not None:
        raise StaleAttempt(
            f"attempt {n} of rollout {event.rollout_id} is {why}; nothing of it may be written",
            rollout_id=event.rollout_id,
            attempt=n,
        )
    if event.kind == ROLLOUT_EXPORTED and status != "finished":
        raise RolloutNotFinished(
            f"attempt {n} of rollout {event.rollout_id} is {status}, not finished: it has no result to export",
            rollout_id=event.rollout_id,
            attempt=n,
        )
    if event.kind == ATTEMPT_FENCED:
        return RolloutState({**state.attempts, n: "fenced"}, state.retired_through)
    if event.kind == ATTEMPT_FINISHED:
        return RolloutState({**state.attempts, n: "finished"}, state.retired_through)
    return state


# The kinds after which an attempt that was live may no longer be: its fence, or a retire mark that
# reaches it. Every other event leaves a live attempt live (`attempt_finished` keeps it admissible).
FENCE_KINDS = frozenset({ATTEMPT_FENCED, ROLLOUT_RETIRED})


def check_current(rollout_id: str, attempt: int, status: str | None, retired_through: int) -> None:
    """The check every data request makes before it does anything: the rule `admit` applies to
    every append, on the attempt's projected status and its rollout's retire mark. Raises StaleAttempt."""
    why = "unknown" if status is None else not_live(attempt, status, retired_through)
    if why is not None:
        raise StaleAttempt(f"attempt {attempt} of rollout {rollout_id} is {why}", rollout_id=rollout_id, attempt=attempt)


class AttemptStore(Protocol):
    """What the attempt check reads (adapters.postgres.PostgresEventStore implements it)."""

    async def fence_position(self) -> int:
        """The log position of the latest event of FENCE_KINDS (0: none), as of now."""
        ...

    async def attempt_status(self, rollout_id: str, attempt: int) -> tuple[str | None, int]:
        """The attempt's projected status (None: never started) and its rollout's retire mark (-1: none)."""
        ...

    async def attempt_reading(self, rollout_id: str, attempt: int) -> tuple[int, str | None, int]:
        """The fence position, the attempt's status and its rollout's retire mark, read together (one
        snapshot): what `fence_position` and `attempt_status` answer, as of one moment."""
        ...


class AttemptGate:
    """The attempt check of every request, answered from memory while no fence has landed.

    An attempt found live while the log's fence position was F is still live while it is F: only
    an event of FENCE_KINDS ends a live attempt, and the append that writes one moves the position in
    the same transaction. So each check reads the fence position first (one single-row read) and
    reads the attempt itself only when the position moved since it last found that attempt live. A
    fence committed by any server before a request arrives has moved the position that request
    reads: the stale attempt is refused on its very next request, exactly as without the cache.
    An attempt not found live at the current position is read together with the position, in one
    snapshot (`attempt_reading`): a fence cannot land between the two and be cached under the older
    position, and the first request of an attempt costs one read, not two. Refusals are never cached
    (`forget` can lift them).

    Concurrent checks share one read of the fence position, as long as that read began after each
    of them arrived (a read already under way may predate a fence they must see): a check that
    arrives during a read waits for the next one, which serves every check that arrived meanwhile."""

    def __init__(self, store: AttemptStore, max_entries: int = 65_536) -> None:
        self._store = store
        self._max = max_entries
        self._fence = -1  # the fence position the entries below were found live at
        self._live: set[Key] = set()
        self._waiting: asyncio.Future[int] | None = None  # the checks that arrived since the last read began
        self._reader: asyncio.Task[None] | None = None

    async def fence_position(self) -> int:
        """The fence position, read after this call began."""
        if self._waiting is None:
            self._waiting = asyncio.get_running_loop().create_future()
            # A waiter that went away leaves a result (or an error) no one reads: that is fine.
            self._waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        waiting = self._waiting
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        return await asyncio.shield(waiting)

    async def _read(self) -> None:
        while self._waiting is not None:
            batch, self._waiting = self._waiting, None  # everyone in it arrived before this read begins
            try:
                batch.set_result(await self._store.fence_position())
            except asyncio.CancelledError:
                batch.cancel()
                raise
            except Exception as exc:  # every check of the batch hears why (e.g. database_unavailable)
                batch.set_exception(exc)

    async def check(self, rollout_id: str, attempt: int) -> None:
        key = (rollout_id, attempt)
        # Only an attempt found live before can be answered by the fence position alone.
        if key in self._live and await self.fence_position() == self._fence and key in self._live:
            return
        fence, status, mark = await self._store.attempt_reading(rollout_id, attempt)
        check_current(rollout_id, attempt, status, mark)
        if fence > self._fence:  # a fence landed: every attempt found live before it must be read again
            self._fence, self._live = fence, set()
        if fence == self._fence:
            if len(self._live) >= self._max:
                self._live.clear()
            self._live.add(key)
