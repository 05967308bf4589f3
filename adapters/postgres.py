"""The event log on PostgreSQL (SQLAlchemy 2 async on psycopg 3).

Gap-free positions: every append transaction starts by locking the one row of `log_head`
(SELECT ... FOR UPDATE) and takes its positions from it. PostgreSQL makes a transaction visible
before it releases its row locks, so the next writer cannot commit a higher position until the
lower one is visible: readers that select `position > P` in order never see a later position
before an earlier one. The same lock serializes fencing with appends (both are appends).

That lock would cap throughput at one commit (one fsync) per append, so appends are grouped:
concurrent `append` calls in a process queue up and one transaction writes them all, each
request still atomic and checked on its own (engine.log.plan_batch). A caller's append returns
only after the transaction holding it has committed. Within the transaction the rows go to the
server in pipeline mode, a chunk at a time, so PostgreSQL writes while Python plans the rest.

Database faults: pooled connections are checked before use (pool_pre_ping) and a lost one is
dropped and opened again. An operation that loses its connection is retried with backoff for up
to `patience_s` (a restart of a few seconds is ridden out), then fails with `database_unavailable`.
A retried append is safe even when its first try did commit and only the answer was lost: every
request carries an idempotency key, checked and recorded in the append transaction
(`rollbook.append_keys`), so a retry returns the events the first try wrote.

Bounds: each process holds at most `PoolLimits.size + overflow` connections, and an operation that
waits longer than `timeout_s` for one is treated as a database that does not answer (retried
within the patience, then `database_unavailable`, a 503), never a 500. A group of appends stops
taking requests once its payloads reach MAX_GROUP_BYTES.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import psycopg
import sqlalchemy.exc
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from adapters.database import libpq_dsn, sqlalchemy_url
from engine import catalog as ev
from engine.attempts import FENCE_KINDS, RolloutState
from engine.errors import DatabaseUnavailable, RollbookError
from engine.events import (
    DEFAULT_PAYLOAD_LIMIT,
    AppendRequest,
    RecordedEvent,
    escape_strings,
    load_stored_json,
)
from engine.log import LogState, PlannedEvent, StreamHead, plan_batch
from engine.projections import TABLES, Change, changes_for

log = logging.getLogger(__name__)

CHANNEL = "rollbook_events"
# Every append takes this lock first; so do a rebuild (no append may interleave) and head() (it
# waits for an append in flight, so the head it returns counts that append).
LOCK_LOG_HEAD = "SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE"
# What an append plans from, read in one statement once the log head is locked: the requests' keys
# already recorded (k), the streams' heads (h), the rollouts' retire marks (r) and attempts (a).
READ_HEADS = (
    "SELECT 'k', key, first_position, last_position, NULL::text, NULL::bytea FROM rollbook.append_keys "
    "WHERE key = ANY(%s) "
    "UNION ALL SELECT 'h', stream, version, NULL, NULL, hash FROM rollbook.stream_heads WHERE stream = ANY(%s) "
    "UNION ALL SELECT 'r', rollout_id, retired_through, NULL, NULL, NULL FROM rollbook.rollout_state "
    "WHERE rollout_id = ANY(%s) "
    "UNION ALL SELECT 'a', rollout_id, attempt, NULL, status, NULL FROM rollbook.attempt_state WHERE rollout_id = ANY(%s)"
)
MAX_GROUP_EVENTS = 2000
# A group's transaction, and the memory its plan holds, stays near this many bytes of payload: the
# group stops taking requests once it reaches it (one request is atomic, so it is never split).
MAX_GROUP_BYTES = 8 * 1024 * 1024
# Rows per INSERT of a group: enough that per-statement cost stays small (a group of 64 one-event
# appends is one statement), few enough that the server has rows to write while the next are planned.
INSERT_CHUNK_EVENTS = 100
# How long an operation keeps retrying a database that does not answer before it reports
# `database_unavailable`: long enough for a restart of a few seconds.
DEFAULT_PATIENCE_S = float(os.environ.get("ROLLBOOK_DB_PATIENCE_S") or 20.0)
# How long an append's idempotency key is kept (`rollbook db prune-keys`). A key is only ever looked
# up by a retry of the same append, and the store retries an append only within its patience
# (DEFAULT_PATIENCE_S, seconds) of the first try: the key is made per call of `append`, never handed
# to a caller, so no retry can come later. A day is that window many thousand times over.
DEFAULT_KEY_RETENTION_S = 86400.0
# The shortest retention `prune_append_keys` accepts: well past any patience a store is given.
MIN_KEY_RETENTION_S = 600.0
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    """One process's database connections ([limits] in the config; docs/operations.md, "Bounds, and sizing PostgreSQL").
    The defaults let four servers, two workers each, and a `rollbook run` (9 processes, 90
    connections at most) fit PostgreSQL's default max_connections = 100 with its reserved slots."""

    size: int = 5  # kept open
    overflow: int = 5  # opened under load, closed when returned
    timeout_s: float = 10.0  # waiting for a free connection; past it the wait counts as an outage

    @property
    def most(self) -> int:
        return self.size + self.overflow


def make_engine(dsn: str, pool: PoolLimits | None = None) -> AsyncEngine:
    """The one way a process opens its pool: bounded, and pre-pinged (a connection the server dropped,
    as in a restart, is replaced at checkout rather than used and failed)."""
    pool = pool or PoolLimits()
    return create_async_engine(sqlalchemy_url(dsn), pool_size=pool.size, max_overflow=pool.overflow,
                               pool_timeout=pool.timeout_s, pool_pre_ping=True, json_deserializer=load_stored_json)


class StoreObserver(Protocol):
    """Told of appends and database faults (adapters.telemetry.Telemetry is one): plain calls, made on
    the event loop, that must not block or raise."""

    def appended(self, events: int, seconds: float) -> None: ...
    def append_failed(self, code: str) -> None: ...
    def connection_lost(self, what: str) -> None: ...
    def database_unavailable(self, what: str) -> None: ...


def connection_lost(exc: BaseException) -> bool:
    """Whether `exc` says the database connection failed (retry), not that the statement was wrong."""
    if isinstance(exc, sqlalchemy.exc.TimeoutError):
        return True  # no pooled connection came free in time: nothing ran, so asking again is safe
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(exc.orig, psycopg.OperationalError | psycopg.InterfaceError)
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | sqlalchemy.exc.InterfaceError
                      | ConnectionError | TimeoutError) or (isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError))


def retrying(what: str) -> Callable[[Callable[..., Awaitable[_T]]], Callable[..., Awaitable[_T]]]:
    """An operation that is safe to repeat (a read, an upsert), retried across a lost connection."""
    def wrap(fn: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
        @functools.wraps(fn)
        async def retried(self: Any, *args: Any, **kw: Any) -> _T:
            return await with_retry(lambda: fn(self, *args, **kw), getattr(self, "patience_s", DEFAULT_PATIENCE_S), what,
                                    getattr(self, "observers", ()))
        return retried
    return wrap


async def with_retry(op: Callable[[], Awaitable[_T]], patience_s: float = DEFAULT_PATIENCE_S, what: str = "a query",
                     observers: Sequence[StoreObserver] = ()) -> _T:
    """Run `op`, again after a lost connection, with backoff, for up to `patience_s` seconds.
    `op` must be safe to repeat (a read, or an append with its idempotency key). `observers` hear of
    each lost connection and of giving up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    delay = 0.05
    while True:
        try:
            return await op()
        except Exception as exc:
            if not connection_lost(exc):
                raise
            if loop.time() + delay > deadline:
                for o in observers:
                    o.database_unavailable(what)
                raise DatabaseUnavailable(f"the database did not answer {what} for {patience_s:g} s: "
                                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
            for o in observers:
                o.connection_lost(what)
            log.warning("database connection lost during %s; retrying in %.2f s", what, delay)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


_COLUMNS = "position, stream, stream_version, kind, data, schema_version, rollout_id, attempt, writer, hash, recorded_at"


def _row_to_event(row: Any) -> RecordedEvent:
    return RecordedEvent(
        position=row.position,
        stream=row.stream,
        stream_version=row.stream_version,
        kind=row.kind,
        data=row.data,
        rollout_id=row.rollout_id,
        attempt=row.attempt,
        schema_version=row.schema_version,
        writer=row.writer,
        hash=bytes(row.hash),
        recorded_at=row.recorded_at,
    )


def merge_changes(changes: Iterable[Change]) -> list[Change]:
    """Sequential upserts of one row equal one upsert of their merged columns, later ones winning."""
    merged: dict[tuple[str, tuple[Any, ...]], Change] = {}
    for ch in changes:
        if ch.guard is not None:
            continue  # applied after the upserts by apply_changes
        key = (ch.table, tuple(ch.key[c] for c in TABLES[ch.table]))
        prior = merged.get(key)
        merged[key] = ch if prior is None else Change(ch.table, ch.key, {**prior.values, **ch.values})
    return list(merged.values())


async def apply_changes(conn: psycopg.AsyncConnection[Any], changes: Iterable[Change]) -> None:
    changes = list(changes)
    groups: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for ch in merge_changes(changes):
        cols = tuple(sorted(ch.values))
        # Projected values come from event data: stored in the same escaped spelling as the events
        # (engine.events.escape_strings), or a NUL in a task id would fail the whole group's transaction.
        values = escape_strings({**ch.key, **ch.values})
        row = {c: Jsonb(v) if isinstance(v, dict | list) else v for c, v in values.items()}
        groups.setdefault((ch.table, cols), []).append(row)
    async with conn.cursor() as cur:
        for (table, cols), rows in groups.items():
            keys = TABLES[table]
            allcols = keys + cols
            updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols) or f"{keys[0]} = EXCLUDED.{keys[0]}"
            sql = (
                f"INSERT INTO rollbook.{table} ({', '.join(allcols)}) VALUES ({', '.join(f'%({c})s' for c in allcols)}) "
                f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates}"
            )
            await cur.executemany(sql, rows)
        # Guarded changes come last: no event the append check admits after a retire (in the same
        # group) can touch an attempt it ended, so applying them after the upserts is in log order.
        for ch in changes:
            if ch.guard == "live_through":
                sets = ", ".join(f"{c} = %({c})s" for c in sorted(ch.values))
                await cur.execute(
                    f"UPDATE rollbook.{ch.table} SET {sets} WHERE rollout_id = %(rollout_id)s "
                    "AND attempt <= %(attempt)s AND status = 'live'", {**ch.key, **ch.values})


class _Pending:
    __slots__ = ("request", "future")

    def __init__(self, request: AppendRequest, future: asyncio.Future[list[RecordedEvent]]) -> None:
        self.request = request
        self.future = future


class PostgresEventStore:
    def __init__(self, engine: AsyncEngine, dsn: str, writer: str, payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
                 patience_s: float = DEFAULT_PATIENCE_S) -> None:
        self.engine = engine
        self.dsn = dsn
        self.writer = writer
        self.payload_limit = payload_limit
        self.patience_s = patience_s
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._notify_pending = False
        self.observers: list[StoreObserver] = []  # told of every append and database fault (a server's metrics)

    @classmethod
    def connect(cls, dsn: str, writer: str, pool: PoolLimits | None = None, **kw: Any) -> PostgresEventStore:
        return cls(make_engine(dsn, pool), dsn, writer, **kw)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):
                pass
            self._worker = None
        await self.engine.dispose()

    # ---- appending ------------------------------------------------------------------------

    async def append(self, request: AppendRequest) -> list[RecordedEvent]:
        if not request.events:
            return []
        if request.key is None:  # one key for every try of this request
            request = dataclasses.replace(request, key=uuid.uuid4().hex)
        loop = asyncio.get_running_loop()
        pending = _Pending(request, loop.create_future())
        self._queue.append(pending)
        self._wakeup.set()
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run_worker())
        if not self.observers:
            return await pending.future
        started = time.perf_counter()
        try:
            written = await pending.future
        except Exception as exc:
            for o in self.observers:
                o.append_failed(exc.code if isinstance(exc, RollbookError) else type(exc).__name__)
            raise
        for o in self.observers:
            o.appended(len(request.events), time.perf_counter() - started)
        return written

    async def _run_worker(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                group, size = [], 0
                while self._queue and (not group or size + len(self._queue[0].request.events) <= MAX_GROUP_EVENTS):
                    item = self._queue.pop(0)
                    group.append(item)
                    size += len(item.request.events)
                requests = [p.request for p in group]
                try:
                    # A lost connection is retried: the keys make a retry of a committed group return it.
                    outcomes = await with_retry(lambda r=requests: self._commit_group(r), self.patience_s, "an append",  # type: ignore[misc]
                                                self.observers)
                except Exception as exc:  # the whole transaction failed: every caller in it hears why
                    for p in group:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                # Requests past the group's byte bound were not planned: first in line for the next group.
                self._queue[:0] = [p for p, outcome in zip(group, outcomes, strict=True) if outcome is None]
                for p, outcome in zip(group, outcomes, strict=True):
                    if p.future.done() or outcome is None:
                        continue
                    if isinstance(outcome, RollbookError):
                        p.future.set_exception(outcome)
                    else:
                        p.future.set_result(outcome)
                self._schedule_notify()

    async def _commit_group(self, requests: Sequence[AppendRequest]) -> list[list[RecordedEvent] | RollbookError | None]:
        """Each request's events or refusal; None for a request left for the next group (the group's
        payloads had reached MAX_GROUP_BYTES before it)."""
        keys = [r.key for r in requests if r.key is not None]
        streams = sorted({e.stream for r in requests for e in r.events} | {s for r in requests for s in r.expected_versions})
        rollouts = sorted({e.rollout_id for r in requests for e in r.events if e.rollout_id is not None})
        # Pipeline mode: the server writes one request's rows while Python plans the next (on two
        # cores that overlap is most of a large group's cost; benchmarks/README.md). The reads
        # below fetch, so they still wait for the lock before the heads are read.
        async with self._driver_connection() as conn, conn.pipeline(), conn.transaction():
            lock = await conn.execute(LOCK_LOG_HEAD)
            # Everything else the plan depends on, in one statement: its own snapshot is taken after
            # the lock above is granted, so it sees every append committed before this one.
            heads = await conn.execute(READ_HEADS, (keys, streams, rollouts, rollouts))
            head = await lock.fetchone()
            if head is None:
                raise RuntimeError("rollbook.log_head has no row; run `rollbook db upgrade` on this database")
            state = LogState(position=head[0])
            done: dict[str, tuple[int, int]] = {}
            marks: list[tuple[str, int | None]] = []
            for what, name, n, m, status, digest in await heads.fetchall():
                if what == "k":
                    done[name] = (n, m)
                elif what == "h":
                    state.streams[name] = StreamHead(n, bytes(digest))
                elif what == "r":
                    marks.append((name, n))
                else:
                    state.rollouts.setdefault(name, RolloutState({})).attempts[n] = status
            for rollout_id, mark in marks:
                state.rollouts.setdefault(rollout_id, RolloutState({})).retired_through = mark if mark is not None else -1
            # A request whose key is recorded committed on an earlier try: its events, not a second copy.
            earlier: dict[str, list[RecordedEvent]] = {}
            if done:
                lo, hi = min(f for f, _ in done.values()), max(t for _, t in done.values())
                async with conn.cursor(row_factory=namedtuple_row) as cur:
                    await cur.execute(f"SELECT {_COLUMNS} FROM rollbook.events WHERE position BETWEEN %s AND %s "
                                      "ORDER BY position", (lo, hi))
                    rows = [_row_to_event(r) for r in await cur.fetchall()]
                for key, (first, last) in done.items():
                    earlier[key] = [e for e in rows if first <= e.position <= last]
            todo = [r for r in requests if r.key not in done]
            planned: list[list[PlannedEvent] | RollbookError] = []
            unsent: list[PlannedEvent] = []
            size = 0
            # Sized as planned (the payload is encoded once, here): the group stops once it holds
            # MAX_GROUP_BYTES, and the requests after that point wait for the next transaction.
            for outcome in plan_batch(todo, state, self.writer, self.payload_limit):
                planned.append(outcome)
                if isinstance(outcome, list):
                    unsent.extend(outcome)
                    size += sum(len(pe.payload) for pe in outcome)
                if len(unsent) >= INSERT_CHUNK_EVENTS:
                    await self._insert_events(conn, unsent)
                    unsent = []
                if size >= MAX_GROUP_BYTES:
                    break
            if unsent:
                await self._insert_events(conn, unsent)
            written = [pe.event for o in planned if isinstance(o, list) for pe in o]
            if written:
                landed = [(r.key, o[0].event.position, o[-1].event.position)
                          for r, o in zip(todo[:len(planned)], planned, strict=True) if isinstance(o, list) and o and r.key is not None]
                await self._advance_heads(conn, written, state, landed)
                await apply_changes(conn, (ch for e in written for ch in changes_for(e)))
        fresh = iter(planned)
        outcomes: list[list[RecordedEvent] | RollbookError | None] = []
        for r in requests:
            if r.key in done:
                outcomes.append(earlier[r.key])  # type: ignore[index]
            else:
                o = next(fresh, None)
                outcomes.append(o if o is None or isinstance(o, RollbookError) else [pe.event for pe in o])
        return outcomes

    @contextlib.asynccontextmanager
    async def _driver_connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The psycopg connection under a pooled SQLAlchemy one: the append path needs pipeline
        mode, which SQLAlchemy does not offer. The pool still owns the connection's life."""
        async with self.engine.connect() as pooled:
            raw = await pooled.get_raw_connection()
            try:
                yield raw.driver_connection
            except BaseException as exc:
                if connection_lost(exc) or raw.driver_connection.closed:
                    # psycopg raised past SQLAlchemy, which would hand this dead connection out again.
                    await pooled.invalidate()
                raise

    async def _insert_events(self, conn: psycopg.AsyncConnection[Any], planned: list[PlannedEvent]) -> None:
        evs = [pe.event for pe in planned]
        # Arrays go in binary: as text, psycopg escapes every quote of every JSON payload, which
        # measured as half the cost of a 2,000-event insert.
        await conn.execute(
            "INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, "
            "rollout_id, attempt, writer, hash) "
            "SELECT p, s, v, k, d::jsonb, sv, r, a, %(w)s, h FROM unnest("
            "%(p)b::bigint[], %(s)b::text[], %(v)b::int[], %(k)b::text[], %(d)b::text[], "
            "%(sv)b::smallint[], %(r)b::text[], %(a)b::int[], %(h)b::bytea[]) AS t(p, s, v, k, d, sv, r, a, h)",
            {
                "p": [e.position for e in evs],
                "s": [e.stream for e in evs],
                "v": [e.stream_version for e in evs],
                "k": [e.kind for e in evs],
                "d": [pe.payload for pe in planned],
                "sv": [e.schema_version for e in evs],
                "r": [e.rollout_id for e in evs],
                "a": [e.attempt for e in evs],
                "h": [e.hash for e in evs],
                "w": self.writer,
            },
        )

    @staticmethod
    async def _advance_heads(conn: psycopg.AsyncConnection[Any], written: list[RecordedEvent], state: LogState,
                             landed: list[tuple[str | None, int, int]]) -> None:
        """Move the stream heads and the log head, and record each request's idempotency key: one statement."""
        heads = {e.stream: state.streams[e.stream] for e in written}
        # A fence or a retire mark moves the fence position in the same transaction: the attempt
        # checks that servers answer from memory (engine.attempts.AttemptGate) are invalid from here.
        fence = max((e.position for e in written if e.kind in FENCE_KINDS), default=0)
        await conn.execute(
            "WITH sh AS (INSERT INTO rollbook.stream_heads (stream, version, hash) "
            "SELECT * FROM unnest(%(hs)b::text[], %(hv)b::int[], %(hh)b::bytea[]) "
            "ON CONFLICT (stream) DO UPDATE SET version = EXCLUDED.version, hash = EXCLUDED.hash), "
            "ak AS (INSERT INTO rollbook.append_keys (key, first_position, last_position) "
            "SELECT * FROM unnest(%(kk)s::text[], %(kf)s::bigint[], %(kl)s::bigint[])) "
            "UPDATE rollbook.log_head SET position = %(head)s, fence_position = greatest(fence_position, %(fence)s) "
            "WHERE id = 1",
            {
                "hs": list(heads),
                "hv": [h.version for h in heads.values()],
                "hh": [h.hash for h in heads.values()],
                "kk": [k for k, _, _ in landed],
                "kf": [f for _, f, _ in landed],
                "kl": [t for _, _, t in landed],
                "head": state.position,
                "fence": fence,
            },
        )

    def _schedule_notify(self) -> None:
        # NOTIFY serializes commits cluster-wide, so it stays off the append transaction and
        # is coalesced: at most one in flight per process. Readers treat it as a hint only.
        if self._notify_pending:
            return
        self._notify_pending = True

        async def notify() -> None:
            try:
                async with self.engine.connect() as conn:
                    # Autocommit: one statement, not BEGIN, NOTIFY, COMMIT, for a hint sent after every append.
                    await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await conn.execute(text(f"NOTIFY {CHANNEL}"))
            except Exception:  # a lost hint only delays readers until their poll
                log.debug("notify failed", exc_info=True)
            finally:
                self._notify_pending = False

        asyncio.get_running_loop().create_task(notify())

    async def prune_append_keys(self, older_than_s: float = DEFAULT_KEY_RETENTION_S, batch: int = 10_000) -> int:
        """Delete the idempotency keys of appends committed more than `older_than_s` ago; the count.
        Safe while servers write: a key is read only by a retry of its own append, which comes within
        the writer's patience (see DEFAULT_KEY_RETENTION_S), and the deletes take no lock an append
        waits for (not the log head; only the old rows, in short batches)."""
        if older_than_s < max(MIN_KEY_RETENTION_S, self.patience_s):
            raise ValueError(f"a retention of {older_than_s:g} s is shorter than a writer may retry an append "
                             f"(at least {max(MIN_KEY_RETENTION_S, self.patience_s):g} s)")
        removed = 0
        while True:
            n = await self._prune_batch(older_than_s, batch)
            removed += n
            if n < batch:
                return removed

    @retrying("pruning append keys")  # deleting by age is safe to repeat
    async def _prune_batch(self, older_than_s: float, batch: int) -> int:
        async with self.engine.begin() as conn:
            return int((await conn.execute(text(
                "DELETE FROM rollbook.append_keys WHERE key IN (SELECT key FROM rollbook.append_keys "
                "WHERE recorded_at < now() - make_interval(secs => :s) LIMIT :n)"),
                {"s": older_than_s, "n": batch})).rowcount)

    # ---- reading --------------------------------------------------------------------------

    @retrying("reading the log head")
    async def head(self) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(text(LOCK_LOG_HEAD))).scalar_one())

    async def read_stream(self, stream: str, after_version: int = 0, to_version: int | None = None) -> list[RecordedEvent]:
        where = "stream = :s AND stream_version > :v"
        params: dict[str, Any] = {"s": stream, "v": after_version}
        if to_version is not None:
            where += " AND stream_version <= :t"
            params["t"] = to_version
        return await self._select_events(where, params, "ORDER BY stream_version")

    async def read_all(self, after: int = 0, limit: int = 1000, to: int | None = None) -> list[RecordedEvent]:
        where = "position > :a"
        params: dict[str, Any] = {"a": after, "l": limit}
        if to is not None:
            where += " AND position <= :t"
            params["t"] = to
        return await self._select_events(where, params, "ORDER BY position LIMIT :l")

    async def read_rollout(self, rollout_id: str, attempt: int | None = None, to: int | None = None) -> list[RecordedEvent]:
        where = "rollout_id = :r"
        params: dict[str, Any] = {"r": rollout_id}
        if attempt is not None:
            where += " AND attempt = :n"
            params["n"] = attempt
        if to is not None:
            where += " AND position <= :t"
            params["t"] = to
        return await self._select_events(where, params, "ORDER BY position")

    @retrying("reading events")
    async def read_rollouts(self, rollout_ids: Sequence[str], to: int | None = None) -> list[RecordedEvent]:
        """Every event of these rollouts up to `to`, in log order, in one query (restore's one pass).
        On the driver connection: SQLAlchemy's row processing doubled the time of a large read."""
        if not rollout_ids:
            return []
        where = "rollout_id = ANY(%(r)s)" + ("" if to is None else " AND position <= %(t)s")
        async with self._driver_connection() as conn, conn.cursor(row_factory=namedtuple_row) as cur:
            await cur.execute(f"SELECT {_COLUMNS} FROM rollbook.events WHERE {where} ORDER BY position",
                              {"r": list(rollout_ids), "t": to})
            return [_row_to_event(r) for r in await cur.fetchall()]

    @retrying("reading stream hashes")
    async def stream_hashes(self, versions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        if not versions:
            return {}
        async with self._driver_connection() as conn:
            cur = await conn.execute(
                "SELECT e.stream, e.stream_version, e.hash FROM unnest(%s::text[], %s::int[]) AS k(s, v) "
                "JOIN rollbook.events e ON e.stream = k.s AND e.stream_version = k.v",
                ([s for s, _ in versions], [v for _, v in versions]))
            return {(r[0], r[1]): bytes(r[2]) for r in await cur.fetchall()}

    @retrying("reading events")
    async def _select_events(self, where: str, params: dict[str, Any], tail: str) -> list[RecordedEvent]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(text(f"SELECT {_COLUMNS} FROM rollbook.events WHERE {where} {tail}"), params)
            return [_row_to_event(r) for r in rows]

    async def subscribe(self, after: int = 0, poll_seconds: float = 1.0) -> AsyncIterator[RecordedEvent]:
        """Catch up from `after`, then follow. NOTIFY only wakes the reader early; the poll is the truth."""
        conn = await psycopg.AsyncConnection.connect(libpq_dsn(self.dsn), autocommit=True)
        try:
            await conn.execute(f"LISTEN {CHANNEL}")
            while True:
                batch = await self.read_all(after, 1000)
                for e in batch:
                    yield e
                    after = e.position
                if len(batch) == 1000:
                    continue
                async for _ in conn.notifies(timeout=poll_seconds, stop_after=1):
                    pass
        finally:
            await conn.close()

    # ---- projections ----------------------------------------------------------------------

    async def rebuild_projections(self, page: int = 2000) -> int:
        """Empty every projection table and derive it again from the log alone."""
        count = 0
        async with self._driver_connection() as conn, conn.transaction():
            await conn.execute(LOCK_LOG_HEAD)
            await conn.execute("TRUNCATE " + ", ".join(f"rollbook.{t}" for t in TABLES))
            after = 0
            async with conn.cursor(row_factory=namedtuple_row) as cur:
                while True:
                    await cur.execute(
                        f"SELECT {_COLUMNS} FROM rollbook.events WHERE position > %s ORDER BY position LIMIT %s", (after, page)
                    )
                    evs = [_row_to_event(r) for r in await cur.fetchall()]
                    if not evs:
                        break
                    # merge_changes may reorder rows of different keys, never two changes of one key
                    await apply_changes(conn, (ch for e in evs for ch in changes_for(e)))
                    count += len(evs)
                    after = evs[-1].position
        return count

    # ---- what a cut needs -------------------------------------------------------------------

    @retrying("reading attempts")
    async def attempt_rows(self, rollout_ids: Sequence[str]) -> dict[tuple[str, int], dict[str, Any]]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT a.*, r.retired_through FROM rollbook.attempt_state a "
                     "LEFT JOIN rollbook.rollout_state r USING (rollout_id) WHERE a.rollout_id = ANY(:r)"),
                {"r": list(rollout_ids)},
            )
            return {(r.rollout_id, r.attempt): dict(r._mapping) for r in rows}

    @retrying("reading attempts")
    async def live_attempts(self) -> dict[tuple[str, int], dict[str, Any]]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(text("SELECT * FROM rollbook.attempt_state WHERE status IN ('live', 'finished')"))
            return {(r.rollout_id, r.attempt): dict(r._mapping) for r in rows}

    @retrying("reading boundaries")
    async def latest_boundaries(
        self, keys: Sequence[tuple[str, int]], position: int, kinds: Sequence[str]
    ) -> dict[tuple[str, int], int]:
        if not keys:
            return {}
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT k.r, k.a, (SELECT max(e.position) FROM rollbook.events e WHERE e.rollout_id = k.r "
                    "AND e.attempt = k.a AND e.position <= :p AND e.kind = ANY(:kinds)) AS b "
                    "FROM unnest(CAST(:rs AS text[]), CAST(:as_ AS int[])) AS k(r, a)"
                ),
                {"rs": [r for r, _ in keys], "as_": [a for _, a in keys], "p": position, "kinds": list(kinds)},
            )
            return {(r.r, r.a): r.b for r in rows if r.b is not None}

    @retrying("reading stream heads")
    async def rollout_heads_at(self, rollout_ids: Sequence[str], position: int) -> dict[str, list[tuple[str, int, bytes]]]:
        """Each rollout's streams at their last version at or below `position`; reads no event data
        (the hash of a stream's head covers every earlier event of that stream)."""
        out: dict[str, list[tuple[str, int, bytes]]] = {r: [] for r in rollout_ids}
        if not rollout_ids:
            return out
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT DISTINCT ON (e.rollout_id, e.stream) e.rollout_id, e.stream, e.stream_version, e.hash "
                    "FROM rollbook.events e WHERE e.rollout_id = ANY(CAST(:rs AS text[])) AND e.position <= :p "
                    "ORDER BY e.rollout_id, e.stream, e.stream_version DESC"
                ),
                {"rs": list(rollout_ids), "p": position},
            )
            for r in rows:
                out[r.rollout_id].append((r.stream, r.stream_version, bytes(r.hash)))
        return out

    @retrying("reading checkpoints")
    async def checkpoints_in_phase(self, phases: Sequence[str]) -> list[str]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT checkpoint_id FROM rollbook.checkpoint_state WHERE phase = ANY(:ph) ORDER BY checkpoint_id"),
                {"ph": list(phases)},
            )
            return [r for (r,) in rows]

    @retrying("reading a retire mark")
    async def session_revision(self, rollout_id: str, attempt: int) -> int | None:
        """The revision the session projection records for an attempt (None: it never opened one)."""
        async with self.engine.connect() as conn:
            return (await conn.execute(
                text("SELECT revision FROM rollbook.session_state WHERE rollout_id = :r AND attempt = :a"),
                {"r": rollout_id, "a": attempt})).scalar()

    @retrying("reading the fence position")
    async def fence_position(self) -> int:
        """engine.attempts.AttemptStore: one single-row read, no lock (an append in flight has not
        fenced anything yet; once it commits, this read sees it). Autocommit: no BEGIN, no ROLLBACK."""
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return int((await conn.execute(text("SELECT fence_position FROM rollbook.log_head WHERE id = 1"))).scalar() or 0)

    @retrying("reading an attempt")
    async def attempt_status(self, rollout_id: str, attempt: int) -> tuple[str | None, int]:
        """engine.attempts.AttemptStore: the attempt's status and its rollout's retire mark, in one statement."""
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            row = (await conn.execute(text(
                "SELECT (SELECT status FROM rollbook.attempt_state WHERE rollout_id = :r AND attempt = :a), "
                "(SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = :r)"), {"r": rollout_id, "a": attempt})).one()
            return row[0], -1 if row[1] is None else int(row[1])

    @retrying("reading sessions")
    async def open_sessions(self) -> dict[tuple[str, int], str]:
        """The environment of each live attempt's open resources session, as the log records it."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(text(
                "SELECT s.rollout_id, s.attempt, s.env FROM rollbook.session_state s JOIN rollbook.attempt_state a "
                "USING (rollout_id, attempt) WHERE s.status = 'open' AND a.status = 'live'"))
            return {(r.rollout_id, r.attempt): r.env for r in rows}

    @retrying("reading restart-only executions")
    async def restart_only_at(self, boundaries: dict[tuple[str, int], int]) -> list[tuple[str, int]]:
        if not boundaries:
            return []
        keys = list(boundaries)
        async with self.engine.connect() as conn:
            rows = await conn.execute(text(
                "SELECT k.r, k.a FROM unnest(CAST(:rs AS text[]), CAST(:as_ AS int[]), CAST(:bs AS bigint[])) AS k(r, a, b)"
                " WHERE EXISTS ("
                " SELECT 1 FROM rollbook.events o WHERE o.rollout_id = k.r AND o.attempt = k.a AND o.kind = :opened"
                " AND o.position <= k.b AND o.data->>'state_mode' = 'restart_only' AND NOT EXISTS ("
                "  SELECT 1 FROM rollbook.events c WHERE c.rollout_id = k.r AND c.attempt = k.a AND c.kind = :closed"
                "  AND c.position > o.position AND c.position <= k.b)"
                ") OR EXISTS ("
                " SELECT 1 FROM rollbook.events g WHERE g.rollout_id = k.r AND g.attempt = k.a AND g.kind = :boundary"
                " AND g.position <= k.b AND g.data->>'continuable' = 'false' AND NOT EXISTS ("
                "  SELECT 1 FROM rollbook.events c WHERE c.rollout_id = k.r AND c.attempt = k.a AND c.kind = :completed"
                "  AND c.position > g.position AND c.position <= k.b))"),
                {"rs": [r for r, _ in keys], "as_": [a for _, a in keys], "bs": [boundaries[k] for k in keys],
                 "opened": ev.SESSION_OPENED, "closed": ev.SESSION_CLOSED, "boundary": ev.AGENT_BOUNDARY,
                 "completed": ev.ACTIVATION_COMPLETED})
            return sorted((r.r, r.a) for r in rows)

    @retrying("reading a retire mark")
    async def retired_through(self, rollout_id: str) -> int:
        async with self.engine.connect() as conn:
            mark = (
                await conn.execute(text("SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = :r"), {"r": rollout_id})
            ).scalar()
            return -1 if mark is None else int(mark)
