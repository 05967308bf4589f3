"""Workers behind one address, without processes: how a request is keyed (participants/base/routing.py), where
the front sends it and what it does when a worker is gone (participants/base/front.py), how workers are
recorded and superseded (engine/membership.py, the rollbook.participants view), and which addresses a
checkpoint drives (apps/participant_set.py). tests/e2e/test_workers.py runs them as real processes."""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import text

from adapters.http_client import CONTROL, PeerTimeouts
from adapters.membership import Lease, MembershipReader
from adapters.postgres import PostgresEventStore
from apps.participant_set import LoggedParticipants
from engine import membership as M
from participants.base.front import Front
from participants.base.routing import EPISODE_ATTEMPT, Peers, pick, request_key

# ---- the key a request is routed by ---------------------------------------------------------------


def test_a_request_is_keyed_by_its_rollout_attempt_an_episode_by_its_rollout_and_control_by_none() -> None:
    assert request_key("POST", "/rollouts/r-1/attempts/3/v1/chat/completions", b"") == ("r-1", 3)
    assert request_key("POST", "/rollouts/r-1/attempts/0/tools/search", b"{}") == ("r-1", 0)
    assert request_key("POST", "/episodes", json.dumps({"rollout_id": "r-2"}).encode()) == ("r-2", EPISODE_ATTEMPT)
    assert request_key("GET", "/episodes/r-2", b"") == ("r-2", EPISODE_ATTEMPT)
    assert request_key("POST", "/episodes", b"not json") is None  # the worker refuses it with the right error
    assert request_key("POST", "/episodes", b'{"rollout_id": 7}') is None
    assert request_key("POST", f"{CONTROL}/prepare", b"{}") is None
    assert request_key("GET", "/metrics", b"") is None


def test_nemo_gym_run_requests_are_keyed_by_the_rollout_their_row_or_episode_names() -> None:
    """NeMo Gym's collector posts `/run` with no rollout in the path: the agent's (a flat row) and the
    environment's (an episode request) are keyed by the rollout they name, as rollbook's episodes are,
    so `workers = N` serves a collection on all N instead of the first."""
    flat = {"responses_create_params": {"input": "hi"}, "_ng_task_index": 4, "_ng_rollout_index": 2}
    assert request_key("POST", "/run", json.dumps(flat).encode()) == ("4-2", EPISODE_ATTEMPT)
    assert request_key("POST", "/run", json.dumps({**flat, "_ng_rollout_id": "gym-9"}).encode()) == ("gym-9", EPISODE_ATTEMPT)
    episode = {"episode_id": {"rollout_id": "gym-4-2", "attempt": 1}, "task": {}}
    assert request_key("POST", "/run", json.dumps(episode).encode()) == ("gym-4-2", EPISODE_ATTEMPT)
    rows = [{**flat, "_ng_task_index": i} for i in range(64)]
    workers = {pick(["http://w:1", "http://w:2"], *request_key("POST", "/run", json.dumps(r).encode())) for r in rows}
    assert workers == {"http://w:1", "http://w:2"}  # a collection's rows land on both workers
    # Not a row: the worker that gets it refuses it (`rollout_id_required`, `invalid_request`).
    for body in (b"not json", b"[1]", b'{"responses_create_params": {}}', b'{"episode_id": {"rollout_id": 7}}'):
        assert request_key("POST", "/run", body) is None


# ---- workers in the membership rule ---------------------------------------------------------------


def worker(name: str, position: int, parent: str, front: str = "http://f:1", renewed_at: float = 100.0) -> M.Instance:
    return M.Instance("agent", name, f"http://w:{position}", 2, 10.0, position, 90.0, renewed_at, False,
                      front, parent, position % 2)


def test_workers_of_one_front_stand_together_and_a_new_front_at_their_address_supersedes_them_all() -> None:
    first = [worker("a-w0", 1, "a"), worker("a-w1", 2, "a")]
    states = {m.instance.instance: m.state for m in M.members(first, now=101.0)}
    assert states == {"a-w0": "live", "a-w1": "live"}  # a parent's second worker does not supersede its first
    later = [*first, worker("b-w0", 3, "b"), worker("b-w1", 4, "b"), worker("c-w0", 5, "c", front="http://f:2")]
    states = {m.instance.instance: m.state for m in M.members(later, now=101.0)}
    assert states == {"a-w0": "superseded", "a-w1": "superseded", "b-w0": "live", "b-w1": "live", "c-w0": "live"}
    # A plain instance at a front's address: it took the address, so the workers behind the old front are gone.
    plain = M.Instance("agent", "p", "http://f:1", 1, 10.0, 6, 90.0, 100.0)
    states = {m.instance.instance: m.state for m in M.members([*later, plain], now=101.0)}
    assert states["b-w0"] == states["b-w1"] == "superseded" and states["p"] == "live"


async def test_the_view_and_the_rule_agree_on_workers(dsn: str, store: PostgresEventStore) -> None:
    leases = [Lease(store, "agent", f"{p}-w{i}", f"http://w:{n}", workers=2, of=M.WorkerOf("http://f:1", p, i))
              for n, (p, i) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)])]
    for lease in leases[:2]:
        await lease.start()
    async with store.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT instance, state, front, parent, worker FROM rollbook.participants"))).all()
    assert sorted(tuple(r) for r in rows) == [("a-w0", "live", "http://f:1", "a", 0), ("a-w1", "live", "http://f:1", "a", 1)]
    for lease in leases[2:]:
        await lease.start()
    async with store.engine.connect() as conn:
        view = {r.instance: r.state for r in await conn.execute(text("SELECT instance, state FROM rollbook.participants"))}
    rule = {m.instance.instance: m.state for m in await MembershipReader(store).members()}
    assert view == rule == {"a-w0": "superseded", "a-w1": "superseded", "b-w0": "live", "b-w1": "live"}
    for lease in leases:
        await lease.stop()


async def test_a_checkpoint_drives_every_live_worker_and_not_the_front_they_stand_behind(
        dsn: str, store: PostgresEventStore) -> None:
    workers = [Lease(store, "agent", f"a-w{i}", f"http://127.0.0.1:{9000 + i}", workers=2,
                     of=M.WorkerOf("http://127.0.0.1:8103", "a", i)) for i in range(2)]
    for lease in workers:
        await lease.start()
    await workers[1].stop()  # its parent saw it exit
    async with aiohttp.ClientSession() as session:
        driven = await LoggedParticipants(store, [("agent", "http://127.0.0.1:8103"), ("model", "http://127.0.0.1:8101")],
                                          "token", session).current()
    assert sorted((p.name, p.base_url) for p in driven) == [  # type: ignore[attr-defined]
        ("agent:a-w0", "http://127.0.0.1:9000"), ("model", "http://127.0.0.1:8101")]
    await workers[0].stop()


# ---- the front ----------------------------------------------------------------------------------


async def _worker_app(name: str, seen: list[tuple[str, str]]) -> web.Application:
    async def any_route(request: web.Request) -> web.Response:
        seen.append((name, request.raw_path))
        if request.path.endswith("/prepare") and name == "refuses":
            return web.json_response({"error": {"code": "admission_closed"}}, status=409)
        return web.json_response({"worker": name, "body": (await request.read()).decode()})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    return app


class Fronted:
    """Workers (plain aiohttp servers) behind a Front, all in this process; `kill` closes a worker's socket."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.seen: list[tuple[str, str]] = []
        self.servers: dict[str, TestServer] = {}
        self.address: dict[str, str] = {}
        self.dead: set[str] = set()
        self.stale_reads = 0  # reads of the log that still name a dead worker live (its stop not yet recorded)

    def live(self) -> list[str]:
        return [a for n, a in self.address.items() if n not in self.dead]

    async def __aenter__(self) -> TestClient:
        for name in self.names:
            server = TestServer(await _worker_app(name, self.seen))
            await server.start_server()
            self.servers[name] = server
            self.address[name] = str(server.make_url("")).rstrip("/")
        peers = Peers("http://front", "agent", ttl_s=0.0)

        async def live() -> list[str]:
            if self.stale_reads:
                self.stale_reads -= 1
                return list(self.address.values())
            return self.live()

        peers.source = live
        front = Front("agent", peers, self.live, PeerTimeouts(connect_s=2.0), patience_s=1.0)
        self.client = TestClient(TestServer(front.app))
        await self.client.start_server()
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        for server in self.servers.values():
            await server.close()

    async def kill(self, name: str) -> None:
        await self.servers[name].close()
        self.dead.add(name)

    def name_of(self, rollout: str, attempt: int) -> str:
        return next(n for n, a in self.address.items() if a == pick(self.live(), rollout, attempt))


async def test_the_front_sends_each_session_to_the_worker_the_rule_picks_and_a_dead_ones_to_a_live_one() -> None:
    async with (f := Fronted(["w0", "w1", "w2"])) as client:
        for i in range(30):
            rollout = f"r-{i}"
            resp = await client.post(f"/rollouts/{rollout}/attempts/0/run", data=b'{"x": 1}')
            assert resp.status == 200
            # Where the rule says, with the body passed on whole.
            assert await resp.json() == {"worker": f.name_of(rollout, 0), "body": '{"x": 1}'}
        assert {n for n, _ in f.seen} == {"w0", "w1", "w2"}
        # A path reaches the worker as it was sent, still escaped: an escaped tool name stays one segment.
        resp = await client.post("/rollouts/r-0/attempts/0/tools/a%2F..%2F..%2Fx?q=1", data=b"{}")
        assert resp.status == 200 and f.seen[-1] == (f.name_of("r-0", 0), "/rollouts/r-0/attempts/0/tools/a%2F..%2F..%2Fx?q=1")
        busy = f.name_of("r-0", 0)
        # The worker holding r-0 dies: its socket is closed, as a SIGKILL leaves it, and the live set still
        # names it. The request finds it dead and goes where the rule says once the set no longer does.
        await f.servers[busy].close()
        f.dead.add(busy)
        f.stale_reads = 1
        resp = await client.post("/rollouts/r-0/attempts/0/run", data=b"{}")
        assert resp.status == 200 and (await resp.json())["worker"] == f.name_of("r-0", 0) != busy


async def test_the_front_answers_participant_unavailable_when_no_worker_is_left() -> None:
    async with (f := Fronted(["w0", "w1"])) as client:
        for name in f.names:
            await f.kill(name)
        resp = await client.post("/rollouts/r-0/attempts/0/run", data=b"{}")
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "participant_unavailable"


async def test_a_control_request_at_the_front_reaches_every_worker_and_one_refusal_is_the_answer() -> None:
    async with (f := Fronted(["w0", "refuses"])) as client:
        resp = await client.post(f"{CONTROL}/resume", json={"checkpoint_id": "ck"})
        assert resp.status == 200
        assert sorted(n for n, p in f.seen if p.endswith("/resume")) == ["refuses", "w0"]
        resp = await client.post(f"{CONTROL}/prepare", json={"checkpoint_id": "ck"})
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "admission_closed"
        assert sorted(n for n, p in f.seen if p.endswith("/prepare")) == ["refuses", "w0"]
