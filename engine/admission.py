"""The rules of admission, written once for every server: closed for a checkpoint, drained, reopened.

A participant's admission is closed from prepare until resume (and from restore until resume). While
it is closed, nothing new starts: a new episode, activation, model call or session is refused with
`admission_closed`, which a caller retries through `engine.patience`. What already runs may pass up
to its next boundary, where it parks and waits for the admission to open again; that is why the
state is an event rather than a flag: parked work resumes the moment resume opens it.

Prepare waits for its blockers until a little before the control plane's deadline, never past it,
so that its answer arrives in time (`drain_until`). The same budget serves every kind of server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable
from typing import TypeVar

from engine.errors import AdmissionClosed

T = TypeVar("T")
K = TypeVar("K", bound=tuple[str, int])

POLL_S = 0.005  # how often a drain looks at its blockers again
ANSWER_MARGIN_S = 0.25  # at most this much of the time left is kept to answer the control plane
ANSWER_SHARE = 0.1  # ... and at most this share of it, so a short deadline still leaves time to drain


CHECKPOINT = "checkpoint"  # the hold of prepare (or restore) until resume
JOINING = "joining"  # an instance not yet recorded in the log, or one that joined during a paused checkpoint


class Admission:
    """Open or closed; work that reached a boundary waits on it. Each reason to close it is a hold of
    its own, and it opens when the last hold is released: a resume does not open an instance that is
    still joining, and its joining does not open one a checkpoint closed."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._holds: set[str] = set()
        self.closed_for: str | None = None  # the checkpoint that holds it closed; its refusals name it
        self.resumed_from: str | None = None  # the checkpoint of the latest resume here

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self, hold: str = CHECKPOINT, checkpoint_id: str | None = None) -> None:
        self._holds.discard(hold)
        if hold == CHECKPOINT:
            self.closed_for = None
            self.resumed_from = checkpoint_id or self.resumed_from
        if not self._holds:
            self._open.set()

    def close(self, hold: str = CHECKPOINT, checkpoint_id: str | None = None) -> None:
        self._holds.add(hold)
        if hold == CHECKPOINT:
            self.closed_for = checkpoint_id
        self._open.clear()

    def callee_resuming(self, refusal: BaseException) -> bool:
        """Whether a peer's refusal names the checkpoint this server has already resumed from: the
        coordinator resumes every participant of a checkpoint in one pass, so the peer's resume is
        on its way, and asking again soon costs a refusal where a long back-off costs the run."""
        named = getattr(refusal, "context", {}).get("checkpoint_id")
        return self.is_open and named is not None and named == self.resumed_from

    async def wait_open(self) -> None:
        await self._open.wait()

    @property
    def joining(self) -> bool:
        """Closed only because this instance is still joining: a moment after it listens, no checkpoint."""
        return self._holds == {JOINING}

    def require_open(self, what: str) -> None:
        """Refuse new work while closed: `what` says which work, for the caller's log."""
        if not self.is_open:
            raise AdmissionClosed(f"{what} refused: a checkpoint is in progress; retry after it resumes")


def drain_until(deadline: float, now: float) -> float:
    """When prepare stops waiting for its blockers: before the deadline by a tenth of the time
    left, at most ANSWER_MARGIN_S, so the report reaches the control plane before it gives up."""
    return deadline - min(ANSWER_MARGIN_S, max(0.0, deadline - now) * ANSWER_SHARE)


async def drain(blockers: Callable[[], list[T]], deadline: float) -> list[T]:
    """Wait until nothing blocks or the drain's time is up; the blockers left, empty when parked."""
    stop = drain_until(deadline, time.time())
    while True:
        left = blockers()
        if not left or time.time() >= stop:
            return left
        await asyncio.sleep(POLL_S)


async def wait_for_all(events: Iterable[asyncio.Event], deadline: float) -> None:
    """Wait for every event to be set, or until the drain's time is up, whichever comes first."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    budget = drain_until(deadline, time.time()) - time.time()
    if waiters and budget > 0:
        await asyncio.wait(waiters, timeout=budget)
    for w in waiters:
        w.cancel()


def retired(keys: Collection[K], rollout_id: str, through: int) -> list[K]:
    """The (rollout, attempt) keys a retire mark `through` ends: that rollout's attempts at or below it."""
    return [k for k in keys if k[0] == rollout_id and k[1] <= through]


__all__ = ["CHECKPOINT", "JOINING", "Admission", "drain", "drain_until", "retired", "wait_for_all"]
