"""The event log on PostgreSQL (SQLAlchemy 2 async on psycopg 3): the append path.

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
A transaction is two statements whatever it holds, in one implicit transaction of the pipeline (no
BEGIN, no COMMIT): the lock with the read of what the plan needs (LOCK_AND_READ), and one statement
that writes the last chunk of events, the heads, the keys and the projections. One more when the
lock had to wait for another append (the read is repeated), for a group past INSERT_CHUNK_EVENTS
events, for a retire's guarded update, or for carried rows.
Rows of other tables that must be durable no later than the events that name them (a model call's
token blobs, adapters.token_store) ride in the next append transaction of the process (`carry`),
written before the lock is asked for, so that no other append waits while they are.

Database faults (adapters.pg_pool): a lost connection is found where it fails, and the operation
retried. A retried append is safe even when its first try did commit and only the answer was lost:
every request carries an idempotency key, checked and recorded in the append transaction
(`rollbook.append_keys`), so a retry returns the events the first try wrote. A group of appends
stops taking requests once its payloads reach MAX_GROUP_BYTES.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from adapters.pg_pool import (
    DEFAULT_PATIENCE_S,
    PoolLimits,
    StoreObserver,
    connection_lost,
    log,
    make_engine,
    retrying,
    with_retry,
)
from adapters.pg_projections import apply_changes, guarded_updates, upsert_ctes
from adapters.pg_reads import _COLUMNS, CHANNEL, LOCK_LOG_HEAD, _row_to_event
from adapters.pg_snapshots import SnapshotRows
from engine.attempts import FENCE_KINDS, RolloutState
from engine.errors import RollbookError
from engine.events import DEFAULT_PAYLOAD_LIMIT, AppendRequest, RecordedEvent
from engine.log import LogState, PlannedEvent, StreamHead, plan_batch
from engine.projections import TABLES, changes_for

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
# The lock and the read in one statement. The read's snapshot is taken when the statement starts,
# before the lock may have to wait, so the statement also reads the position that snapshot saw (`seen`)
# next to the one the lock returns (the newest, once granted). Equal: no append committed in between
# (every append moves the position), so what was read is what a read after the lock would return.
# Different: the statement waited out an append, and READ_HEADS is read again, after the lock.
LOCK_AND_READ = (
    "SELECT 'l', NULL, (SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE), "
    "(SELECT position FROM rollbook.log_head WHERE id = 1), NULL::text, NULL::bytea UNION ALL " + READ_HEADS
)
# Arrays go in binary: as text, psycopg escapes every quote of every JSON payload, which measured
# as half the cost of a 2,000-event insert.
INSERT_EVENTS = (
    "INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, "
    "rollout_id, attempt, writer, hash) "
    "SELECT p, s, v, k, d::jsonb, sv, r, a, %(w)s, h FROM unnest("
    "%(p)b::bigint[], %(s)b::text[], %(v)b::int[], %(k)b::text[], %(d)b::text[], "
    "%(sv)b::smallint[], %(r)b::text[], %(a)b::int[], %(h)b::bytea[]) AS t(p, s, v, k, d, sv, r, a, h)"
)
ADVANCE_HEADS = (
    "sh AS (INSERT INTO rollbook.stream_heads (stream, version, hash) "
    "SELECT * FROM unnest(%(hs)b::text[], %(hv)b::int[], %(hh)b::bytea[]) "
    "ON CONFLICT (stream) DO UPDATE SET version = EXCLUDED.version, hash = EXCLUDED.hash), "
    "ak AS (INSERT INTO rollbook.append_keys (key, first_position, last_position) "
    "SELECT * FROM unnest(%(kk)s::text[], %(kf)s::bigint[], %(kl)s::bigint[]))"
)
_SET_LOG_HEAD = ("UPDATE rollbook.log_head SET position = %(head)s, "
                 "fence_position = greatest(fence_position, %(fence)s) ")
MOVE_LOG_HEAD = _SET_LOG_HEAD + "WHERE id = 1"
# The subscribers' hint, sent by the append's own statement when one is due (see NOTIFY_INTERVAL_S). In
# FROM, where a volatile call is evaluated; in EXISTS the planner drops the select list unevaluated.
MOVE_LOG_HEAD_NOTIFY = _SET_LOG_HEAD + f"FROM (SELECT pg_notify('{CHANNEL}', '')) AS hint WHERE id = 1"
MAX_GROUP_EVENTS = 2000
# A group's transaction, and the memory its plan holds, stays near this many bytes of payload: the
# group stops taking requests once it reaches it (one request is atomic, so it is never split).
MAX_GROUP_BYTES = 8 * 1024 * 1024
# Rows per INSERT of a group: enough that per-statement cost stays small (a group of 64 one-event
# appends is one statement), few enough that the server has rows to write while the next are planned.
INSERT_CHUNK_EVENTS = 100
# The hint a subscriber waits on (NOTIFY) goes out at most this often per process, the last one after
# the last append: a reader wakes within this long of an append, and a process appending every few
# milliseconds sends one hint every this long, not one per append. The poll is the truth. A hint that is
# due when an append is written rides in that append's last statement (delivered at its commit); only
# the trailing one after a burst is a statement of its own.
NOTIFY_INTERVAL_S = 0.25
# How long an append's idempotency key is kept (`rollbook db prune-keys`). A key is only ever looked
# up by a retry of the same append, and the store retries an append only within its patience
# (DEFAULT_PATIENCE_S, seconds) of the first try: the key is made per call of `append`, never handed
# to a caller, so no retry can come later. A day is that window many thousand times over.
DEFAULT_KEY_RETENTION_S = 86400.0
# The shortest retention `prune_append_keys` accepts: well past any patience a store is given.
MIN_KEY_RETENTION_S = 600.0

# Rows of another table, written by the append transaction (see `carry`): given the rows and a name
# unique in the statement, the data-modifying statement that writes them and its parameters (named
# after that name).
CarryWriter = Callable[[list[Any], str], tuple[str, dict[str, Any]]]
Outcome = list[RecordedEvent] | RollbookError | None


class _Pending:
    __slots__ = ("request", "future")

    def __init__(self, request: AppendRequest, future: asyncio.Future[list[RecordedEvent]]) -> None:
        self.request = request
        self.future = future


@dataclasses.dataclass
class _Plan:
    """What one group's transaction decided: requests already committed by an earlier try (their
    keys were found), and the plan of the rest (None past the group's byte bound)."""

    done: dict[str, tuple[int, int]]
    earlier: dict[str, list[RecordedEvent]]
    todo: list[AppendRequest]
    planned: list[list[PlannedEvent] | RollbookError] = dataclasses.field(default_factory=list)

    def outcomes(self, requests: Sequence[AppendRequest]) -> list[Outcome]:
        fresh = iter(self.planned)
        out: list[Outcome] = []
        for r in requests:
            if r.key in self.done:
                out.append(self.earlier[r.key])  # type: ignore[index]
                continue
            o = next(fresh, None)
            out.append(o if o is None or isinstance(o, RollbookError) else [pe.event for pe in o])
        return out


class PostgresEventStore(SnapshotRows):
    def __init__(self, engine: AsyncEngine, dsn: str, writer: str, payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
                 patience_s: float = DEFAULT_PATIENCE_S) -> None:
        self.engine = engine
        self.dsn = dsn
        self.writer = writer
        self.payload_limit = payload_limit
        self.patience_s = patience_s
        self._queue: list[_Pending] = []
        self._carried: dict[CarryWriter, list[Any]] = {}
        self._carrying: dict[CarryWriter, list[Any]] = {}  # taken by the group being committed
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._notify: asyncio.Task[None] | None = None
        self._last_notify = -NOTIFY_INTERVAL_S  # loop time of the latest hint sent or ridden in an append
        self._notify_owed: float | None = None  # loop time of the first commit no hint has covered yet
        self._notify_inline = False  # the group being committed carries the hint
        self.observers: list[StoreObserver] = []  # told of every append and database fault (a server's metrics)

    @classmethod
    def connect(cls, dsn: str, writer: str, pool: PoolLimits | None = None, **kw: Any) -> PostgresEventStore:
        return cls(make_engine(dsn, pool), dsn, writer, **kw)

    async def close(self) -> None:
        for task in (self._worker, self._notify):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._worker = self._notify = None
        await self.engine.dispose()

    # ---- appending ------------------------------------------------------------------------

    def carry(self, write: CarryWriter, row: Any) -> None:
        """Have `row` written by `write`, inside this process's next append transaction: it is durable
        no later than any event appended after this call. A transaction that fails hands its rows on to
        the next. Rows nobody appends after are written with whatever append comes next."""
        self._carried.setdefault(write, []).append(row)

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

    def _next_group(self) -> list[_Pending]:
        group: list[_Pending] = []
        size = 0
        while self._queue and (not group or size + len(self._queue[0].request.events) <= MAX_GROUP_EVENTS):
            item = self._queue.pop(0)
            group.append(item)
            size += len(item.request.events)
        return group

    async def _run_worker(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                group = self._next_group()
                requests = [p.request for p in group]
                self._carrying, self._carried = self._carried, {}
                self._notify_inline = False
                try:
                    # A lost connection is retried: the keys make a retry of a committed group return it.
                    outcomes = await with_retry(lambda r=requests: self._commit_group(r),  # type: ignore[misc]
                                                self.patience_s, "an append", self.observers)
                except Exception as exc:  # the whole transaction failed: every caller in it hears why
                    for write, rows in self._carrying.items():
                        self._carried.setdefault(write, [])[:0] = rows
                    self._carrying = {}
                    if self._notify_inline:  # the hint it carried, and any it stood for, did not go
                        self._schedule_notify()
                    for p in group:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                self._carrying = {}
                self._settle(group, outcomes)
                if not self._notify_inline:  # no hint rode in that transaction: one is owed
                    self._schedule_notify()

    def _settle(self, group: list[_Pending], outcomes: list[Outcome]) -> None:
        # Requests past the group's byte bound were not planned: first in line for the next group.
        self._queue[:0] = [p for p, outcome in zip(group, outcomes, strict=True) if outcome is None]
        for p, outcome in zip(group, outcomes, strict=True):
            if p.future.done() or outcome is None:
                continue
            if isinstance(outcome, RollbookError):
                p.future.set_exception(outcome)
            else:
                p.future.set_result(outcome)

    async def _commit_group(self, requests: Sequence[AppendRequest]) -> list[Outcome]:
        """Each request's events or refusal; None for a request left for the next group (the group's
        payloads had reached MAX_GROUP_BYTES before it). The carried rows the worker took for this
        group are written too, on every try."""
        # Pipeline mode: the server writes one request's rows while Python plans the next (on two
        # cores that overlap is most of a large group's cost; benchmarks/README.md). The reads
        # below fetch, so they still wait for the lock before the heads are read.
        # No BEGIN, no COMMIT: in pipeline mode every statement up to the Sync that ends the pipeline
        # runs in one implicit transaction, which that Sync commits (or an error in it rolls back).
        async with self._driver_connection(autocommit=True) as conn, conn.pipeline():
            try:
                await self._write_carried(conn)
                state, plan = await self._read_plan_inputs(conn, requests)
                unsent = await self._plan_and_send(conn, plan, state)
                await self._write_rest(conn, plan, unsent, state)
            except BaseException:
                # The Sync on the way out would commit what was sent so far: the connection goes
                # instead, and the server rolls the transaction back.
                await conn.close()
                raise
        return plan.outcomes(requests)

    async def _read_plan_inputs(self, conn: psycopg.AsyncConnection[Any],
                                requests: Sequence[AppendRequest]) -> tuple[LogState, _Plan]:
        """The log state the plan starts from, read after the lock, and what earlier tries committed."""
        keys = [r.key for r in requests if r.key is not None]
        streams = sorted({e.stream for r in requests for e in r.events} | {s for r in requests for s in r.expected_versions})
        rollouts = sorted({e.rollout_id for r in requests for e in r.events if e.rollout_id is not None})
        params = (keys, streams, rollouts, rollouts)
        rows = await (await conn.execute(LOCK_AND_READ, params)).fetchall()
        locked, seen = next(((r[2], r[3]) for r in rows if r[0] == "l"), (None, None))
        if locked is None:
            raise RuntimeError("rollbook.log_head has no row; run `rollbook db upgrade` on this database")
        if locked != seen:  # an append committed while this one waited for the lock: read after it
            rows = await (await conn.execute(READ_HEADS, params)).fetchall()
        state, done = _log_state(locked, [r for r in rows if r[0] != "l"])
        earlier = await self._earlier(conn, done) if done else {}
        return state, _Plan(done, earlier, [r for r in requests if r.key not in done])

    @staticmethod
    async def _earlier(conn: psycopg.AsyncConnection[Any], done: dict[str, tuple[int, int]]) -> dict[str, list[RecordedEvent]]:
        """A request whose key is recorded committed on an earlier try: its events, not a second copy."""
        lo, hi = min(f for f, _ in done.values()), max(t for _, t in done.values())
        async with conn.cursor(row_factory=namedtuple_row) as cur:
            await cur.execute(f"SELECT {_COLUMNS} FROM rollbook.events WHERE position BETWEEN %s AND %s "
                              "ORDER BY position", (lo, hi))
            rows = [_row_to_event(r) for r in await cur.fetchall()]
        return {key: [e for e in rows if first <= e.position <= last] for key, (first, last) in done.items()}

    async def _plan_and_send(self, conn: psycopg.AsyncConnection[Any], plan: _Plan, state: LogState) -> list[PlannedEvent]:
        """Plan the requests in order, sending every full chunk of rows as it is planned; the rows of
        the last, partial chunk are returned to go with the heads. Sized as planned (the payload is
        encoded once, here): the group stops once it holds MAX_GROUP_BYTES, and the requests after
        that point wait for the next transaction."""
        unsent: list[PlannedEvent] = []
        size = 0
        for outcome in plan_batch(plan.todo, state, self.writer, self.payload_limit):
            plan.planned.append(outcome)
            if isinstance(outcome, list):
                unsent.extend(outcome)
                size += sum(len(pe.payload) for pe in outcome)
            if len(unsent) >= INSERT_CHUNK_EVENTS:
                await conn.execute(INSERT_EVENTS, self._event_params(unsent))
                unsent = []
            if size >= MAX_GROUP_BYTES:
                break
        return unsent

    def _event_params(self, planned: list[PlannedEvent]) -> dict[str, Any]:
        evs = [pe.event for pe in planned]
        return {
            "p": [e.position for e in evs], "s": [e.stream for e in evs], "v": [e.stream_version for e in evs],
            "k": [e.kind for e in evs], "d": [pe.payload for pe in planned], "sv": [e.schema_version for e in evs],
            "r": [e.rollout_id for e in evs], "a": [e.attempt for e in evs], "h": [e.hash for e in evs],
            "w": self.writer,
        }

    async def _write_rest(self, conn: psycopg.AsyncConnection[Any], plan: _Plan, unsent: list[PlannedEvent],
                          state: LogState) -> None:
        """One statement: the rows carried for this transaction, the events not sent yet, the stream
        heads, each request's idempotency key, the projections and the log head. A fence or a retire
        mark moves the fence position in the same statement: the attempt checks that servers answer
        from memory (engine.attempts.AttemptGate) are invalid from here."""
        written = [pe.event for o in plan.planned if isinstance(o, list) for pe in o]
        changes = [ch for e in written for ch in changes_for(e)]
        if written:
            upserts, more = upsert_ctes(changes)
            params: dict[str, Any] = dict(more)
            ctes = [f"ev AS ({INSERT_EVENTS})"] if unsent else []
            ctes += [ADVANCE_HEADS, *upserts]
            params.update(**(self._event_params(unsent) if unsent else {}), **_head_params(plan, written, state))
            move = MOVE_LOG_HEAD_NOTIFY if self._take_notify() else MOVE_LOG_HEAD
            await conn.execute("WITH " + ", ".join(ctes) + " " + move, params)
        await guarded_updates(conn, changes)

    async def _write_carried(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The rows carried for this transaction (a model call's token blobs), before the log's lock is
        asked for: every append of every process waits on that lock, and these rows need no position
        (the model server's blobs, parsed from their JSON, were most of the time its appends held it).
        One transaction still commits them with the events that name them. No deadlock: no transaction
        writes a carried row while it holds the lock, so one waiting on another's carried row never
        holds the lock that other waits for."""
        if not self._carrying:
            return
        ctes: list[str] = []
        params: dict[str, Any] = {}
        for i, (write, rows) in enumerate(self._carrying.items()):
            sql, more = write(rows, f"c{i}")
            ctes.append(f"c{i} AS ({sql})")
            params.update(more)
        await conn.execute("WITH " + ", ".join(ctes) + " SELECT 1", params)

    def _take_notify(self) -> bool:
        """Whether this append's statement carries the hint: when none went out for NOTIFY_INTERVAL_S.
        A NOTIFY holds a cluster-wide lock through its commit, so at most one transaction per interval
        carries one; an append already holds the log head through its commit, so that costs the
        writers little, and it saves a statement and a transaction per hint."""
        now = asyncio.get_running_loop().time()
        self._notify_inline = now - self._last_notify >= NOTIFY_INTERVAL_S
        if self._notify_inline:
            self._last_notify, self._notify_owed = now, None
        return self._notify_inline

    def _schedule_notify(self) -> None:
        """A commit no hint covered: one is owed within NOTIFY_INTERVAL_S of it. The sender waits that
        long, so that an append meanwhile (past the interval since the last hint) carries it instead."""
        if self._notify_owed is None:
            self._notify_owed = asyncio.get_running_loop().time()
        if self._notify is None or self._notify.done():
            self._notify = asyncio.get_running_loop().create_task(self._send_notifies())

    async def _send_notifies(self) -> None:
        loop = asyncio.get_running_loop()
        while self._notify_owed is not None:
            wait = self._notify_owed + NOTIFY_INTERVAL_S - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._notify_owed, self._last_notify = None, loop.time()
            try:
                async with self._reading() as conn:
                    await conn.execute(text(f"NOTIFY {CHANNEL}"))
            except Exception:  # a lost hint only delays readers until their poll
                log.debug("notify failed", exc_info=True)

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


def _head_params(plan: _Plan, written: list[RecordedEvent], state: LogState) -> dict[str, Any]:
    """ADVANCE_HEADS's and MOVE_LOG_HEAD's parameters: the streams' new heads, the keys of the
    requests that landed, the log's new head and the highest fence among the events."""
    landed = [(r.key, o[0].event.position, o[-1].event.position)
              for r, o in zip(plan.todo, plan.planned, strict=False) if isinstance(o, list) and o and r.key is not None]
    heads = {e.stream: state.streams[e.stream] for e in written}
    return {"hs": list(heads), "hv": [h.version for h in heads.values()], "hh": [h.hash for h in heads.values()],
            "kk": [k for k, _, _ in landed], "kf": [f for _, f, _ in landed], "kl": [t for _, _, t in landed],
            "head": state.position, "fence": max((e.position for e in written if e.kind in FENCE_KINDS), default=0)}


def _log_state(position: int, rows: Sequence[Any]) -> tuple[LogState, dict[str, tuple[int, int]]]:
    """READ_HEADS's rows as the state a plan starts from, and the keys already recorded."""
    state = LogState(position=position)
    done: dict[str, tuple[int, int]] = {}
    marks: list[tuple[str, int | None]] = []
    for what, name, n, m, status, digest in rows:
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
    return state, done


__all__ = ["CHANNEL", "DEFAULT_KEY_RETENTION_S", "DEFAULT_PATIENCE_S", "INSERT_CHUNK_EVENTS", "LOCK_LOG_HEAD",
           "MAX_GROUP_BYTES", "MIN_KEY_RETENTION_S", "PoolLimits", "PostgresEventStore", "StoreObserver",
           "connection_lost", "make_engine", "retrying", "with_retry"]
