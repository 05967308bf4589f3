"""Restore's read of a scope where a participant holds session snapshots: the events past each
snapshot only (engine.checkpoint.read_cut with `after`), and each snapshot checked against the log.

Which snapshot: the newest of each scoped attempt's own session stream at or below its boundary
(one query), whose row matches its own digest. The check against the log (two queries, reading no
event data): each session stream the snapshot names must have, at the version it names, the hash it
names, and the stream's next event must be the first of it past the snapshot's position (or, if
none of it is past that position up to P, the stream's head at P must be the one named). A snapshot
that fails is counted and logged (engine.snapshots) and the scope is read whole again, as with none.
A rollout with two attempts in the scope, or whose snapshot names a session of another rollout (a
fork's origin), is read whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.checkpoint import Cut, CutHistory, CutStore, read_cut
from engine.events import RecordedEvent
from engine.identity import session_stream
from engine.snapshots import COUNTS, Row, SessionSnapshot, SnapshotStore, from_row, ignored, merged_bounds


class ScopeSnapshotStore(CutStore, SnapshotStore, Protocol):
    pass


async def read_scope(store: ScopeSnapshotStore, cut: Cut) -> tuple[CutHistory, dict[str, SessionSnapshot]]:
    """read_cut without the re-hash, past each usable snapshot; the snapshots it used, by rollout."""
    twice = Counter(s.rollout_id for s in cut.scope)
    wanted = {session_stream(s.rollout_id, s.attempt): s for s in cut.scope if twice[s.rollout_id] == 1}
    starts: dict[str, SessionSnapshot] = {}
    for row in await store.session_snapshots({stream: s.boundary for stream, s in wanted.items()}):
        snap = from_row(*row)
        if snap is None:
            ignored(row[0], row[1], "its own digest")
        else:
            starts[wanted[snap.stream].rollout_id] = snap
    if not starts:
        return await read_cut(store, cut, rehash=False), {}
    read = await read_cut(store, cut, rehash=False, after={r: s.position for r, s in starts.items()})
    good = await _agreeing(store, starts, read.events, cut.position)
    if len(good) < len(starts):  # read again, whole where a snapshot did not agree
        starts = {r: starts[r] for r in good}
        read = await read_cut(store, cut, rehash=False, after={r: s.position for r, s in starts.items()})
    COUNTS.used += len(starts)
    return read, starts


async def lineage_rows(store: SnapshotStore, cut: Cut, effective: Mapping[tuple[str, int], Sequence[RecordedEvent]],
                       starts: Mapping[str, SessionSnapshot]) -> list[Row]:
    """For the rollouts read whole, the snapshots of their lineages' other attempts (a restored
    attempt's origin), in one query: their own sessions' were judged by read_scope already."""
    own = {session_stream(s.rollout_id, s.attempt) for s in cut.scope}
    bounds = merged_bounds([h for k, h in effective.items() if k[0] not in starts])
    return await store.session_snapshots({s: b for s, b in bounds.items() if s not in own})


async def _agreeing(store: ScopeSnapshotStore, starts: Mapping[str, SessionSnapshot],
                    tails: Mapping[str, Sequence[RecordedEvent]], position: int) -> set[str]:
    found = await store.stream_hashes(sorted({(s, v) for snap in starts.values() for s, v, _ in snap.heads}))
    now = await store.rollout_heads_at(sorted(starts), position)
    good = set()
    for rollout_id, snap in starts.items():
        first: dict[str, int] = {}
        for e in tails.get(rollout_id, ()):
            first.setdefault(e.stream, e.stream_version)
        heads_now = {s: (v, h.hex()) for s, v, h in now.get(rollout_id, [])}
        if all(found.get((s, v), b"").hex() == h and (first[s] == v + 1 if s in first else heads_now.get(s) == (v, h))
               for s, v, h in snap.heads):
            good.add(rollout_id)
        else:
            ignored(snap.stream, snap.position, "the log's events")
    return good
