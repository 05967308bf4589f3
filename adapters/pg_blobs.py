"""The file blobs' table on PostgreSQL (engine.file_blobs.BlobStore): rollbook.file_blobs."""

from __future__ import annotations

from collections.abc import Sequence

from adapters.pg_pool import retrying
from adapters.pg_snapshots import SnapshotRows
from engine.file_blobs import Blob


class BlobRows(SnapshotRows):
    @retrying("writing file blobs")  # an upsert of content-addressed rows: safe to repeat
    async def put_blobs(self, blobs: Sequence[Blob]) -> None:
        unique = {b.digest: b for b in blobs}
        if not unique:
            return
        digests = sorted(unique)  # one lock order for every writer
        async with self._driver_connection(autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO rollbook.file_blobs (digest, content, names) "
                "SELECT k.d, k.c, ARRAY(SELECT jsonb_array_elements_text(k.n)) "
                "FROM unnest(%s::text[], %s::bytea[], %s::text[]::jsonb[]) AS k(d, c, n) "
                "ON CONFLICT (digest) DO UPDATE SET written_at = now()",
                (digests, [unique[d].content for d in digests],
                 [_names(unique[d].names) for d in digests]))

    @retrying("reading file blobs")
    async def get_blobs(self, digests: Sequence[str]) -> dict[str, bytes]:
        if not digests:
            return {}
        async with self._driver_connection(autocommit=True) as conn:
            cur = await conn.execute("SELECT digest, content FROM rollbook.file_blobs WHERE digest = ANY(%s::text[])",
                                     (sorted(set(digests)),))
            return {r[0]: bytes(r[1]) for r in await cur.fetchall()}


def _names(names: Sequence[str]) -> str:
    # A text[] of arrays of different lengths cannot be unnested row by row; a JSON array per row can.
    return "[" + ",".join(f'"{n}"' for n in names) + "]"
