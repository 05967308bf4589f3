"""The event log in memory: the engine's store protocols, for tests and tools that need no durability.

Every append is decided by the same pure planning as PostgreSQL's (engine.log.plan_batch: versions,
positions, hashes, the attempt rules) and projected by the same function (engine.projections.changes_for),
so a rule holds here exactly when it holds there. What it cannot promise is what only a database
gives: nothing survives the process, and there is one writer, the event loop (an append runs
without awaiting anything, so appends are atomic and serialized by construction).

One `MemoryLog` is the database; each `MemoryEventStore` on it is one process's connection to it,
with its own writer name, as each server holds its own PostgresEventStore.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from engine.attempts import FENCE_KINDS
from engine.checkpoint import CutReads, online_cut_reads, restart_only_at
from engine.errors import RollbookError
from engine.events import DEFAULT_PAYLOAD_LIMIT, AppendRequest, RecordedEvent, load_stored_json, stored_text
from engine.file_blobs import Blob
from engine.identity import Key, in_run
from engine.log import LogState, plan_batch
from engine.projections import TABLES, Change, changes_for
from engine.snapshots import SessionSnapshot

# The columns of each projection table (migrations/versions/0001_event_log.py): a row read here has
# every column, None where no event set it, as a row read from PostgreSQL has.
COLUMNS: dict[str, tuple[str, ...]] = {
    "attempt_state": ("rollout_id", "attempt", "status", "parent_attempt", "restored_from", "origin_position",
                      "started_position", "ended_position", "reward"),
    "rollout_state": ("rollout_id", "latest_attempt", "retired_through"),
    "episode_state": ("rollout_id", "attempt", "env", "task_id", "status", "step", "reward", "started_position",
                      "updated_position"),
    "session_state": ("rollout_id", "attempt", "env", "status", "revision", "stream_version", "updated_position"),
    "model_call_state": ("call_id", "rollout_id", "attempt", "status", "parent_call_id", "policy_version", "receipt",
                         "tokens", "disposition", "accepted_position", "updated_position"),
    "checkpoint_state": ("checkpoint_id", "phase", "position", "scope_size", "digest", "started_position",
                         "published_position", "updated_position"),
}


class MemoryLog:
    """The log and its projections: what a database holds, shared by every store opened on it."""

    def __init__(self) -> None:
        self.events: list[RecordedEvent] = []
        self.state = LogState(position=0)
        self.tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {t: {} for t in TABLES}
        self.keys: dict[str, tuple[int, int]] = {}  # an append's idempotency key -> its first and last position
        self.fence_position = 0
        self._appended = asyncio.Condition()
        # rollbook.stream_snapshots: (stream, position) -> (data, digest), JSON as stored (engine.snapshots)
        self.snapshots: dict[tuple[str, int], tuple[dict[str, Any], str]] = {}
        self.blobs: dict[str, bytes] = {}  # rollbook.file_blobs: digest -> content (engine.file_blobs)

    def store(self, writer: str, payload_limit: int = DEFAULT_PAYLOAD_LIMIT) -> MemoryEventStore:
        return MemoryEventStore(self, writer, payload_limit)

    def commit(self, request: AppendRequest, writer: str, limit: int) -> list[RecordedEvent]:
        """Plan one request against the log's state and record it, or raise and change nothing."""
        if request.key is not None and request.key in self.keys:
            first, last = self.keys[request.key]
            return self.events[first - 1:last]
        (outcome,) = plan_batch([request], self.state, writer, limit)
        if isinstance(outcome, RollbookError):
            raise outcome
        now = datetime.now(UTC)
        # What a reader gets back is the stored text read again, as from JSONB (engine.events.encode_payload).
        written = [dataclasses.replace(pe.event, data=load_stored_json(pe.payload), recorded_at=now) for pe in outcome]
        self.events.extend(written)
        if written and request.key is not None:
            self.keys[request.key] = (written[0].position, written[-1].position)
        for e in written:
            for change in changes_for(e):
                self._apply(change)
            if e.kind in FENCE_KINDS:
                self.fence_position = e.position
        return written

    def _apply(self, change: Change) -> None:
        rows = self.tables[change.table]
        if change.guard == "live_through":
            for (rollout_id, attempt), row in rows.items():
                if (rollout_id == change.key["rollout_id"] and attempt <= change.key["attempt"]
                        and row["status"] == "live"):
                    row.update(change.values)
            return
        key = tuple(change.key[c] for c in TABLES[change.table])
        row = rows.setdefault(key, dict.fromkeys(COLUMNS[change.table]))
        row.update(change.key)
        row.update(change.values)

    async def appended(self) -> None:
        async with self._appended:
            self._appended.notify_all()

    async def wait_past(self, position: int, timeout: float) -> None:
        async with self._appended:
            try:
                await asyncio.wait_for(self._appended.wait_for(lambda: len(self.events) > position), timeout)
            except TimeoutError:
                pass

    def row(self, table: str, *key: Any) -> dict[str, Any] | None:
        return self.tables[table].get(key)

    # What a careless disk or operator does behind the store's back: the engine's checks of a cut
    # (hash chains, lineage) are tested against these.

    def tamper(self, position: int, **data: Any) -> None:
        """Edit a recorded event's data; its hash stays as recorded."""
        i = next(i for i, e in enumerate(self.events) if e.position == position)
        self.events[i] = dataclasses.replace(self.events[i], data={**self.events[i].data, **data})

    def delete(self, position: int) -> None:
        self.events[:] = [e for e in self.events if e.position != position]


class MemoryEventStore:
    """engine.checkpoint.ParticipantStore and engine.coordinator.CheckpointStore over a MemoryLog."""

    def __init__(self, log: MemoryLog | None = None, writer: str = "memory",
                 payload_limit: int = DEFAULT_PAYLOAD_LIMIT) -> None:
        self.log = log if log is not None else MemoryLog()
        self.writer = writer
        self.payload_limit = payload_limit
        self.observers: list[Any] = []  # adapters.postgres.StoreObserver: told of every append

    async def close(self) -> None:
        """Nothing to release: the log outlives its stores, as a database outlives a connection."""

    # ---- appending ------------------------------------------------------------------------

    async def append(self, request: AppendRequest) -> list[RecordedEvent]:
        if not request.events:
            return []
        try:
            written = self.log.commit(request, self.writer, self.payload_limit)
        except RollbookError as exc:
            for o in self.observers:
                o.append_failed(exc.code)
            raise
        for o in self.observers:
            o.appended(len(request.events), 0.0)
        await self.log.appended()
        return written

    # ---- reading --------------------------------------------------------------------------

    async def head(self) -> int:
        return self.log.state.position

    async def read_stream(self, stream: str, after_version: int = 0, to_version: int | None = None) -> list[RecordedEvent]:
        return [e for e in self.log.events if e.stream == stream and e.stream_version > after_version
                and (to_version is None or e.stream_version <= to_version)]

    async def read_all(self, after: int = 0, limit: int = 1000, to: int | None = None) -> list[RecordedEvent]:
        events = self.log.events
        end = len(events) if to is None else self._index_after(to)
        return events[self._index_after(after):end][:limit]

    def _index_after(self, position: int) -> int:
        """The index of the first event past `position`. Found by position, not computed from it: a test
        that deletes an event behind the store's back (as a careless operator would a row) leaves a gap."""
        return bisect.bisect_right(self.log.events, position, key=lambda e: e.position)

    async def read_rollout(self, rollout_id: str, attempt: int | None = None, to: int | None = None,
                           kinds: Sequence[str] | None = None) -> list[RecordedEvent]:
        return [e for e in self.log.events if e.rollout_id == rollout_id and (attempt is None or e.attempt == attempt)
                and (to is None or e.position <= to) and (kinds is None or e.kind in kinds)]

    async def read_rollouts(self, rollout_ids: Sequence[str], to: int | None = None,
                            after: Mapping[str, int] | None = None) -> list[RecordedEvent]:
        wanted, after = set(rollout_ids), after or {}
        return [e for e in self.log.events if e.rollout_id in wanted and (to is None or e.position <= to)
                and e.position > after.get(e.rollout_id, 0)]

    async def stream_hashes(self, versions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        wanted = set(versions)
        return {(e.stream, e.stream_version): e.hash for e in self.log.events if (e.stream, e.stream_version) in wanted}

    async def session_snapshots(self, bounds: Mapping[str, int]) -> list[tuple[str, int, dict[str, Any], str]]:
        out = []
        for stream, bound in bounds.items():
            found = [p for s, p in self.log.snapshots if s == stream and p <= bound]
            if found:
                data, digest = self.log.snapshots[(stream, max(found))]
                out.append((stream, max(found), load_stored_json(stored_text(data)), digest))
        return out

    async def put_blobs(self, blobs: Sequence[Blob]) -> None:
        for b in blobs:
            self.log.blobs.setdefault(b.digest, b.content)

    async def get_blobs(self, digests: Sequence[str]) -> dict[str, bytes]:
        return {d: self.log.blobs[d] for d in digests if d in self.log.blobs}

    async def put_session_snapshots(self, snapshots: Sequence[SessionSnapshot]) -> None:
        for snap in snapshots:  # through JSON, as PostgreSQL would store it
            row = snap.row()
            self.log.snapshots.setdefault((snap.stream, snap.position), (load_stored_json(stored_text(row["data"])), row["digest"]))

    async def subscribe(self, after: int = 0, poll_seconds: float = 1.0) -> AsyncIterator[RecordedEvent]:
        """Catch up from `after`, then follow: woken by every append, as PostgreSQL's NOTIFY wakes a reader."""
        while True:
            batch = await self.read_all(after, 1000)
            for e in batch:
                yield e
                after = e.position
            if len(batch) < 1000:
                await self.log.wait_past(after, poll_seconds)

    # ---- projections: what a cut and a server need ------------------------------------------

    async def attempt_rows(self, rollout_ids: Sequence[str]) -> dict[Key, dict[str, Any]]:
        wanted = set(rollout_ids)
        return {key: {**row, "retired_through": (self.log.row("rollout_state", key[0]) or {}).get("retired_through")}
                for key, row in self.log.tables["attempt_state"].items() if key[0] in wanted}

    async def running_attempts(self, position: int, run: str | None) -> dict[Key, dict[str, Any]]:
        return {key: dict(row) for key, row in self.log.tables["attempt_state"].items()
                if (row["status"] == "live" or (row["status"] == "finished" and (row["ended_position"] or 0) > position))
                and in_run(key[0], run)}

    async def latest_boundaries(self, keys: Sequence[Key], position: int, kinds: Sequence[str]) -> dict[Key, int]:
        wanted, kinds_ = set(keys), set(kinds)
        out: dict[Key, int] = {}
        for e in self.log.events[:self._index_after(position)]:
            key = (e.rollout_id, e.attempt)
            if key in wanted and e.kind in kinds_:
                out[key] = e.position  # type: ignore[index]
        return out

    async def online_cut_reads(self, run: str | None, kinds: Sequence[str]) -> CutReads:
        return await online_cut_reads(self, run, kinds)  # one moment: nothing runs between its reads here

    async def restart_only_at(self, boundaries: dict[Key, int]) -> list[Key]:
        own: dict[Key, list[RecordedEvent]] = {k: [] for k in boundaries}
        for e in self.log.events:
            key = (e.rollout_id, e.attempt)
            if key in own:
                own[key].append(e)  # type: ignore[index]
        return sorted(k for k, b in boundaries.items() if restart_only_at(own[k], b))

    async def rollout_heads_at(self, rollout_ids: Sequence[str], position: int) -> dict[str, list[tuple[str, int, bytes]]]:
        heads: dict[str, dict[str, tuple[str, int, bytes]]] = {r: {} for r in rollout_ids}
        for e in self.log.events[:self._index_after(position)]:
            if e.rollout_id in heads:
                heads[e.rollout_id][e.stream] = (e.stream, e.stream_version, e.hash)
        return {r: sorted(streams.values()) for r, streams in heads.items()}

    async def checkpoints_in_phase(self, phases: Sequence[str]) -> list[str]:
        return sorted(cid for (cid,), row in self.log.tables["checkpoint_state"].items() if row["phase"] in phases)

    async def session_revision(self, rollout_id: str, attempt: int) -> int | None:
        row = self.log.row("session_state", rollout_id, attempt)
        return None if row is None else row["revision"]

    async def fence_position(self) -> int:
        return self.log.fence_position

    async def attempt_status(self, rollout_id: str, attempt: int) -> tuple[str | None, int]:
        row = self.log.row("attempt_state", rollout_id, attempt)
        return (None if row is None else row["status"]), await self.retired_through(rollout_id)

    async def attempt_reading(self, rollout_id: str, attempt: int) -> tuple[int, str | None, int]:
        return (await self.fence_position(), *await self.attempt_status(rollout_id, attempt))

    async def open_sessions(self) -> dict[Key, str]:
        attempts = self.log.tables["attempt_state"]
        return {key: row["env"] for key, row in self.log.tables["session_state"].items()
                if row["status"] == "open" and (attempts.get(key) or {}).get("status") == "live"}

    async def retired_through(self, rollout_id: str) -> int:
        mark = (self.log.row("rollout_state", rollout_id) or {}).get("retired_through")
        return -1 if mark is None else int(mark)

