"""Policy versions: set in the config, changed at runtime by an authenticated control-plane operation
logged as an event, carried by every model call and every token segment, and queried in SQL."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text

from adapters.postgres import PostgresEventStore
from adapters.token_store import PostgresTokenStore
from engine.identity import call_stream
from participants.model.backends.scripted import ScriptedBackend
from participants.model.server import POLICY_STREAM, POLICY_VERSION
from tests.participants.model.test_server import (
    CREDS,
    MATH,
    TOKEN,
    call_headers,
    control,
    model_server,
    planned,
    save_progress,
    start_attempt,
    url,
)


@pytest.fixture
async def tokens(dsn: str):
    s = PostgresTokenStore(dsn)
    yield s
    await s.close()


async def set_version(client, version: object, token: str | None = TOKEN):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = await client.post(POLICY_VERSION, json={"policy_version": version}, headers=headers)
    return resp.status, await resp.json()


async def test_the_configured_version_is_recorded_at_start_and_a_change_needs_the_token(store: PostgresEventStore, tokens) -> None:
    async with model_server(store, ScriptedBackend(policy_version="step-0"), tokens) as client:
        no_token = await set_version(client, "step-1", token=None)
        wrong = await set_version(client, "step-1", token="nope")
        bad = await set_version(client, "step 1!")
        data = await set_version(client, "step-1", token=CREDS.data)  # the data credential opens no control route
        # Refused requests write nothing, not even the configured version (validate, then write).
        assert await store.read_stream(POLICY_STREAM) == []
        ok = await set_version(client, "step-1")
    assert no_token[0] == wrong[0] == 401 and no_token[1]["error"]["code"] == "unauthorized"
    assert (data[0], data[1]["error"]["code"]) == (403, "forbidden")
    assert bad[0] == 400 and "policy_version" in bad[1]["error"]["detail"]
    assert ok == (200, {"policy_version": "step-1", "previous": "step-0"})
    changes = await store.read_stream(POLICY_STREAM)
    assert [(e.kind, e.data["policy_version"], e.data["previous"], e.data["source"]) for e in changes] == [
        ("policy_version_changed", "step-0", None, "config"), ("policy_version_changed", "step-1", "step-0", "weight_sync")]


async def test_a_call_cut_under_one_version_and_continued_under_the_next_records_both_and_the_views_say_so(
        store: PostgresEventStore, tokens) -> None:
    await start_attempt(store, "pv")
    backend = ScriptedBackend(token_latency_s=0.05, policy_version="step-0")
    _, full, _ = planned(backend, MATH)
    async with model_server(store, backend, tokens) as client:
        done0 = await client.post(url("pv"), json={**MATH, "seed": 9}, headers=call_headers("pv.0.t9"))
        assert done0.status == 200
        pending = asyncio.ensure_future(client.post(url("pv"), json=MATH, headers=call_headers("pv.0.t0")))
        while backend.tokens_generated < len(planned(backend, {**MATH, "seed": 9})[1]) + 3:
            await asyncio.sleep(0.01)
        await save_progress(client)
        await control(client, "prepare", "ck-pv")
        assert (await set_version(client, "step-1"))[0] == 200  # the weight sync happens while paused
        await control(client, "resume", "ck-pv")
        assert (await pending).status == 409
        resp = await client.post(url("pv"), json=MATH, headers=call_headers("pv.0.t0"))
        assert resp.status == 200 and (await resp.json())["rollbook"]["policy_version"] == "step-1"
    cut, done = [e for e in await store.read_stream(call_stream("pv.0.t0")) if e.kind in ("call_cut", "call_completed")]
    n = cut.data["tokens"]
    assert cut.data["segments"] == [{"policy_version": "step-0", "tokens": n}]
    assert done.data["segments"] == [{"policy_version": "step-0", "tokens": n}, {"policy_version": "step-1", "tokens": len(full) - n}]
    async with store.engine.connect() as conn:
        rows = {r.call_id: r for r in await conn.execute(text(
            "SELECT call_id, policy_version, version_seq, versions_behind_latest FROM rollbook.sample_staleness "
            "WHERE rollout_id = 'pv'"))}
        mix = (await conn.execute(text(
            "SELECT policy_versions, mixes_versions, max_versions_behind_latest FROM rollbook.rollout_policy_versions "
            "WHERE rollout_id = 'pv'"))).one()
        seqs = [tuple(r) for r in await conn.execute(text("SELECT seq, policy_version FROM rollbook.policy_versions"))]
    assert seqs == [(1, "step-0"), (2, "step-1")]
    assert (rows["pv.0.t9"].policy_version, rows["pv.0.t9"].versions_behind_latest) == ("step-0", 1)
    assert (rows["pv.0.t0"].policy_version, rows["pv.0.t0"].versions_behind_latest) == ("step-1", 0)
    assert sorted(mix.policy_versions) == ["step-0", "step-1"] and mix.mixes_versions and mix.max_versions_behind_latest == 1
