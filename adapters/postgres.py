"""The event log on PostgreSQL (SQLAlchemy 2 async on psycopg 3): the append path.

Gap-free positions: every append transaction locks the one row of `log_head` (SELECT ... FOR
UPDATE) and takes its positions from it. PostgreSQL makes a transaction visible before it releases
its row locks, so the next writer cannot commit a higher position until the lower one is visible:
readers that select `position > P` in order never see a later position before an earlier one. The
same lock serializes fencing with appends (both are appends).

That lock would cap throughput at one commit (one fsync) per append, so appends are grouped:
concurrent `append` calls in a process queue up and one transaction writes them all, each
request still atomic and checked on its own (engine.log.plan_batch). A caller's append returns
only after the transaction holding it has committed.

Every writer of every process waits for the lock as long as one holds it, so an append holds it for
no round trip to its process and no Python: it plans from what the process remembers of the log
(adapters.pg_plan_inputs) or from a read without the lock (READ), then sends the lock and one
statement that writes everything, and the Sync that commits, in one flush (pipeline mode: no BEGIN,
no COMMIT; every statement up to the Sync is one implicit transaction). That statement checks, in a
snapshot taken after the lock, that what the plan read is still what the log holds, and moves each
planned position by how far the head has moved since (PLANNED_FROM). When another writer changed a
stream or rollout of the group in between, it writes nothing, and the group is planned again after
the lock (LOCK_AND_READ), as it is from the start when it must be: a retry that found its keys, or a
retire's guarded update.
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

from adapters.pg_arrays import byteas, int2s, int4s_or_null, int8s, texts
from adapters.pg_blobs import BlobRows
from adapters.pg_plan_inputs import (
    ROLLOUT_TABLES,
    PlanInputs,
    Row,
    first_attempt_rollouts,
    log_state,
    packed_inputs,
    read_inputs,
)
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
from adapters.pg_projections import apply_changes, until_guarded, upsert_ctes
from adapters.pg_reads import _COLUMNS, CHANNEL, LOCK_LOG_HEAD, _row_to_event
from engine.attempts import FENCE_KINDS
from engine.errors import RollbookError
from engine.events import DEFAULT_PAYLOAD_LIMIT, AppendRequest, RecordedEvent
from engine.log import LogState, PlannedEvent, plan_batch
from engine.projections import TABLES, Change, changes_for

# What an append plans from, read in one statement: the requests' keys already recorded (k), the
# streams' heads (h), the rollouts' retire marks (r) and attempts (a).
READ_HEADS = (
    "SELECT 'k', key, first_position, last_position, NULL::text, NULL::bytea FROM rollbook.append_keys "
    "WHERE key = ANY(%(keys)s) "
    "UNION ALL SELECT 'h', stream, version, NULL, NULL, hash FROM rollbook.stream_heads WHERE stream = ANY(%(streams)s) "
    "UNION ALL SELECT 'r', rollout_id, retired_through, NULL, NULL, NULL FROM rollbook.rollout_state "
    "WHERE rollout_id = ANY(%(rollouts)s) "
    "UNION ALL SELECT 'a', rollout_id, attempt, NULL, status, NULL FROM rollbook.attempt_state "
    "WHERE rollout_id = ANY(%(rollouts)s)"
)
# An append's reads and its write are prepared at first use on a connection and planned there once,
# generically: planned every call, the write cost PostgreSQL as much planning as running (generic_plans.py).
# The mode holds for the append's transaction alone: set first where the append reads what it plans from
# (GENERIC_PLANS), by its lock where it plans from memory (LOCK). A prepared write holds about 220 KB of
# its backend's memory; psycopg keeps at most 100 statements a connection.
GENERICALLY = "set_config('plan_cache_mode', 'force_generic_plan', true)"
GENERIC_PLANS = f"SELECT {GENERICALLY}"
# The log's position (l) with them, without the lock: a plan made from this is checked when written.
READ = "SELECT 'l', NULL, position, position, NULL::text, NULL::bytea FROM rollbook.log_head WHERE id = 1 UNION ALL " + READ_HEADS
# The lock and the read in one statement, for a plan that must not be stale. The read's snapshot is
# taken when the statement starts, before the lock may have to wait, so the statement also reads the
# position that snapshot saw (`seen`) next to the one the lock returns (the newest, once granted).
# Equal: no append committed in between (every append moves the position), so what was read is what a
# read after the lock would return. Different: the statement waited out an append, and READ_HEADS is
# read again, after the lock.
LOCK_AND_READ = (
    "SELECT 'l', NULL, (SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE), "
    "(SELECT position FROM rollbook.log_head WHERE id = 1), NULL::text, NULL::bytea UNION ALL " + READ_HEADS
)
LOCK = f"SELECT position, {GENERICALLY} FROM rollbook.log_head WHERE id = 1 FOR UPDATE"
# A plan is written only if what it was planned from is what the log holds: READ_HEADS again, in the
# writing statement's own snapshot (taken after the lock), compared both ways with the rows the plan
# read (sent back as arrays). Then `d` holds one row: how far the log's head has moved since the plan
# was made, added to every planned position (a chain hash does not depend on the position, so nothing
# else a plan decided changes). Every write joins `d`, so a stale plan writes nothing.
PLANNED_FROM = (
    "was AS (SELECT * FROM unnest(%(rt)s::text[], %(rn)s::text[], %(rx)s::bigint[], %(ry)s::bigint[], "
    "%(rs)s::text[], %(rh)s::bytea[])), "
    "now AS MATERIALIZED (" + READ_HEADS + "), "
    "ok AS (SELECT NOT EXISTS ((TABLE now EXCEPT ALL TABLE was) UNION ALL (TABLE was EXCEPT ALL TABLE now)) AS same), "
    "d AS (SELECT position - %(planned_from)s AS delta FROM rollbook.log_head, ok WHERE id = 1 AND ok.same)"
)
# Arrays go in binary: as text, psycopg escapes every quote of every JSON payload, which measured
# as half the cost of a 2,000-event insert.
INSERT_EVENTS = (
    "ev AS (INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, "
    "rollout_id, attempt, writer, hash) "
    "SELECT p + d.delta, s, v, k, j::jsonb, sv, r, a, %(w)s, h FROM unnest("
    "%(p)b::bigint[], %(s)b::text[], %(v)b::int[], %(k)b::text[], %(j)b::text[], "
    "%(sv)b::smallint[], %(r)b::text[], %(a)b::int[], %(h)b::bytea[]) AS t(p, s, v, k, j, sv, r, a, h), d)"
)
ADVANCE_HEADS = (
    "sh AS (INSERT INTO rollbook.stream_heads (stream, version, hash) "
    "SELECT t.s, t.v, t.h FROM unnest(%(hs)b::text[], %(hv)b::int[], %(hh)b::bytea[]) AS t(s, v, h), d "
    "ON CONFLICT (stream) DO UPDATE SET version = EXCLUDED.version, hash = EXCLUDED.hash), "
    "ak AS (INSERT INTO rollbook.append_keys (key, first_position, last_position) "
    "SELECT t.k, t.f + d.delta, t.l + d.delta FROM unnest(%(kk)s::text[], %(kf)s::bigint[], %(kl)s::bigint[]) "
    "AS t(k, f, l), d)"
)
# A group without a fence passes NULL, which greatest() ignores.
_SET_LOG_HEAD = ("UPDATE rollbook.log_head SET position = %(head)s + d.delta, "
                 "fence_position = greatest(fence_position, %(fence)s::bigint + d.delta) ")
MOVE_LOG_HEAD = _SET_LOG_HEAD + "FROM d WHERE id = 1 RETURNING d.delta"
# The subscribers' hint, sent by the append's own statement when one is due (see NOTIFY_INTERVAL_S). In
# FROM, where a volatile call is evaluated; in EXISTS the planner drops the select list unevaluated.
MOVE_LOG_HEAD_NOTIFY = _SET_LOG_HEAD + f"FROM d, (SELECT pg_notify('{CHANNEL}', '')) AS hint WHERE id = 1 RETURNING d.delta"
MAX_GROUP_EVENTS = 2000
# A group's transaction, and the memory its plan holds, stays near this many bytes of payload: the
# group stops taking requests once it reaches it (one request is atomic, so it is never split).
MAX_GROUP_BYTES = 8 * 1024 * 1024
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
    keys were found), and the plan of the rest (None past the group's byte bound), made from the log
    as it was at position `planned_from` and the rows `read` then."""

    done: dict[str, tuple[int, int]]
    earlier: dict[str, list[RecordedEvent]]
    todo: list[AppendRequest]
    planned_from: int
    read: list[tuple[Any, ...]]
    inputs: dict[str, list[str]]  # the keys, streams and rollouts whose rows were read
    planned: list[list[PlannedEvent] | RollbookError] = dataclasses.field(default_factory=list)

    def outcomes(self, requests: Sequence[AppendRequest], delta: int) -> list[Outcome]:
        """Each request's outcome, its events moved by `delta`: how far the log's head had moved past
        `planned_from` when they were written."""
        fresh = iter(self.planned)
        out: list[Outcome] = []
        for r in requests:
            if r.key in self.done:
                out.append(self.earlier[r.key])  # type: ignore[index]
                continue
            o = next(fresh, None)
            out.append(o if o is None or isinstance(o, RollbookError)
                       else [dataclasses.replace(pe.event, position=pe.event.position + delta) if delta else pe.event
                             for pe in o])
        return out


class PostgresEventStore(BlobRows):
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
        self.plan_inputs = PlanInputs()  # what appends plan from, remembered (adapters.pg_plan_inputs)
        self._stale: list[Row] | None = None  # a plan from memory found stale: until the read under the lock
        self._first_try = False  # the group being committed has not been tried yet

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
                    # A lost connection is retried: the keys make a retry of a committed group return it,
                    # so a retry reads them (only the first try may plan from memory).
                    self._first_try = True
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
        group are written too, on every try.
        Planned before the lock, written under it with no round trip to this process in between;
        planned again after the lock only when what it read had changed by then (another writer on
        the same stream or rollout), or when it must read after the lock (a retry of a group that may
        have committed, a retire's guarded update)."""
        remembered, self._first_try = self._first_try, False
        outcomes = await self._try_group(requests, locked=False, remembered=remembered)
        if outcomes is None:
            for o in self.observers:
                o.replanned()
            outcomes = await self._try_group(requests, locked=True)
        assert outcomes is not None  # planned under the lock: nothing it read can change
        return outcomes

    async def _try_group(self, requests: Sequence[AppendRequest], locked: bool,
                         remembered: bool = False) -> list[Outcome] | None:
        """One transaction of the group, its plan read before the lock (`locked` False) or after it, or
        (`remembered`) made from memory where it can be, with no read at all. None when a plan made
        before the lock was stale at the lock, or needs reading after it: the transaction then
        committed the carried rows alone (written again, as they are, by the next)."""
        # No BEGIN, no COMMIT: in pipeline mode every statement up to the Sync that ends the pipeline
        # runs in one implicit transaction, which that Sync commits (or an error in it rolls back).
        async with self._driver_connection(autocommit=True) as conn, conn.pipeline():
            try:
                await self._write_carried(conn)
                state, plan, written, from_memory = await self._planned(conn, requests, locked, remembered)
                changes = [ch for e in written for ch in changes_for(e)]
                if not locked and (plan.done or any(ch.guard for ch in changes)):
                    return None
                if not written:  # every request refused, from a consistent read: nothing to lock for
                    return plan.outcomes(requests, 0)
                if not locked:
                    await conn.execute(LOCK, prepare=True)
                upserts, rest = until_guarded(changes)
                moved = await conn.execute(*self._write(plan, written, upserts, state), prepare=True)
                if locked:  # one round trip under the lock, only on this path: nothing stale is written
                    if await moved.fetchone() is None:
                        raise RuntimeError("a plan read after the log's lock was stale under it")
                    await apply_changes(conn, rest)
            except BaseException:
                # The Sync on the way out would commit what was sent so far: the connection goes
                # instead, and the server rolls the transaction back.
                await conn.close()
                raise
        if locked:
            self._remember(written, changes, state, 0)  # committed: the Sync on the way out succeeded
            return plan.outcomes(requests, 0)
        row = await moved.fetchone()
        if row is None:
            self._stale = plan.read if from_memory else None
            return None
        self._remember(written, changes, state, int(row[0]))
        return plan.outcomes(requests, int(row[0]))

    async def _planned(self, conn: psycopg.AsyncConnection[Any], requests: Sequence[AppendRequest], locked: bool,
                       remembered: bool) -> tuple[LogState, _Plan, list[RecordedEvent], bool]:
        """The group's plan and the events it writes, made from memory where it may be (the last: True),
        else from a read before the lock or after it."""
        guess = self._remembered_plan(requests) if remembered and not locked else None
        if guess is not None:
            return (*guess, True)
        state, plan = await self._read_plan_inputs(conn, requests, locked)
        return state, plan, self._plan(plan, state), False

    def _remembered_plan(self, requests: Sequence[AppendRequest]) -> tuple[LogState, _Plan, list[RecordedEvent]] | None:
        """The group planned from what this process remembers of the log, when it remembers all it needs
        and the plan refuses nothing (a refusal is decided on a read)."""
        params = read_inputs(requests)
        rows = self.plan_inputs.rows(params, first_attempt_rollouts(requests))
        if rows is None:
            return None
        state, _ = log_state(self.plan_inputs.position, rows)
        plan = _Plan({}, {}, list(requests), self.plan_inputs.position, rows, params)
        written = self._plan(plan, state)
        if any(isinstance(o, RollbookError) for o in plan.planned):
            return None
        return state, plan, written

    def _remember(self, written: list[RecordedEvent], changes: list[Change], state: LogState, delta: int) -> None:
        """A committed group: its streams' heads, and the rollouts whose attempt rows it changed."""
        self.plan_inputs.written({e.stream: state.streams[e.stream] for e in written},
                                 {str(ch.key["rollout_id"]) for ch in changes if ch.table in ROLLOUT_TABLES},
                                 state.position + delta)

    async def _read_plan_inputs(self, conn: psycopg.AsyncConnection[Any], requests: Sequence[AppendRequest],
                                locked: bool) -> tuple[LogState, _Plan]:
        """The log state a plan starts from, read before the lock or after it, and (after it) what
        earlier tries committed."""
        params = read_inputs(requests)
        await conn.execute(GENERIC_PLANS, prepare=True)
        packed = packed_inputs(params)
        rows = await (await conn.execute(LOCK_AND_READ if locked else READ, packed, prepare=True)).fetchall()
        position, seen = next(((r[2], r[3]) for r in rows if r[0] == "l"), (None, None))
        if position is None:
            raise RuntimeError("rollbook.log_head has no row; run `rollbook db upgrade` on this database")
        if position != seen:  # an append committed while this one waited for the lock: read after it
            rows = await (await conn.execute(READ_HEADS, packed, prepare=True)).fetchall()
        read = [tuple(r) for r in rows if r[0] != "l"]
        if self._stale is not None and locked:
            self.plan_inputs.differed(self._stale, read)
        self._stale = None
        self.plan_inputs.read(params, read, position)
        state, done = log_state(position, read)
        earlier = await self._earlier(conn, done) if done and locked else {}
        return state, _Plan(done, earlier, [r for r in requests if r.key not in done], position, read, params)

    @staticmethod
    async def _earlier(conn: psycopg.AsyncConnection[Any], done: dict[str, tuple[int, int]]) -> dict[str, list[RecordedEvent]]:
        """A request whose key is recorded committed on an earlier try: its events, not a second copy."""
        lo, hi = min(f for f, _ in done.values()), max(t for _, t in done.values())
        async with conn.cursor(row_factory=namedtuple_row) as cur:
            await cur.execute(f"SELECT {_COLUMNS} FROM rollbook.events WHERE position BETWEEN %s AND %s "
                              "ORDER BY position", (lo, hi))
            rows = [_row_to_event(r) for r in await cur.fetchall()]
        return {key: [e for e in rows if first <= e.position <= last] for key, (first, last) in done.items()}

    def _plan(self, plan: _Plan, state: LogState) -> list[RecordedEvent]:
        """Plan the requests in order, the payload encoded once, here; the events to write. The group
        stops once it holds MAX_GROUP_BYTES, and the requests after that point wait for the next."""
        size = 0
        for outcome in plan_batch(plan.todo, state, self.writer, self.payload_limit):
            plan.planned.append(outcome)
            if isinstance(outcome, list):
                size += sum(len(pe.payload) for pe in outcome)
            if size >= MAX_GROUP_BYTES:
                break
        return [pe.event for o in plan.planned if isinstance(o, list) for pe in o]

    def _write(self, plan: _Plan, written: list[RecordedEvent], changes: list[Change],
               state: LogState) -> tuple[str, dict[str, Any]]:
        """One statement and its parameters: the check of what the plan read, the events, the stream
        heads, each request's idempotency key, the projections and the log head. A fence or a retire
        mark moves the fence position in the same statement: the attempt checks that servers answer
        from memory (engine.attempts.AttemptGate) are invalid from here."""
        upserts, params = upsert_ctes(changes, moved_by="d")
        move = MOVE_LOG_HEAD_NOTIFY if self._take_notify() else MOVE_LOG_HEAD
        planned = [pe for o in plan.planned if isinstance(o, list) for pe in o]
        rt, rn, rx, ry, rs, rh = [list(c) for c in zip(*plan.read, strict=True)] or [[] for _ in range(6)]
        return ("WITH " + ", ".join([PLANNED_FROM, INSERT_EVENTS, ADVANCE_HEADS, *upserts]) + " " + move, {
            **params, **self._event_params(planned), **_head_params(plan, written, state), **packed_inputs(plan.inputs),
            "planned_from": plan.planned_from, "rt": texts(rt), "rn": texts(rn), "rx": int8s(rx), "ry": int8s(ry),
            "rs": texts(rs), "rh": byteas(rh)})

    def _event_params(self, planned: list[PlannedEvent]) -> dict[str, Any]:
        evs = [pe.event for pe in planned]
        return {
            "p": int8s([e.position for e in evs]), "s": texts([e.stream for e in evs]),
            "v": int4s_or_null([e.stream_version for e in evs]), "k": texts([e.kind for e in evs]),
            "j": texts([pe.payload for pe in planned]), "sv": int2s([e.schema_version for e in evs]),
            "r": texts([e.rollout_id for e in evs]), "a": int4s_or_null([e.attempt for e in evs]),
            "h": byteas([e.hash for e in evs]), "w": self.writer,
        }

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
                async with self._driver_connection(autocommit=True) as conn:
                    await conn.execute(f"NOTIFY {CHANNEL}")
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
    return {"hs": texts(list(heads)), "hv": int4s_or_null([h.version for h in heads.values()]),
            "hh": byteas([h.hash for h in heads.values()]), "kk": texts([k for k, _, _ in landed]),
            "kf": int8s([f for _, f, _ in landed]), "kl": int8s([t for _, _, t in landed]),
            "head": state.position, "fence": max((e.position for e in written if e.kind in FENCE_KINDS), default=None)}


__all__ = ["CHANNEL", "DEFAULT_KEY_RETENTION_S", "DEFAULT_PATIENCE_S", "LOCK_LOG_HEAD",
           "MAX_GROUP_BYTES", "MIN_KEY_RETENTION_S", "PoolLimits", "PostgresEventStore", "StoreObserver",
           "connection_lost", "make_engine", "retrying", "with_retry"]
