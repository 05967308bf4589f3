"""The engine's cut store in memory, for the fast tests of engine.checkpoint: appends planned by the
engine's own rules (engine.log.plan_request), projections derived by its own function
(engine.projections.changes_for), reads answered as adapters.postgres answers them. `events` is the
log itself, so a test edits or deletes a recorded event as a faulty disk would."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from engine.events import AppendRequest, RecordedEvent
from engine.identity import Key
from engine.log import LogState, plan_request
from engine.projections import TABLES, changes_for


class MemoryCutStore:
    def __init__(self, writer: str = "test") -> None:
        self.writer = writer
        self.events: list[RecordedEvent] = []
        self.state = LogState(position=0)
        self.tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {t: {} for t in TABLES}

    async def append(self, request: AppendRequest) -> list[RecordedEvent]:
        planned = plan_request(request, self.state, self.writer, 1 << 20)
        for p in planned:
            self.events.append(p.event)
            for change in changes_for(p.event):
                self._apply(change.table, change.key, change.values, change.guard)
        return [p.event for p in planned]

    def _apply(self, table: str, key: dict[str, Any], values: dict[str, Any], guard: str | None) -> None:
        rows = self.tables[table]
        if guard == "live_through":
            for (r, a), row in rows.items():
                if r == key["rollout_id"] and a <= key["attempt"] and row.get("status") == "live":
                    row.update(values)
            return
        k = tuple(key[c] for c in TABLES[table])
        rows.setdefault(k, {**key, "started_position": None, "ended_position": None}).update(values)

    def tamper(self, position: int, **data: Any) -> None:
        """Edit a recorded event's data (its hash stays as recorded)."""
        i = next(i for i, e in enumerate(self.events) if e.position == position)
        self.events[i] = replace(self.events[i], data={**self.events[i].data, **data})

    def delete(self, position: int) -> None:
        self.events = [e for e in self.events if e.position != position]

    async def read_stream(self, stream: str, after_version: int = 0) -> list[RecordedEvent]:
        return [e for e in self.events if e.stream == stream and e.stream_version > after_version]

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        return [e for e in self.events if e.position > after][:limit]

    async def head(self) -> int:
        return self.state.position

    async def subscribe(self, after: int = 0) -> AsyncIterator[RecordedEvent]:
        for e in await self.read_all(after):
            yield e

    async def read_rollout(self, rollout_id: str, attempt: int | None = None, to: int | None = None) -> list[RecordedEvent]:
        return [e for e in self.events if e.rollout_id == rollout_id and (attempt is None or e.attempt == attempt)
                and (to is None or e.position <= to)]

    async def read_rollouts(self, rollout_ids: Sequence[str], to: int | None = None) -> list[RecordedEvent]:
        return [e for e in self.events if e.rollout_id in rollout_ids and (to is None or e.position <= to)]

    async def stream_hashes(self, versions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        wanted = set(versions)
        return {(e.stream, e.stream_version): e.hash for e in self.events if (e.stream, e.stream_version) in wanted}

    async def attempt_rows(self, rollout_ids: Sequence[str]) -> dict[Key, dict[str, Any]]:
        marks = self.tables["rollout_state"]
        return {k: {**row, "retired_through": marks.get((k[0],), {}).get("retired_through")}
                for k, row in self.tables["attempt_state"].items() if k[0] in rollout_ids}

    async def live_attempts(self) -> dict[Key, dict[str, Any]]:
        return {k: dict(row) for k, row in self.tables["attempt_state"].items() if row["status"] in ("live", "finished")}

    async def latest_boundaries(self, keys: Sequence[Key], position: int, kinds: Sequence[str]) -> dict[Key, int]:
        out: dict[Key, int] = {}
        for r, a in keys:
            found = [e.position for e in self.events
                     if e.rollout_id == r and e.attempt == a and e.position <= position and e.kind in kinds]
            if found:
                out[(r, a)] = max(found)
        return out

    async def rollout_heads_at(self, rollout_ids: Sequence[str], position: int) -> dict[str, list[tuple[str, int, bytes]]]:
        out: dict[str, list[tuple[str, int, bytes]]] = {r: [] for r in rollout_ids}
        for r in rollout_ids:
            heads: dict[str, RecordedEvent] = {}
            for e in self.events:
                if e.rollout_id == r and e.position <= position:
                    if e.stream not in heads or e.stream_version > heads[e.stream].stream_version:
                        heads[e.stream] = e
            out[r] = [(s, e.stream_version, e.hash) for s, e in sorted(heads.items())]
        return out

    async def checkpoints_in_phase(self, phases: Sequence[str]) -> list[str]:
        return sorted(k[0] for k, row in self.tables["checkpoint_state"].items() if row["phase"] in phases)
