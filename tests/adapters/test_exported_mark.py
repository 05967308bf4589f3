"""`rollout_exported`: `rollbook export` marks each finished attempt it wrote out, exactly once, however
many exporters race; an attempt that has not finished cannot be marked."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from engine import catalog as ev
from engine.errors import RolloutNotFinished
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.exports import mark_exported
from engine.identity import rollout_stream


async def start(store: PostgresEventStore, rollout_id: str, attempt: int = 0, finish: bool = True) -> None:
    stream = rollout_stream(rollout_id)
    events = [NewEvent(stream, ev.ATTEMPT_STARTED, {"parent_attempt": None}, rollout_id, attempt)]
    if finish:
        events.append(NewEvent(stream, ev.ATTEMPT_FINISHED, {"reward": 1.0}, rollout_id, attempt))
    await store.append(AppendRequest(tuple(events)))


def marks(dsn: str) -> dict[tuple[str, int], int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT rollout_id, attempt, count(*) FROM rollbook.events WHERE kind = 'rollout_exported' "
                            "GROUP BY rollout_id, attempt").fetchall()
    return {(r, a): n for r, a, n in rows}


async def test_exporting_twice_marks_each_finished_attempt_once_and_never_a_live_one(
        dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from apps import cli

    store = PostgresEventStore.connect(dsn, writer="mark-test")
    try:
        await start(store, "exp-0000")
        await start(store, "exp-0001")
        await start(store, "exp-0002", finish=False)  # still running: not exported, not marked
        for out in ("a.jsonl", "b.jsonl"):
            code = await asyncio.to_thread(cli.main, ["export", "--run", "exp", "--out", str(tmp_path / out), "--dsn", dsn])
            assert code == 0
        first, second = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:])
        assert (first["rollouts"], first["newly_marked_exported"], second["newly_marked_exported"]) == (2, 2, 0)
        assert marks(dsn) == {("exp-0000", 0): 1, ("exp-0001", 0): 1}
        with pytest.raises(RolloutNotFinished) as refused:
            await mark_exported(store, "exp-0002", 0, "exp", "jsonl")
        assert refused.value.code == "rollout_not_finished"
        assert marks(dsn) == {("exp-0000", 0): 1, ("exp-0001", 0): 1}
    finally:
        await store.close()


class ReadTogether:
    """A store whose first read returns only once every racer has read: each exporter decides on the
    same stream version, the worst order for the mark."""

    def __init__(self, store: PostgresEventStore, barrier: asyncio.Barrier) -> None:
        self.store, self.barrier, self.waited = store, barrier, False

    async def read_stream(self, stream: str, after_version: int = 0) -> list[RecordedEvent]:
        events = await self.store.read_stream(stream, after_version)
        if not self.waited:
            self.waited = True
            await self.barrier.wait()
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.mark.parametrize("exporters", [2, 5])
async def test_exporters_racing_on_one_rollout_append_one_mark(dsn: str, exporters: int) -> None:
    # Separate stores are separate pools: the appends race in the database, not in one process's queue.
    stores = [PostgresEventStore.connect(dsn, writer=f"exporter-{i}") for i in range(exporters)]
    try:
        await start(stores[0], "race-0000")
        barrier = asyncio.Barrier(exporters)
        landed = await asyncio.gather(*(mark_exported(ReadTogether(s, barrier), "race-0000", 0, "race", "jsonl")  # type: ignore[arg-type]
                                        for s in stores))
        assert sum(landed) == 1
        assert marks(dsn) == {("race-0000", 0): 1}
    finally:
        for s in stores:
            await s.close()
