"""Retention: what the database may drop while the servers write (`rollbook db retain`).

Two things are dropped, both older than the retention (`[limits] append_key_retention_s`, a day by
default, never under MIN_KEY_RETENTION_S):

- append idempotency keys (PostgresEventStore.prune_append_keys says why an old key is never asked
  for again);
- token blobs that nothing names: no event's data holds their id (a receipt of a model call, of a
  cut prefix it continues, of a captured entry, anywhere in the data) and no token snapshot lists
  them. Such a blob is what a write left behind when the append that was to name it was refused or
  never came (a fenced call's outcome, a crash between a put and its event).

Everything a kept checkpoint's restore reads is named: the cut's events (their receipts) are never
deleted and its token snapshot lists its blobs; so are the blobs of every live attempt, every
finished rollout (exported or not) and every open capture. Events themselves are kept: the log is
the source of truth and its positions are gap-free. Session snapshots (rollbook.stream_snapshots)
are left alone: they name no blob, and a restore that starts at one reads the events after it,
which are kept.

Safe while servers write. A blob is "written" whenever any writer upserts it (`created_at` is set
again on every write, adapters.token_store), and an event names a blob only after the blob was
written, within the writer's database patience (seconds) or in the same transaction. The delete
re-checks each row's age under its row lock, so a blob written again while retention runs (the same
tokens generated anew) is kept, and a blob older than the retention cannot be named by an event
still to come.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from adapters.pg_pool import retrying
from adapters.postgres import DEFAULT_KEY_RETENTION_S, MIN_KEY_RETENTION_S, PostgresEventStore

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


@dataclass(frozen=True)
class Retained:
    """What one run of retention dropped."""

    append_keys: int
    token_blobs: int
    token_bytes: int  # the stored size of the dropped arrays (pg_column_size)
    older_than_s: float


async def retain(store: PostgresEventStore, older_than_s: float = DEFAULT_KEY_RETENTION_S,
                 batch: int = 10_000) -> Retained:
    """Drop the append keys and the unnamed token blobs older than `older_than_s`; raises ValueError
    for a retention shorter than a writer may still retry or name what it wrote."""
    if older_than_s < max(MIN_KEY_RETENTION_S, store.patience_s):
        raise ValueError(f"a retention of {older_than_s:g} s is shorter than a writer may retry an append "
                         f"(at least {max(MIN_KEY_RETENTION_S, store.patience_s):g} s)")
    keys = await store.prune_append_keys(older_than_s, batch)
    blobs = size = 0
    while True:
        sizes = await _drop_blob_batch(store, older_than_s, batch)
        blobs, size = blobs + len(sizes), size + sum(sizes)
        if len(sizes) < batch:
            return Retained(keys, blobs, size, older_than_s)


@retrying("dropping token blobs")  # deleting unnamed old rows is safe to repeat
async def _drop_blob_batch(store: PostgresEventStore, older_than_s: float, batch: int) -> list[int]:
    async with store.engine.begin() as conn:
        rows = await conn.execute(text(_DROP_BLOBS), {"s": older_than_s, "n": batch})
        return [int(r[0] or 0) for r in rows]
