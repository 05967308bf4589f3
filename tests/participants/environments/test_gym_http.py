"""The relay's HTTP to a NeMo Gym server: one kept-alive connection for a session's calls, its cookie
sent back, never a connection the server may have dropped, and a failure never leaving a stale one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from participants.environments import gym_http
from participants.environments.nemo_gym_relay import GymProcess, GymServer, Live, LiveGone, NemoGymEnvironment


class Recorder(ThreadingHTTPServer):
    """An HTTP/1.1 server that keeps connections open, as uvicorn does, and records what it was sent."""

    daemon_threads = True
    request_queue_size = 64  # the default 5 drops connections of 8 calls started at once

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.connections: set[tuple[str, int]] = set()
        self.cookies: list[str | None] = []
        self.open: list[socket.socket] = []
        self.closes: list[dict] = []  # the bodies of /close_session
        self.refuse_close = False  # answer /close_session as NeMo Gym's base close does a body without its id


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def setup(self) -> None:
        super().setup()
        self.server.open.append(self.connection)

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.connections.add(self.client_address)
        self.server.cookies.append(self.headers.get("Cookie"))
        reply = json.dumps({"path": self.path, "got": json.loads(body)}).encode()
        if self.path == "/close_session":
            self.server.closes.append(json.loads(body))
            if self.server.refuse_close:
                reply = b'{"detail": [{"type": "missing", "loc": ["body", "episode_id"]}]}'
                self.send_response(422)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        if self.path == "/seed_session":
            self.send_header("Set-Cookie", "session=s1; path=/; Max-Age=1209600; httponly; samesite=lax")
        if self.path == "/close_session":
            self.send_header("Set-Cookie", "session=null; path=/; expires=Thu, 01 Jan 1970 00:00:00 GMT")
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


def serving(port: int = 0) -> Recorder:
    server = Recorder(port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stopped(server: Recorder) -> None:
    """As a process that exits: the listener and every connection it holds are closed."""
    server.shutdown()
    server.server_close()
    for conn in server.open:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture(autouse=True)
async def closed_clients() -> AsyncIterator[None]:
    yield
    await gym_http.close_all()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = serving()
    yield server
    stopped(server)


def live_on(server: Recorder) -> Live:
    return Live(f"http://127.0.0.1:{server.server_address[1]}", None, 5.0)


async def test_a_sessions_calls_share_one_connection_and_send_its_cookie_back(recorder: Recorder) -> None:
    """Input: a seed that sets NeMo Gym's `session` cookie, four tool calls and a close that expires it."""
    live = live_on(recorder)
    assert await live.post("/seed_session", {}) == {"path": "/seed_session", "got": {}}
    for n in range(4):
        assert (await live.post("/email_search_emails", {"query": str(n)}))["got"] == {"query": str(n)}
    await live.post("/close_session", {})
    await live.post("/email_search_emails", {"query": "after"})
    assert len(recorder.connections) == 1, recorder.connections  # one connection per call before
    assert recorder.cookies == [None, *["session=s1"] * 5, None]


async def test_two_sessions_on_one_server_keep_their_own_cookies(recorder: Recorder) -> None:
    """Input: two live sessions seeded on one server, the first one's cookie set by its own seed only."""
    first, second = live_on(recorder), live_on(recorder)
    await first.post("/seed_session", {})
    await second.post("/email_search_emails", {})
    await first.post("/email_search_emails", {})
    assert recorder.cookies == [None, None, "session=s1"]


async def test_concurrent_calls_of_many_sessions_share_the_servers_kept_connections(recorder: Recorder) -> None:
    """Input: 8 sessions seeded at once, then 5 rounds of their 8 tool calls at once (the resources
    server's event loop, never a thread per call): at most one connection per call in flight."""
    lives = [live_on(recorder) for _ in range(8)]
    await asyncio.gather(*(live.post("/seed_session", {}) for live in lives))
    for n in range(5):
        replies = await asyncio.gather(*(live.post("/email_search_emails", {"n": n}) for live in lives))
        assert [r["got"] for r in replies] == [{"n": n}] * 8
    assert len(recorder.connections) == 8, recorder.connections  # one each at the first round, then kept
    assert recorder.cookies.count("session=s1") == 40


async def test_a_connection_idle_longer_than_a_server_may_keep_it_is_not_reused(recorder: Recorder,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: a pause longer than IDLE_S between two calls (a server may have closed the connection)."""
    monkeypatch.setattr(gym_http, "IDLE_S", 0.05)
    live = live_on(recorder)
    await live.post("/a", {})
    await asyncio.sleep(0.2)
    await live.post("/b", {})
    await live.post("/c", {})
    assert len(recorder.connections) == 2  # a fresh one after the pause, kept for the next call


async def test_a_server_gone_is_live_gone_and_its_kept_connections_are_not_used_again() -> None:
    """Input: the server a session's kept-alive connection leads to stops, and another starts on its port."""
    server = serving()
    live = live_on(server)
    await live.post("/seed_session", {})
    pool = gym_http.connections(live.base_url, None, live.timeout_s)
    kept = pool.client
    assert kept is not None
    stopped(server)
    with pytest.raises(LiveGone):
        for _ in range(2):  # the kept connection may fail at once or only at its reply; a new one is refused
            await live.post("/email_search_emails", {})
    assert pool.client is None  # retired with its connections
    again = serving(server.server_address[1])
    try:
        assert (await live.post("/email_search_emails", {"q": 1}))["got"] == {"q": 1}  # on a fresh connection
        assert len(again.connections) == 1
        assert pool.client is not kept
    finally:
        stopped(again)
        await pool.close()


def relay_to(server: Recorder) -> NemoGymEnvironment:
    url = f"http://127.0.0.1:{server.server_address[1]}"

    class Relayed(NemoGymEnvironment):
        pass

    Relayed.server = GymServer(name="recorded", module="resources_servers.recorded.app", url=url)
    Relayed.process = GymProcess(Relayed.server)
    return Relayed()


@pytest.mark.parametrize("refused", [False, True])
async def test_a_session_is_closed_by_its_cookie_and_a_server_that_refuses_that_is_not_asked_again(
        recorder: Recorder, refused: bool) -> None:
    """Input: two sessions seeded from their rows, each closed; the server answers the close 200 (it
    releases the cookie's session, as interactive_browser does) or 422 (NeMo Gym's base close, which
    wants an id and an episode_id a row-seeded session never had)."""
    recorder.refuse_close = refused
    env = relay_to(recorder)
    for _ in range(2):
        live = live_on(recorder)
        await live.post("/seed_session", {})
        await env.close_live(live)
    assert recorder.closes == ([{}] if refused else [{}, {}])
    assert recorder.cookies == [None, "session=s1", None] + ([] if refused else ["session=s1"])  # the close sends its cookie
