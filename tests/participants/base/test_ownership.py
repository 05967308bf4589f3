"""One owner at a time (engine/ownership.py) and instances in the log (engine/membership.py): two
model servers and two resources servers on one database, each recorded with a lease."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text

from adapters.membership import Lease, MembershipReader
from adapters.postgres import PostgresEventStore
from engine import membership as M
from engine.identity import call_stream, session_stream
from engine.ownership import verdict
from participants.base.app import PARTICIPANT
from participants.model.backends.scripted import ScriptedBackend
from tests.participants.model.test_server import DATA, MATH, model_server, start_attempt, url
from tests.resources_harness import call, control, open_session, prefix, start
from tests.resources_harness import serving as resources_serving
from tests.waiting import eventually

# ---- the rules, without a database --------------------------------------------------------------


def test_work_is_mine_only_while_i_hold_it_held_while_its_live_owner_does_and_orphaned_otherwise() -> None:
    assert verdict("a", "a", True, set()) == "mine"
    assert verdict("a", "a", False, {"a"}) == "orphaned"  # claimed here, then lost from memory
    assert verdict("b", "a", False, {"a", "b"}) == "held"
    assert verdict("b", "a", False, {"a"}) == "orphaned"  # its owner's lease ran out
    assert verdict(None, "a", False, {"a", "b"}) == "orphaned"  # claimed before owners were recorded


def inst(name: str, position: int, address: str = "http://h:1", renewed_at: float = 100.0, stopped: bool = False) -> M.Instance:
    return M.Instance("model", name, address, 1, 10.0, position, 90.0, renewed_at, stopped)


def test_membership_states_stopped_superseded_live_and_expired() -> None:
    found = {m.instance.instance: m.state for m in M.members([
        inst("old", 1), inst("new", 2), inst("other", 3, "http://h:2", renewed_at=80.0),
        inst("gone", 4, "http://h:3", stopped=True), inst("fresh", 5, "http://h:4", renewed_at=105.0)], now=109.0)}
    assert found == {"old": "superseded", "new": "live", "other": "expired", "gone": "stopped", "fresh": "live"}
    assert M.live_ids(M.members([inst("a", 1)], now=109.0), "model") == {"a"}
    assert M.live_ids(M.members([inst("a", 1)], now=109.0), "agent") == frozenset()


# ---- instances in the log ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def leased(dsn: str, kind: str, name: str, address: str, lease_s: float = 30.0) -> AsyncIterator[tuple[PostgresEventStore, Lease]]:
    store = PostgresEventStore.connect(dsn, writer=name)
    lease = Lease(store, kind, name, address, lease_s=lease_s)
    await lease.start()
    try:
        yield store, lease
    finally:
        await lease.stop()
        await store.close()


async def view_states(store: PostgresEventStore) -> dict[str, str]:
    async with store.engine.connect() as conn:
        return {r.instance: r.state for r in await conn.execute(text("SELECT instance, state FROM rollbook.participants"))}


async def test_the_participants_view_and_the_membership_rule_agree_on_every_state(dsn: str, store: PostgresEventStore) -> None:
    reader = MembershipReader(store)
    async with leased(dsn, "model", "m-old", "http://h:1", lease_s=0.6):
        async with leased(dsn, "model", "m-new", "http://h:1"), leased(dsn, "agent", "a-1", "http://h:2"):
            short = Lease(store, "resources", "r-1", "http://h:3", lease_s=0.6)
            await short.start()
            short._task.cancel()  # type: ignore[union-attr]  # a SIGKILL, as far as its lease can tell
            stopped = Lease(store, "environment", "e-1", "http://h:4")
            await stopped.start()
            await stopped.stop()
            await asyncio.sleep(0.8)
            expected = {"m-old": "superseded", "m-new": "live", "a-1": "live", "r-1": "expired", "e-1": "stopped"}
            assert await view_states(store) == expected
            assert {m.instance.instance: m.state for m in await reader.members()} == expected
            assert await reader.live("model") == {"m-new"}
    # A renewed lease stays live past its first term.
    async with leased(dsn, "agent", "a-2", "http://h:5", lease_s=0.6):
        await asyncio.sleep(1.0)
        assert (await view_states(store))["a-2"] == "live"


# ---- a model call: one owner --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def two_model_servers(dsn: str, tokens: Any, backends: list[ScriptedBackend]) -> AsyncIterator[list[Any]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for name, backend in zip(("model-a", "model-b"), backends, strict=True):
            store, _ = await stack.enter_async_context(leased(dsn, "model", name, f"http://{name}:8000"))
            client = await stack.enter_async_context(model_server(store, backend, tokens, name))
            client.server.app[PARTICIPANT].members = MembershipReader(store)
            clients.append(client)
        yield clients


async def ask(client: Any, rollout: str, call_id: str) -> tuple[int, Any]:
    resp = await client.post(url(rollout), json=MATH, headers={"X-Rollbook-Call-Id": call_id, **DATA})
    return resp.status, await resp.json()


async def custody(store: PostgresEventStore, call_id: str) -> list[str]:
    return [e.kind for e in await store.read_stream(call_stream(call_id))]


async def only_accepted(store: PostgresEventStore, call_id: str) -> bool:
    return await custody(store, call_id) == ["call_accepted"]


async def test_two_model_servers_racing_for_the_same_call_id_generate_it_exactly_once(
        dsn: str, store: PostgresEventStore, tokens: Any) -> None:
    backends = [ScriptedBackend(latency_s=0.05), ScriptedBackend(latency_s=0.05)]
    async with two_model_servers(dsn, tokens, backends) as (a, b):
        await start_attempt(store, "race")
        for i in range(12):
            (sa, ra), (sb, rb) = await asyncio.gather(ask(a, "race", f"c{i}"), ask(b, "race", f"c{i}"))
            assert (sa, sb) == (200, 200), (ra, rb)
            assert ra["choices"][0]["message"] == rb["choices"][0]["message"]
            assert await custody(store, f"c{i}") == ["call_accepted", "call_completed"]
        assert backends[0].generations + backends[1].generations == 12
        owners = {e.data["instance"] for i in range(12) for e in await store.read_stream(call_stream(f"c{i}"))
                  if e.kind == "call_accepted"}
        assert owners <= {"model-a", "model-b"}


async def test_a_call_held_by_a_live_model_server_is_awaited_by_another_never_marked_lost(
        dsn: str, store: PostgresEventStore, tokens: Any) -> None:
    backends = [ScriptedBackend(latency_s=1.0), ScriptedBackend()]
    async with two_model_servers(dsn, tokens, backends) as (a, b):
        await start_attempt(store, "held")
        first = asyncio.ensure_future(ask(a, "held", "c-held"))
        await eventually("a accepted the call", lambda: only_accepted(store, "c-held"))
        status, reply = await ask(b, "held", "c-held")  # answered once a's reply is in the log
        assert status == 200, reply
        assert (await first)[1]["choices"][0]["message"] == reply["choices"][0]["message"]
        assert await custody(store, "c-held") == ["call_accepted", "call_completed"]
        assert (backends[0].generations, backends[1].generations) == (1, 0)


async def test_a_call_whose_owner_left_is_taken_over_as_lost_through_the_recovery_rules(
        dsn: str, store: PostgresEventStore, tokens: Any) -> None:
    async with leased(dsn, "model", "model-b", "http://model-b:8000") as (b_store, _), \
            model_server(b_store, ScriptedBackend(), tokens, "model-b") as b:
        b.server.app[PARTICIPANT].members = MembershipReader(b_store)
        await start_attempt(store, "gone")
        async with leased(dsn, "model", "model-a", "http://model-a:8000") as (a_store, a_lease), \
                model_server(a_store, ScriptedBackend(latency_s=30), tokens, "model-a") as a:
            pending = asyncio.ensure_future(ask(a, "gone", "c-gone"))
            await eventually("a accepted the call", lambda: only_accepted(store, "c-gone"))
            waiting = asyncio.ensure_future(ask(b, "gone", "c-gone"))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # its owner is live: b waits, records nothing
            await a_lease.stop()  # a leaves the deployment with the call unfinished
            status, reply = await waiting
            pending.cancel()
        assert status == 409 and reply["error"]["code"] == "attempt_lost", reply
        kinds = await custody(store, "c-gone")
        assert kinds[:2] == ["call_accepted", "call_failed"] and kinds.count("call_failed") == 1


# ---- a resources session: one owner ---------------------------------------------------------------


@pytest.mark.usefixtures("restart_only_live")
async def test_a_resources_server_reports_as_restarts_only_the_restart_only_sessions_of_dead_instances(
        dsn: str, store: PostgresEventStore) -> None:
    await start(store, "sb")
    async with resources_serving(dsn, "resources-a") as (http_a, a), leased(dsn, "resources", "resources-a", "http://ra:1") as (_, a_lease):
        a.instance = "resources-a"
        await open_session(http_a, "sb", "sandbox", 2)
        opened = (await store.read_stream(session_stream("sb", 0)))[0]
        assert opened.data["instance"] == "resources-a"
        async with resources_serving(dsn, "resources-b") as (http_b, b), \
                leased(dsn, "resources", "resources-b", "http://rb:1") as (b_store, _):
            b.instance, b.members = "resources-b", MembershipReader(b_store)
            status, report = await control(http_b, "prepare", "ck-live")
            assert status == 200 and report["restarts"] == [], report  # a holds it, live
            await control(http_b, "resume", "ck-live")
            await a_lease.stop()
            status, report = await control(http_b, "prepare", "ck-dead")
            assert status == 200 and report["restarts"] == [{"rollout_id": "sb", "attempt": 0}], report
            await control(http_b, "resume", "ck-dead")
        status, _ = await call(http_a, "GET", f"{prefix('sb', 0)}/state")
        assert status == 200


@pytest.fixture
async def tokens(dsn: str) -> AsyncIterator[Any]:
    from adapters.token_store import PostgresTokenStore

    s = PostgresTokenStore(dsn)
    yield s
    await s.close()


# ---- the participant set a coordinator drives ------------------------------------------------------


async def test_a_coordinator_drives_every_live_instance_and_the_configured_addresses_the_log_does_not_call_dead(
        dsn: str, store: PostgresEventStore) -> None:
    import aiohttp

    from apps.participant_set import LoggedParticipants

    configured = [("model", "http://m:1"), ("agent", "http://a:1/"), ("resources", "http://r:1")]
    async with aiohttp.ClientSession() as session, \
            leased(dsn, "model", "model-1", "http://m:1"), leased(dsn, "model", "model-2", "http://m:2"), \
            leased(dsn, "resources", "resources-1", "http://r:1", lease_s=0.5):
        stopped = Lease(store, "model", "model-3", "http://m:3")
        await stopped.start()
        await stopped.stop()
        await asyncio.sleep(0.7)  # resources-1 was renewed every 0.17 s: still live
        members = LoggedParticipants(store, configured, "token", session)
        found = {(p.name, p.base_url) for p in await members.current()}  # type: ignore[attr-defined]
        assert found == {("model", "http://m:1"), ("agent", "http://a:1"), ("resources", "http://r:1"),
                         ("model:model-2", "http://m:2")}
    # Every lease above has ended: the configured model and resources addresses are recorded as gone,
    # the agent's was never recorded (a server that predates instance records is still driven).
    async with aiohttp.ClientSession() as session:
        found = {p.name for p in await LoggedParticipants(store, configured, "token", session).current()}
    assert found == {"agent"}
