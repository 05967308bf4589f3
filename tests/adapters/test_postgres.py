"""The log contract on PostgreSQL, on every server version the fixtures reach, and what only a database
promises: positions gap-free in commit order across connections, a fence serialized with appends
from another connection, and a committed append surviving its store.

The store-agnostic contract lives in tests/log_contract.py (the memory store passes it too)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import psycopg
import pytest

from adapters.database import libpq_dsn
from adapters.postgres import PostgresEventStore
from adapters.telemetry import Telemetry
from engine.attempts import ATTEMPT_FENCED
from engine.catalog import ATTEMPT_FINISHED, ATTEMPT_STARTED, ROLLOUT_RETIRED
from engine.errors import StaleAttempt
from engine.events import GENESIS_HASH, AppendRequest, NewEvent, chain_hash, encode_payload
from engine.identity import rollout_stream
from engine.log import append_one
from tests.log_contract import LogContract, OpenStore, ev, start_attempt


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


def interrupted(store: PostgresEventStore, meanwhile: Callable[[], Awaitable[object]]) -> list[bool]:
    """Have `meanwhile` commit between `store`'s next plan (from a read, or from what it remembers) and its
    lock, as another process would; the list records, per plan from now on, whether it was made after the lock."""
    real, reads = store._planned, []

    async def planned(conn, requests, locked, remembered):  # type: ignore[no-untyped-def]
        got = await real(conn, requests, locked, remembered)
        reads.append(locked)
        if len(reads) == 1:
            await meanwhile()
        return got

    store._planned = planned  # type: ignore[method-assign]
    return reads


@pytest.fixture
async def two_writers(dsn: str) -> AsyncIterator[tuple[PostgresEventStore, PostgresEventStore]]:
    """Two stores on one database, as two processes have: the one under test and another writer."""
    mine, other = (PostgresEventStore.connect(dsn, writer=w) for w in ("mine", "other"))
    yield mine, other
    await mine.close()
    await other.close()


async def test_an_append_planned_before_another_writer_fenced_its_attempt_is_refused(
        two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    # Input: an agent's turn for attempt 0, planned while the attempt was live; the coordinator's
    # fence commits before the agent's write takes the lock.
    agent, coordinator = two_writers
    await start_attempt(agent, "pf", 0)
    reads = interrupted(agent, lambda: append_one(coordinator, ev(rollout_stream("pf"), ATTEMPT_FENCED, "pf", 0,
                                                                  reason="restore")))
    with pytest.raises(StaleAttempt):
        await append_one(agent, ev("agent:pf:0", "turn", "pf", 0, i=1))
    assert reads == [False, True]  # the stale plan wrote nothing; the one after the lock refused
    fences = [e.position for e in await agent.read_rollout("pf", 0) if e.kind == ATTEMPT_FENCED]
    assert len(fences) == 1 and await agent.read_stream("agent:pf:0") == [] and await agent.head() == fences[0]


async def test_an_append_planned_before_another_writer_took_its_streams_next_version_lands_after_it(
        dsn: str, two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    mine, other = two_writers
    telemetry = Telemetry("test", "mine")
    mine.observers.append(telemetry)
    reads = interrupted(mine, lambda: append_one(other, ev("shared", n="other")))
    written = await append_one(mine, ev("shared", n="mine"))
    assert reads == [False, True]
    assert telemetry.registry.get_sample_value("rollbook_append_replans_total") == 1  # on the server's /metrics
    first, second = await mine.read_stream("shared")
    assert (first.writer, first.stream_version, second.writer, second.stream_version) == ("other", 1, "mine", 2)
    assert (written.position, written.stream_version, written.hash) == (second.position, 2, second.hash)
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn)) as conn:
        (version, digest), = await (await conn.execute(
            "SELECT version, hash FROM rollbook.stream_heads WHERE stream = 'shared'")).fetchall()
    assert (version, bytes(digest)) == (2, second.hash)
    assert chain_hash(first.hash, "shared", 2, NewEvent("shared", "noted", {"n": "mine"}),
                      encode_payload({"n": "mine"})) == second.hash


async def test_an_append_planned_before_other_streams_moved_the_head_is_written_at_the_head_it_finds(
        dsn: str, two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    # Nothing it read changed, so it is not planned again: its positions, its key and its projections'
    # position columns move by the events committed in between.
    mine, other = two_writers
    await start_attempt(mine, "pm", 0)

    async def five_elsewhere() -> None:
        await other.append(AppendRequest(tuple(ev("elsewhere", n=i) for i in range(5))))

    telemetry = Telemetry("test", "mine")
    mine.observers.append(telemetry)
    reads = interrupted(mine, five_elsewhere)
    fenced, = await mine.append(AppendRequest((ev(rollout_stream("pm"), ATTEMPT_FENCED, "pm", 0, reason="x"),),
                                              key="pm-fence"))
    assert reads == [False] and telemetry.registry.get_sample_value("rollbook_append_replans_total") == 0
    assert fenced.position == 7 and await mine.head() == 7
    assert [e.position for e in await mine.read_all()] == list(range(1, 8))
    again = await mine.append(AppendRequest((ev(rollout_stream("pm"), ATTEMPT_FENCED, "pm", 0, reason="x"),),
                                            key="pm-fence"))
    assert [e.position for e in again] == [7]  # the key was recorded at the moved position
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn)) as conn:
        row = await (await conn.execute("SELECT a.ended_position, h.fence_position FROM rollbook.attempt_state a, "
                                        "rollbook.log_head h WHERE a.rollout_id = 'pm'")).fetchone()
    assert row == (7, 7)


def counted_reads(store: PostgresEventStore) -> list[bool]:
    """Every read of what `store` plans from, from now on: whether it was taken after the lock."""
    real, reads = store._read_plan_inputs, []

    async def read(conn, requests, locked):  # type: ignore[no-untyped-def]
        reads.append(locked)
        return await real(conn, requests, locked)

    store._read_plan_inputs = read  # type: ignore[method-assign]
    return reads


async def test_a_writer_plans_from_what_it_remembers_and_reads_only_what_it_cannot_know(
        two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    """Its own stream's head after its own append, a rollout's attempts after a read: no read. A rollout
    whose attempt rows its own append changed is read again (here attempt 1, which no plan takes as
    live unread); a new stream is taken as new."""
    mine, _ = two_writers
    await start_attempt(mine, "mr", 0)
    await append_one(mine, ev(rollout_stream("mr"), ATTEMPT_FENCED, "mr", 0, reason="x"))
    reads = counted_reads(mine)
    await start_attempt(mine, "mr", 1)  # the rollout is read, then changed by this append
    for i in range(4):
        await append_one(mine, ev("agent:mr:1", "turn", "mr", 1, i=i))
    await append_one(mine, ev("fresh", n=1))  # never seen: taken as new, no read
    assert reads == [False, False]  # the start, and the first turn (its rollout's attempt rows had changed)
    turns = await mine.read_stream("agent:mr:1")
    assert [e.stream_version for e in turns] == [1, 2, 3, 4] and [e.position for e in turns] == [4, 5, 6, 7]
    previous = GENESIS_HASH
    for e in turns:  # each hash chains from the one before, as a read-planned append writes them
        assert e.hash == chain_hash(previous, e.stream, e.stream_version, e, encode_payload(e.data))
        previous = e.hash


async def test_a_rollout_first_met_at_its_first_attempt_is_taken_live_unread_and_a_wrong_guess_is_judged_under_the_lock(
        two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    """Every server but the one that starts an attempt first meets its rollout at attempt 0, live. Input:
    the other writer starts attempt 0 of four rollouts and leaves one live, fences one, finishes one and
    retires one; this writer, which never read any of them, appends an event of attempt 0 to each. The
    live one is written with no read at all; each of the others is planned again from a read under the
    lock and refused as a read-planned append refuses it, with nothing written."""
    mine, env = two_writers
    for r in ("gl", "gf", "gd", "gr"):
        await start_attempt(env, r, 0)
    await append_one(env, ev(rollout_stream("gf"), ATTEMPT_FENCED, "gf", 0, reason="restore"))
    await append_one(env, ev(rollout_stream("gr"), ROLLOUT_RETIRED, "gr", 0, through=0))
    reads = counted_reads(mine)
    written = await append_one(mine, ev("agent:gl:0", "turn", "gl", 0, n=1))
    assert reads == [] and (written.stream_version, written.position) == (1, await env.head())
    for r in ("gf", "gr"):
        with pytest.raises(StaleAttempt):
            await append_one(mine, ev(f"agent:{r}:0", "turn", r, 0, n=1))
        assert await mine.read_stream(f"agent:{r}:0") == []
    assert reads == [True, True]
    await append_one(env, ev(rollout_stream("gd"), ATTEMPT_FINISHED, "gd", 0, reward=1.0))
    done = await append_one(mine, ev("agent:gd:0", "turn", "gd", 0, n=1))  # a finished attempt still writes
    assert reads == [True, True, True] and done.attempt == 0


async def test_a_stream_another_writer_moved_makes_the_plan_from_memory_stale_and_is_read_from_then_on(
        two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    """Input: another writer appends to a stream this writer remembers the head of."""
    mine, other = two_writers
    await append_one(mine, ev("both", n=1))
    await append_one(other, ev("both", n=2))
    reads = counted_reads(mine)
    written = await append_one(mine, ev("both", n=3))  # from memory: stale at the lock, planned again under it
    assert reads == [True] and written.stream_version == 3
    await append_one(mine, ev("both", n=4))
    assert reads == [True, False]  # shared now: read before the lock, every time
    assert [(e.writer, e.stream_version) for e in await mine.read_stream("both")] == \
        [("mine", 1), ("other", 2), ("mine", 3), ("mine", 4)]


async def test_an_attempt_fenced_by_another_writer_refuses_the_append_planned_from_memory(
        two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    """Input: the coordinator fences an attempt this writer remembers live."""
    agent, coordinator = two_writers
    await start_attempt(agent, "mf", 0)
    await append_one(agent, ev("agent:mf:0", "turn", "mf", 0, i=0))  # the rollout read again, remembered live
    await append_one(coordinator, ev(rollout_stream("mf"), ATTEMPT_FENCED, "mf", 0, reason="restore"))
    with pytest.raises(StaleAttempt):
        await append_one(agent, ev("agent:mf:0", "turn", "mf", 0, i=1))
    assert len(await agent.read_stream("agent:mf:0")) == 1


async def test_a_refusal_is_never_decided_from_memory(
        two_writers: tuple[PostgresEventStore, PostgresEventStore]) -> None:
    """Input: an event of attempt 1, which another writer started after this one last read the rollout
    (its memory knows attempt 0 only, so a plan from memory would refuse it)."""
    agent, env = two_writers
    await start_attempt(agent, "mn", 0)
    await append_one(agent, ev("agent:mn:0", "turn", "mn", 0, i=0))
    await append_one(env, ev(rollout_stream("mn"), ATTEMPT_FENCED, "mn", 0, reason="crash"))
    await start_attempt(env, "mn", 1)
    reads = counted_reads(agent)
    written = await append_one(agent, ev("agent:mn:1", "turn", "mn", 1, i=0))
    assert reads == [False] and written.attempt == 1


async def test_an_appends_statements_are_prepared_at_first_use_and_planned_generically_in_its_transaction_alone(
        dsn: str) -> None:
    """Planned on every call, an append's write cost PostgreSQL as much planning as running. Input: three
    appends to three streams, one at a time, on a pool of one connection. The write is prepared by the
    first and planned once, generically (PostgreSQL's own count of each prepared statement's plans); the
    planning mode is the append transaction's own: the connection's other statements keep PostgreSQL's."""
    from adapters.pg_pool import PoolLimits

    store = PostgresEventStore.connect(dsn, writer="t", pool=PoolLimits(size=1, overflow=0, timeout_s=2.0))
    try:
        for i in range(3):
            await store.append(AppendRequest((ev(f"plans-{i}", n=i),)))
        async with store._driver_connection(autocommit=True) as conn:
            writes = await (await conn.execute(
                "SELECT sum(generic_plans), sum(custom_plans) FROM pg_prepared_statements "
                "WHERE statement LIKE 'WITH was AS%'")).fetchone()
            mode = await (await conn.execute("SELECT current_setting('plan_cache_mode')")).fetchone()
        assert writes == (3, 0)
        assert mode == ("auto",)
    finally:
        await store.close()


async def test_the_reads_every_request_makes_are_prepared_at_their_first_use_and_planned_generically_after_a_few(
        dsn: str) -> None:
    """psycopg prepares a statement only after five runs on one connection, and a server spreads its
    reads over its pool, so nearly every read was planned. Input: on a pool of one connection, twelve
    rounds of the three reads a request makes (the fence position, an attempt with it, a rollout's events
    of some kinds). Each is prepared by its first run, and PostgreSQL stops planning it after its first
    few (its own count of each prepared statement's plans)."""
    from adapters.pg_pool import PoolLimits

    store = PostgresEventStore.connect(dsn, writer="t", pool=PoolLimits(size=1, overflow=0, timeout_s=2.0))
    try:
        await start_attempt(store, "rp", 0)
        for _ in range(12):
            await store.fence_position()
            await store.attempt_reading("rp", 0)
            await store.read_rollout("rp", 0, kinds=[ATTEMPT_STARTED])
        async with store._driver_connection(autocommit=True) as conn:
            rows = await (await conn.execute(
                "SELECT statement, generic_plans + custom_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement NOT LIKE 'WITH was AS%' AND statement NOT LIKE 'SELECT position, set_config%' "
                "AND statement NOT LIKE 'SELECT set_config%' AND statement NOT LIKE 'SELECT ''l''%'")).fetchall()
        # Runs of each as a prepared statement, and of them those planned for their parameters.
        by = {("attempt" if "attempt_state" in sql else "events" if "rollbook.events" in sql else "fence"): (runs, custom)
              for sql, runs, custom in rows}
        assert set(by) == {"fence", "attempt", "events"} and len(rows) == 3
        assert all(runs == 12 and custom <= 5 for runs, custom in by.values()), by
    finally:
        await store.close()


async def test_a_connection_the_driver_path_used_goes_back_to_the_pool_as_it_came_even_after_a_failed_read(
        dsn: str) -> None:
    """The append path and the driver's reads take a pool's psycopg connection without SQLAlchemy's
    Connection and put it in autocommit. Input: an append, then a read on that path that fails
    (`SELEC 1`, a syntax error), on a pool of one connection. The pool hands the same connection out
    again, transactional as SQLAlchemy gave it, and a transaction on it rolls back."""
    from adapters.pg_pool import PoolLimits

    store = PostgresEventStore.connect(dsn, writer="t", pool=PoolLimits(size=1, overflow=0, timeout_s=2.0))
    try:
        await store.append(AppendRequest((ev("pool-1", n=1),)))
        with pytest.raises(psycopg.errors.SyntaxError):
            async with store._driver_connection(autocommit=True) as conn:
                first = conn.info.backend_pid
                await conn.execute("SELEC 1")
        async with store.engine.connect() as pooled:
            raw = (await pooled.get_raw_connection()).driver_connection
            assert raw.info.backend_pid == first and raw.autocommit is False
            await pooled.exec_driver_sql("CREATE TABLE rollbook.pool_probe (x int)")
            await pooled.rollback()
        async with store._driver_connection(autocommit=True) as conn:
            assert conn.info.backend_pid == first
            probe = await (await conn.execute("SELECT to_regclass('rollbook.pool_probe')")).fetchone()
            assert probe == (None,)  # rolled back: the pool's connection was in a transaction
        assert [e.data for e in await store.read_stream("pool-1")] == [{"n": 1}]
    finally:
        await store.close()
