"""Less per call: an append is one transaction of two statements when planned from memory, four when it reads what it plans from, whatever it holds (and one more, before them, for rows it carries), and it holds the log's lock for none of its round trips."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from adapters.postgres import GENERIC_PLANS, GENERICALLY, PostgresEventStore
from engine import catalog as ev
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream, session_stream


async def test_an_append_plans_before_the_lock_and_holds_it_for_no_round_trip(
        store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # Attempt 1: a plan takes no attempt but the first as live without a read (adapters.pg_plan_inputs).
    for kind, data, n in ((ev.ATTEMPT_STARTED, {"parent_attempt": None}, 0), (ev.ATTEMPT_FENCED, {"reason": "x"}, 0),
                          (ev.ATTEMPT_STARTED, {"parent_attempt": 0}, 1)):
        await store.append(AppendRequest((NewEvent(rollout_stream("pc-1"), kind, data, "pc-1", n),)))
    wire: list[str] = []  # what went to the server and when the process waited for an answer, in order
    execute, fetchall, fetchone = psycopg.AsyncConnection.execute, psycopg.AsyncCursor.fetchall, psycopg.AsyncCursor.fetchone
    pipeline_exit = psycopg.AsyncPipeline.__aexit__

    async def sent(self: psycopg.AsyncConnection[Any], query: Any, *args: Any, **kw: Any) -> Any:
        wire.append(str(query))
        return await execute(self, query, *args, **kw)

    async def waited_all(self: psycopg.AsyncCursor[Any]) -> Any:
        wire.append("<answer>")
        return await fetchall(self)

    async def waited_one(self: psycopg.AsyncCursor[Any]) -> Any:
        wire.append("<answer>")
        return await fetchone(self)

    async def synced(self: psycopg.AsyncPipeline, *args: Any) -> Any:
        wire.append("<sync>")
        return await pipeline_exit(self, *args)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", sent)
    monkeypatch.setattr(psycopg.AsyncCursor, "fetchall", waited_all)
    monkeypatch.setattr(psycopg.AsyncCursor, "fetchone", waited_one)
    monkeypatch.setattr(psycopg.AsyncPipeline, "__aexit__", synced)
    (opened,) = await store.append(AppendRequest((NewEvent(session_stream("pc-1", 1), ev.SESSION_OPENED,
                                                           {"env": "math", "task": {}}, "pc-1", 1),)))
    read_first, wire[:] = list(wire), []
    # The next event of the same stream is planned from what the process remembers: no read, and the
    # lock sets the planning mode, in no statement of its own.
    await store.append(AppendRequest((NewEvent(session_stream("pc-1", 1), ev.SESSION_VERIFIED, {"reward": 1.0},
                                               "pc-1", 1),)))
    remembered, wire[:] = list(wire), read_first
    monkeypatch.undo()
    lock, write, sync, outcome = remembered
    assert "FOR UPDATE" in lock and GENERICALLY in lock and "INSERT INTO rollbook.events" in write
    assert (sync, outcome) == ("<sync>", "<answer>")
    # The transaction's planning mode goes first, with nothing waited for; then stream heads,
    # idempotency keys, retire marks and attempts: one read, before the lock, answered before the plan is made.
    mode, read, answer, lock, write, sync, outcome = wire
    assert mode == GENERIC_PLANS
    assert "FROM rollbook.stream_heads" in read and "FROM rollbook.attempt_state" in read and "FOR UPDATE" not in read
    assert answer == "<answer>" and "FOR UPDATE" in lock
    # From the lock to the commit the process waits for nothing: one statement writes the events, the
    # heads, the key and the projections, and the Sync that commits goes with it.
    assert "INSERT INTO rollbook.events" in write and "INSERT INTO rollbook.session_state" in write
    assert "INSERT INTO rollbook.append_keys" in write and (sync, outcome) == ("<sync>", "<answer>")
    # And what it read was right: the stream was new, and a key recorded that way answers a retry.
    assert opened.stream_version == 1
    closed = NewEvent(session_stream("pc-1", 1), ev.SESSION_CLOSED, {}, "pc-1", 1)
    first = await store.append(AppendRequest((closed,), key="pc-key"))
    again = await store.append(AppendRequest((closed,), key="pc-key"))
    assert [e.position for e in again] == [e.position for e in first] and await store.head() == first[0].position


async def xmin(store: PostgresEventStore, sql: str, *args: Any) -> int:
    """The id of the transaction that wrote the row `sql` selects."""
    async with store.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        row = await (await raw.execute(sql, args)).fetchone()
        await raw.rollback()
    assert row is not None, sql
    return int(row[0])


async def event_xmin(store: PostgresEventStore, position: int) -> int:
    return await xmin(store, "SELECT xmin::text::bigint FROM rollbook.events WHERE position = %s", position)


async def blob_xmin(store: PostgresEventStore, blob_id: str) -> int:
    return await xmin(store, "SELECT xmin::text::bigint FROM rollbook.token_blobs WHERE blob_id = %s", blob_id)


async def test_a_model_calls_token_blobs_are_written_by_the_transaction_that_appends_its_outcome(dsn: str) -> None:
    from adapters.token_store import PostgresTokenStore
    from participants.model.backends.scripted import ScriptedBackend
    from tests.participants.model.test_server import MATH, call_headers, model_server, start_attempt, url

    store = PostgresEventStore.connect(dsn, writer="model-xmin")
    try:
        await start_attempt(store, "bx")
        async with model_server(store, ScriptedBackend(), PostgresTokenStore(store)) as client:
            reply = await client.post(url("bx"), json=MATH, headers=call_headers("bx.0.t0"))
            assert reply.status == 200, await reply.text()
        accepted, completed = (await store.read_rollout("bx", 0))[-2:]
        assert (accepted.kind, completed.kind) == (ev.CALL_ACCEPTED, ev.CALL_COMPLETED)
        outcome = await event_xmin(store, completed.position)
        for receipt in (completed.data["receipt"], completed.data["prompt_receipt"]):
            blob = await blob_xmin(store, receipt["blob_id"])
            assert blob == outcome  # one transaction: the outcome is never durable without its tokens
        assert outcome != await event_xmin(store, accepted.position)  # accepted is its own append, before the generation
    finally:
        await store.close()


async def test_carried_rows_of_a_transaction_that_failed_go_with_the_next_append(dsn: str) -> None:
    from adapters.token_store import PostgresTokenStore

    store = PostgresEventStore.connect(dsn, writer="carry")
    tokens = PostgresTokenStore(store)
    try:
        receipt = await tokens.stage([5, 6, 7], [-0.5, -0.25, -0.125])
        real, failed = store._commit_group, []

        async def fails_once(requests):  # type: ignore[no-untyped-def]
            if not failed:
                failed.append(True)
                raise RuntimeError("a statement the server refused")
            return await real(requests)

        store._commit_group = fails_once  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await store.append(AppendRequest((NewEvent("carry-s", "noted", {"n": 1}),)))
        (landed,) = await store.append(AppendRequest((NewEvent("carry-s", "noted", {"n": 2}),)))
        assert (await tokens.get(receipt.blob_id)).ids == (5, 6, 7)
        assert await blob_xmin(store, receipt.blob_id) == await event_xmin(store, landed.position)
    finally:
        await store.close()


async def test_an_append_that_fails_after_writing_its_events_commits_none_of_them(store: PostgresEventStore,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # No BEGIN/COMMIT: the pipeline's closing Sync commits. A retire's guarded update goes after the
    # statement that wrote its events; if it fails, that Sync must not commit them.
    await store.append(AppendRequest((NewEvent(rollout_stream("gf"), ev.ATTEMPT_STARTED, {"parent_attempt": None},
                                               "gf", 0),)))
    head = await store.head()

    async def broken(*args: Any) -> None:
        raise RuntimeError("the guarded update failed after the events were written")

    monkeypatch.setattr("adapters.postgres.apply_changes", broken)
    retire = NewEvent(rollout_stream("gf"), ev.ROLLOUT_RETIRED, {"through": 0}, "gf", 0)
    with pytest.raises(RuntimeError):
        await store.append(AppendRequest((retire,)))
    monkeypatch.undo()
    assert [e.kind for e in await store.read_stream(rollout_stream("gf"))] == [ev.ATTEMPT_STARTED]
    assert await store.head() == head
    (after,) = await store.append(AppendRequest((retire,)))
    assert after.position == head + 1 and after.stream_version == 2


async def test_a_pooled_connection_is_not_pinged_at_checkout(store: PostgresEventStore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A ping is a round trip and a transaction per checkout; a lost connection is found where it fails
    # (tests/adapters/test_database_faults.py) instead.
    pings: list[object] = []
    dialect = type(store.engine.sync_engine.dialect)
    real = dialect.do_ping
    monkeypatch.setattr(dialect, "do_ping", lambda self, conn: pings.append(conn) or real(self, conn))
    await store.append(AppendRequest((NewEvent("np", "noted", {}),)))
    for _ in range(3):
        assert [e.kind for e in await store.read_stream("np")] == ["noted"]
    assert await store.head() == 1 and pings == []


async def test_an_append_that_waited_for_the_lock_plans_from_what_the_append_before_it_wrote(
        dsn: str, store: PostgresEventStore) -> None:
    # The lock and the read are one statement, whose snapshot predates the wait for the lock: when an
    # append committed meanwhile, the read is repeated after it, or the plan would reuse its version.
    import asyncio

    from engine.events import chain_hash, encode_payload
    from tests.waiting import eventually

    (first,) = await store.append(AppendRequest((NewEvent("race", "noted", {"n": 1}),)))
    second = NewEvent("race", "noted", {"n": 2})
    h2 = chain_hash(first.hash, "race", 2, second, encode_payload(second.data))
    with psycopg.connect(dsn) as other:  # another writer, mid-append: it holds the log head
        other.execute("SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE")
        third = NewEvent("race", "noted", {"n": 3})
        pending = asyncio.ensure_future(store.append(AppendRequest((third,))))

        def waiting() -> bool:
            with psycopg.connect(dsn, autocommit=True) as probe:
                return bool(probe.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                          "AND datname = current_database()").fetchone()[0])  # type: ignore[index]

        async def blocked() -> bool:
            await asyncio.sleep(0.02)
            return waiting()

        await eventually("the append waits for the log head", blocked)
        other.execute("INSERT INTO rollbook.events (position, stream, stream_version, kind, data, schema_version, writer, hash) "
                      "VALUES (2, 'race', 2, 'noted', %s::jsonb, 1, 'other', %s)", (encode_payload(second.data), h2))
        other.execute("UPDATE rollbook.stream_heads SET version = 2, hash = %s WHERE stream = 'race'", (h2,))
        other.execute("UPDATE rollbook.log_head SET position = 2 WHERE id = 1")
        other.commit()
    (landed,) = await pending
    assert (landed.position, landed.stream_version) == (3, 3)
    assert landed.hash == chain_hash(h2, "race", 3, third, encode_payload(third.data))
    assert [e.data["n"] for e in await store.read_stream("race")] == [1, 2, 3]


async def test_a_due_hint_rides_in_the_appends_own_statement(dsn: str, store: PostgresEventStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A subscriber's wake-up costs no statement of its own while appends come: the first append after a
    # quiet interval carries it, delivered at its commit.
    import asyncio

    import adapters.postgres as pg

    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {pg.CHANNEL}")
        await store.append(AppendRequest((NewEvent("hint", "noted", {"n": 1}),)))
        assert store._notify is None  # no sender of its own was started
        assert [n.channel for n in listener.notifies(timeout=30, stop_after=1)] == [pg.CHANNEL]
        # One that comes before the interval has passed carries none: a hint is owed, and the sender waits
        # to send it until an interval after that commit, unless an append carries it first.
        monkeypatch.setattr(pg, "NOTIFY_INTERVAL_S", 3600.0)
        await store.append(AppendRequest((NewEvent("hint", "noted", {"n": 2}),)))
        assert store._notify is not None and store._notify_owed is not None
        store._last_notify = asyncio.get_running_loop().time() - 7200  # as if the interval had passed
        await store.append(AppendRequest((NewEvent("hint", "noted", {"n": 3}),)))
        assert store._notify_owed is None  # carried by that append: the sender has nothing left to send
        assert [n.channel for n in listener.notifies(timeout=30, stop_after=1)] == [pg.CHANNEL]


async def test_an_episode_reads_no_new_calls_stream_its_attempts_once_and_asks_no_close_a_passed_verify_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import Counter

    from adapters.memory_store import MemoryEventStore
    from apps.stack import MemoryBacking, start_stack
    from participants.environments.tasks import make_tasks
    from participants.model.backends.scripted import ScriptedBackend
    from participants.resources.server import ResourcesParticipant

    reads: Counter[tuple[str, str]] = Counter()
    read_stream, attempt_rows, close = MemoryEventStore.read_stream, MemoryEventStore.attempt_rows, ResourcesParticipant.close_session

    async def counted_stream(self: MemoryEventStore, stream: str, *a: Any) -> Any:
        reads[(self.writer.split("-")[0], stream.split(":")[0])] += 1
        return await read_stream(self, stream, *a)

    async def counted_rows(self: MemoryEventStore, ids: Any) -> Any:
        reads[(self.writer.split("-")[0], "attempt_rows")] += 1
        return await attempt_rows(self, ids)

    async def counted_close(self: ResourcesParticipant, *a: Any) -> Any:
        reads[("resources", "close")] += 1
        return await close(self, *a)

    monkeypatch.setattr(MemoryEventStore, "read_stream", counted_stream)
    monkeypatch.setattr(MemoryEventStore, "attempt_rows", counted_rows)
    monkeypatch.setattr(ResourcesParticipant, "close_session", counted_close)
    stack = await start_stack(MemoryBacking(), "pc", ScriptedBackend())
    try:
        result = await stack.episode(make_tasks(1, 3, ["math"])[0], "pc-ep")
    finally:
        await stack.close()
    assert result["reward"] and result["reward"] > 0 and result["steps"][-1] == "close"
    # A new call is claimed by an append that expects its stream empty, not after reading it.
    assert reads[("model", "call")] == 0
    # Whether the rollout is done or live: one read for both.
    assert reads[("environment", "attempt_rows")] == 1
    # The passed verify closed the session in its own append: the close step asks nothing.
    assert reads[("resources", "close")] == 0


async def test_carried_rows_are_written_before_the_log_lock_is_asked_for(dsn: str) -> None:
    """Every append of every process waits on the log head's lock, so a model call's token blobs are
    not parsed and written under it: while an append waits for the lock (held here by a transaction
    of the test's), its transaction already holds the row lock of the blob it carries."""
    import asyncio

    from adapters.database import libpq_dsn
    from adapters.token_store import PostgresTokenStore

    store = PostgresEventStore.connect(dsn, writer="carry-first")
    tokens = PostgresTokenStore(store)
    try:
        await store.append(AppendRequest((NewEvent("carry-first", "noted", {"n": 0}),)))  # the pool is warm
        receipt = await tokens.stage([9, 8, 7], [-0.5, -0.25, -0.125])
        # The observer polls in a transaction per query: within one transaction pg_stat_activity's
        # `query` comes from a snapshot of the first read (its wait columns are live), so a poll from
        # the holder's transaction kept whatever statement the append's backend ran at that read.
        async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn)) as holder, \
                await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as observer:
            await holder.execute("SELECT position FROM rollbook.log_head WHERE id = 1 FOR UPDATE")
            append = asyncio.create_task(store.append(AppendRequest((NewEvent("carry-first", "noted", {"n": 1}),))))
            waiting: list[Any] = []
            for _ in range(1000):  # the append's backend, waiting for the held lock (this database only)
                waiting = await (await observer.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE '%log_head%'"
                )).fetchall()
                if waiting:
                    break
                await asyncio.sleep(0.01)
            assert len(waiting) == 1, "the append never waited for the log head's lock"
            blobs_locked = await (await observer.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = %s AND relation = 'rollbook.token_blobs'::regclass",
                (waiting[0][0],))).fetchone()
            assert blobs_locked is not None and blobs_locked[0] >= 1, "the blob was not written before the lock"
            assert not append.done()
            await holder.rollback()  # the lock goes; the append commits, blob and event in one transaction
        (landed,) = await append
        assert (await tokens.get(receipt.blob_id)).ids == (9, 8, 7)
        assert await blob_xmin(store, receipt.blob_id) == await event_xmin(store, landed.position)
    finally:
        await store.close()
