"""The cut and the restore: a checkpoint is a log position plus, per episode, its resume boundary.

Commit fixes P at the head of the log and, for each rollout attempt in scope, the latest boundary
at or below P. It copies no session state: the digest combines, for every rollout in scope, the
hash-chain head at P of each of its streams (each head covers every event before it in its
stream), together with the cut's own lists (continue, fresh_dispatch) and its run. So its cost
grows with the number of streams in scope, never with their size, and yet an edit of any event of
a scoped rollout up to P, or of the lists, changes it.

A cut is the size of what is in flight at P, never of what the run (or the database) has done:
it lists the attempts it continues and the ones it restarts, not the ones already finished. Restore
learns which rollouts were complete at P from their own events up to P (`complete_at`), and asks
only about the rollouts it would otherwise fence. Restore re-reads each scoped rollout up to
P, re-derives the chain heads and checks lineage, before one atomic append fences every old
attempt and starts every new one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine import catalog as ev
from engine.attempts import AttemptStore
from engine.boundaries import with_messages
from engine.errors import InvalidCheckpointState, RestartInScope, UnknownCheckpoint
from engine.events import (
    GENESIS_HASH,
    NewEvent,
    RecordedEvent,
    canonical_json,
    chain_hash,
    encode_payload,
    has_large_float,
    stored_text,
)
from engine.file_blobs import BlobStore
from engine.identity import Key, checkpoint_stream, in_run
from engine.lineage import lineage_origin
from engine.log import EventStore
from engine.sessions import boundary_disagreement, open_session_restart, session_revisions
from engine.snapshots import SnapshotStore

# Events after which a rollout attempt can be resumed: its start, each environment step, each agent boundary.
BOUNDARY_KINDS = (ev.ATTEMPT_STARTED, ev.EPISODE_STEP, ev.AGENT_BOUNDARY)



@dataclass(frozen=True)
class CutReads:
    """What an online cut reads of the log, as of one moment (CutStore.online_cut_reads)."""

    position: int  # P, the head of the log
    attempts: dict[Key, dict[str, Any]]  # running_attempts(P, run): each one's status, started_position, ended_position
    boundaries: dict[Key, int]  # of those started by P, the latest boundary at or below P of each that has one
    restarts: frozenset[Key]  # of those with a boundary, the ones restart-only there (restart_only_at)
    heads: dict[str, list[tuple[str, int, bytes]]]  # rollout_heads_at(the rollouts of `boundaries`, P)


async def online_cut_reads(store: CutStore, run: str | None, kinds: Sequence[str]) -> CutReads:
    """CutReads by the store's separate reads, each of them at P: what a store without a statement of
    its own for it answers, and what the PostgreSQL statement is held to."""
    position = await store.head()
    attempts = {k: {c: row[c] for c in ("status", "started_position", "ended_position")}
                for k, row in (await store.running_attempts(position, run)).items()}
    started = sorted(k for k, row in attempts.items() if (row["started_position"] or 0) <= position)
    boundaries = await store.latest_boundaries(started, position, kinds)
    restarts = frozenset(await store.restart_only_at(boundaries))
    heads = await store.rollout_heads_at(sorted({r for r, _ in boundaries}), position)
    return CutReads(position, attempts, boundaries, restarts, heads)


class CutStore(EventStore, Protocol):
    async def latest_boundaries(self, keys: Sequence[Key], position: int, kinds: Sequence[str]) -> dict[Key, int]: ...

    async def rollout_heads_at(self, rollout_ids: Sequence[str], position: int) -> dict[str, list[tuple[str, int, bytes]]]: ...

    async def read_rollout(self, rollout_id: str, attempt: int | None = None, to: int | None = None,
                           kinds: Sequence[str] | None = None) -> list[RecordedEvent]: ...

    async def read_rollouts(self, rollout_ids: Sequence[str], to: int | None = None,
                            after: Mapping[str, int] | None = None) -> list[RecordedEvent]:
        """Every event of these rollouts (up to `to`; of one in `after`, past that position only), in
        log order: one query, whatever their number."""
        ...

    async def stream_hashes(self, versions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        """The recorded hash of each (stream, version) that exists: one query."""
        ...

    async def attempt_rows(self, rollout_ids: Sequence[str]) -> dict[Key, dict[str, Any]]: ...

    async def running_attempts(self, position: int, run: str | None) -> dict[Key, dict[str, Any]]:
        """Each attempt of the run's rollouts (every rollout's, with no run) live now or finished after
        `position`: what was in flight at `position`, plus what started since. Its rows only, whatever
        the run has finished before."""
        ...

    async def online_cut_reads(self, run: str | None, kinds: Sequence[str]) -> CutReads:
        """What an online cut reads (CutReads, with `kinds` the boundaries' kinds), as of one moment:
        `online_cut_reads` by the separate reads, or one statement that reads what they read."""
        ...

    async def restart_only_at(self, boundaries: dict[Key, int]) -> list[Key]:
        """Of these attempts, the ones that cannot be continued from the given boundary position: a
        resources session of a restart-only environment open there (`session_opened` records its
        state mode), or an activation in progress there on an agent that cannot continue one (its
        boundary says `continuable: false`)."""
        ...


class ParticipantStore(CutStore, AttemptStore, SnapshotStore, BlobStore, Protocol):
    """What a server needs of storage (adapters.postgres.PostgresEventStore implements it): the servers
    are typed against this, so they depend on the engine's port, not on the PostgreSQL driver."""

    async def retired_through(self, rollout_id: str) -> int: ...

    async def session_revision(self, rollout_id: str, attempt: int) -> int | None: ...

    async def open_sessions(self) -> dict[tuple[str, int], str]: ...


@dataclass(frozen=True)
class ScopeEntry:
    rollout_id: str
    attempt: int
    boundary: int  # log position of the boundary this attempt resumes from

    def to_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt, "boundary": self.boundary}


@dataclass(frozen=True)
class Cut:
    checkpoint_id: str
    position: int
    scope: tuple[ScopeEntry, ...]
    fresh: tuple[Key, ...]  # executions that restart from their input (restart-only or not continued)
    digest: str
    refs: dict[str, Any] = field(default_factory=dict)
    run: str | None = None  # the framework's rollouts are this run's (engine.identity.run_of); None: every one

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "position": self.position,
            "scope": [s.to_json() for s in self.scope],
            "fresh_dispatch": [list(k) for k in self.fresh],
            "digest": self.digest,
            "run": self.run,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], refs: dict[str, Any] | None = None) -> Cut:
        if "completed" in d:
            # Its digest covers the lists it kept: a cut of this version would never match it.
            raise InvalidCheckpointState(
                f"checkpoint {d.get('checkpoint_id')} was committed by an earlier rollbook, whose cut listed every "
                "completed attempt; this version cannot check it: take a new checkpoint",
                checkpoint_id=d.get("checkpoint_id"))
        return cls(
            d["checkpoint_id"],
            d["position"],
            tuple(ScopeEntry(s["rollout_id"], s["attempt"], s["boundary"]) for s in d["scope"]),
            tuple((r, a) for r, a in d.get("fresh_dispatch", [])),
            d["digest"],
            refs or {},
            d.get("run"),
        )


def cut_digest(heads: dict[str, list[tuple[str, int, bytes]]], scope: Iterable[ScopeEntry], *, position: int,
               fresh: Iterable[Key] = (), run: str | None = None) -> str:
    """One digest over the cut's lists and, per scoped rollout, its streams' chain heads at P.

    `heads` maps each scoped rollout to (stream, version, hash) of every stream holding its
    events, at the last version at or below P: a head covers every earlier event of its stream."""
    h = hashlib.sha256()
    h.update(canonical_json({
        "position": position,
        "continue": sorted([s.rollout_id, s.attempt, s.boundary] for s in scope),
        "fresh_dispatch": sorted([r, a] for r, a in fresh),
        "run": run,
    }).encode())
    for rollout_id in sorted({s.rollout_id for s in scope}):
        streams = sorted(heads.get(rollout_id, []))
        h.update(canonical_json([rollout_id, [[n, v, x.hex()] for n, v, x in streams]]).encode())
    return h.hexdigest()


def digest_of(cut: Cut, heads: dict[str, list[tuple[str, int, bytes]]]) -> str:
    return cut_digest(heads, cut.scope, position=cut.position, fresh=cut.fresh, run=cut.run)


@dataclass(frozen=True)
class Classification:
    """Exactly one disposition per execution, or the checkpoint is refused."""

    completed: tuple[Key, ...]
    continued: tuple[Key, ...]
    fresh_dispatch: tuple[Key, ...]


def classify(live: Iterable[Key], finished: Iterable[Key], scope: Iterable[Key], restarts: Iterable[Key]) -> Classification:
    """`live` are the executions known at the cut; `finished` completed at or before it.

    A scoped execution that finished at or before P is completed, not continued: a paused checkpoint
    lets work in flight run on to its next boundary, an episode's last step included, so a framework
    that named its running executions before P was fixed may name one that finished since (at 80
    rollouts in flight and a checkpoint every second, twice in 12 checkpoints)."""
    live_set, finished_set, restart_set = set(live), set(finished), set(restarts)
    scope_set = set(scope) - finished_set
    bad = sorted(scope_set & restart_set)
    if bad:
        raise RestartInScope(
            f"{len(bad)} restart-only execution(s) named in the scope, e.g. {bad[0][0]} attempt {bad[0][1]}",
            executions=[list(k) for k in bad[:10]],
        )
    unknown = sorted(scope_set - live_set)
    if unknown:
        raise InvalidCheckpointState(f"scope names unknown or inactive execution {unknown[0][0]} attempt {unknown[0][1]}")
    continued = scope_set
    # A restart reported for an attempt the cut does not hold live (a server still tracking an attempt
    # the rollout has since moved past) names no execution of the cut: the live one is classified.
    fresh = (live_set - finished_set - continued) | ((restart_set & live_set) - finished_set)
    return Classification(tuple(sorted(finished_set & (live_set | finished_set))), tuple(sorted(continued)), tuple(sorted(fresh)))


async def make_cut(store: CutStore, checkpoint_id: str, scope: Sequence[Key] | None, restarts: Sequence[Key],
                   run: str | None = None) -> Cut:
    """Fix P at the head of the log and each scoped attempt's resume boundary at or below it.

    Every execution in flight at P of the `run` (default: of every rollout in the database) gets a
    disposition, named in the scope or not; a framework sharing the database with others names its run.
    No scope: every execution in flight at P continues, less the restart-only ones."""
    position = await store.head()
    # participants report restart-only executions of every framework they serve
    restarts = [k for k in restarts if in_run(k[0], run)]
    # A scoped attempt may have finished before P (a paused checkpoint lets work run on to its next
    # boundary): its own row says so, and it is completed, not continued.
    rows = {**await store.running_attempts(position, run), **await store.attempt_rows(sorted({r for r, _ in scope or ()}))}
    live, finished = attempts_at(rows, position)
    # What the log says cannot be rebuilt at its boundary restarts too, whoever reported it.
    boundaries = await store.latest_boundaries(sorted(set(live) - set(finished)), position, BOUNDARY_KINDS)
    restarts = sorted(set(restarts) | set(await store.restart_only_at(boundaries)))
    if scope is None:
        scope = sorted(set(live) - set(finished) - set(restarts))
    return await _cut_at(store, checkpoint_id, position, classify(live, finished, scope, restarts), run, boundaries)


async def make_online_cut(store: CutStore, checkpoint_id: str, run: str | None = None) -> Cut:
    """The cut of a checkpoint that pauses no one: P is the head of the log, and every attempt live
    at P continues from its latest boundary at or below P, except the restart-only ones, which the
    log knows (engine/checkpoint.py `restart_only_at`): they restart from their input.

    Work done after an attempt's boundary and before P is not part of the cut: restore continues
    from the boundary, and that work is done again under the new attempt (a model call in flight is
    generated again, a tool call after the boundary is applied again to the state rebuilt at it)."""
    reads = await store.online_cut_reads(run, BOUNDARY_KINDS)
    live, finished = attempts_at(reads.attempts, reads.position)
    running = sorted(set(live) - set(finished))
    boundaries = {k: reads.boundaries[k] for k in running if k in reads.boundaries}
    # What cannot be rebuilt at the boundary it would continue from restarts from its input instead.
    restarts = reads.restarts & set(running)
    scope = [k for k in running if k not in restarts]
    return await _cut_at(store, checkpoint_id, reads.position, classify(live, finished, scope, restarts), run,
                         boundaries, reads.heads)


def restart_only_at(own: Sequence[RecordedEvent], boundary: int) -> bool:
    """Whether an attempt (its own events, in log order) cannot be continued from `boundary`: a
    resources session of a restart-only environment is open there, or an activation is in progress
    there on an agent that cannot continue one. The rule of CutStore.restart_only_at (one query on
    PostgreSQL); the session's rule is engine.sessions.open_session_restart."""
    before = [e for e in own if e.position <= boundary]
    continuable = True
    for e in before:
        if e.kind == ev.AGENT_BOUNDARY:
            continuable = continuable and e.data.get("continuable") is not False
        elif e.kind == ev.ACTIVATION_COMPLETED:
            continuable = True
    return open_session_restart(before) is not None or not continuable


def attempts_at(rows: dict[Key, dict[str, Any]], position: int) -> tuple[list[Key], list[Key]]:
    """The attempts started at or below `position` (live then, or finished since), and of those the
    ones finished at or below it."""
    live = [k for k, row in rows.items()
            if row["status"] in ("live", "finished") and (row["started_position"] or 0) <= position]
    finished = [k for k, row in rows.items() if row["status"] == "finished" and (row["ended_position"] or 0) <= position]
    return live, finished


async def _cut_at(store: CutStore, checkpoint_id: str, position: int, cls: Classification,
                  run: str | None, boundaries: dict[Key, int] | None = None,
                  heads: dict[str, list[tuple[str, int, bytes]]] | None = None) -> Cut:
    """The cut at `position`; `boundaries` and `heads` where the caller already read them at `position`
    (every continued attempt's and its rollout's, or more)."""
    if boundaries is None:
        boundaries = await store.latest_boundaries(list(cls.continued), position, BOUNDARY_KINDS)
    missing = [k for k in cls.continued if k not in boundaries]
    if missing:
        raise InvalidCheckpointState(f"rollout {missing[0][0]} attempt {missing[0][1]} has no boundary at or below {position}")
    entries = tuple(ScopeEntry(r, a, boundaries[(r, a)]) for r, a in cls.continued)
    rollouts = sorted({s.rollout_id for s in entries})
    heads = await store.rollout_heads_at(rollouts, position) if heads is None else {r: heads.get(r, []) for r in rollouts}
    cut = Cut(checkpoint_id, position, entries, cls.fresh_dispatch, "", run=run)
    return replace(cut, digest=digest_of(cut, heads))


def committed_event(cut: Cut) -> NewEvent:
    return NewEvent(checkpoint_stream(cut.checkpoint_id), ev.CHECKPOINT_COMMITTED, cut.to_json())


async def load_cut(store: CutStore, checkpoint_id: str) -> tuple[Cut, str]:
    """The committed cut of a checkpoint and its current phase."""
    events = await store.read_stream(checkpoint_stream(checkpoint_id))
    if not events:
        raise UnknownCheckpoint(f"no checkpoint {checkpoint_id}", checkpoint_id=checkpoint_id)
    committed = [e for e in events if e.kind == ev.CHECKPOINT_COMMITTED]
    phase = events[-1].kind.removeprefix("checkpoint_")
    if not committed:
        raise InvalidCheckpointState(f"checkpoint {checkpoint_id} was never committed (phase {phase})")
    _rechain(events)  # the checkpoint's own record (its lists, its digest) is as tamper-evident as the rest
    refs = {k: v for e in events if e.kind == ev.CHECKPOINT_PUBLISHED for k, v in e.data.items() if k.endswith("_ref")}
    return Cut.from_json(committed[-1].data, refs), phase


async def _predecessors(store: CutStore, per_rollout: dict[str, list[RecordedEvent]]) -> dict[str, dict[str, tuple[int, bytes]]]:
    """Where a rollout's part of a stream starts after other events of that stream, its chain
    continues from the recorded hash of the event just before: for every rollout, in one query."""
    firsts: dict[str, dict[str, int]] = {}
    for rollout_id, events in per_rollout.items():
        first = firsts.setdefault(rollout_id, {})
        for e in events:
            first.setdefault(e.stream, e.stream_version)
    wanted = sorted({(stream, v - 1) for first in firsts.values() for stream, v in first.items() if v > 1})
    found = await store.stream_hashes(wanted) if wanted else {}
    out: dict[str, dict[str, tuple[int, bytes]]] = {}
    for rollout_id, first in firsts.items():
        for stream, v in first.items():
            if v > 1:
                if (stream, v - 1) not in found:
                    raise InvalidCheckpointState(f"stream {stream} is missing version {v - 1}")
                out.setdefault(rollout_id, {})[stream] = (v - 1, found[(stream, v - 1)])
    return out


def _rechain(events: Sequence[RecordedEvent], start: dict[str, tuple[int, bytes]] | None = None) -> list[tuple[str, int, bytes]]:
    """Recompute each stream's chain head from its events; a gap or an edit shows as a mismatch."""
    heads: dict[str, tuple[int, bytes]] = dict(start or {})
    for e in events:
        version, prev = heads.get(e.stream, (0, GENESIS_HASH))
        if e.stream_version != version + 1:
            raise InvalidCheckpointState(f"stream {e.stream} is missing version {version + 1}")
        digest = recorded_chain_hash(prev, e)
        if digest != e.hash:
            raise InvalidCheckpointState(f"event {e.stream}@{e.stream_version} does not match its recorded hash")
        heads[e.stream] = (e.stream_version, digest)
    return [(s, v, h) for s, (v, h) in heads.items()]


def recorded_chain_hash(previous: bytes, e: RecordedEvent) -> bytes:
    """engine.events.chain_hash of an event as read back, without the append's checks (size limit:
    what was stored passed it): restore runs this once per event in scope."""
    text = canonical_json(e.data)
    if "e+" in text and has_large_float(e.data):  # the writer hashed them as PostgreSQL hands them back
        text = encode_payload(e.data, limit=1 << 62)
    return chain_hash(previous, e.stream, e.stream_version, e, stored_text(e.data, text))


def _recorded_heads(events: Sequence[RecordedEvent], start: dict[str, tuple[int, bytes]] | None = None) -> list[tuple[str, int, bytes]]:
    """Each stream's head as recorded, checking only that no version is missing: what a participant
    checks of the events it reads, once the coordinator has re-derived every hash (see read_cut)."""
    heads: dict[str, tuple[int, bytes]] = dict(start or {})
    for e in events:
        version, _ = heads.get(e.stream, (0, GENESIS_HASH))
        if e.stream_version != version + 1:
            raise InvalidCheckpointState(f"stream {e.stream} is missing version {version + 1}")
        heads[e.stream] = (e.stream_version, e.hash)
    return [(s, v, h) for s, (v, h) in heads.items()]


@dataclass(frozen=True)
class RestoreItem:
    entry: ScopeEntry
    history: tuple[RecordedEvent, ...]  # the attempt's own events up to its boundary


@dataclass(frozen=True)
class CutHistory:
    """One read of every scoped rollout's events (engine.checkpoint.read_cut), checked against the cut;
    each participant takes what it needs from it instead of reading history again."""

    cut: Cut
    events: dict[str, tuple[RecordedEvent, ...]]  # rollout id -> its events in log order
    items: tuple[RestoreItem, ...]  # in the order of the cut's scope

    def attempt(self, rollout_id: str, attempt: int, to: int | None = None) -> list[RecordedEvent]:
        return [e for e in self.events.get(rollout_id, ()) if e.attempt == attempt and (to is None or e.position <= to)]

    def effective(self, rollout_id: str, attempt: int, to: int | None = None) -> list[RecordedEvent]:
        """engine.lineage.effective_history from this read: the origin's events up to its boundary, then the attempt's own."""
        own = self.attempt(rollout_id, attempt, to)
        origin = lineage_origin(rollout_id, own)
        return own if origin is None else self.effective(*origin) + own


async def read_cut(store: CutStore, cut: Cut, *, rehash: bool = True, beyond_cut: bool = False,
                   after: Mapping[str, int] | None = None) -> CutHistory:
    """Read every scoped rollout's events in one query (plus one for chain predecessors, if any) and
    check them against the cut before anything is installed anywhere.

    With `rehash` (the coordinator, once per restore) every event up to P must re-derive its recorded
    hash, and the chain heads plus the cut's lists must give the committed digest. Without it (each
    participant, after the coordinator's check) the stream versions must be gap-free and the heads
    *as recorded* must still give the digest: a deleted event or a changed hash is refused there
    too, without paying for a second re-hash of every payload. `beyond_cut` also returns events
    after P (an episode's input may land after its first boundary); they are never part of the check.

    `after` (a participant that holds a snapshot of a rollout as of a position, engine.snapshots)
    reads that rollout's events past the position only: its heads at P come from the log's stream
    heads (one query reading no data), which its tail's recorded heads must agree with, and its
    lineage is not checked again here (the coordinator checked all of it before any participant
    restores). Its items and its `events` hold the tail only."""
    after = _tail_reads(after, rehash)
    by_rollout: dict[str, list[ScopeEntry]] = {}
    for s in cut.scope:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    events = _by_rollout(await store.read_rollouts(sorted(by_rollout), None if beyond_cut else cut.position, after), by_rollout)
    upto = {r: [e for e in events[r] if e.position <= cut.position] for r in by_rollout}
    await _read_fork_origins(store, events, cut.position, beyond_cut)
    start = await _predecessors(store, upto)
    heads: dict[str, list[tuple[str, int, bytes]]] = {}
    logged = await store.rollout_heads_at(sorted(after), cut.position) if after else {}
    items: list[RestoreItem] = []
    for rollout_id, entries in sorted(by_rollout.items()):
        upto_cut = upto[rollout_id]
        mine_start = start.get(rollout_id, {})
        heads[rollout_id] = _rechain(upto_cut, mine_start) if rehash else _recorded_heads(upto_cut, mine_start)
        if rollout_id in after:
            heads[rollout_id] = _tail_heads(rollout_id, heads[rollout_id], logged[rollout_id])
            items += [RestoreItem(s, tuple(_own(upto_cut, s))) for s in entries]
        else:
            items += [_restore_item(s, upto_cut, cut.position) for s in entries]
    if digest_of(cut, heads) != cut.digest:
        raise InvalidCheckpointState(f"checkpoint {cut.checkpoint_id}: the log no longer matches the cut's digest")
    order = {(s.rollout_id, s.attempt): i for i, s in enumerate(cut.scope)}
    items.sort(key=lambda i: order[(i.entry.rollout_id, i.entry.attempt)])
    return CutHistory(cut, {r: tuple(evs) for r, evs in events.items()}, tuple(items))


def _tail_reads(after: Mapping[str, int] | None, rehash: bool) -> Mapping[str, int]:
    if after and rehash:
        raise ValueError("the coordinator's check reads every event: no `after` with `rehash`")
    return after or {}


def _own(events: Iterable[RecordedEvent], s: ScopeEntry) -> list[RecordedEvent]:
    return [e for e in events if e.attempt == s.attempt and e.position <= s.boundary]


def _tail_heads(rollout_id: str, tail: list[tuple[str, int, bytes]], logged: list[tuple[str, int, bytes]]) -> list[tuple[str, int, bytes]]:
    """A rollout read past a snapshot: its heads at P are the log's, which its tail must agree with."""
    if not set(tail) <= set(logged):
        raise InvalidCheckpointState(f"{rollout_id}: its events no longer match the log's stream heads")
    return logged


def _restore_item(s: ScopeEntry, upto_cut: Sequence[RecordedEvent], position: int) -> RestoreItem:
    """A scoped attempt's history up to its boundary, checked: the boundary is there, its lineage holds."""
    mine = [e for e in upto_cut if e.attempt == s.attempt]
    history = [e for e in mine if e.position <= s.boundary]
    if not any(e.position == s.boundary for e in history):
        raise InvalidCheckpointState(f"the boundary of {s.rollout_id} attempt {s.attempt} is missing")
    _check_lineage(s, history, position, mine)
    with_messages(history)  # every agent boundary's conversation rebuilds from its deltas, or the cut is refused
    return RestoreItem(s, tuple(history))


def _by_rollout(rows: Iterable[RecordedEvent], rollouts: Iterable[str]) -> dict[str, list[RecordedEvent]]:
    events: dict[str, list[RecordedEvent]] = {r: [] for r in rollouts}
    for e in rows:
        if e.rollout_id in events:
            events[e.rollout_id].append(e)
    return events


async def validate_cut(store: CutStore, cut: Cut) -> list[RestoreItem]:
    """Check the whole cut before anything is installed anywhere: every event of every scoped
    rollout up to P must re-derive its recorded hash, and the chain heads plus the cut's lists
    must give the committed digest (read_cut with `rehash`)."""
    return list((await read_cut(store, cut)).items)


async def _read_fork_origins(store: CutStore, events: dict[str, list[RecordedEvent]], position: int, beyond_cut: bool) -> None:
    """Add to `events` the rollouts a scoped fork's lineage goes back to (a fork's origin, its origin's
    origin...), so each attempt's effective history comes from this read. They are history the fork
    only reads; the cut's digest covers the scoped rollouts themselves."""
    while True:
        wanted = sorted({str(e.data["origin_rollout_id"]) for evs in events.values() for e in evs
                         if e.kind == ev.ATTEMPT_STARTED and e.data.get("origin_rollout_id")} - set(events))
        if not wanted:
            return
        for rollout_id in wanted:
            events[rollout_id] = []
        for e in await store.read_rollouts(wanted, None if beyond_cut else position):
            if e.rollout_id in events:
                events[e.rollout_id].append(e)


def _check_lineage(s: ScopeEntry, history: Sequence[RecordedEvent], position: int, upto_cut: Sequence[RecordedEvent]) -> None:
    """The boundary's model calls must be durable by P, and the resources revisions it saw must be the
    revisions the sessions had at the boundary: otherwise components would resume from different moments."""
    boundary = next(e for e in history if e.position == s.boundary)
    completed = {e.data["call_id"] for e in upto_cut if e.kind == ev.CALL_COMPLETED}
    for call_id in boundary.data.get("calls", []):
        if call_id not in completed:
            raise InvalidCheckpointState(f"{s.rollout_id}: boundary depends on model call {call_id}, not completed by the cut")
    wrong = boundary_disagreement(boundary.data, session_revisions(history))  # the session rules: engine.sessions
    if wrong is not None:
        raise InvalidCheckpointState(f"{s.rollout_id}: boundary saw {wrong[0]} at revision {wrong[1]}, the log has {wrong[2]}")


async def started_after(store: CutStore, cut: Cut) -> list[Key]:
    """Attempts (live or finished) the cut never saw: started after P in one of its run's rollouts
    that had no attempt in flight or complete at P. In the restored world they were never
    dispatched, so restore fences them and starts each afresh. A rollout complete at P is left as it
    is: the cut does not list those, so their own events up to P say which they are."""
    named = {s.rollout_id for s in cut.scope} | {r for r, _ in cut.fresh}
    rows = await store.running_attempts(cut.position, cut.run)
    later = sorted(k for k, row in rows.items() if (row["started_position"] or 0) > cut.position and k[0] not in named)
    if not later:
        return []
    complete = {r for r, _ in complete_at(await store.read_rollouts(sorted({r for r, _ in later}), cut.position), cut.position)}
    return [k for k in later if k[0] not in complete]


def complete_at(events: Iterable[RecordedEvent], position: int) -> set[Key]:
    """The attempts complete at `position`: finished at or below it, and not fenced there since (the
    same reading of the log that attempt_state gives of its head, as of `position`)."""
    ended: dict[Key, str] = {}
    for e in events:
        if e.position <= position and e.attempt is not None and e.kind in (ev.ATTEMPT_FINISHED, ev.ATTEMPT_FENCED):
            ended[(str(e.rollout_id), e.attempt)] = e.kind
    return {k for k, kind in ended.items() if kind == ev.ATTEMPT_FINISHED}
