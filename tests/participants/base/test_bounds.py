"""Everything a process waits for or holds is bounded: its calls to peers, what its clients may take
to send a request, how many connections it holds, its database connections, the size of an append
transaction; and a run id's `_` or `%` never matches another run's rollouts. Each test names the
input or fault it tries."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import psycopg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from sqlalchemy import text

import adapters.postgres as pg_adapter
from adapters.database import like_prefix
from adapters.http_client import JsonClient, PeerTimeouts, default_timeouts, set_default_timeouts
from adapters.http_server import BoundedAppRunner, ServerLimits
from adapters.postgres import PoolLimits, PostgresEventStore
from apps import cli
from apps import config as cfg
from apps.collection import Collection
from apps.processes import free_port
from engine.errors import DatabaseUnavailable, GenerationFailed, ParticipantUnavailable
from engine.events import AppendRequest, NewEvent
from participants.base.guard import Credentials
from participants.base.http_errors import errors_as_json
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from participants.resources.app import build_resources_app

CREDS = Credentials(control="bounds-control-token", data="bounds-data-token")
DATA = {"Authorization": f"Bearer {CREDS.data}"}


# ---- outgoing calls ----------------------------------------------------------------------------

async def _silent_peer(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                       ) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_and_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(65536):  # takes the request, never answers, until the caller hangs up
        pass
    writer.close()


async def test_a_peer_that_accepts_and_never_answers_fails_the_call_as_participant_unavailable() -> None:
    """Fault: a server that accepts the connection, reads the request and never replies (a hung event
    loop). Before, JsonClient had no timeout at all and the caller waited forever; now the call fails
    with participant_unavailable once the peer has been silent for reply_s, which the agent's and
    environment server's Patience treat as "ask again, within PEER_PATIENCE_S"."""
    server, url = await _silent_peer(_read_and_hang)
    client = JsonClient("t", PeerTimeouts(connect_s=1, reply_s=0.5, work_s=60))
    try:
        started = time.monotonic()
        with pytest.raises(ParticipantUnavailable):
            await asyncio.wait_for(client.post(f"{url}/rollouts/r/attempts/0/tools/echo", {}), 30)
        assert time.monotonic() - started < 20
    finally:
        await client.close()
        server.close()


async def test_the_process_default_bounds_the_clients_servers_build_and_long_replies_get_work_s() -> None:
    """Input: a peer that answers after 1.5 s of silence, on an ordinary route and on /run (an
    activation's reply comes when it ends). With reply_s = 0.5 the ordinary call fails, the /run call,
    bounded by work_s instead, gets its answer: a long activation is not cut by the short bound. The
    client is built as the servers build theirs, JsonClient(token), after `rollbook serve` set the
    config's bounds."""
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/rollouts/r/attempts/0/run", slow)
    app.router.add_post("/rollouts/r/attempts/0/session", slow)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    before = default_timeouts()
    set_default_timeouts(PeerTimeouts(connect_s=1, reply_s=0.5, work_s=30))
    client = JsonClient("t")
    try:
        assert await client.post(str(server.make_url("/rollouts/r/attempts/0/run")), {}) == {"ok": True}
        with pytest.raises(ParticipantUnavailable):
            await client.post(str(server.make_url("/rollouts/r/attempts/0/session")), {})
    finally:
        set_default_timeouts(before)
        await client.close()
        await server.close()


async def test_an_upstream_model_that_goes_silent_fails_the_generation_but_a_long_steady_stream_does_not() -> None:
    """Fault: an upstream that accepts a generation and never answers (before, bounded only by a 600 s
    total, after which a bare TimeoutError escaped the backend). Now: generation_failed after
    silence_s. Input: a stream that lasts 1.6 s, a chunk every 0.2 s, with silence_s 0.6: it is read
    to its end, where a total bound of that size would have cut it."""
    server, url = await _silent_peer(_read_and_hang)
    backend = OpenAICompatibleBackend(url, model="m", connect_s=1, silence_s=0.5)
    try:
        with pytest.raises(GenerationFailed):
            await asyncio.wait_for(anext(backend.generate({"messages": []}, None)), 30)
    finally:
        await backend.close()
        server.close()

    async def steady(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            await asyncio.sleep(0.2)
            chunk = {"prompt_token_ids": [1] if i == 0 else None,
                     "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [i + 10],
                                  "logprobs": {"content": [{"token": f"token_id:{i + 10}", "logprob": -0.1}]},
                                  "finish_reason": "stop" if i == 7 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", steady)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    backend = OpenAICompatibleBackend(str(upstream.make_url("/v1")), model="m", connect_s=1, silence_s=0.6)
    try:
        events = [e async for e in backend.generate({"messages": []}, None)]
        assert type(events[-1]).__name__ == "End" and events[-1].finish_reason == "stop"  # type: ignore[union-attr]
    finally:
        await backend.close()
        await upstream.close()


# ---- incoming requests -------------------------------------------------------------------------

async def _bounded_server(limits: ServerLimits) -> tuple[BoundedAppRunner, int, asyncio.Event]:
    reached = asyncio.Event()

    async def echo(request: web.Request) -> web.Response:
        reached.set()
        return web.json_response(await request.json())

    async def slow(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(float(body["seconds"]))
        return web.json_response(body)

    app = web.Application(middlewares=[errors_as_json])
    app.router.add_post("/echo", echo)
    app.router.add_post("/slow", slow)
    runner = BoundedAppRunner(app, limits, handler_cancellation=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1], reached


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before closing; fails if it keeps the connection open past `seconds`."""
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
        except TimeoutError:
            break
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept the connection open for {seconds} s (sent {got[:80]!r})")


async def test_a_client_that_sends_half_a_header_or_a_slow_body_is_dropped() -> None:
    """Input (raw sockets): a request line and half a header, then nothing; and a whole head promising
    100 bytes of body, followed by 10 of them, then nothing. aiohttp alone waits for both forever (the
    head: until its keep-alive timeout, 75 s, on recent versions only); each is closed after head_s /
    body_s, and the handler never ran for the first. A prompt client on the same server is served."""
    runner, port, reached = await _bounded_server(ServerLimits(head_s=0.5, body_s=0.7, max_connections=64))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Ty")
        await writer.drain()
        await _closed_within(reader, 10)
        writer.close()
        assert not reached.is_set()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"a\": 1234")
        await writer.drain()
        sent = await _closed_within(reader, 10)
        writer.close()
        assert b"200 OK" not in sent

        async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/echo", json={"a": 1}) as r:
            assert r.status == 200 and await r.json() == {"a": 1}
    finally:
        await runner.cleanup()


async def test_connections_past_the_cap_are_refused_with_a_retryable_503() -> None:
    """Input: 20 raw connections that each open and say nothing, against a cap of 8. The first 8 are
    held (until head_s), the 12 others are answered 503 participant_unavailable and closed at once,
    and a JsonClient call made while the server is full fails as participant_unavailable (which its
    caller retries); once they are gone the server answers again."""
    runner, port, _ = await _bounded_server(ServerLimits(head_s=30, body_s=30, max_connections=8))
    opened = []
    try:
        for _ in range(20):
            opened.append(await asyncio.open_connection("127.0.0.1", port))
        refused = 0
        for reader, _w in opened[8:]:
            sent = await _closed_within(reader, 10)
            refused += b"503" in sent and b"participant_unavailable" in sent
        assert refused == 12
        client = JsonClient(None, PeerTimeouts(connect_s=2, reply_s=5, work_s=5))
        try:
            with pytest.raises(ParticipantUnavailable):
                await client.post(f"http://127.0.0.1:{port}/echo", {"a": 1})
            for _r, w in opened:
                w.close()
            for _ in range(200):
                try:
                    assert await client.post(f"http://127.0.0.1:{port}/echo", {"a": 2}) == {"a": 2}
                    break
                except ParticipantUnavailable:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("the server did not answer after its connections closed")
        finally:
            await client.close()
    finally:
        for _r, w in opened:
            w.close()
        await runner.cleanup()


async def test_at_the_cap_a_connection_kept_alive_between_requests_gives_way_to_a_new_one() -> None:
    """Input: a cap of 8, filled by 4 connections kept alive after a request each and 4 in the middle
    of one (/slow). A new client (a checkpoint's control request on a connection of its own) is
    served: an idle kept-alive connection is closed for it; the busy ones all finish."""
    runner, port, _ = await _bounded_server(ServerLimits(head_s=30, body_s=30, max_connections=8))
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as kept, aiohttp.ClientSession() as working:
            async def once(session: aiohttp.ClientSession, i: int) -> int:
                async with session.post(f"{url}/slow", json={"seconds": 0.5, "i": i}) as r:
                    return r.status
            assert await asyncio.gather(*(once(kept, i) for i in range(4))) == [200] * 4  # kept alive, idle now
            busy = [asyncio.ensure_future(once(working, i)) for i in range(4)]  # 4 more, in the middle of a request
            await asyncio.sleep(0.2)
            assert len(runner.server.connections) == 8  # type: ignore[union-attr]
            async with aiohttp.ClientSession() as control, control.post(f"{url}/echo", json={"a": 1}) as r:
                assert r.status == 200 and await r.json() == {"a": 1}
            statuses = await asyncio.gather(*busy, return_exceptions=True)
        assert statuses == [200] * 4
    finally:
        await runner.cleanup()


def test_rollbook_serve_drops_a_half_header_and_caps_its_connections(dsn: str, tmp_path: Path) -> None:
    """Fault: the same half header and a connection flood, against `rollbook serve resources` as a real
    process with [limits] head_s = 1, max_connections = 8 in its config: the bounds reach the server
    that operators run, not only the runner class."""
    port = free_port()
    path = tmp_path / "rollbook.toml"
    path.write_text(f'dsn = "{dsn}"\ncontrol_token = "{CREDS.control}"\ndata_token = "{CREDS.data}"\n'
                    f"[servers.resources]\nport = {port}\n[limits]\nhead_s = 1.0\nmax_connections = 8\n")
    path.chmod(0o600)
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "resources", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT)
    socks: list[socket.socket] = []
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.1)
        half = socket.create_connection(("127.0.0.1", port), timeout=20)
        half.sendall(b"GET /rollbook/v1/control/status HTTP/1.1\r\nHost: x\r\nAuthoriz")
        started = time.monotonic()
        assert half.recv(100) == b""  # closed by the server
        assert time.monotonic() - started < 15
        half.close()
        for _ in range(12):
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            socks.append(s)
        time.sleep(0.3)  # the server's loop takes them in order
        answered = [s.recv(4096) for s in socks[8:]]
        assert all(b"503" in a for a in answered), answered
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


# ---- the database ------------------------------------------------------------------------------

async def test_a_pool_with_no_free_connection_is_database_unavailable_503_not_a_500(dsn: str) -> None:
    """Fault: every pooled connection is checked out (pool_size 1, no overflow) and held, so the
    request's checkout waits out pool_timeout. Before, sqlalchemy's pool TimeoutError reached the
    caller as a 500 internal_error; now the store retries within its patience and then answers
    database_unavailable, a 503 every caller retries."""
    store = PostgresEventStore.connect(dsn, writer="pool", pool=PoolLimits(size=1, overflow=0, timeout_s=0.2),
                                       patience_s=0.5)
    server = TestServer(build_resources_app(store, CREDS), host="127.0.0.1")
    await server.start_server()
    try:
        async with store.engine.connect() as held:
            await held.execute(text("SELECT 1"))
            with pytest.raises(DatabaseUnavailable):
                await store.read_stream("anything")
            async with aiohttp.ClientSession() as http:
                task = {"env": "math", "task_id": "t", "prompt": "p", "params": {}}
                async with http.post(server.make_url("/rollouts/r1/attempts/0/session"),
                                     json={"env": "math", "task": task}, headers=DATA) as resp:
                    body = await resp.json()
            assert resp.status == 503 and body["error"]["code"] == "database_unavailable", body
        assert await store.read_stream("anything") == []  # the connection is back: so is the store
    finally:
        await server.close()
        await store.close()


async def test_large_appends_all_land_in_transactions_bounded_by_bytes(
        store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: 30 concurrent appends of one ~100 KB event each (3 MB), with the group bound at 256 KiB.
    Before, they went into one transaction (bounded only by 2,000 events); now every one lands, in
    several transactions, none holding more than the bound plus the one request that reached it."""
    monkeypatch.setattr(pg_adapter, "MAX_GROUP_BYTES", 256 * 1024)
    blob = "x" * 100_000
    written = await asyncio.gather(*(store.append(AppendRequest((NewEvent(f"big-{i}", "noted", {"blob": blob}),)))
                                     for i in range(30)))
    assert sorted(w[0].stream for w in written) == sorted(f"big-{i}" for i in range(30))
    async with store.engine.connect() as conn:
        groups = [r[0] for r in await conn.execute(text(
            "SELECT sum(octet_length(data::text)) FROM rollbook.events WHERE stream LIKE 'big-%' "
            "GROUP BY xmin::text"))]
    assert sum(groups) >= 30 * 100_000
    assert len(groups) > 1
    assert max(groups) <= 256 * 1024 + 100_100, groups


async def test_a_run_id_with_underscore_does_not_match_another_runs_rollouts(store: PostgresEventStore) -> None:
    """Input: run `a_b`, while run `a-b` has finished rollout a-b-0000 (the `_` of an unescaped LIKE
    pattern matches the `-`), and ids holding `%` and `\\`. `a_b`'s collection must find none of its
    own rollouts finished."""
    async with store.engine.begin() as conn:
        await conn.execute(text("INSERT INTO rollbook.attempt_state (rollout_id, attempt, status) "
                                "VALUES ('a-b-0000', 0, 'finished'), ('a-b-0001', 0, 'finished')"))
        cases = [("a_b-", "a-b-1", False), ("a_b-", "a_b-1", True), ("a%b-", "axxb-1", False),
                 ("a%b-", "a%b-1", True), ("a\\b-", "a\\b-1", True), ("a\\b-", "ab-1", False)]
        for prefix, value, expected in cases:
            got = (await conn.execute(text("SELECT :s LIKE :p"), {"s": value, "p": like_prefix(prefix)})).scalar_one()
            assert got is expected, (prefix, value)
    config = cfg.Config(control_token=CREDS.control, data_token=CREDS.data,
                        servers={"environment": cfg.ServerConfig(port=1)})
    from participants.environments.base import Task

    tasks = [Task(env="math", task_id=f"t{i}", prompt="p", params={}) for i in range(2)]
    assert await Collection(config, store, "a_b", tasks).unfinished() == [0, 1]
    assert await Collection(config, store, "a-b", tasks).unfinished() == []


async def test_prune_keys_drops_old_append_keys_keeps_new_ones_and_a_kept_key_still_dedups(dsn: str) -> None:
    """Input: three keyed appends, two of them recorded two days ago, then `rollbook db prune-keys`
    with the default retention (a day) while the store stays open. The two old keys go, the new one
    stays, and a retry of the append that owns it still returns the first try's events instead of a
    second copy. A retention shorter than a writer's retry window is refused."""
    store = PostgresEventStore.connect(dsn, writer="prune")
    try:
        for key in ("old-1", "old-2", "new-1"):
            await store.append(AppendRequest((NewEvent(f"s-{key}", "noted", {"k": key}),), key=key))
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("UPDATE rollbook.append_keys SET recorded_at = now() - interval '2 days' "
                          "WHERE key LIKE 'old-%'")
        # The command runs while this store goes on appending (as servers would).
        pruned, _ = await asyncio.gather(
            asyncio.to_thread(cli.main, ["db", "prune-keys", "--dsn", dsn]),
            asyncio.gather(*(store.append(AppendRequest((NewEvent("during", "noted", {"i": i}),))) for i in range(20))))
        assert pruned == 0
        with psycopg.connect(dsn, autocommit=True) as admin:
            keys = sorted(k for (k,) in admin.execute("SELECT key FROM rollbook.append_keys"))
        assert "new-1" in keys and not [k for k in keys if k.startswith("old-")] and len(keys) == 21
        retried = await store._commit_group([AppendRequest((NewEvent("s-new-1", "noted", {"k": "new-1"}),), key="new-1")])
        assert [e.stream_version for e in retried[0]] == [1]  # type: ignore[union-attr]
        assert len(await store.read_stream("s-new-1")) == 1
        assert await asyncio.to_thread(cli.main, ["db", "prune-keys", "--dsn", dsn, "--older-than-s", "5"]) == 2
    finally:
        await store.close()


async def test_a_request_whose_work_outlasts_the_head_and_body_bounds_is_answered_and_its_connection_reused() -> None:
    """The bounds are on what the client sends, never on how long the server works: an agent's /run or
    an environment's /episodes lasts as long as the episode. aiohttp feeds the protocol b"" between
    requests; that empty read once started a head deadline, and every request that outlasted head_s
    was cut off ("Server disconnected"), a restored run's rollouts among them."""
    runner, port, _ = await _bounded_server(ServerLimits(head_s=0.3, body_s=0.3, max_connections=8))
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(2):  # the second on the same kept-alive connection
                async with client.post(f"http://127.0.0.1:{port}/slow", json={"seconds": 1.0}) as resp:
                    assert resp.status == 200 and (await resp.json()) == {"seconds": 1.0}
    finally:
        await runner.cleanup()


async def test_a_server_to_server_client_holds_more_than_a_hundred_requests_at_once() -> None:
    """aiohttp caps a client session at 100 connections. A hop holds one per rollout for the whole of
    its episode or activation (dispatch, /run), so the 101st rollout, and a checkpoint's request
    behind it, waited for one of the first hundred to end: a checkpoint with 120 rollouts in flight
    failed at its deadline. 150 requests held open at once all reach the server."""
    arrived, release = 0, asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/held", held)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    client = JsonClient("token")
    try:
        calls = [asyncio.ensure_future(client.post(str(server.make_url("/held")), {})) for _ in range(150)]
        deadline = time.monotonic() + 20
        while arrived < 150 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert arrived == 150
        release.set()
        await asyncio.gather(*calls)
    finally:
        release.set()
        await client.close()
        await server.close()
