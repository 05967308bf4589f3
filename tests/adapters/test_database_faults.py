"""Database faults: lost connections are replaced, a retried append lands once, an outage is a 503."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

import aiohttp
import psycopg
import pytest
from aiohttp.test_utils import TestServer
from sqlalchemy.ext.asyncio import create_async_engine

from adapters.database import sqlalchemy_url
from adapters.postgres import PostgresEventStore
from apps.processes import free_port
from engine.errors import DatabaseUnavailable
from engine.events import AppendRequest, NewEvent
from participants.base.guard import Credentials
from participants.base.wire import CONTROL
from participants.resources.app import build_resources_app
from tests.waiting import eventually

CREDS = Credentials(control="db-control-token", data="db-data-token")
TOKEN = CREDS.control
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DATA = {"Authorization": f"Bearer {CREDS.data}"}


def dead_dsn() -> str:
    """A DSN nothing answers on: every connection attempt is refused."""
    return f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"


async def test_an_append_whose_commit_answer_was_lost_is_retried_and_lands_once(store: PostgresEventStore) -> None:
    real = store._commit_group
    tries = 0

    async def answer_lost(requests):  # type: ignore[no-untyped-def]
        nonlocal tries
        tries += 1
        outcome = await real(requests)  # committed for real...
        if tries == 1:  # ...but the connection dropped before the answer arrived
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return outcome

    store._commit_group = answer_lost  # type: ignore[method-assign]
    written = await store.append(AppendRequest((NewEvent("once", "noted", {"n": 1}), NewEvent("once", "noted", {"n": 2}))))
    assert tries == 2
    assert [e.stream_version for e in written] == [1, 2]
    assert [e.data["n"] for e in await store.read_stream("once")] == [1, 2]  # one copy, not two
    async with store.engine.connect() as conn:
        from sqlalchemy import text

        assert (await conn.execute(text("SELECT count(*) FROM rollbook.append_keys"))).scalar_one() == 1


async def test_without_its_key_the_same_retry_would_have_written_twice(store: PostgresEventStore) -> None:
    # The negative control of the test above: the key, not luck, keeps the second copy out.
    request = AppendRequest((NewEvent("twice", "noted", {"n": 1}),))
    await store._commit_group([request])
    await store._commit_group([request])
    assert len(await store.read_stream("twice")) == 2
    keyed = AppendRequest((NewEvent("keyed", "noted", {"n": 1}),), key="k-1")
    first = await store._commit_group([keyed])
    again = await store._commit_group([keyed])
    assert [(e.position, e.hash) for e in first[0]] == [(e.position, e.hash) for e in again[0]]  # type: ignore[union-attr]
    assert len(await store.read_stream("keyed")) == 1


async def test_connections_the_server_dropped_are_replaced_before_use(dsn: str, store: PostgresEventStore) -> None:
    await store.append(AppendRequest((NewEvent("before", "noted", {}),)))
    assert await store.read_stream("before")
    with psycopg.connect(dsn, autocommit=True) as admin:  # what a restart does to every pooled connection
        killed = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchone()[0]
    assert killed >= 1
    await store.append(AppendRequest((NewEvent("after", "noted", {}),)))
    assert [e.kind for e in await store.read_stream("after")] == ["noted"]
    assert await store.head() == 2


async def test_a_database_that_does_not_answer_is_database_unavailable_after_the_patience() -> None:
    store = PostgresEventStore.connect(dead_dsn(), writer="dead", patience_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as err:
            await store.append(AppendRequest((NewEvent("s", "noted", {}),)))
        # its own patience, not the default 20 s (bounded loosely: a loaded machine is slow, not wrong)
        assert err.value.code == "database_unavailable" and time.monotonic() - started < 10
        with pytest.raises(DatabaseUnavailable):
            await store.read_stream("s")
    finally:
        await store.close()


async def test_a_server_answers_503_database_unavailable_while_the_database_is_down() -> None:
    store = PostgresEventStore.connect(dead_dsn(), writer="dead", patience_s=0.3)
    server = TestServer(build_resources_app(store, CREDS), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            task = {"env": "math", "task_id": "t", "prompt": "p", "params": {}}
            async with http.post(server.make_url("/rollouts/r1/attempts/0/session"), json={"env": "math", "task": task}, headers=DATA) as resp:
                body = await resp.json()
        assert resp.status == 503 and body["error"]["code"] == "database_unavailable", body
    finally:
        await server.close()
        await store.close()


async def _phase_is(status: Awaitable[dict], phase: str) -> bool:
    return (await status)["phase"] == phase


async def test_the_lease_watcher_retries_an_abort_it_could_not_record(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="participants.base.control_plane")
    store = PostgresEventStore.connect(dsn, writer="lease", patience_s=0.2)
    server = TestServer(build_resources_app(store, CREDS), host="127.0.0.1")
    await server.start_server()
    healthy = store.engine
    try:
        async with aiohttp.ClientSession() as http:
            async def control(op: str, deadline: float) -> dict:
                async with http.post(server.make_url(f"{CONTROL}/{op}"), headers=AUTH,
                                     json={"checkpoint_id": "ck-lease", "deadline": deadline}) as resp:
                    return dict(await resp.json())

            async def status() -> dict:
                async with http.get(server.make_url(f"{CONTROL}/status"), headers=AUTH) as resp:
                    return dict(await resp.json())

            assert (await control("prepare", time.time() + 1.0))["ready"]
            store.engine = create_async_engine(sqlalchemy_url(dead_dsn()))  # the database goes away

            def failed_aborts() -> int:
                return sum("could not record the lease abort" in r.getMessage() for r in caplog.records)
            # past deadline + grace the watcher tries to record the abort, and fails, more than once
            await eventually("two failed attempts to record the abort", lambda: failed_aborts() >= 2)
            assert (await status())["phase"] == "prepared"  # not recorded, so not done
            await store.engine.dispose()
            store.engine = healthy  # the database is back
            await eventually("the participant to reopen", lambda: _phase_is(status(), "idle"))
        aborts = [e for e in await store.read_all() if e.kind == "participant_abort"]
        assert len(aborts) == 1 and aborts[0].data["reason"] == "lease expired"
    finally:
        store.engine = healthy
        await server.close()
        await store.close()


async def test_a_resume_whose_record_cannot_be_written_yet_reopens_and_is_recorded_when_the_database_is_back(
        dsn: str) -> None:
    """The bad input: the database goes away between prepare and resume. Resume waits for no write
    (its `participant_resume` is appended after the reply): the participant reopens at once, and the
    record lands, once, when the database is back."""
    store = PostgresEventStore.connect(dsn, writer="resume", patience_s=0.2)
    server = TestServer(build_resources_app(store, CREDS), host="127.0.0.1")
    await server.start_server()
    healthy = store.engine

    async def resumes() -> int:
        return sum(e.kind == "participant_resume" for e in await store.read_all())

    try:
        async with aiohttp.ClientSession() as http:
            async def control(op: str) -> tuple[int, dict]:
                async with http.post(server.make_url(f"{CONTROL}/{op}"), headers=AUTH,
                                     json={"checkpoint_id": "ck-db", "deadline": time.time() + 30}) as resp:
                    return resp.status, dict(await resp.json())

            assert (await control("prepare"))[1]["ready"]
            store.engine = create_async_engine(sqlalchemy_url(dead_dsn()))  # the database goes away mid-checkpoint
            status, body = await control("resume")
            assert status == 200 and body["phase"] == "idle", body
            await asyncio.sleep(0.5)  # past the store's patience: the record's first tries were refused
            dead, store.engine = store.engine, healthy
            await dead.dispose()
            await eventually("the resume recorded", resumes)
            await asyncio.sleep(0.3)
            assert await resumes() == 1
    finally:
        store.engine = healthy
        await server.close()
        await store.close()


# Every read a server makes of the store, with arguments of the right shape. A read that reaches the
# database outside `with_retry` turns a database restart into a traceback and a 500 (CI saw
# `retired_through`, which every attempt check calls, do exactly that).
READS = {
    "head": (), "read_stream": ("s",), "read_all": (), "read_rollout": ("r", 0), "read_rollouts": (["r"],),
    "stream_hashes": ([("s", 1)],), "attempt_rows": (["r"],), "running_attempts": (0, "r"),
    "latest_boundaries": ([("r", 0)], 1, ["agent_boundary"]), "rollout_heads_at": (["r"], 1),
    "checkpoints_in_phase": (["prepared"],), "session_revision": ("r", 0), "retired_through": ("r",),
    "fence_position": (), "attempt_status": ("r", 0), "attempt_reading": ("r", 0), "open_sessions": (), "restart_only_at": ({("r", 0): 1},),
    "online_cut_reads": ("r", ["agent_boundary"]),
    "session_snapshots": ({"s": 1},), "get_blobs": (["ab" * 32],),
}
NOT_READS = {"append", "carry", "close", "subscribe", "rebuild_projections", "connect",
             "prune_append_keys",  # maintenance: each of its batches is retried
             "put_session_snapshots", "put_blobs"}  # a write, retried like a read (an insert that keeps a row already there)


def test_the_list_of_reads_covers_every_public_method_of_the_store() -> None:
    public = {name for name in dir(PostgresEventStore) if not name.startswith("_")
              and callable(getattr(PostgresEventStore, name))}
    assert public - NOT_READS == set(READS), "a new read of the store: add it to READS"


@pytest.mark.parametrize("name", sorted(READS))
async def test_every_read_of_the_store_waits_out_a_lost_database_then_says_database_unavailable(name: str) -> None:
    store = PostgresEventStore.connect(dead_dsn(), writer="dead", patience_s=0.3)
    try:
        with pytest.raises(DatabaseUnavailable):
            await getattr(store, name)(*READS[name])
    finally:
        await store.close()


async def test_a_call_whose_outcome_cannot_be_recorded_is_503_and_its_generation_ends_without_an_error(
        dsn: str) -> None:
    """The bad input: the database goes away while a reply is being generated and stays away past the
    store's patience, so neither the reply nor the failure can be recorded. The caller is told
    database_unavailable; the generation's task ends without an exception (an escaped one is a traceback
    in the server's log); the log holds the call as accepted with no outcome, as a crash would leave it."""
    from adapters.token_store import PostgresTokenStore
    from participants.base.app import PARTICIPANT
    from tests.participants.model.test_server import (
        MATH,
        HeldAfter,
        call_headers,
        kinds,
        model_server,
        start_attempt,
        url,
    )

    store = PostgresEventStore.connect(dsn, writer="model-db", patience_s=0.2)
    tokens = PostgresTokenStore(dsn)
    healthy = store.engine
    try:
        await start_attempt(store, "rdb")
        backend = HeldAfter(2)  # in flight until released
        async with model_server(store, backend, tokens) as client:
            pending = asyncio.ensure_future(client.post(url("rdb"), json=MATH, headers=call_headers("rdb.0.t0")))
            await asyncio.wait_for(backend.holding.wait(), 30)
            generation = client.server.app[PARTICIPANT].calls["rdb.0.t0"].task
            store.engine = create_async_engine(sqlalchemy_url(dead_dsn()))  # the database goes away
            backend.release.set()
            reply = await pending
            assert (reply.status, (await reply.json())["error"]["code"]) == (503, "database_unavailable")
            await asyncio.wait({generation}, timeout=30)
            assert generation.done() and generation.exception() is None, generation
            await store.engine.dispose()
            store.engine = healthy  # the database is back
        assert await kinds(store, "rdb.0.t0") == ["call_accepted"]
    finally:
        store.engine = healthy
        await store.close()
        await tokens.close()
