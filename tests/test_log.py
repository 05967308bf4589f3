"""The log contract on PostgreSQL, on every server version the fixtures reach, and what only a database
promises: positions gap-free in commit order across connections, a fence serialized with appends
from another connection, and a committed append surviving its store.

The store-agnostic contract lives in tests/log_contract.py (the memory store passes it too)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psycopg
import pytest

from adapters.database import libpq_dsn
from adapters.postgres import INSERT_CHUNK_EVENTS, PostgresEventStore
from engine.attempts import ATTEMPT_FENCED
from engine.errors import StaleAttempt
from engine.events import AppendRequest
from engine.identity import rollout_stream
from engine.log import append_one
from tests.log_contract import GROUP, LogContract, OpenStore, ev, start_attempt


class TestPostgresLog(LogContract):
    @pytest.fixture
    async def open_store(self, any_dsn: str) -> Iterator[OpenStore]:
        opened: list[PostgresEventStore] = []

        def open_(writer: str) -> PostgresEventStore:
            opened.append(PostgresEventStore.connect(any_dsn, writer=writer))
            return opened[-1]

        yield open_
        for s in opened:
            await s.close()


def test_the_contracts_request_spans_more_than_one_chunk_of_rows() -> None:
    assert GROUP > INSERT_CHUNK_EVENTS  # so its refusal test has rows on the wire before the refusal


async def test_positions_are_gap_free_in_commit_order_under_concurrent_writers(any_dsn: str) -> None:
    # Several stores = several connections committing concurrently; each store also groups.
    writers = [PostgresEventStore.connect(any_dsn, writer=f"w{i}") for i in range(6)]
    reader = PostgresEventStore.connect(any_dsn, writer="reader")
    per_task, tasks_per_writer = 40, 4
    done = asyncio.Event()
    seen: list[int] = []

    async def write(store: PostgresEventStore, tag: str) -> None:
        for i in range(per_task):
            batch = tuple(ev(f"{tag}", n=i, j=j) for j in range(1 + i % 3))
            await store.append(AppendRequest(batch))

    async def tail() -> None:
        last = 0
        while True:
            finished = done.is_set()
            for e in await reader.read_all(after=last, limit=500):
                # A position below one already read would mean a reader skipped it.
                assert e.position == last + 1, f"read position {e.position} right after {last}"
                last = e.position
                seen.append(e.position)
            if finished:
                return
            await asyncio.sleep(0)

    tailer = asyncio.create_task(tail())
    await asyncio.gather(*(write(w, f"s{i}-{t}") for i, w in enumerate(writers) for t in range(tasks_per_writer)))
    done.set()
    await tailer
    expected = sum(1 + i % 3 for i in range(per_task)) * len(writers) * tasks_per_writer
    assert seen == list(range(1, expected + 1))
    assert await reader.head() == expected
    for s in [*writers, reader]:
        await s.close()


async def test_fence_and_inflight_appends_serialize(dsn: str) -> None:
    appender = PostgresEventStore.connect(dsn, writer="agent")
    fencer = PostgresEventStore.connect(dsn, writer="coordinator")
    for round_ in range(5):
        rid = f"race{round_}"
        await start_attempt(appender, rid, 0)

        async def spam(k: int, rid: str = rid) -> None:
            for i in range(30):
                try:
                    await append_one(appender, ev(f"agent:{rid}:0:{k}", "turn", rid, 0, i=i))
                except StaleAttempt:
                    return

        spammers = [asyncio.create_task(spam(k)) for k in range(8)]
        await asyncio.sleep(0.02 * round_)
        fence = await append_one(fencer, ev(rollout_stream(rid), ATTEMPT_FENCED, rid, 0, reason="restore"))
        await asyncio.gather(*spammers)
        late = [e for e in await appender.read_rollout(rid, 0) if e.position > fence.position]
        assert late == [], f"attempt 0 of {rid} wrote after its fence at {fence.position}"
    await appender.close()
    await fencer.close()


async def test_a_committed_append_outlives_its_store(dsn: str) -> None:
    first = PostgresEventStore.connect(dsn, writer="first")
    written = await append_one(first, ev("kept", n=1))
    await first.close()
    second = PostgresEventStore.connect(dsn, writer="second")
    try:
        (read,) = await second.read_stream("kept")
        assert (read.position, read.hash, read.writer) == (written.position, written.hash, "first")
    finally:
        await second.close()


async def test_the_head_is_the_last_committed_position_and_waits_for_no_append_in_flight(dsn: str) -> None:
    """A checkpoint every second reads P from here: it must not queue behind the run's appends, and an
    append still in flight lands above the head it returns (so a cut at that head is whole)."""
    store = PostgresEventStore.connect(dsn, writer="head")
    try:
        committed = await append_one(store, ev("before", n=1))
        # An append in flight elsewhere: it holds the log head's lock and has moved the head, uncommitted.
        async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn)) as other:
            await other.execute("SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE")
            await other.execute("UPDATE rollbook.log_head SET position = position + 1 WHERE id = 1")
            assert await asyncio.wait_for(store.head(), timeout=5) == committed.position
            await other.rollback()
        assert await store.head() == committed.position
    finally:
        await store.close()
