"""HTTP from the relay's threads to a NeMo Gym server: kept-alive connections, shared by its live sessions.

A connection per call costs both sides a TCP handshake, and the server a connection set-up, for
every tool call, seed and verify. Here each server (its address and, for a process rollbook runs,
that process) has a pool of idle connections; a call takes one, or opens one, and gives it back when
the reply was read whole and the server keeps it open. A connection idle longer than IDLE_S is closed
instead of reused: a server drops idle connections after its keep-alive timeout (NeMo Gym's uvicorn
after 30 s, common servers after 2 s or more), and a call sent on one it dropped would fail. Any
failure closes the idle connections beside it too: it usually means the server went away, and the
caller then takes the session for gone and rebuilds it, which a stale connection must not do again.

Cookies (NeMo Gym keeps its session in one) are the caller's: it sends what it holds and keeps what
each reply sets (`Cookies`).
"""

from __future__ import annotations

import http.client
import http.cookies
import threading
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

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
    """The kept-alive connections to one server; safe to use from many threads."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.idle: list[tuple[float, http.client.HTTPConnection]] = []
        self.lock = threading.Lock()

    def post(self, path: str, body: bytes, cookies: Cookies) -> tuple[int, bytes]:
        """The reply's status and body. OSError or http.client.HTTPException when no whole reply came."""
        conn = self._take()
        headers = {"Content-Type": "application/json"}
        if (cookie := cookies.header()) is not None:
            headers["Cookie"] = cookie
        try:
            conn.request("POST", self.prefix + path, body, headers)
            resp = conn.getresponse()
            raw = resp.read()
        except BaseException:
            conn.close()
            self.close()
            raise
        cookies.take(resp.headers.get_all("Set-Cookie") or [])
        if resp.will_close:
            conn.close()
        else:
            with self.lock:
                self.idle.append((time.monotonic(), conn))
        return resp.status, raw

    def _take(self) -> http.client.HTTPConnection:
        now, stale = time.monotonic(), []
        with self.lock:
            while self.idle:
                since, conn = self.idle.pop()
                if now - since < IDLE_S:
                    break
                stale.append(conn)
            else:
                conn = None
        for old in stale:
            old.close()
        if conn is not None:
            return conn
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for _, conn in idle:
            conn.close()


_POOLS: dict[tuple[str, int | None, float], Connections] = {}
_POOLS_LOCK = threading.Lock()


def connections(base_url: str, pid: int | None, timeout_s: float) -> Connections:
    """The pool for a server: its address, and the process rollbook started there (None: one the
    operator runs), so a process started afresh on the same port never gets its predecessor's."""
    key = (base_url, pid, timeout_s)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            for old in [k for k in _POOLS if k[0] == base_url]:
                _POOLS.pop(old).close()  # a predecessor's: its process is gone
            pool = _POOLS[key] = Connections(base_url, timeout_s)
        return pool
