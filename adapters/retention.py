"""Retention: what the database may drop while the servers write (`rollbook db retain`).

What is dropped, in this order, each older than the retention (`[limits] append_key_retention_s`,
a day by default, never under MIN_KEY_RETENTION_S):

1. the events of attempts nothing needs any more. An attempt is *done* when it was fenced (a later
   attempt superseded it) or finished and marked exported (`rollout_exported`, engine/exports.py). A
   done attempt is dropped unless it is *needed*:
   - it is an attempt of a rollout a *kept* checkpoint continues or dispatches afresh (its cut's
     scope: restore re-hashes every event of a scoped rollout up to the cut, all attempts; its fresh
     dispatches: their input is read from their events), or of a rollout such a rollout was forked
     from (its lineage). A rollout a cut lists as completed needs no event at restore (its attempt's
     row says it finished; restore leaves it as it is), and every later cut lists every finished
     rollout as completed: counting those would keep every finished rollout for ever;
   - it is in the lineage (`origin_attempt`, a fork's `origin_rollout_id`, recursively) of an attempt
     that is not done: live, retired (forget may revive it), finished and not exported, or with an
     open token capture (a capture stream without `capture_retired`).
   *Kept* checkpoints: the newest `[limits] retention_keep_checkpoints` published ones, any
   committed one (being published), and every checkpoint a needed attempt was restored from.
   Dropped are the attempt's events outside its rollout's stream (its episode, agent, session,
   capture and model-call streams), whole streams only, each event of them older than the retention,
   with their projection rows (episode_state, session_state, model_call_state: the rows those events
   alone derive, so a rebuild from the log still equals the live tables) and their `stream_heads`
   rows (an event appended to such a stream later, which only a finished attempt may still write,
   starts a new chain at version 1 instead of following versions no row holds). The rollout's own stream
   stays: a few events per attempt (started, fenced, finished, exported) that keep `attempts`, the
   export mark and what `rollbook run` reads to know a rollout finished.
   A restore of a checkpoint that is not kept may then fail validation (its rollouts' events are
   gone): that is what not keeping it means.
2. the token snapshots of checkpoints that ended (published or aborted) and are not kept;
3. append idempotency keys (PostgresEventStore.prune_append_keys says why an old key is never asked
   for again; a dropped event is older than the retention, and so is its key);
4. token blobs that nothing names: no event's data holds their id (a receipt of a model call, of a
   cut prefix it continues, of a captured entry, anywhere in the data) and no token snapshot lists
   them. Such a blob is what a write left behind when the append that was to name it was refused or
   never came (a fenced call's outcome, a crash between a put and its event), or what the events
   and snapshots dropped above named;
5. sandbox snapshot blobs (rollbook.file_blobs, engine.file_blobs) that nothing names: no kept
   `mutation_applied` names the manifest (its effect's `snapshot`) and no named blob names it (a
   manifest names its files and the full manifest it is a delta of). A live, kept or unexported
   attempt keeps its session's events (1), and so its snapshots' blobs; what only dropped events
   named goes. The same age rule as token blobs: a writer puts a snapshot's blobs right before the
   event that names them, and putting a blob again makes it new.

Holes in positions. Dropping events leaves positions that no row holds. Every reader stays correct
with them: `read_all` and `subscribe` select `position > after` in order (a hole is an event they
never see, and nothing lands below the head later); restore's chain check (`_rechain`) is per stream
and only whole streams are dropped, of rollouts no kept checkpoint names; the views and the UI read
whatever rows are there. Only the log head says how many events were ever appended.

Session snapshots (rollbook.stream_snapshots, engine/snapshots.py) name no blob. Those of a dropped
stream go with it; the others stay, and a restore that starts at one reads the events after it,
which are kept with their stream.

Safe while servers write. Each batch of (1) is decided without holding anything, then deleted in a
transaction that holds the log head FOR SHARE (no append commits meanwhile) and first checks that
nothing appended since the decision's head could have made a decided attempt needed
(`_drop_event_batch` lists what could); if something did, the batch is decided again. A checkpoint
makes its cut after `checkpoint_started` lands, so (1) and (2) are skipped while a checkpoint is
started or prepared (`deferred_by` names it) and such a cut never covers a stream being deleted. A blob is "written" whenever any writer upserts it (`created_at` is set again on
every write, adapters.token_store), and an event names a blob only after the blob was written,
within the writer's database patience (seconds) or in the same transaction. The delete re-checks
each row's age under its row lock, so a blob written again while retention runs (the same tokens
generated anew) is kept, and a blob older than the retention cannot be named by an event still to
come. What is not guarded: a fork started from a boundary of a done attempt while retention drops
it (its read of the origin came first) cannot be restored from its origin; fork from what is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import text

from adapters.pg_pool import retrying
from adapters.postgres import DEFAULT_KEY_RETENTION_S, MIN_KEY_RETENTION_S, PostgresEventStore
from engine import catalog as ev
from engine.identity import rollout_stream
from engine.phases import OPEN_CHECKPOINT_PHASES

# How many published checkpoints stay restorable (`[limits] retention_keep_checkpoints`).
DEFAULT_KEEP_CHECKPOINTS = 3

# The attempts that are not done, and those their lineage goes back to (see the module's docstring).
# Anti-joins are NOT EXISTS, never NOT IN: past work_mem a NOT IN set is scanned once per row.
_NEEDED = f"""
marked AS (SELECT DISTINCT rollout_id, attempt FROM rollbook.events WHERE kind = '{ev.ROLLOUT_EXPORTED}'),
open_captures AS (SELECT rollout_id, attempt FROM rollbook.events WHERE kind IN ({", ".join(f"'{k}'" for k in ev.CAPTURE_KINDS)})
                  GROUP BY rollout_id, attempt HAVING NOT bool_or(kind = '{ev.CAPTURE_RETIRED}')),
starts AS (SELECT rollout_id, attempt, coalesce(data->>'origin_rollout_id', rollout_id) AS origin_rollout,
                  (data->>'origin_attempt')::integer AS origin_attempt
           FROM rollbook.events WHERE kind = '{ev.ATTEMPT_STARTED}'),
done AS (SELECT a.rollout_id, a.attempt FROM rollbook.attempt_state a
         WHERE a.status = 'fenced' OR (a.status = 'finished' AND (a.rollout_id, a.attempt) IN (SELECT * FROM marked))),
needed (rollout_id, attempt) AS (
    SELECT a.rollout_id, a.attempt FROM rollbook.attempt_state a
    WHERE NOT EXISTS (SELECT 1 FROM done d WHERE d.rollout_id = a.rollout_id AND d.attempt = a.attempt)
    UNION SELECT rollout_id, attempt FROM open_captures
    UNION SELECT s.origin_rollout, s.origin_attempt FROM needed n
          JOIN starts s ON s.rollout_id = n.rollout_id AND s.attempt = n.attempt WHERE s.origin_attempt IS NOT NULL),
kept AS (
    SELECT checkpoint_id FROM (SELECT checkpoint_id FROM rollbook.checkpoint_state WHERE phase = 'published'
                               ORDER BY published_position DESC LIMIT :keep) newest
    UNION SELECT checkpoint_id FROM rollbook.checkpoint_state WHERE phase = 'committed'
    UNION SELECT a.restored_from FROM rollbook.attempt_state a JOIN needed n USING (rollout_id, attempt)
          WHERE a.restored_from IS NOT NULL),
kept_rollouts (rollout_id) AS (
    SELECT r.rollout_id FROM rollbook.checkpoint_rollouts r JOIN kept k USING (checkpoint_id)
    WHERE r.disposition <> 'completed'
    UNION SELECT s.origin_rollout FROM kept_rollouts k JOIN starts s USING (rollout_id)),
droppable AS (SELECT d.rollout_id, d.attempt FROM done d
              WHERE NOT EXISTS (SELECT 1 FROM needed n WHERE n.rollout_id = d.rollout_id AND n.attempt = d.attempt)
                AND NOT EXISTS (SELECT 1 FROM kept_rollouts k WHERE k.rollout_id = d.rollout_id))"""
# Every event of an attempt outside its rollout's stream (`:rs` || rollout id spells that stream).
_OWN = "e.rollout_id = d.rollout_id AND e.attempt = d.attempt AND e.stream <> :rs || d.rollout_id"
# A batch of droppable attempts that have events to drop, each of those events old, and every event
# of every stream they are in an old one of a droppable attempt: streams go whole or not at all.
_DECIDE = f"""WITH RECURSIVE {_NEEDED},
batch AS (
    SELECT d.rollout_id, d.attempt FROM droppable d
    WHERE EXISTS (SELECT 1 FROM rollbook.events e WHERE {_OWN})
      AND NOT EXISTS (
        SELECT 1 FROM rollbook.events e JOIN rollbook.events o ON o.stream = e.stream
        WHERE {_OWN} AND (o.recorded_at >= now() - make_interval(secs => :s)
                          OR NOT EXISTS (SELECT 1 FROM droppable x WHERE x.rollout_id = o.rollout_id
                                                                     AND x.attempt = o.attempt)))
    LIMIT :n)
SELECT DISTINCT d.rollout_id, d.attempt, e.stream FROM batch d JOIN rollbook.events e ON {_OWN}"""
# What, appended after the decision's head, could make a decided attempt needed (the docstring of
# `_drop_event_batch`); any of it and the batch is decided again.
_CHANGED_SINCE = f"""SELECT
    EXISTS (SELECT 1 FROM rollbook.events WHERE kind = ANY(CAST(:ck AS text[])) AND position > :h)
 OR EXISTS (SELECT 1 FROM rollbook.events WHERE kind = '{ev.ATTEMPT_STARTED}' AND position > :h
            AND (data->>'origin_attempt' IS NOT NULL OR data->>'restored_from' IS NOT NULL))
 OR EXISTS (SELECT 1 FROM rollbook.events e JOIN rollbook.attempt_state a USING (rollout_id, attempt)
            WHERE e.kind = ANY(CAST(:cap AS text[])) AND e.position > :h AND a.status IN ('fenced', 'finished'))
 OR EXISTS (SELECT 1 FROM unnest(CAST(:r AS text[]), CAST(:a AS integer[])) AS k(rollout_id, attempt)
            JOIN rollbook.events e USING (rollout_id, attempt) WHERE e.position > :h)
 OR EXISTS (SELECT 1 FROM rollbook.events WHERE stream = ANY(CAST(:st AS text[])) AND position > :h)"""
_DELETE_STREAMS = ("DELETE FROM rollbook.events WHERE stream = ANY(CAST(:st AS text[])) "
                   "RETURNING stream, rollout_id, attempt, kind, data->>'call_id' AS call_id, pg_column_size(events.*) AS bytes")
_CHECKPOINT_KINDS = [ev.checkpoint_phase_kind(p) for p in ("started", "prepared", "committed", "published", "aborted")]
# A batch decided again this many times in a row, each time overtaken by the log, ends the run's event step.
DECIDE_TRIES = 20
# The projection rows only the dropped events derived (engine.projections: episode_*, session_* and
# mutation_applied by attempt, call_* by call id; none of those kinds goes to a rollout's stream).
_DROP_PROJECTIONS = (
    "WITH k AS (SELECT * FROM unnest(CAST(:r AS text[]), CAST(:a AS integer[])) AS k(rollout_id, attempt)), "
    "es AS (DELETE FROM rollbook.episode_state t USING k WHERE t.rollout_id = k.rollout_id AND t.attempt = k.attempt), "
    "ss AS (DELETE FROM rollbook.session_state t USING k WHERE t.rollout_id = k.rollout_id AND t.attempt = k.attempt), "
    "sh AS (DELETE FROM rollbook.stream_heads WHERE stream = ANY(CAST(:s AS text[]))), "
    "sn AS (DELETE FROM rollbook.stream_snapshots WHERE stream = ANY(CAST(:s AS text[]))) "
    "DELETE FROM rollbook.model_call_state WHERE call_id = ANY(CAST(:c AS text[]))"
)
_OPEN_CHECKPOINT = ("SELECT checkpoint_id FROM rollbook.checkpoint_state WHERE phase IN "
                    f"({', '.join(repr(p) for p in OPEN_CHECKPOINT_PHASES)}) ORDER BY checkpoint_id LIMIT 1")
_HOLD_APPENDS = "SELECT position FROM rollbook.log_head WHERE id = 1 FOR SHARE"
_HEAD = "SELECT position FROM rollbook.log_head WHERE id = 1"
_DROP_SNAPSHOTS = f"""WITH RECURSIVE {_NEEDED}
DELETE FROM rollbook.token_snapshots t USING rollbook.checkpoint_state c
WHERE c.checkpoint_id = t.checkpoint_id AND c.phase IN ('published', 'aborted')
  AND NOT EXISTS (SELECT 1 FROM kept k WHERE k.checkpoint_id = t.checkpoint_id)"""

# Every blob id anywhere in an event's data, and every blob a token snapshot lists.
_NAMED = (
    "SELECT jsonb_path_query(e.data, 'strict $.**.blob_id') #>> '{}' AS blob_id FROM rollbook.events e "
    "UNION ALL SELECT unnest(s.blob_ids) FROM rollbook.token_snapshots s"
)
# An anti-join, not NOT IN: a set of named ids larger than work_mem still hashes (spilling to disk)
# instead of being scanned once per blob.
_DROP_BLOBS = (
    f"WITH named AS ({_NAMED}), "
    "unnamed AS (SELECT b.blob_id FROM rollbook.token_blobs b WHERE b.created_at < now() - make_interval(secs => :s) "
    "AND NOT EXISTS (SELECT 1 FROM named n WHERE n.blob_id = b.blob_id) LIMIT :n) "
    "DELETE FROM rollbook.token_blobs b USING unnamed u WHERE b.blob_id = u.blob_id "
    "AND b.created_at < now() - make_interval(secs => :s) "
    "RETURNING pg_column_size(b.token_ids) + coalesce(pg_column_size(b.logprobs), 0)"
)


# Every manifest a session's change names (its effect's `snapshot`), and every blob a named blob names
# (a manifest's files and the manifest it is a delta of), recursively.
_NAMED_FILES = (
    "WITH RECURSIVE named(digest) AS ("
    f" SELECT e.data->'effect'->>'snapshot' FROM rollbook.events e WHERE e.kind = '{ev.MUTATION_APPLIED}'"
    " AND e.data->'effect'->>'snapshot' IS NOT NULL"
    " UNION SELECT unnest(b.names) FROM rollbook.file_blobs b JOIN named n ON b.digest = n.digest)"
)
_DROP_FILE_BLOBS = (
    f"{_NAMED_FILES}, "
    "unnamed AS (SELECT b.digest FROM rollbook.file_blobs b WHERE b.written_at < now() - make_interval(secs => :s) "
    "AND NOT EXISTS (SELECT 1 FROM named n WHERE n.digest = b.digest) LIMIT :n) "
    "DELETE FROM rollbook.file_blobs b USING unnamed u WHERE b.digest = u.digest "
    "AND b.written_at < now() - make_interval(secs => :s) RETURNING length(b.content)"
)


@dataclass(frozen=True)
class Retained:
    """What one run of retention dropped."""

    append_keys: int
    token_blobs: int
    token_bytes: int  # the stored size of the dropped arrays (pg_column_size)
    older_than_s: float
    events: int = 0
    event_bytes: int = 0  # the stored size of the dropped rows (pg_column_size)
    attempts: int = 0  # attempts whose events went
    token_snapshots: int = 0
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    deferred_by: str | None = None  # a checkpoint started or prepared: no event or snapshot was dropped
    longest_hold_s: float = 0.0  # the longest a batch held the log head: what an append waited at most
    file_blobs: int = 0  # sandbox snapshot blobs (files and manifests) nothing names any more
    file_bytes: int = 0


@dataclass
class _Dropped:
    events: int = 0
    bytes: int = 0
    attempts: int = 0
    longest_hold_s: float = 0.0


async def retain(store: PostgresEventStore, older_than_s: float = DEFAULT_KEY_RETENTION_S,
                 batch: int = 10_000, keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS) -> Retained:
    """Drop what nothing needs (the module's docstring says what that is); raises ValueError for a
    retention shorter than a writer may still retry or name what it wrote, or no kept checkpoint."""
    if older_than_s < max(MIN_KEY_RETENTION_S, store.patience_s):
        raise ValueError(f"a retention of {older_than_s:g} s is shorter than a writer may retry an append "
                         f"(at least {max(MIN_KEY_RETENTION_S, store.patience_s):g} s)")
    if keep_checkpoints < 1:
        raise ValueError("retention keeps at least the newest published checkpoint (keep_checkpoints >= 1)")
    dropped, deferred_by = _Dropped(), None
    while deferred_by is None:
        deferred_by, n = await _drop_event_batch(store, older_than_s, max(1, batch // 10), keep_checkpoints, dropped)
        if n == 0:
            break
    snapshots = 0 if deferred_by is not None else await _drop_snapshots(store, keep_checkpoints)
    keys = await store.prune_append_keys(older_than_s, batch)
    blobs = size = 0
    while True:
        sizes = await _drop_blob_batch(store, older_than_s, batch, _DROP_BLOBS)
        blobs, size = blobs + len(sizes), size + sum(sizes)
        if len(sizes) < batch:
            break
    files = file_size = 0
    while True:
        sizes = await _drop_blob_batch(store, older_than_s, batch, _DROP_FILE_BLOBS)
        files, file_size = files + len(sizes), file_size + sum(sizes)
        if len(sizes) < batch:
            return Retained(keys, blobs, size, older_than_s, dropped.events, dropped.bytes, dropped.attempts,
                            snapshots, keep_checkpoints, deferred_by, round(dropped.longest_hold_s, 3), files, file_size)


@retrying("dropping events")  # decided again on every try: safe to repeat
async def _drop_event_batch(store: PostgresEventStore, older_than_s: float, batch: int, keep: int,
                            dropped: _Dropped) -> tuple[str | None, int]:
    """Decide a batch without holding appends off, then delete it in a transaction that does, if nothing
    appended since the decision's head could have changed it. (why nothing was dropped, attempts dropped)

    The decision reads the log at head H. A decided attempt is done (fenced, or finished and marked:
    neither ever undone) and not needed; only an event after H can make it needed or its rollout kept:
    a checkpoint's move (a new cut, a new kept set), an attempt started with an origin or restored from
    a checkpoint (a lineage reaching it), a capture event of a done attempt (an open capture), or any
    event of a decided attempt or in a decided stream. The delete's transaction holds the log head,
    so none can land between that check and the delete. The expensive decision holds nothing."""
    for _ in range(DECIDE_TRIES):
        async with store.engine.begin() as conn:
            head = int((await conn.execute(text(_HEAD))).scalar_one())
            rows = (await conn.execute(text(_DECIDE), {"s": older_than_s, "n": batch, "keep": keep,
                                                       "rs": rollout_stream("")})).all()
        if not rows:
            return None, 0
        attempts = sorted({(r.rollout_id, r.attempt) for r in rows})
        streams = sorted({r.stream for r in rows})
        await _decided()
        async with store.engine.begin() as conn:
            await conn.execute(text(_HOLD_APPENDS))
            held = time.perf_counter()
            open_checkpoint = (await conn.execute(text(_OPEN_CHECKPOINT))).scalar()
            if open_checkpoint is not None:
                return str(open_checkpoint), 0
            if (await conn.execute(text(_CHANGED_SINCE), {
                    "h": head, "ck": _CHECKPOINT_KINDS, "cap": list(ev.CAPTURE_KINDS), "r": [r for r, _ in attempts],
                    "a": [a for _, a in attempts], "st": streams})).scalar():
                continue
            gone = (await conn.execute(text(_DELETE_STREAMS), {"st": streams})).all()
            calls = sorted({g.call_id for g in gone if g.kind.startswith("call_") and g.call_id is not None})
            await conn.execute(text(_DROP_PROJECTIONS), {"r": [r for r, _ in attempts], "a": [a for _, a in attempts],
                                                         "c": calls, "s": streams})
        dropped.longest_hold_s = max(dropped.longest_hold_s, time.perf_counter() - held)  # to the commit
        dropped.events += len(gone)
        dropped.bytes += sum(int(g.bytes or 0) for g in gone)
        dropped.attempts += len(attempts)
        return None, len(attempts)
    return f"the log changed under {DECIDE_TRIES} decisions in a row (checkpoints, restores): run it again", 0


async def _decided() -> None:
    """Between a batch's decision and its delete: nothing. Tests append here, as a server would."""


@retrying("dropping token snapshots")  # deleting what is not kept is safe to repeat
async def _drop_snapshots(store: PostgresEventStore, keep: int) -> int:
    async with store.engine.begin() as conn:
        return int((await conn.execute(text(_DROP_SNAPSHOTS), {"keep": keep})).rowcount)


@retrying("dropping blobs")  # deleting unnamed old rows is safe to repeat
async def _drop_blob_batch(store: PostgresEventStore, older_than_s: float, batch: int, sql: str) -> list[int]:
    async with store.engine.begin() as conn:
        rows = await conn.execute(text(sql), {"s": older_than_s, "n": batch})
        return [int(r[0] or 0) for r in rows]
