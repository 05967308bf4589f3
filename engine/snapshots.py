"""Snapshots of a session's replayed state: a speed-up of the session fold, never the truth.

WHICH FOLD. Restore (the resources server's `rebuild`), recovery after a crash (the same `rebuild`,
from `_recover`) and `rollbook replay` all fold an attempt's effective history through one fold,
engine.sessions.SessionReplay; it is the only fold whose cost per event is the environment's, not
ours: a reducer that copies its state makes it quadratic (a workplace session of 5,000 mutations
took 70 s to replay, against 0.4 s to read its 10,000 events and 0.1 s to re-hash them; measured
with the PostgreSQL store). So one snapshot format, `SessionSnapshot`, holds that fold's state:
the session's opening data (its environment and task), its state, revision, whether it is open,
and the revision of every session stream seen. It is keyed by (stream, position): the session
stream of the attempt whose effective history was folded, and the log position folded up to. It
stands for `effective_history(rollout, attempt, to=position)`.

WHAT A READER DOES. `fold_from` picks, for an effective history it has read, the newest snapshot
at or before each segment of its lineage ends (an origin's snapshot serves every attempt restored
from a later boundary of it), checks it, and hands the fold that state plus the events after it:
recovery (`_recover`) and a restore whose rollout has no snapshot of its own. The resources
server's restore goes further (engine/snapshot_reads.py): with a snapshot of a scoped attempt's own
session it reads only that rollout's events past the snapshot.

THE CHECK, AND WHY IT IS CHEAP. A snapshot records its `heads`: each session stream it folded, at
its last version at or below the position, with that event's recorded hash; this is the digest
rule of the cut (engine.checkpoint.cut_digest): a stream's chain head covers every earlier event of
the stream, so equal heads mean the very events the snapshot was folded from. Checking them never
re-reads what the snapshot saves. A reader that has the events in hand (recovery reads the
attempt's effective history for its other checks) compares heads in one pass of dictionary updates,
no payload hashed. A restore that reads only the tail asks the log for the recorded hash at each
named version and for the stream heads at P, two queries reading no event data, and requires each
named stream's next event to be the first past the position (engine/snapshot_reads.py). Restore's
coordinator re-derives every hash of the scope from the payloads before any participant restores
(engine.checkpoint.validate_cut), so the heads a snapshot is compared with are those the cut's
digest covers: the digest check still covers what the snapshot stands for. The row's own `digest`
is sha256 over everything else in it (the state included), so a row edited in place (state, heads
or position) no longer matches and is ignored. A snapshot that fails either check is ignored, the
events are read and folded from the start, and `COUNTS.ignored` counts it (and the log says so):
it is never an error to the user.

What the check cannot see: someone able to write the table who also recomputes the row's digest
over a forged state. Such a writer can equally rewrite the log's own rows and recompute their hash
chain; the cut's digest in the checkpoint's hash-chained events is the anchor against that for the
log, and a snapshot has none. Delete the table's rows to drop every snapshot: nothing is lost.

WHEN ONE IS WRITTEN, AND WHY THERE. Lazily, by a reader that just folded a long tail
(`worth_writing`: SNAPSHOT_AFTER session events or more beyond where it started): one insert, off
every append's path, paid only by a reader that just paid far more for the fold. Not at checkpoint
commit: a commit reads stream heads and no event data, so its cost grows with the number of streams
in scope and never with their length; folding there would make every checkpoint pay for the longest
session in scope, whether or not anyone ever restores it. The first restore, recovery or replay of
a long session pays for the fold once; every later one starts at the snapshot. `rollbook replay`
never starts at one (the fold of every step is its check) but leaves one where it ended.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine import catalog as ev
from engine.events import RecordedEvent, canonical_json
from engine.identity import is_session_stream, session_stream
from engine.sessions import Opener, SessionReplay

SNAPSHOT_AFTER = 100  # session events folded beyond the start before a reader writes a snapshot
log = logging.getLogger("rollbook.snapshots")


@dataclass
class Counts:
    """How often a snapshot was used, ignored (it did not match) or written, in this process."""

    used: int = 0
    ignored: int = 0
    written: int = 0


COUNTS = Counts()


@dataclass(frozen=True)
class SessionSnapshot:
    stream: str  # the session stream of the attempt whose effective history was folded
    position: int  # folded up to this log position, inclusive
    heads: tuple[tuple[str, int, str], ...]  # (session stream, version, recorded hash hex) at `position`
    state: dict[str, Any]  # SessionReplay's fields: opened, state, revision, open, revisions

    @property
    def digest(self) -> str:
        return snapshot_digest(self.stream, self.position, self.heads, self.state)

    def row(self) -> dict[str, Any]:
        return {"stream": self.stream, "position": self.position,
                "data": {"heads": [list(h) for h in self.heads], "state": self.state}, "digest": self.digest}


def snapshot_digest(stream: str, position: int, heads: Sequence[Sequence[Any]], state: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json({"stream": stream, "position": position, "heads": [list(h) for h in heads],
                                          "state": state}).encode()).hexdigest()


def from_row(stream: str, position: int, data: Mapping[str, Any], digest: str) -> SessionSnapshot | None:
    """A stored row as a snapshot; None when the row does not match its own digest (edited in place)."""
    try:
        heads = tuple((str(s), int(v), str(h)) for s, v, h in data["heads"])
        snap = SessionSnapshot(stream, int(position), heads, dict(data["state"]))
    except (KeyError, TypeError, ValueError):
        return None
    return snap if snap.digest == digest else None


class SnapshotStore(Protocol):
    async def session_snapshots(self, bounds: Mapping[str, int]) -> list[tuple[str, int, dict[str, Any], str]]:
        """For each stream, its newest snapshot row at or below the bound (stream, position, data,
        digest): one query."""
        ...

    async def put_session_snapshots(self, snapshots: Sequence[SessionSnapshot]) -> None:
        """Store these (one grouped insert; a row already there for the same key is kept)."""
        ...


def recorded_heads(events: Sequence[RecordedEvent], position: int) -> tuple[tuple[str, int, str], ...]:
    """Each session stream of `events` at its last version at or below `position`, with its
    recorded hash: the cut's digest rule, applied to the session streams."""
    heads: dict[str, tuple[int, str]] = {}
    for e in events:
        if e.position > position:
            break
        if is_session_stream(e.stream):
            heads[e.stream] = (e.stream_version, e.hash.hex())
    return tuple(sorted((s, v, h) for s, (v, h) in heads.items()))


def lineage_bounds(history: Sequence[RecordedEvent]) -> dict[str, int]:
    """Where a snapshot may stand in an effective history: for each attempt of its lineage, that
    attempt's session stream and the position of its last event in the history (a snapshot of the
    attempt at or below it stands for a prefix of this history)."""
    bounds: dict[str, int] = {}
    for e in history:
        if e.rollout_id is not None and e.attempt is not None:
            bounds[session_stream(e.rollout_id, e.attempt)] = e.position
    return bounds


def capture(replay: SessionReplay, history: Sequence[RecordedEvent], opened: Mapping[str, Any] | None,
            base: Sequence[tuple[str, int, str]] = ()) -> SessionSnapshot | None:
    """The snapshot of `replay`, which has folded all of `history` (an effective history, in log
    order; after a snapshot with heads `base`, the events past it); None for an empty history."""
    if not history:
        return None
    last = history[-1]
    if last.rollout_id is None or last.attempt is None:
        return None
    heads = {s: (v, h) for s, v, h in base} | {s: (v, h) for s, v, h in recorded_heads(history, last.position)}
    return SessionSnapshot(session_stream(last.rollout_id, last.attempt), last.position,
                           tuple(sorted((s, v, h) for s, (v, h) in heads.items())), {
                               "opened": dict(opened) if opened is not None else None,
                               "state": replay.state, "revision": replay.revision, "open": replay.open,
                               "revisions": dict(replay.revisions)})


def resume(snapshot: SessionSnapshot, opener: Opener) -> tuple[SessionReplay, Mapping[str, Any] | None]:
    """A SessionReplay as the snapshot left it, and the opening data it was opened with."""
    s = snapshot.state
    replay = SessionReplay(opener, revision=int(s["revision"]), open=bool(s["open"]), revisions=dict(s["revisions"]))
    opened = s.get("opened")
    if opened is not None:
        replay.env, replay.task, _ = opener(opened)
        replay.state = s["state"]
    return replay, opened


def ignored(stream: str, position: int, why: str) -> None:
    COUNTS.ignored += 1
    log.warning("snapshot %s@%s does not match %s; the events are read from the start", stream, position, why)


def choose(rows: Sequence[tuple[str, int, dict[str, Any], str]], history: Sequence[RecordedEvent]) -> SessionSnapshot | None:
    """Of the stored rows, the newest that matches both its own digest and the heads of the
    history's events it stands for; each one that does not is counted and logged, never raised."""
    for stream, position, data, digest in sorted(rows, key=lambda r: r[1], reverse=True):
        snap = from_row(stream, position, data, digest)
        if snap is not None and snap.heads == recorded_heads(history, snap.position) and _ends_at(history, snap):
            COUNTS.used += 1
            return snap
        ignored(stream, position, "its own digest" if snap is None else "the log's events")
    return None


def _ends_at(history: Sequence[RecordedEvent], snap: SessionSnapshot) -> bool:
    """The snapshot's position is an event of this history, of the attempt it names."""
    return any(e.position == snap.position and e.rollout_id is not None and e.attempt is not None
               and session_stream(e.rollout_id, e.attempt) == snap.stream for e in history)


def opening(e: RecordedEvent, opened: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The opening data a fold keeps after `e`: a fresh `session_opened` replaces it."""
    if e.kind == ev.SESSION_OPENED and is_session_stream(e.stream) and not (
            e.data.get("restored_from") is not None or e.data.get("recovered")):
        return e.data
    return opened


def worth_writing(folded: int) -> bool:
    return folded >= SNAPSHOT_AFTER


Row = tuple[str, int, dict[str, Any], str]  # a stored snapshot: stream, position, data, digest


def merged_bounds(histories: Sequence[Sequence[RecordedEvent]]) -> dict[str, int]:
    """lineage_bounds of several histories, for one query: a stream two of them share (two forks
    of one origin) is asked for at the lower bound, which serves both."""
    out: dict[str, int] = {}
    for history in histories:
        for stream, bound in lineage_bounds(history).items():
            out[stream] = min(bound, out.get(stream, bound))
    return out


def fold_from(rows: Sequence[Row], opener: Opener, history: Sequence[RecordedEvent], *, write: bool = True,
              start: SessionSnapshot | None = None) -> tuple[SessionReplay, SessionSnapshot | None]:
    """SessionReplay over an effective history (log order), started from the newest of `rows` that
    stands for a prefix of it and matches, then the events after it. Raises ReplayDivergence as the
    fold from the start would. With `write`, a long tail folded gives the snapshot of where it
    ended (`worth_writing`), for the caller to store with others in one insert. `start`: a snapshot
    the caller checked against the log already (engine.snapshot_reads), and `history` holds only
    the events past it."""
    bounds = lineage_bounds(history)
    mine = [r for r in rows if r[0] in bounds and r[1] <= bounds[r[0]]]
    snap = start or (choose(mine, history) if mine else None)
    opened: Mapping[str, Any] | None
    if snap is None:
        replay, opened, tail = SessionReplay(opener), None, list(history)
    else:
        replay, opened = resume(snap, opener)
        tail = [e for e in history if e.position > snap.position]
    folded = 0
    for e in tail:
        opened = opening(e, opened)
        if replay.apply(e) is not None:
            folded += 1
    base = start.heads if start is not None else ()
    return replay, capture(replay, history, opened, base) if write and worth_writing(folded) else None


async def store_snapshots(store: SnapshotStore, new: Sequence[SessionSnapshot | None]) -> None:
    written = [s for s in new if s is not None]
    if written:
        await store.put_session_snapshots(written)
        COUNTS.written += len(written)


async def fold_session(store: SnapshotStore, opener: Opener, history: Sequence[RecordedEvent], *,
                       write: bool = True) -> SessionReplay:
    """fold_from one history with the store's snapshots (one query), storing the one it leaves."""
    rows = await store.session_snapshots(lineage_bounds(history)) if history else []
    replay, new = fold_from(rows, opener, history, write=write)
    await store_snapshots(store, [new])
    return replay
