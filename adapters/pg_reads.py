"""Reading the event log and the projections on PostgreSQL: what `PostgresEventStore` answers.

Every read runs in autocommit: one statement, no BEGIN and no ROLLBACK around it (a read is one
statement, so it sees one snapshot anyway). Every read is retried across a lost connection
(`retrying`), then reports `database_unavailable`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row, namedtuple_row, tuple_row
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from adapters.database import connect_options, libpq_dsn
from adapters.pg_pool import connection_lost, drop_pool, retrying
from engine import catalog as ev
from engine.checkpoint import CutReads
from engine.events import RecordedEvent

CHANNEL = "rollbook_events"
# Every append takes this lock first, and so does a rebuild (no append may interleave).
LOCK_LOG_HEAD = "SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE"
# The head as committed: an append moves it in the transaction that writes its events, so every
# event at or below it is visible, and one still in flight lands above it. No lock: a checkpoint
# reading P every second must not queue behind (or hold up) the run's appends.
READ_LOG_HEAD = "SELECT position FROM rollbook.log_head WHERE id = 1"


_COLUMNS = "position, stream, stream_version, kind, data, schema_version, rollout_id, attempt, writer, hash, recorded_at"
_E_COLUMNS = ", ".join(f"e.{c}" for c in _COLUMNS.split(", "))


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


# engine.identity.run_of in SQL: a rollout's run is its id less a trailing `-<digits>`.
RUN_OF = r"regexp_replace(rollout_id, '-[0-9]+$', '')"
# Asked at every checkpoint, answered from partial indexes of what is open (migrations 0013, 0014),
# so their cost follows what is live, not the run's history. A cut's attempts: the live ones through
# attempt_state_live, those finished after P through attempt_state_finished.
# The attempts of `run` (every rollout's, with none) live now or finished after the position `{p}`.
_RUNNING = ("(status = 'live' OR (status = 'finished' AND ended_position > {p})) "
            f"AND (%(run)s::text IS NULL OR {RUN_OF} = %(run)s)")
RUNNING_ATTEMPTS = "SELECT * FROM rollbook.attempt_state WHERE " + _RUNNING.format(p="%(p)s")
# engine.checkpoint.restart_only_at, over attempts k(r, a, b) (rollout, attempt, boundary position):
# the read by parameters and the online cut's statement share it.
RESTART_ONLY = (
    "(EXISTS ("
    " SELECT 1 FROM rollbook.events o WHERE o.rollout_id = k.r AND o.attempt = k.a AND o.kind = %(opened)s"
    " AND o.position <= k.b AND COALESCE(NULLIF(o.data->>'state_mode', ''), (SELECT s.data->>'state_mode'"
    "  FROM rollbook.events s WHERE s.rollout_id = k.r AND s.attempt = k.a AND s.kind = %(step)s"
    "  AND s.data->>'step' = 'seed' AND s.position < o.position ORDER BY s.position DESC LIMIT 1)) = 'restart_only'"
    " AND NOT EXISTS ("
    "  SELECT 1 FROM rollbook.events c WHERE c.rollout_id = k.r AND c.attempt = k.a AND c.kind = %(closed)s"
    "  AND c.position > o.position AND c.position <= k.b)"
    ") OR EXISTS ("
    # engine.sessions.open_session_restart: the session's last change left it unrestorable
    " SELECT 1 FROM rollbook.events m WHERE m.rollout_id = k.r AND m.attempt = k.a AND m.kind = %(mutated)s"
    " AND m.position <= k.b AND m.data ? 'unrestorable' AND NOT EXISTS ("
    "  SELECT 1 FROM rollbook.events n WHERE n.rollout_id = k.r AND n.attempt = k.a"
    "  AND n.kind IN (%(mutated)s, %(opened)s, %(closed)s) AND n.position > m.position AND n.position <= k.b)"
    ") OR EXISTS ("
    " SELECT 1 FROM rollbook.events g WHERE g.rollout_id = k.r AND g.attempt = k.a AND g.kind = %(boundary)s"
    " AND g.position <= k.b AND g.data->>'continuable' = 'false' AND NOT EXISTS ("
    "  SELECT 1 FROM rollbook.events c WHERE c.rollout_id = k.r AND c.attempt = k.a AND c.kind = %(completed)s"
    "  AND c.position > g.position AND c.position <= k.b)))"
)
RESTART_ONLY_KINDS = {"opened": ev.SESSION_OPENED, "closed": ev.SESSION_CLOSED, "boundary": ev.AGENT_BOUNDARY,
                      "completed": ev.ACTIVATION_COMPLETED, "step": ev.EPISODE_STEP, "mutated": ev.MUTATION_APPLIED}
# What an online cut reads (engine.checkpoint.CutReads), in one statement and so one snapshot, where it
# was five round trips: P (p), the running attempts (a), the boundaries of those started by P (b), the
# restart-only ones among them (o) and their rollouts' stream heads at P (h). P is read as a scalar
# subquery so that the partial indexes of what is open serve the attempts as they do RUNNING_ATTEMPTS.
_P = "(SELECT position FROM p)"
ONLINE_CUT = (
    "WITH p AS MATERIALIZED (" + READ_LOG_HEAD + "), "
    "att AS MATERIALIZED (SELECT rollout_id, attempt, status, started_position, ended_position FROM rollbook.attempt_state "
    "WHERE " + _RUNNING.format(p=_P) + "), "
    "k AS MATERIALIZED (SELECT * FROM (SELECT rollout_id AS r, attempt AS a, (SELECT max(e.position) FROM rollbook.events e "
    f"WHERE e.rollout_id = att.rollout_id AND e.attempt = att.attempt AND e.position <= {_P} AND e.kind = ANY(%(kinds)s)) AS b "
    f"FROM att WHERE COALESCE(started_position, 0) <= {_P}) AS started WHERE b IS NOT NULL) "
    "SELECT 'p', NULL::text, NULL::int, position, NULL::bigint, NULL::text, NULL::bytea FROM p "
    "UNION ALL SELECT 'a', rollout_id, attempt, started_position, ended_position, status, NULL FROM att "
    "UNION ALL SELECT 'b', r, a, b, NULL, NULL, NULL FROM k "
    "UNION ALL SELECT 'o', r, a, NULL, NULL, NULL, NULL FROM k WHERE " + RESTART_ONLY + " "
    "UNION ALL (SELECT DISTINCT ON (e.rollout_id, e.stream) 'h', e.rollout_id, e.stream_version, NULL, NULL, e.stream, e.hash "
    f"FROM rollbook.events e WHERE e.rollout_id IN (SELECT r FROM k) AND e.position <= {_P} "
    "ORDER BY e.rollout_id, e.stream, e.stream_version DESC)"
)
OPEN_SESSIONS = ("SELECT s.rollout_id, s.attempt, s.env FROM rollbook.session_state s JOIN rollbook.attempt_state a "
                 "USING (rollout_id, attempt) WHERE s.status = 'open' AND a.status = 'live'")
CHECKPOINTS_IN_PHASE = "SELECT checkpoint_id FROM rollbook.checkpoint_state WHERE phase = ANY(%(ph)s) ORDER BY checkpoint_id"


class LogReads:
    """The reads of the store; PostgresEventStore (adapters.postgres) adds the append path."""

    engine: AsyncEngine
    dsn: str
    patience_s: float

    @contextlib.asynccontextmanager
    async def _driver_connection(self, autocommit: bool = False) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The psycopg connection of a pooled one, taken from SQLAlchemy's pool with no SQLAlchemy
        Connection around it: the append path needs pipeline mode, which SQLAlchemy does not offer, a
        large read is twice as fast without SQLAlchemy's row processing, and a Connection with its
        execution options cost about 55 us of CPU a checkout more than the pool's own 30 (every append
        and most reads take one; benchmarks/README.md). The pool still owns the connection's life, and
        gets it back as it gave it (out of autocommit)."""
        pooled = await self.engine.raw_connection()
        conn: psycopg.AsyncConnection[Any] = pooled.driver_connection  # type: ignore[assignment]
        try:
            if autocommit:
                await conn.set_autocommit(True)
            yield conn
        except BaseException as exc:
            if connection_lost(exc) or conn.closed:
                # psycopg raised past SQLAlchemy, which would hand this dead connection out again,
                # and its siblings from before the same restart with it.
                await greenlet_spawn(pooled.invalidate)
                await drop_pool(self.engine)
            raise
        finally:
            if autocommit and not conn.closed:
                try:
                    await conn.set_autocommit(False)
                except psycopg.Error:  # left inside a transaction: not one to hand out again
                    await greenlet_spawn(pooled.invalidate)
            await greenlet_spawn(pooled.close)

    async def _rows(self, sql: str, params: Mapping[str, Any] | None = None, rows: Any = tuple_row,
                    prepare: bool | None = None) -> list[Any]:
        """One read's rows on a pool's psycopg connection (`%(name)s` placeholders): a read through
        SQLAlchemy's Connection and `text()` cost about 200 us of CPU against 85 here (benchmarks/README.md).
        `prepare`: the reads every request makes are prepared at their first use on a connection, so
        PostgreSQL can settle on one plan there after a few, instead of planning every one of them (psycopg
        prepares a statement only after five runs on one connection, and a server spreads its reads
        over its pool)."""
        async with self._driver_connection(autocommit=True) as conn, conn.cursor(row_factory=rows) as cur:
            await cur.execute(sql, params, prepare=prepare)
            return await cur.fetchall()

    # ---- reading --------------------------------------------------------------------------

    @retrying("reading the log head")
    async def head(self) -> int:
        return int((await self._rows(READ_LOG_HEAD))[0][0])

    async def read_stream(self, stream: str, after_version: int = 0, to_version: int | None = None) -> list[RecordedEvent]:
        where = "stream = %(s)s AND stream_version > %(v)s"
        params: dict[str, Any] = {"s": stream, "v": after_version}
        if to_version is not None:
            where += " AND stream_version <= %(t)s"
            params["t"] = to_version
        return await self._select_events(where, params, "ORDER BY stream_version")

    async def read_all(self, after: int = 0, limit: int = 1000, to: int | None = None) -> list[RecordedEvent]:
        where = "position > %(a)s"
        params: dict[str, Any] = {"a": after, "l": limit}
        if to is not None:
            where += " AND position <= %(t)s"
            params["t"] = to
        return await self._select_events(where, params, "ORDER BY position LIMIT %(l)s")

    async def read_rollout(self, rollout_id: str, attempt: int | None = None, to: int | None = None,
                           kinds: Sequence[str] | None = None) -> list[RecordedEvent]:
        where = "rollout_id = %(r)s"
        params: dict[str, Any] = {"r": rollout_id}
        if attempt is not None:
            where += " AND attempt = %(n)s"
            params["n"] = attempt
        if to is not None:
            where += " AND position <= %(t)s"
            params["t"] = to
        if kinds is not None:
            where += " AND kind = ANY(%(k)s)"
            params["k"] = list(kinds)
        return await self._select_events(where, params, "ORDER BY position")

    @retrying("reading events")
    async def read_rollouts(self, rollout_ids: Sequence[str], to: int | None = None,
                            after: Mapping[str, int] | None = None) -> list[RecordedEvent]:
        """Every event of these rollouts up to `to` (and of a rollout in `after`, past that position
        only), in log order, in one query (restore's one pass). On the driver connection:
        SQLAlchemy's row processing doubled the time of a large read."""
        if not rollout_ids:
            return []
        ids = list(dict.fromkeys(rollout_ids))
        where = "" if to is None else " AND e.position <= %(t)s"
        async with self._driver_connection(autocommit=True) as conn, conn.cursor(row_factory=namedtuple_row) as cur:
            # A join on (rollout, lower bound): the position bound is checked in the rollout index's entries.
            await cur.execute(f"SELECT {_E_COLUMNS} FROM unnest(%(r)s::text[], %(a)s::bigint[]) AS k(r, a) "
                              f"JOIN rollbook.events e ON e.rollout_id = k.r AND e.position > k.a{where} ORDER BY e.position",
                              {"r": ids, "a": [(after or {}).get(r, 0) for r in ids], "t": to})
            return [_row_to_event(r) for r in await cur.fetchall()]

    @retrying("reading stream hashes")
    async def stream_hashes(self, versions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        if not versions:
            return {}
        async with self._driver_connection(autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT e.stream, e.stream_version, e.hash FROM unnest(%s::text[], %s::int[]) AS k(s, v) "
                "JOIN rollbook.events e ON e.stream = k.s AND e.stream_version = k.v",
                ([s for s, _ in versions], [v for _, v in versions]))
            return {(r[0], r[1]): bytes(r[2]) for r in await cur.fetchall()}

    @retrying("reading events")
    async def _select_events(self, where: str, params: dict[str, Any], tail: str) -> list[RecordedEvent]:
        rows = await self._rows(f"SELECT {_COLUMNS} FROM rollbook.events WHERE {where} {tail}", params, namedtuple_row,
                                prepare=True)
        return [_row_to_event(r) for r in rows]

    async def subscribe(self, after: int = 0, poll_seconds: float = 1.0) -> AsyncIterator[RecordedEvent]:
        """Catch up from `after`, then follow. NOTIFY only wakes the reader early; the poll is the truth."""
        conn = await psycopg.AsyncConnection.connect(libpq_dsn(self.dsn), autocommit=True, **connect_options(self.dsn))
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

    # ---- what a cut needs -------------------------------------------------------------------

    @retrying("reading attempts")
    async def attempt_rows(self, rollout_ids: Sequence[str]) -> dict[tuple[str, int], dict[str, Any]]:
        return await self._attempts("SELECT a.*, r.retired_through FROM rollbook.attempt_state a "
                                    "LEFT JOIN rollbook.rollout_state r USING (rollout_id) WHERE a.rollout_id = ANY(%s)",
                                    (list(rollout_ids),))

    @retrying("reading attempts")
    async def running_attempts(self, position: int, run: str | None) -> dict[tuple[str, int], dict[str, Any]]:
        return await self._attempts(RUNNING_ATTEMPTS, {"p": position, "run": run})

    async def _attempts(self, sql: str, params: tuple[Any, ...] | dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
        """Each attempt's row as a dict, by (rollout, attempt), read without SQLAlchemy's row processing:
        a cut reads every attempt of the rollouts its framework names, and that processing was most of
        the driver's CPU in a checkpoint of a 15,000-rollout run."""
        async with self._driver_connection(autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(sql, params)
            return {(r["rollout_id"], r["attempt"]): r for r in await cur.fetchall()}

    @retrying("reading boundaries")
    async def latest_boundaries(
        self, keys: Sequence[tuple[str, int]], position: int, kinds: Sequence[str]
    ) -> dict[tuple[str, int], int]:
        if not keys:
            return {}
        rows = await self._rows(
            "SELECT k.r, k.a, (SELECT max(e.position) FROM rollbook.events e WHERE e.rollout_id = k.r "
            "AND e.attempt = k.a AND e.position <= %(p)s AND e.kind = ANY(%(kinds)s)) AS b "
            "FROM unnest(%(rs)s::text[], %(as_)s::int[]) AS k(r, a)",
            {"rs": [r for r, _ in keys], "as_": [a for _, a in keys], "p": position, "kinds": list(kinds)})
        return {(r, a): b for r, a, b in rows if b is not None}

    @retrying("reading stream heads")
    async def rollout_heads_at(self, rollout_ids: Sequence[str], position: int) -> dict[str, list[tuple[str, int, bytes]]]:
        """Each rollout's streams at their last version at or below `position`; reads no event data
        (the hash of a stream's head covers every earlier event of that stream)."""
        out: dict[str, list[tuple[str, int, bytes]]] = {r: [] for r in rollout_ids}
        if not rollout_ids:
            return out
        rows = await self._rows(
            "SELECT DISTINCT ON (e.rollout_id, e.stream) e.rollout_id, e.stream, e.stream_version, e.hash "
            "FROM rollbook.events e WHERE e.rollout_id = ANY(%(rs)s::text[]) AND e.position <= %(p)s "
            "ORDER BY e.rollout_id, e.stream, e.stream_version DESC", {"rs": list(rollout_ids), "p": position})
        for rollout_id, stream, version, hash_ in rows:
            out[rollout_id].append((stream, version, bytes(hash_)))
        return out

    @retrying("reading checkpoints")
    async def checkpoints_in_phase(self, phases: Sequence[str]) -> list[str]:
        return [r for (r,) in await self._rows(CHECKPOINTS_IN_PHASE, {"ph": list(phases)})]

    @retrying("reading a retire mark")
    async def session_revision(self, rollout_id: str, attempt: int) -> int | None:
        """The revision the session projection records for an attempt (None: it never opened one)."""
        rows = await self._rows("SELECT revision FROM rollbook.session_state WHERE rollout_id = %(r)s AND attempt = %(a)s",
                                {"r": rollout_id, "a": attempt})
        return rows[0][0] if rows else None

    @retrying("reading the fence position")
    async def fence_position(self) -> int:
        """engine.attempts.AttemptStore: one single-row read, no lock (an append in flight has not
        fenced anything yet; once it commits, this read sees it)."""
        rows = await self._rows("SELECT fence_position FROM rollbook.log_head WHERE id = 1", prepare=True)
        return int(rows[0][0] or 0) if rows else 0

    @retrying("reading an attempt")
    async def attempt_status(self, rollout_id: str, attempt: int) -> tuple[str | None, int]:
        """engine.attempts.AttemptStore: the attempt's status and its rollout's retire mark, in one statement."""
        (status, mark), = await self._rows(
            "SELECT (SELECT status FROM rollbook.attempt_state WHERE rollout_id = %(r)s AND attempt = %(a)s), "
            "(SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = %(r)s)", {"r": rollout_id, "a": attempt},
            prepare=True)
        return status, -1 if mark is None else int(mark)

    @retrying("reading an attempt")
    async def attempt_reading(self, rollout_id: str, attempt: int) -> tuple[int, str | None, int]:
        """engine.attempts.AttemptStore: the fence position, the attempt's status and its rollout's retire
        mark, in one statement (one snapshot)."""
        (fence, status, mark), = await self._rows(
            "SELECT (SELECT fence_position FROM rollbook.log_head WHERE id = 1), "
            "(SELECT status FROM rollbook.attempt_state WHERE rollout_id = %(r)s AND attempt = %(a)s), "
            "(SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = %(r)s)", {"r": rollout_id, "a": attempt},
            prepare=True)
        return int(fence or 0), status, -1 if mark is None else int(mark)

    @retrying("reading sessions")
    async def open_sessions(self) -> dict[tuple[str, int], str]:
        """The environment of each live attempt's open resources session, as the log records it."""
        return {(r, a): env for r, a, env in await self._rows(OPEN_SESSIONS)}

    @retrying("reading restart-only executions")
    async def restart_only_at(self, boundaries: dict[tuple[str, int], int]) -> list[tuple[str, int]]:
        if not boundaries:
            return []
        keys = list(boundaries)
        async with self._driver_connection(autocommit=True) as conn:
            rows = await (await conn.execute(
                "SELECT k.r, k.a FROM unnest(%(rs)s::text[], %(as_)s::int[], %(bs)s::bigint[]) AS k(r, a, b) WHERE "
                + RESTART_ONLY, {"rs": [r for r, _ in keys], "as_": [a for _, a in keys],
                                 "bs": [boundaries[k] for k in keys], **RESTART_ONLY_KINDS})).fetchall()
            return sorted((r[0], r[1]) for r in rows)

    @retrying("reading an online cut")
    async def online_cut_reads(self, run: str | None, kinds: Sequence[str]) -> CutReads:
        async with self._driver_connection(autocommit=True) as conn:
            rows = await (await conn.execute(ONLINE_CUT, {"run": run, "kinds": list(kinds), **RESTART_ONLY_KINDS})).fetchall()
        position = next(r[3] for r in rows if r[0] == "p")
        attempts = {(r[1], r[2]): {"status": r[5], "started_position": r[3], "ended_position": r[4]} for r in rows if r[0] == "a"}
        heads: dict[str, list[tuple[str, int, bytes]]] = {}
        for r in rows:
            if r[0] == "h":
                heads.setdefault(r[1], []).append((r[5], r[2], bytes(r[6])))
        return CutReads(int(position), attempts, {(r[1], r[2]): int(r[3]) for r in rows if r[0] == "b"},
                        frozenset((r[1], r[2]) for r in rows if r[0] == "o"), heads)

    @retrying("reading a retire mark")
    async def retired_through(self, rollout_id: str) -> int:
        rows = await self._rows("SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = %(r)s", {"r": rollout_id})
        return -1 if not rows or rows[0][0] is None else int(rows[0][0])
