"""The ownership rule (engine/ownership.py) as a server applies it: whose is this work, and waiting
for a live owner's outcome instead of doing the work a second time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from engine import catalog as ev
from engine.events import RecordedEvent
from engine.identity import Key, session_stream
from engine.lineage import effective_history
from engine.ownership import Verdict, verdict
from participants.base.participant import Participant

FIRST_POLL_S = 0.02
LAST_POLL_S = 0.5  # a live owner's outcome is read at least this often
# A refused claim reads the log again and then waits for the winner: one refusal per race. More in a
# row is a stream that keeps changing under the claimer, reported rather than retried for ever.
CLAIM_TRIES = 3


async def owner_verdict(p: Participant, owner: str | None, held_here: bool) -> Verdict:
    """engine.ownership.verdict, with the live instances of p's kind read from the log only when
    they matter (another instance is named). Without a membership reader no other instance is
    known to be live: a server alone on its database behaves as before instances were recorded."""
    live: frozenset[str] = frozenset()
    if owner is not None and owner != p.instance and p.members is not None:
        live = await p.members.live(p.kind)
    return verdict(owner, p.instance, held_here, live)


async def settled(p: Participant, stream: str, holder: Callable[[Sequence[RecordedEvent]], str | None],
                  read: list[RecordedEvent] | None = None) -> list[RecordedEvent]:
    """The events of `stream` once no other live instance holds its work. `holder` names the owner
    while the work is claimed and unfinished (None: nobody holds it). The outcome the owner records
    (or its lease running out) ends the wait; the caller then decides on what the log says. `read`:
    the stream as the caller just read it, taken for the first look; returned as it is (the same
    list) when nothing was waited for, so a caller knows whether what it read with it is still current."""
    delay = FIRST_POLL_S
    events = read if read is not None else await p.store.read_stream(stream)
    while True:
        owner = holder(events)
        if owner is None or owner == p.instance or await owner_verdict(p, owner, held_here=False) != "held":
            return events
        await asyncio.sleep(delay)
        delay = min(delay * 2, LAST_POLL_S)
        events = await p.store.read_stream(stream)


async def settled_in_history(p: Participant, key: Key, stream: str, holder: Callable[[Sequence[RecordedEvent]], str | None],
                             kinds: Sequence[str] | None = None) -> tuple[list[RecordedEvent], list[RecordedEvent]]:
    """`settled` for work whose stream is part of attempt `key`'s history, and that history (its events
    of `kinds` alone, when given: every kind the stream holds must be among them): read once, the
    stream taken from it; read again only when another instance held the work meanwhile."""
    history = await effective_history(p.store, *key, kinds=kinds)
    seen = [e for e in history if e.stream == stream]
    own = await settled(p, stream, holder, seen)
    return own, (history if own is seen else await effective_history(p.store, *key, kinds=kinds))


async def orphaned_sessions(p: Participant, keys: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
    """Of the open sessions `keys` that p does not hold, those whose owner (the instance that opened
    them, in their latest `session_opened`) is gone: a live owner's sessions are not p's to report."""
    out: set[tuple[str, int]] = set()
    for key in keys:
        opened = [e for e in await p.store.read_stream(session_stream(*key)) if e.kind == ev.SESSION_OPENED]
        owner = opened[-1].data.get("instance") if opened else None
        if await owner_verdict(p, owner, held_here=False) == "orphaned":
            out.add(key)
    return out


__all__ = ["CLAIM_TRIES", "orphaned_sessions", "owner_verdict", "settled", "settled_in_history"]
