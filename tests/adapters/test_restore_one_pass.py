"""Restore reads each scoped rollout's events once, set-based, and every participant reads them once too.

Counted at the store: every read of events goes through `_select_events` (read_stream, read_rollout,
read_all), `read_rollouts` or `stream_hashes`, one query each. The integrity checks stay: the
coordinator re-derives every hash (tests/engine/test_checkpoint.py), and a participant's own pass
still refuses a log whose recorded heads or versions no longer match the cut."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from adapters.database import libpq_dsn
from adapters.postgres import PostgresEventStore
from engine.checkpoint import make_cut, read_cut, validate_cut
from engine.errors import InvalidCheckpointState
from engine.identity import session_stream
from tests.engine.test_checkpoint import episode
from tests.resources_harness import checkpoint, control, open_session, serving, start, tool

READS = ("_select_events", "read_rollouts", "stream_hashes")


class Reads:
    """Counts the queries that read events, around the store's own methods."""

    def __init__(self, store: PostgresEventStore) -> None:
        self.calls: list[str] = []
        for name in READS:
            inner = getattr(store, name)

            def counted(inner: Any = inner, name: str = name) -> Any:
                async def call(*args: Any, **kw: Any) -> Any:
                    self.calls.append(name)
                    return await inner(*args, **kw)
                return call

            setattr(store, name, counted())


@pytest.mark.parametrize("episodes", [3, 15])
async def test_validate_cut_reads_the_log_in_one_query_whatever_the_number_of_episodes(
    store: PostgresEventStore, episodes: int
) -> None:
    rollouts = [f"q{i}" for i in range(episodes)]
    for r in rollouts:
        await episode(store, r)
    cut = await make_cut(store, "ck1", [(r, 0) for r in rollouts], [])
    reads = Reads(store)
    items = await validate_cut(store, cut)
    assert len(items) == episodes
    assert reads.calls == ["read_rollouts"]  # one query for every episode, no per-episode re-read


async def test_read_cut_hands_each_attempt_its_effective_history_from_the_one_read(store: PostgresEventStore) -> None:
    positions = await episode(store, "q0")
    cut = await make_cut(store, "ck1", [("q0", 0)], [])
    read = await read_cut(store, cut, rehash=False)
    history = read.effective("q0", 0, to=positions["boundary"])
    assert history[-1].position == positions["boundary"] and history[0].position == positions["start"]
    assert all(e.position <= cut.position for e in read.events["q0"])


async def test_the_resources_server_restores_every_session_from_one_read(dsn: str, store: PostgresEventStore) -> None:
    rollouts = [f"rs{i}" for i in range(6)]
    async with serving(dsn, "resources-a") as (http, _):
        for rid in rollouts:
            await start(store, rid)
            await open_session(http, rid, "workplace", 11)
            await tool(http, rid, "update_deal", {"deal_id": "D-103", "seats": 3})
        await checkpoint(store, "ck1", {rid: 1 for rid in rollouts})
    async with serving(dsn, "resources-b") as (http, participant):
        reads = Reads(participant.store)
        status, reply = await control(http, "restore")
        assert status == 200 and reply["detail"]["staged"] == len(rollouts), reply
    # the checkpoint's own stream (load_cut), then one read of every scoped rollout; no validate_cut re-read
    assert reads.calls == ["_select_events", "read_rollouts"]


async def test_a_participant_refuses_a_log_whose_recorded_hash_was_changed(dsn: str, store: PostgresEventStore) -> None:
    async with serving(dsn, "resources-a") as (http, _):
        for rid in ("rh1", "rh2"):
            await start(store, rid)
            await open_session(http, rid, "workplace", 11)
            await tool(http, rid, "update_deal", {"deal_id": "D-103", "seats": 3})
        await checkpoint(store, "ck1", {"rh1": 1, "rh2": 1})
    victim = (await store.read_stream(session_stream("rh2", 0)))[-1]
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute("UPDATE rollbook.events SET hash = sha256(hash) WHERE position = %s", (victim.position,))
    async with serving(dsn, "resources-b") as (http, participant):
        status, reply = await control(http, "restore")
        assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state")
        assert participant.staged == {}
    with pytest.raises(InvalidCheckpointState):  # and the coordinator's full check refuses it as well
        await validate_cut(store, await make_cut(store, "ck2", [("rh1", 0), ("rh2", 0)], []))
