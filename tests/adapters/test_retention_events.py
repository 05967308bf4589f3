"""Retention of events (adapters/retention.py), checked through SQL against an oracle written here.

A hypothesis scenario draws rollouts (1 to 3 attempts, each later one continuing its predecessor or
dispatched afresh, sometimes restored from the newest published checkpoint), how each ends (live,
finished, finished and exported), open or retired token captures, checkpoints cut between rounds
(published or aborted) and how many are kept. Whatever it draws, after retention:
(a) every kept checkpoint's cut validates (rehashed, and as participants check it) and each scoped
    attempt's effective history reads whole;
(b) no attempt the oracle calls needed (live, unexported, in a needed lineage, of a kept checkpoint's
    rollouts) lost an event, and each one it calls droppable lost exactly its non-rollout streams;
(c) nothing with an open capture lost anything;
and the projections rebuilt from what is left equal the live tables.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from adapters.postgres import PostgresEventStore
from adapters.retention import retain
from adapters.token_store import PostgresTokenStore
from engine import catalog as ev
from engine.checkpoint import committed_event, load_cut, make_online_cut, read_cut, validate_cut
from engine.events import AppendRequest, NewEvent
from engine.exports import mark_exported
from engine.identity import call_stream, capture_stream, checkpoint_stream, episode_stream, rollout_stream
from engine.lineage import effective_history
from engine.phases import checkpoint_started
from engine.projections import TABLES
from tests.conftest import _server

Key = tuple[str, int]


@dataclass
class Plan:
    rollouts: list[dict[str, Any]]  # attempts: [{"continue": bool, "restored": bool}], end, capture
    checkpoints: dict[int, str]  # round -> published | aborted
    keep: int


@dataclass
class World:
    """What the scenario wrote, as the oracle needs it."""

    lineage: dict[Key, Key | None] = field(default_factory=dict)  # attempt -> the attempt it continues
    restored_from: dict[Key, str] = field(default_factory=dict)
    status: dict[Key, str] = field(default_factory=dict)  # live | fenced | finished | exported
    captures: dict[Key, bool] = field(default_factory=dict)  # attempt -> open
    published: list[str] = field(default_factory=list)  # in publish order
    cut_rollouts: dict[str, set[str]] = field(default_factory=dict)  # checkpoint -> rollouts its restore reads


attempt_plan = st.fixed_dictionaries({"continue": st.booleans(), "restored": st.booleans()})
rollout_plan = st.fixed_dictionaries({
    "attempts": st.lists(attempt_plan, min_size=1, max_size=3),
    "end": st.sampled_from(["live", "finished", "exported"]),
    "capture": st.sampled_from([None, "open", "retired"]),
})
plans = st.builds(Plan, st.lists(rollout_plan, min_size=1, max_size=5),
                  st.dictionaries(st.integers(0, 3), st.sampled_from(["published", "aborted"]), max_size=3),
                  st.integers(1, 2))


async def write_attempt(store: PostgresEventStore, tokens: PostgresTokenStore, world: World, rid: str, n: int,
                        how: dict[str, Any]) -> None:
    stream = rollout_stream(rid)
    events: list[NewEvent] = []
    data: dict[str, Any] = {"parent_attempt": n - 1 if n else None}
    if n:
        events.append(NewEvent(stream, ev.ATTEMPT_FENCED, {"reason": "recovery"}, rid, n - 1))
        world.status[(rid, n - 1)] = "fenced"
        if how["continue"]:
            boundary = max(e.position for e in await store.read_rollout(rid, n - 1) if e.kind == ev.EPISODE_STEP)
            data |= {"origin_attempt": n - 1, "origin_position": boundary, "disposition": "continue"}
        if how["restored"] and world.published:
            data["restored_from"] = world.restored_from[(rid, n)] = world.published[-1]
    world.lineage[(rid, n)] = (rid, n - 1) if "origin_attempt" in data else None
    world.status[(rid, n)] = "live"
    events.append(NewEvent(stream, ev.ATTEMPT_STARTED, data, rid, n))
    episode = episode_stream(rid, n)
    events += [NewEvent(episode, ev.EPISODE_STARTED, {"env": "math", "task_id": rid}, rid, n),
               NewEvent(episode, ev.EPISODE_STEP, {"step": "turn"}, rid, n)]
    receipt = (await tokens.put([n, 1, 2], [-0.5, -0.5, -0.5])).to_json()
    call = call_stream(f"{rid}.{n}.t0")
    events += [NewEvent(call, ev.CALL_ACCEPTED, {"call_id": f"{rid}.{n}.t0"}, rid, n),
               NewEvent(call, ev.CALL_COMPLETED, {"call_id": f"{rid}.{n}.t0", "receipt": receipt}, rid, n)]
    await store.append(AppendRequest(tuple(events)))


async def write_capture(store: PostgresEventStore, world: World, rid: str, n: int, retired: bool) -> None:
    stream = capture_stream(rid, n)
    events = [NewEvent(stream, ev.CAPTURE_CALL_BEGUN, {"model_call_id": "m", "call_id": f"{rid}.{n}.t0"}, rid, n)]
    if retired:
        events.append(NewEvent(stream, ev.CAPTURE_RETIRED, {"snapshot_id": "s", "version": 1}, rid, n))
    await store.append(AppendRequest(tuple(events)))
    world.captures[(rid, n)] = not retired


async def write_checkpoint(store: PostgresEventStore, tokens: PostgresTokenStore, world: World, ck: str, fate: str) -> None:
    await store.append(AppendRequest((checkpoint_started(ck, deadline=1e12, mode="online"),)))
    cut = await make_online_cut(store, ck)
    await store.append(AppendRequest((committed_event(cut),)))
    world.cut_rollouts[ck] = {s.rollout_id for s in cut.scope} | {r for r, _ in cut.fresh}  # completed: none read
    kind = ev.CHECKPOINT_PUBLISHED if fate == "published" else ev.CHECKPOINT_ABORTED
    await store.append(AppendRequest((NewEvent(checkpoint_stream(ck), kind, {"checkpoint_id": ck}),)))
    if fate == "published":
        world.published.append(ck)
        blobs = [e.data["receipt"]["blob_id"] for e in await store.read_rollouts(sorted(world.cut_rollouts[ck]))
                 if e.kind == ev.CALL_COMPLETED]
        await tokens.snapshot(ck, blobs)


async def end(store: PostgresEventStore, world: World, rid: str, r: dict[str, Any]) -> None:
    last = len(r["attempts"]) - 1
    if r["capture"] is not None:
        await write_capture(store, world, rid, last, r["capture"] == "retired")
    if r["end"] != "live":
        await store.append(AppendRequest((NewEvent(rollout_stream(rid), ev.ATTEMPT_FINISHED, {"reward": 1.0}, rid, last),)))
        world.status[(rid, last)] = "finished"
    if r["end"] == "exported":
        assert await mark_exported(store, rid, last, "t", "jsonl")
        world.status[(rid, last)] = "exported"


async def write(store: PostgresEventStore, tokens: PostgresTokenStore, plan: Plan) -> World:
    """Round by round: each rollout's next attempt, then the rollouts whose last attempt came in the
    round before end (a checkpoint after that names them no more), then the round's checkpoint."""
    world = World()
    ids = [f"r{i}" for i in range(len(plan.rollouts))]
    for round_ in range(4):
        for rid, r in zip(ids, plan.rollouts, strict=True):
            if round_ < len(r["attempts"]):
                await write_attempt(store, tokens, world, rid, round_, r["attempts"][round_])
            elif round_ == len(r["attempts"]):
                await end(store, world, rid, r)
        if round_ in plan.checkpoints:
            await write_checkpoint(store, tokens, world, f"ck{round_}", plan.checkpoints[round_])
    return world


def oracle(world: World, keep: int) -> tuple[set[Key], set[str]]:
    """The attempts to drop and the checkpoints kept: the module docstring of adapters/retention.py, in Python."""
    done = {k for k, s in world.status.items() if s in ("fenced", "exported")}
    needed = {k for k in world.status if k not in done} | {k for k, is_open in world.captures.items() if is_open}
    frontier = list(needed)
    while frontier:
        origin = world.lineage.get(frontier.pop())
        if origin is not None and origin not in needed:
            needed.add(origin)
            frontier.append(origin)
    kept = set(world.published[-keep:]) | {world.restored_from[k] for k in needed if k in world.restored_from}
    kept_rollouts = {r for ck in kept for r in world.cut_rollouts[ck]}
    return {k for k in done - needed if k[0] not in kept_rollouts}, kept


def sql(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()  # type: ignore[arg-type]


def events_by_attempt(dsn: str) -> dict[Key, set[tuple[int, str, bytes]]]:
    out: dict[Key, set[tuple[int, str, bytes]]] = {}
    for r, a, p, s, h in sql(dsn, "SELECT rollout_id, attempt, position, stream, hash FROM rollbook.events "
                                  "WHERE rollout_id IS NOT NULL"):
        out.setdefault((r, a), set()).add((p, s, bytes(h)))
    return out


def projections(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    return {t: sorted(sql(dsn, f"SELECT * FROM rollbook.{t}"), key=repr) for t in TABLES}


def age_everything(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table, column in (("events", "recorded_at"), ("token_blobs", "created_at"), ("append_keys", "recorded_at")):
            conn.execute(f"UPDATE rollbook.{table} SET {column} = now() - interval '2 days'")  # type: ignore[arg-type]


async def scenario(dsn: str, plan: Plan) -> None:
    store = PostgresEventStore.connect(dsn, writer="ret-prop")
    tokens = PostgresTokenStore(store)
    try:
        world = await write(store, tokens, plan)
        age_everything(dsn)
        # A session snapshot of every stream but the rollouts' own (the rows' contents are not read here).
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO rollbook.stream_snapshots (stream, position, data, digest) SELECT stream, "
                         "max(position), '{}', '' FROM rollbook.events WHERE stream NOT LIKE 'rollout:%' GROUP BY stream")
        before = events_by_attempt(dsn)
        drops, kept = oracle(world, plan.keep)
        done = await retain(store, older_than_s=3600, batch=10, keep_checkpoints=plan.keep)  # one attempt a transaction

        after = events_by_attempt(dsn)
        for key, rows in before.items():
            own = {row for row in rows if row[1] != rollout_stream(key[0])}
            if key in drops:  # (b) the droppable lost exactly its own streams; its rollout stream stays
                assert after.get(key, set()) == rows - own, (key, world)
            else:  # (b), (c) the needed lost nothing
                assert after.get(key) == rows, (key, world)
        assert (done.attempts, done.deferred_by) == (len(drops), None)
        assert done.events == sum(len(before[k]) - len(after.get(k, ())) for k in drops)

        # (a) every kept checkpoint restores: its cut validates, as the coordinator and a participant check it.
        for ck in kept:
            cut, _ = await load_cut(store, ck)
            await validate_cut(store, cut)
            history = await read_cut(store, cut, rehash=False, beyond_cut=True)
            for s in cut.scope:
                assert [e.position for e in await effective_history(store, s.rollout_id, s.attempt, s.boundary)] \
                    == [e.position for e in history.effective(s.rollout_id, s.attempt, s.boundary)]
        # Blobs: every one an event or a kept snapshot names is there; those only dropped events named are gone.
        missing = sql(dsn, "SELECT n.b FROM (SELECT jsonb_path_query(data, 'strict $.**.blob_id') #>> '{}' AS b "
                           "FROM rollbook.events UNION SELECT unnest(blob_ids) FROM rollbook.token_snapshots) n "
                           "LEFT JOIN rollbook.token_blobs t ON t.blob_id = n.b WHERE t.blob_id IS NULL")
        assert missing == []
        assert {c for (c,) in sql(dsn, "SELECT checkpoint_id FROM rollbook.token_snapshots")} == kept
        for table in ("stream_heads", "stream_snapshots"):  # a dropped stream's rows go with it, no other's
            assert sql(dsn, f"SELECT stream FROM rollbook.{table} h WHERE NOT EXISTS "
                            "(SELECT 1 FROM rollbook.events e WHERE e.stream = h.stream)") == []
        assert sql(dsn, "SELECT DISTINCT stream FROM rollbook.events WHERE stream NOT LIKE 'rollout:%%' EXCEPT "
                        "SELECT stream FROM rollbook.stream_snapshots") == []
        # The projections rebuilt from what is left equal the live tables.
        live = projections(dsn)
        await store.rebuild_projections()
        assert projections(dsn) == live
    finally:
        await store.close()


FRESH, CONTINUED, RESTORED = ({"continue": False, "restored": False}, {"continue": True, "restored": False},
                              {"continue": True, "restored": True})


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(plans)
# An exported attempt whose capture is still open keeps everything; a finished one beside it goes.
@example(Plan([{"attempts": [FRESH], "end": "exported", "capture": "open"},
               {"attempts": [FRESH], "end": "exported", "capture": "retired"}], {}, 1))
# r0's attempt 1 was restored from ck0, which is no longer the newest: ck0 is kept by descent, so r1
# (named by ck0's cut, finished and exported before ck1) keeps its events; ck2's snapshot goes.
@example(Plan([{"attempts": [FRESH, RESTORED], "end": "live", "capture": None},
               {"attempts": [FRESH], "end": "exported", "capture": None}],
              {0: "published", 1: "published", 2: "published"}, 1))
def test_retention_drops_only_what_nothing_kept_needs(plan: Plan) -> None:
    server = _server("primary")
    dsn = server.new_database()
    try:
        asyncio.run(scenario(dsn, plan))
    finally:
        server.drop_database(dsn)


@pytest.mark.parametrize("phase", ["started", "prepared"])
async def test_retention_drops_no_event_while_a_checkpoint_makes_its_cut(dsn: str, phase: str) -> None:
    # r0's attempt 0 was fenced and r0 dispatched afresh: attempt 0 is droppable, until a cut of the live
    # attempt 1 covers r0's streams. The cut is made (its digest holds attempt 0's streams) before
    # retention runs and committed after: retention must wait for it.
    store = PostgresEventStore.connect(dsn, writer="ret-defer")
    tokens = PostgresTokenStore(store)
    try:
        await write(store, tokens, Plan([{"attempts": [FRESH, FRESH], "end": "live", "capture": None}], {}, 1))
        age_everything(dsn)
        stream = checkpoint_stream("ck-open")
        await store.append(AppendRequest((checkpoint_started("ck-open", deadline=1e12, mode="online"),)))
        if phase == "prepared":
            await store.append(AppendRequest((NewEvent(stream, ev.CHECKPOINT_PREPARED, {"checkpoint_id": "ck-open"}),)))
        cut = await make_online_cut(store, "ck-open")
        before = events_by_attempt(dsn)
        done = await retain(store, older_than_s=3600)
        await store.append(AppendRequest((committed_event(cut),)))
        await store.append(AppendRequest((NewEvent(stream, ev.CHECKPOINT_PUBLISHED, {"checkpoint_id": "ck-open"}),)))
        await validate_cut(store, cut)
        assert (done.deferred_by, done.events, events_by_attempt(dsn)) == ("ck-open", 0, before)
        # Published, it is kept: r0 is in its scope, and nothing of r0 goes.
        done = await retain(store, older_than_s=3600)
        assert (done.deferred_by, done.attempts) == (None, 0)
        await validate_cut(store, cut)
    finally:
        await store.close()


async def test_an_attempt_with_an_event_younger_than_the_retention_keeps_them_all(dsn: str) -> None:
    store = PostgresEventStore.connect(dsn, writer="ret-young")
    tokens = PostgresTokenStore(store)
    try:
        plan = Plan([{"attempts": [{"continue": False, "restored": False}], "end": "exported", "capture": None}] * 2, {}, 1)
        await write(store, tokens, plan)
        age_everything(dsn)
        sql(dsn, "UPDATE rollbook.events SET recorded_at = now() WHERE stream = %s RETURNING 1", episode_stream("r1", 0))
        before = events_by_attempt(dsn)
        done = await retain(store, older_than_s=3600)
        assert done.attempts == 1 and events_by_attempt(dsn)[("r1", 0)] == before[("r1", 0)]
    finally:
        await store.close()


async def test_retention_racing_appends_and_a_checkpoint_loses_nothing(dsn: str) -> None:
    # 12 exported rollouts to drop, one attempt a transaction, while three writers of their own pools
    # append to live rollouts, export, and a checkpoint cuts the log; what each writer was told was
    # written is there afterwards, and the checkpoint that raced validates.
    stores = [PostgresEventStore.connect(dsn, writer=f"ret-race-{i}") for i in range(4)]
    tokens = PostgresTokenStore(stores[0])
    try:
        old = Plan([{"attempts": [FRESH], "end": "exported", "capture": None}] * 12, {}, 1)
        await write(stores[0], tokens, old)
        age_everything(dsn)
        live = [f"live{i}" for i in range(3)]
        for rid in live:
            await stores[0].append(AppendRequest((NewEvent(rollout_stream(rid), ev.ATTEMPT_STARTED, {}, rid, 0),)))

        async def writer(store: PostgresEventStore, rid: str) -> list[tuple[int, bytes]]:
            written = []
            for i in range(40):
                (e,) = await store.append(AppendRequest((NewEvent(episode_stream(rid, 0), ev.EPISODE_STEP, {"step": i}, rid, 0),)))
                written.append((e.position, e.hash))
            return written

        async def checkpoint() -> None:
            await asyncio.sleep(0.05)
            await write_checkpoint(stores[3], tokens, World(), "ck-race", "published")

        done, *written, _ = await asyncio.gather(retain(stores[3], older_than_s=3600, batch=10),
                                                  *(writer(s, rid) for s, rid in zip(stores, live, strict=False)),
                                                  checkpoint())
        rows = {(p, bytes(h)) for p, h in sql(dsn, "SELECT position, hash FROM rollbook.events")}
        assert all(w in rows for ws in written for w in ws)
        cut, _ = await load_cut(stores[0], "ck-race")
        await validate_cut(stores[0], cut)
        # Whatever the race deferred, a second run drops: every exported rollout's own streams go.
        again = await retain(stores[0], older_than_s=3600)
        assert done.attempts + again.attempts == 12 and again.deferred_by is None
        assert sql(dsn, "SELECT count(*) FROM rollbook.events WHERE rollout_id LIKE 'r%%' AND stream NOT LIKE 'rollout:%%'") == [(0,)]
    finally:
        for s in stores:
            await s.close()


async def test_rollbook_db_retain_takes_the_checkpoints_to_keep(dsn: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from apps import cli
    from apps import config as cfg

    servers = {k: cfg.ServerConfig(port=0) for k in cfg.KINDS}
    cfg.write(cfg.Config(dsn=dsn, control_token="c0ntrol-token", data_token="d4ta-token", servers=servers,
                         limits=cfg.LimitsConfig(retention_keep_checkpoints=5)), tmp_path / "rollbook.toml")
    assert await asyncio.to_thread(cli.main, ["db", "retain", "--config", str(tmp_path / "rollbook.toml")]) == 0
    assert await asyncio.to_thread(cli.main, ["db", "retain", "--dsn", dsn, "--keep-checkpoints", "2"]) == 0
    outs = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert [o["keep_checkpoints"] for o in outs] == [5, 2]
    assert await asyncio.to_thread(cli.main, ["db", "retain", "--dsn", dsn, "--keep-checkpoints", "0"]) == 2


@pytest.mark.parametrize("meanwhile", ["a checkpoint scoping the rollout", "an attempt continuing the decided one"])
async def test_what_lands_between_the_decision_and_the_delete_makes_it_decide_again(
        dsn: str, meanwhile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters import retention

    store = PostgresEventStore.connect(dsn, writer="ret-between")
    tokens = PostgresTokenStore(store)
    try:
        if meanwhile.startswith("a checkpoint"):  # r0's fenced attempt 0 is decided; then a cut of r0 is published
            await write(store, tokens, Plan([{"attempts": [FRESH, FRESH], "end": "live", "capture": None}], {}, 1))
        else:  # r0's exported attempt 0 is decided; then an attempt 1 continuing from it starts
            await write(store, tokens, Plan([{"attempts": [FRESH], "end": "exported", "capture": None}], {}, 1))
        age_everything(dsn)
        # A session snapshot of every stream but the rollouts' own (the rows' contents are not read here).
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO rollbook.stream_snapshots (stream, position, data, digest) SELECT stream, "
                         "max(position), '{}', '' FROM rollbook.events WHERE stream NOT LIKE 'rollout:%' GROUP BY stream")
        before = events_by_attempt(dsn)
        landed: list[str] = []

        async def append_meanwhile() -> None:
            if landed:
                return
            if meanwhile.startswith("a checkpoint"):
                await write_checkpoint(store, tokens, World(), "ck-meanwhile", "published")
            else:
                boundary = max(e.position for e in await store.read_rollout("r0", 0) if e.kind == ev.EPISODE_STEP)
                await store.append(AppendRequest((NewEvent(rollout_stream("r0"), ev.ATTEMPT_STARTED, {
                    "parent_attempt": 0, "origin_attempt": 0, "origin_position": boundary, "disposition": "continue"},
                    "r0", 1),)))
            landed.append(meanwhile)

        monkeypatch.setattr(retention, "_decided", append_meanwhile)
        done = await retain(store, older_than_s=3600)
        assert landed and (done.attempts, done.deferred_by) == (0, None)
        assert all(events_by_attempt(dsn)[k] == rows for k, rows in before.items())
        if meanwhile.startswith("a checkpoint"):
            await validate_cut(store, (await load_cut(store, "ck-meanwhile"))[0])
        else:
            assert any(e.kind == ev.EPISODE_STEP for e in await effective_history(store, "r0", 1))  # inherited from 0
    finally:
        await store.close()
