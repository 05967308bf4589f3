"""A run's checkpoints chain their token snapshots: each lists only what its cut added (apps.collection)."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.collection import Collection
from apps.stack import CREDS, start_stack
from participants.environments.tasks import make_tasks
from participants.model.backends.scripted import ScriptedBackend
from tests.waiting import eventually


async def _replied_after(store: PostgresEventStore, position: int) -> bool:
    async with store.engine.connect() as conn:
        return bool((await conn.execute(text(
            "SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE 'pc-%' "
            "AND position > :p"), {"p": position})).scalar())


async def test_each_publish_of_a_run_snapshots_only_the_blobs_its_cut_added(dsn: str, store: PostgresEventStore) -> None:
    stack = await start_stack(dsn, "chain", ScriptedBackend(token_latency_s=0.002))
    try:
        servers = {k: cfg.ServerConfig(port=stack.servers[k].port) for k in cfg.KINDS}
        coll = Collection(cfg.Config(control_token=CREDS.control, data_token=CREDS.data, servers=servers), store, "pc", make_tasks(6, 3, ["math", "workplace"]))
        dispatch = asyncio.create_task(coll.dispatch(stack.session))
        published: list[dict] = []
        for k in (1, 2, 3):
            # each checkpoint's part of the log holds a reply, however slowly the run goes
            after = published[-1]["position"] if published else 0
            await eventually(f"a reply after checkpoint {k - 1}", lambda a=after: _replied_after(store, a), timeout=60)
            result = await coll.checkpoint(stack.session, f"pc-ck{k}")
            assert result["published"], result
            published.append(result)
        await dispatch
        async with store.engine.connect() as conn:
            rows = {r.checkpoint_id: r for r in await conn.execute(text(
                "SELECT checkpoint_id, snapshot_id, parent_snapshot_id, blob_ids FROM rollbook.token_snapshots "
                "WHERE checkpoint_id LIKE 'pc-ck%'"))}
            blobs_between = []  # the blobs events referenced in each checkpoint's part of the log
            bounds = [0] + [r["position"] for r in published]
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                blobs_between.append({b for (b,) in await conn.execute(text(
                    "SELECT b FROM rollbook.events, LATERAL (VALUES (data->'receipt'->>'blob_id'), "
                    "(data->'prompt_receipt'->>'blob_id')) v(b) WHERE kind IN ('call_completed', 'call_cut') "
                    "AND b IS NOT NULL AND position > :lo AND position <= :hi AND rollout_id LIKE 'pc-%'"),
                    {"lo": lo, "hi": hi})})
        assert rows["pc-ck1"].parent_snapshot_id is None
        assert rows["pc-ck2"].parent_snapshot_id == rows["pc-ck1"].snapshot_id
        assert rows["pc-ck3"].parent_snapshot_id == rows["pc-ck2"].snapshot_id
        # each snapshot lists what its cut added, not the run so far; the chain covers every blob
        assert [set(rows[f"pc-ck{k}"].blob_ids) for k in (1, 2, 3)] == blobs_between
        assert set().union(*blobs_between)  # the run did make model calls
    finally:
        await stack.close()
