"""HTTP from the relay to a NeMo Gym server: one pooled async client per server, kept-alive connections.

A connection per call costs both sides a TCP handshake, and the server a connection set-up, for
every tool call, seed and verify; a blocking client costs the resources server a thread hop per call
besides. Here each server (its address and, for a process rollbook runs, that process) has one
aiohttp client session on the event loop that uses it, and its connector keeps idle connections. A
connection idle longer than IDLE_S is closed instead of reused: a server drops idle connections after
its keep-alive timeout (NeMo Gym's uvicorn after 30 s, common servers after 2 s or more), and a call
sent on one it dropped would fail. Any failure retires the client session with its idle connections:
it usually means the server went away, and the caller then takes the session for gone and rebuilds
it, which a stale connection must not do again. Calls already in flight on the retired client finish
there; it is closed once they have had their timeout.

Cookies (NeMo Gym keeps its session in one) are the caller's, never the client's jar: it sends what
it holds and keeps what each reply sets (`Cookies`), so two live sessions on one server never share one.
"""

from __future__ import annotations

import asyncio
import http.cookies
import threading
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime

import aiohttp

IDLE_S = 1.0


@dataclass
class Cookies:
    """What a server's `Set-Cookie` headers set, sent back on every later request to it."""

    values: dict[str, str] = field(default_factory=dict)

    def header(self) -> str | None:
        return "; ".join(f"{k}={v}" for k, v in self.values.items()) or None

    def take(self, set_cookie: list[str]) -> None:
        for line in set_cookie:
            jar: http.cookies.SimpleCookie = http.cookies.SimpleCookie()
            try:
                jar.load(line)
            except http.cookies.CookieError:
                continue  # a cookie Python cannot parse is one a browser would drop as well
            for name, morsel in jar.items():
                if _expired(morsel):
                    self.values.pop(name, None)
                else:
                    self.values[name] = morsel.value


def _expired(morsel: http.cookies.Morsel[str]) -> bool:
    if morsel["max-age"]:
        return morsel["max-age"].strip().lstrip("-").isdigit() and int(morsel["max-age"]) <= 0
    if morsel["expires"]:
        try:
            return parsedate_to_datetime(morsel["expires"]).timestamp() <= time.time()
        except (TypeError, ValueError):
            return False
    return False


class Connections:
    """The kept-alive connections to one server, on the event loop that uses them."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.client: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def post(self, path: str, body: bytes, cookies: Cookies) -> tuple[int, bytes]:
        """The reply's status and body. OSError (a timeout is one) or aiohttp.ClientError when no whole
        reply came."""
        headers = {"Content-Type": "application/json"}
        if (cookie := cookies.header()) is not None:
            headers["Cookie"] = cookie
        client = self._client()
        try:
            async with client.post(self.base_url + path, data=body, headers=headers) as resp:
                raw = await resp.read()
        except (OSError, aiohttp.ClientError):
            self._retire(client)
            raise
        cookies.take(resp.headers.getall("Set-Cookie", []))
        return resp.status, raw

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self.client is None or self.client.closed or self._loop is not loop:
            # Timeouts per connect and per read, not for the whole call: a verify that asks a judge may
            # take long, as long as its server keeps answering.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
            self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_S),
                                                cookie_jar=aiohttp.DummyCookieJar(), timeout=timeout)
            self._loop = loop
        return self.client

    def _retire(self, client: aiohttp.ClientSession) -> None:
        """No later call uses `client`; it closes after the calls in flight on it had their timeout."""
        if self.client is client:
            self.client = None
        loop = asyncio.get_running_loop()
        if self._loop is loop:  # a client of a loop that ended went with it
            loop.call_later(self.timeout_s, lambda: loop.create_task(client.close()))

    async def close(self) -> None:
        """Close the client, if it is this loop's (a sweep runs one loop per thread, each its own servers)."""
        if self.client is not None and self._loop is asyncio.get_running_loop():
            client, self.client = self.client, None
            await client.close()


_POOLS: dict[tuple[str, int | None, float], Connections] = {}
_POOLS_LOCK = threading.Lock()  # a sweep seeds servers from several threads, each on a loop of its own


def connections(base_url: str, pid: int | None, timeout_s: float) -> Connections:
    """The pool for a server: its address, and the process rollbook started there (None: one the
    operator runs), so a process started afresh on the same port never gets its predecessor's."""
    key = (base_url, pid, timeout_s)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            for old in [k for k in _POOLS if k[0] == base_url]:
                gone = _POOLS.pop(old)  # a predecessor's: its process is gone
                if gone.client is not None:
                    gone._retire(gone.client)
            pool = _POOLS[key] = Connections(base_url, timeout_s)
        return pool


async def close_all() -> None:
    """Close every pool's client on this loop (before a loop that used them ends: `asyncio.run`)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        await pool.close()
