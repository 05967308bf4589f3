"""Waiting on an event instead of sleeping: the one wait loop the tests share.

A test that needs a precondition (a call in flight, a checkpoint aborted, a lock with a waiter)
waits for the observation that proves it, with a generous timeout, and never assumes it after a
fixed sleep: on a loaded machine a fixed sleep is sometimes too short, and everywhere it is too
long. The probe is asked at once, then with a backoff (5 ms, growing to `cap`), so a quick event is
seen quickly and a slow one does not cost a busy poll of the database every 5 ms.

`eventually` is for coroutines, `eventually_sync` for plain functions (subprocess tests);
`QueuedLock` is an asyncio.Lock that says when someone waits on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

FIRST_S = 0.005
CAP_S = 0.1


class NeverHappened(TimeoutError):
    """The awaited event did not come: a scenario that never set up, not an invariant that broke."""


async def eventually(what: str, probe: Callable[[], Awaitable[T] | T], timeout: float = 30.0,
                     cap: float = CAP_S) -> T:
    """Ask `probe` (sync or async) until it returns something truthy, and return that; NeverHappened
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    pause = FIRST_S
    while True:
        got: Any = probe()
        if asyncio.iscoroutine(got) or isinstance(got, asyncio.Future):
            got = await got
        if got:
            return got  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise NeverHappened(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(pause)
        pause = min(cap, pause * 1.5)


def eventually_sync(what: str, probe: Callable[[], T], timeout: float = 30.0, cap: float = CAP_S) -> T:
    """`eventually` for plain functions, from a test that is not a coroutine."""
    deadline = time.monotonic() + timeout
    pause = FIRST_S
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise NeverHappened(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)
        pause = min(cap, pause * 1.5)


class QueuedLock(asyncio.Lock):
    """An asyncio.Lock that counts the acquirers that found it taken: a test holds the lock, starts
    the work that must wait on it, and `await lock.queued(n)` proves the work got that far."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self._changed = asyncio.Event()

    async def acquire(self) -> bool:
        if not self.locked():
            return await super().acquire()
        self.waiting += 1
        self._changed.set()
        try:
            return await super().acquire()
        finally:
            self.waiting -= 1

    async def queued(self, count: int = 1, timeout: float = 30.0) -> None:
        async def until() -> None:
            while self.waiting < count:
                self._changed.clear()
                await self._changed.wait()
        await asyncio.wait_for(until(), timeout)
