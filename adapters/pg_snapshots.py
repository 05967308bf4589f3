"""The session snapshots' table on PostgreSQL (engine.snapshots.SnapshotStore): rollbook.stream_snapshots.

Rows are a speed-up and never the truth (engine/snapshots.py says how a reader checks one): no
append reads them, nothing in the log names them, and deleting any of them loses nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adapters.pg_pool import retrying
from adapters.pg_reads import LogReads
from engine.events import load_stored_json, stored_text
from engine.snapshots import SessionSnapshot


class SnapshotRows(LogReads):
    @retrying("reading snapshots")
    async def session_snapshots(self, bounds: Mapping[str, int]) -> list[tuple[str, int, dict[str, Any], str]]:
        if not bounds:
            return []
        streams = sorted(bounds)
        async with self._driver_connection(autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT s.stream, s.position, s.data::text, s.digest FROM unnest(%s::text[], %s::bigint[]) AS k(stream, bound) "
                "CROSS JOIN LATERAL (SELECT * FROM rollbook.stream_snapshots t WHERE t.stream = k.stream "
                "AND t.position <= k.bound ORDER BY t.position DESC LIMIT 1) s",
                (streams, [bounds[s] for s in streams]))
            return [(r[0], int(r[1]), load_stored_json(r[2]), r[3]) for r in await cur.fetchall()]

    @retrying("writing snapshots")  # an insert that keeps a row already there: safe to repeat
    async def put_session_snapshots(self, snapshots: Sequence[SessionSnapshot]) -> None:
        if not snapshots:
            return
        # Stored as the log stores payloads (engine.events.stored_text: JSONB holds no U+0000).
        rows = [s.row() for s in snapshots]
        async with self._driver_connection(autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO rollbook.stream_snapshots (stream, position, data, digest) "
                "SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[]::jsonb[], %s::text[]) ON CONFLICT DO NOTHING",
                ([r["stream"] for r in rows], [r["position"] for r in rows], [stored_text(r["data"]) for r in rows],
                 [r["digest"] for r in rows]))
