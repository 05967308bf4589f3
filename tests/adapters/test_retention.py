"""Retention drops old append keys and the token blobs nothing names, never what a kept checkpoint's
restore reads."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from adapters.retention import retain
from adapters.token_store import PostgresTokenStore
from engine.checkpoint import committed_event, make_cut
from engine.events import AppendRequest
from engine.identity import call_stream
from engine.install import install_request
from engine.tokens import TokenArray
from participants.model.backends.scripted import ScriptedBackend
from tests.participants.model.test_server import (
    MATH,
    HeldAfter,
    call_headers,
    control,
    kinds,
    model_server,
    planned,
    save_progress,
    start_attempt,
    url,
)


def age_everything(dsn: str, hours: int = 2) -> None:
    """What a run that went on for hours leaves: every blob and key written that long ago."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE rollbook.token_blobs SET created_at = now() - make_interval(hours => %s)", (hours,))
        conn.execute("UPDATE rollbook.append_keys SET recorded_at = now() - make_interval(hours => %s)", (hours,))


def count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute(f"SELECT count(*) FROM rollbook.{table}").fetchone()[0])  # type: ignore[index]


async def test_retention_drops_unnamed_old_blobs_and_old_keys_and_a_kept_checkpoint_still_restores(dsn: str) -> None:
    store = PostgresEventStore.connect(dsn, writer="model-ret")
    tokens = PostgresTokenStore(store)
    try:
        await start_attempt(store, "ret")
        backend = HeldAfter(2)
        _, full, full_lps = planned(backend, MATH)
        async with model_server(store, backend, tokens) as client:
            pending = asyncio.ensure_future(client.post(url("ret"), json=MATH, headers=call_headers("ret.0.t0")))
            await asyncio.wait_for(backend.holding.wait(), 30)
            await save_progress(client)
            assert (await control(client, "prepare", "ck-ret"))["ready"]
            await control(client, "resume", "ck-ret")  # appends the cut the prepare handed over, with no coordinator
            await pending
        cut_event = (await store.read_stream(call_stream("ret.0.t0")))[-1]
        assert cut_event.kind == "call_cut"
        prefix = [cut_event.data["receipt"]["blob_id"], cut_event.data["prompt_receipt"]["blob_id"]]
        cut = await make_cut(store, "ck-ret", [("ret", 0)], [])
        await store.append(AppendRequest((committed_event(cut),)))
        # The kept checkpoint's token snapshot lists the generated prefix; the prompt's blob is named only
        # by the call_cut event, and the restore reads both.
        snapshot = await tokens.snapshot("ck-ret", prefix[:1])
        listed_only = await tokens.put([9, 8, 7], [-1.0, -2.0, -3.0])  # named by the snapshot of another checkpoint
        await tokens.snapshot("ck-other", [listed_only.blob_id])
        orphan = await tokens.put([4, 4, 4], [-0.5, -0.5, -0.5])  # what a refused outcome leaves: named by nothing
        age_everything(dsn)
        fresh = await tokens.put([1, 2, 3])  # unnamed, but written within the retention: a writer may name it yet
        blobs, keys = count(dsn, "token_blobs"), count(dsn, "append_keys")

        with pytest.raises(ValueError):
            await retain(store, older_than_s=60)  # shorter than a writer may retry
        dropped = await retain(store, older_than_s=3600)

        assert (dropped.token_blobs, dropped.append_keys) == (1, keys) and dropped.token_bytes > 0
        assert count(dsn, "token_blobs") == blobs - 1 and count(dsn, "append_keys") == 0
        with pytest.raises(Exception, match="missing"):
            await tokens.get(orphan.blob_id)
        assert (await tokens.get(listed_only.blob_id)).ids == (9, 8, 7) and (await tokens.get(fresh.blob_id)).ids == (1, 2, 3)

        # The kept checkpoint restores after retention: its snapshot validates, and the cut call
        # continues from its stored prefix to exactly the reply an uninterrupted generation gives.
        await tokens.validate(snapshot, "ck-ret", deep=True)
        await store.append(install_request(cut, {"ret": 0}))  # fences attempt 0, starts attempt 1
        async with model_server(store, ScriptedBackend(), tokens, instance="model-ret-1") as client:
            restored = await control(client, "restore", "ck-ret")
            await control(client, "resume", "ck-ret")
            reply = await client.post(url("ret", 1), json={**MATH, "logprobs": True},
                                      headers=call_headers("ret.1.t0", replaces="ret.0.t0"))
            body: dict[str, Any] = await reply.json()
        assert restored["detail"]["cut_calls"] == 1, restored
        assert reply.status == 200, body
        assert [int(e["token"][9:]) for e in body["choices"][0]["logprobs"]["content"]] == full
        assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == full_lps
        assert await kinds(store, "ret.1.t0") == ["call_accepted", "call_completed"]
        done = (await store.read_stream(call_stream("ret.1.t0")))[-1]
        assert done.data["prefix_tokens"] == len((await tokens.get(prefix[0])).ids) > 0
        assert await tokens.get(done.data["receipt"]["blob_id"]) == TokenArray(tuple(full), tuple(full_lps))
    finally:
        await store.close()


async def test_a_blob_written_again_while_retention_decides_is_kept(dsn: str) -> None:
    # The same tokens generated anew write the same content-addressed blob: written again, it is young.
    store = PostgresEventStore.connect(dsn, writer="ret-race")
    tokens = PostgresTokenStore(store)
    try:
        old = await tokens.put([6, 6, 6])
        age_everything(dsn)
        await tokens.put([6, 6, 6])
        assert (await retain(store, older_than_s=3600)).token_blobs == 0
        assert (await tokens.get(old.blob_id)).ids == (6, 6, 6)
    finally:
        await store.close()


async def test_rollbook_db_retain_runs_while_a_store_appends_and_says_what_it_freed(
        dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from apps import cli
    from engine.events import NewEvent

    store = PostgresEventStore.connect(dsn, writer="ret-cli")
    tokens = PostgresTokenStore(store)
    try:
        await tokens.put(list(range(100)), [-0.5] * 100)  # named by nothing
        await store.append(AppendRequest((NewEvent("kept", "noted", {"n": 0}),)))
        age_everything(dsn, hours=48)
        staged = await tokens.stage([3, 1, 4], [-0.1, -0.2, -0.3])  # rides in the next append, while retention runs
        code, _ = await asyncio.gather(
            asyncio.to_thread(cli.main, ["db", "retain", "--dsn", dsn]),
            asyncio.gather(*(store.append(AppendRequest((NewEvent("during", "noted", {"i": i, "blob": staged.blob_id}),)))
                             for i in range(20))))
        assert code == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (out["token_blobs"], out["append_keys"], out["older_than_s"]) == (1, 1, 86400.0) and out["token_bytes"] >= 400
        assert (await tokens.get(staged.blob_id)).ids == (3, 1, 4) and count(dsn, "append_keys") == 20
        assert await asyncio.to_thread(cli.main, ["db", "retain", "--dsn", dsn, "--older-than-s", "5"]) == 2
    finally:
        await store.close()


async def test_retention_drops_the_sandbox_blobs_no_kept_event_names_and_a_kept_session_still_continues(dsn: str) -> None:
    """Two sandbox rollouts on the real jail: `keep`'s attempt is live, `gone`'s was fenced (a later
    attempt superseded it), so its events go, and with them the only names of its files' blobs. A
    blob put whose event never came (`orphan`) goes too; everything `keep` needs stays, and a fresh
    server continues `keep` from it."""
    from engine import catalog as ev
    from engine.events import NewEvent
    from engine.file_blobs import Blob
    from engine.identity import rollout_stream
    from tests.resources_harness import open_session, serving, start, tool

    store = PostgresEventStore.connect(dsn, writer="test")
    try:
        for rid in ("keep", "gone"):
            await start(store, rid)
        async with serving(dsn, "resources-a") as (http, _):
            for rid in ("keep", "gone"):
                await open_session(http, rid, "sandbox", 1)
                status, _ = await tool(http, rid, "run", {"command": f"mkdir d && cd d && echo {rid}-content > f"})
                assert status == 200
        await store.append(AppendRequest((NewEvent(rollout_stream("gone"), ev.ATTEMPT_FENCED, {"reason": "recovery"},
                                                   "gone", 0),)))
        await store.put_blobs([Blob(b"orphan: a put whose event never came")])
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE rollbook.events SET recorded_at = now() - interval '2 days'")
            conn.execute("UPDATE rollbook.file_blobs SET written_at = now() - interval '2 days'")
            before = {bytes(r[0]) for r in conn.execute("SELECT content FROM rollbook.file_blobs")}
        assert {b"keep-content\n", b"gone-content\n", b"orphan: a put whose event never came"} <= before

        done = await retain(store, older_than_s=3600)

        with psycopg.connect(dsn, autocommit=True) as conn:
            after = {bytes(r[0]) for r in conn.execute("SELECT content FROM rollbook.file_blobs")}
        assert b"keep-content\n" in after
        assert b"gone-content\n" not in after and b"orphan: a put whose event never came" not in after
        assert done.file_blobs == len(before) - len(after) >= 3  # the orphan, gone's file and its manifest
        async with serving(dsn, "resources-b") as (http, _):
            status, reply = await tool(http, "keep", "run", {"command": "pwd; cat f"})
        assert status == 200 and reply["output"]["output"] == "/home/sandbox/d\nkeep-content\n"
    finally:
        await store.close()
