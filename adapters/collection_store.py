"""What a collection run (apps.collection, apps.run) reads of the log, by its run prefix.

A run names its rollouts `<run>-NNNN` and its checkpoints `<run>-ckN`; these reads find its own by
that prefix (a LIKE pattern with `_` and `%` literal: adapters.database.like_prefix). Each is safe to
repeat, so each rides out a lost connection within the store's patience.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from adapters.database import like_prefix
from adapters.postgres import PostgresEventStore, retrying
from engine import catalog as ev

# Asked at every publish; the published checkpoints' partial index (migration 0013) answers it from
# the newest end instead of a scan of every checkpoint the database holds.
LAST_SNAPSHOT = ("SELECT c.position, p.data->'token_snapshot_ref' AS ref FROM rollbook.checkpoint_state c "
                 "JOIN rollbook.events p ON p.position = c.published_position WHERE c.phase = 'published' "
                 "AND c.checkpoint_id LIKE :p AND c.position < :b ORDER BY c.position DESC LIMIT 1")


class CollectionStore:
    def __init__(self, store: PostgresEventStore) -> None:
        self.store = store
        self.patience_s = store.patience_s  # read by `retrying`
        self.observers = store.observers

    @retrying("reading the run's rollouts")
    async def finished_rollouts(self, prefix: str) -> set[str]:
        """The rollouts named `prefix...` that have a finished attempt."""
        async with self.store.engine.connect() as conn:
            return {r for (r,) in await conn.execute(
                text("SELECT rollout_id FROM rollbook.attempts WHERE status = 'finished' AND rollout_id LIKE :p"),
                {"p": like_prefix(prefix)})}

    @retrying("reading the run's token receipts")
    async def call_blobs(self, prefix: str, since: int, to: int) -> list[str]:
        """Both token arrays of every call of the rollouts named `prefix...` recorded in (since, to]: the
        generated ids and logprobs, and the prompt ids a continuation needs."""
        async with self.store.engine.connect() as conn:
            return [b for (b,) in await conn.execute(text(
                "SELECT b FROM rollbook.events, LATERAL (VALUES (data->'receipt'->>'blob_id'), "
                "(data->'prompt_receipt'->>'blob_id')) v(b) WHERE kind IN (:completed, :cut) AND b IS NOT NULL "
                "AND position > :since AND position <= :p AND rollout_id LIKE :r"),
                {"since": since, "p": to, "r": like_prefix(prefix), "completed": ev.CALL_COMPLETED, "cut": ev.CALL_CUT})]

    @retrying("reading the run's checkpoints")
    async def last_snapshot(self, prefix: str, before: int) -> tuple[dict[str, Any] | None, int]:
        """The token snapshot of the latest published checkpoint named `prefix...` cut below `before`, and
        its cut position (None and 0 when there is none)."""
        async with self.store.engine.connect() as conn:
            row = (await conn.execute(text(LAST_SNAPSHOT), {"p": like_prefix(prefix), "b": before})).first()
        if row is None or not isinstance(row.ref, dict):
            return None, 0
        return dict(row.ref), int(row.position)

    @retrying("reading the run's checkpoints")
    async def latest_published(self, prefix: str) -> str | None:
        async with self.store.engine.connect() as conn:
            found = (await conn.execute(text(
                "SELECT checkpoint_id FROM rollbook.checkpoints WHERE phase = 'published' AND checkpoint_id LIKE :p "
                "ORDER BY log_position DESC LIMIT 1"), {"p": like_prefix(prefix)})).scalar()
            return None if found is None else str(found)

    @retrying("counting the run's checkpoints")
    async def checkpoint_count(self, prefix: str) -> int:
        async with self.store.engine.connect() as conn:
            return int((await conn.execute(text("SELECT count(*) FROM rollbook.checkpoints WHERE checkpoint_id LIKE :p"),
                                           {"p": like_prefix(prefix)})).scalar_one())
