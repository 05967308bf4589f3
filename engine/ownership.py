"""One owner at a time: who runs a piece of work, written once for every kind of work.

A model call, a resources session, an agent activation and an episode are each owned by exactly one
live instance (engine/membership.py). The rule:

1. **Claim by an expected version.** Ownership is taken by appending the work's claim event (a
   model call's `call_accepted`, a session's `session_opened`), naming the claiming instance, with
   the stream version the claimer read as the expected version (`claim`). Two processes that read
   the same stream and both claim: the store lets exactly one append land and refuses the other
   with `version_conflict`; the loser reads the stream again and decides again, now seeing an owner.
2. **A live owner's work is never done twice.** Work whose owner is another live instance is `held`:
   a second instance waits for its outcome in the log (or tells its caller to ask again), and never
   runs it, reports it lost or restarts it.
3. **A dead owner's work is taken over.** Work whose owner is not live (its lease expired, it
   stopped, a later instance took its address, or the claim names no owner: it was written before
   owners were recorded) is `orphaned`, and so is work this instance claimed but no longer holds in
   memory. Orphaned work goes through the recovery rules (engine/recovery.py); the takeover is
   itself an append at the expected version, so one taker acts, once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal, Protocol

from engine.events import AppendRequest, NewEvent

Verdict = Literal["mine", "held", "orphaned"]


class LiveInstances(Protocol):
    """Which instances of a kind are live now (adapters.membership.MembershipReader)."""

    async def live(self, kind: str) -> frozenset[str]: ...


def verdict(owner: str | None, me: str, held_here: bool, live: Collection[str]) -> Verdict:
    """Who may act on claimed work. `held_here`: this process runs it now; `live`: the live
    instances of the owner's kind."""
    if owner == me:
        return "mine" if held_here else "orphaned"
    if owner is not None and owner in live:
        return "held"
    return "orphaned"


def claim(events: Sequence[NewEvent], stream: str, seen: int) -> AppendRequest:
    """The append that takes (or takes over) a piece of work: lands only if `stream` is still at
    version `seen`, the version the claimer decided on."""
    return AppendRequest(tuple(events), {stream: seen})


__all__ = ["LiveInstances", "Verdict", "claim", "verdict"]
