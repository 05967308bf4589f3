"""The sign-in of `rollbook ui`: sessions, their cookies, CSRF tokens, `next` and the failure limit.

Everything here lives in the memory of one ui process and is drawn afresh when it starts, so a
restart revokes every session and retires every cookie name. Cookies ignore ports: a cookie set by
http://127.0.0.1:8200 is sent to every other port of 127.0.0.1, where any local user may listen. So
over plain HTTP a browser signs in only at this process's own host name, `rb-<random>.localhost`
(every `*.localhost` name is this machine, RFC 6761; Chromium resolves them to the loopback address
without asking DNS), which nobody learns but whoever reads the line the ui prints: a browser sends that host's cookies to
no other host, and another listener is never visited under a name it cannot guess. Over TLS the
cookie is `__Host-` prefixed and Secure instead, and any host name will do.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

COOKIE_PREFIX = "rb_session_"
SIGNIN_PREFIX = "rb_signin_"
TLS_PREFIX = "__Host-"
SESSION_TTL_S = 8 * 3600
MAX_SESSIONS = 256  # sign-ins need the credential, but memory is bounded all the same: the oldest go first
FAILURES = 5  # wrong credentials (or CSRF tokens) per client address per window before sign-in is refused
FAILURE_WINDOW_S = 60.0


def safe_next(value: str) -> str:
    """`value` if a browser would read it as a path of this app, else the app's home.

    A browser's URL parser drops tabs and newlines anywhere, strips leading and trailing control
    characters and spaces, and reads a backslash as a slash, so `/\\host`, `/\\t/host` and `//host`
    all leave this origin. Refusing every such character (and anything not printable ASCII, which a
    path this app writes never holds: it sends the raw, percent-encoded form) leaves only strings
    whose origin is this app's."""
    if not value.startswith("/") or value.startswith("//"):
        return "/"
    if any(not ("!" <= c <= "~") or c == "\\" for c in value):
        return "/"
    parts = urlsplit(value)
    return "/" if parts.scheme or parts.netloc else value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class Session:
    expires: float
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))


@dataclass
class Auth:
    """One ui process's sign-in state. `ttl_s`: how long a session lasts from its sign-in."""

    ttl_s: float = SESSION_TTL_S
    failures: int = FAILURES
    window_s: float = FAILURE_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    _sessions: OrderedDict[str, Session] = field(default_factory=OrderedDict)
    _failed: dict[str, list[float]] = field(default_factory=dict)

    @property
    def host(self) -> str:
        """The host name a browser signs in at over plain HTTP."""
        return f"rb-{self.instance}.localhost"

    def cookie(self, secure: bool) -> str:
        return (TLS_PREFIX if secure else "") + COOKIE_PREFIX + self.instance

    def signin_cookie(self, secure: bool) -> str:
        return (TLS_PREFIX if secure else "") + SIGNIN_PREFIX + self.instance

    def _now(self) -> float:
        return self.clock()

    # Sessions.

    def start(self) -> tuple[str, Session]:
        now = self._now()
        for sid in [s for s, v in self._sessions.items() if v.expires <= now]:
            del self._sessions[sid]
        while len(self._sessions) >= MAX_SESSIONS:
            self._sessions.popitem(last=False)
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = session = Session(expires=now + self.ttl_s)
        return sid, session

    def session(self, sid: str) -> Session | None:
        session = self._sessions.get(sid) if sid else None
        if session is not None and session.expires <= self._now():
            del self._sessions[sid]
            return None
        return session

    def end(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    # The sign-in form's CSRF token: bound to a random value in a cookie of its own, so only the
    # browser that was shown the form can post it (and nothing is kept per visitor).

    def new_nonce(self) -> str:
        return secrets.token_urlsafe(32)

    def signin_csrf(self, nonce: str) -> str:
        return hmac.new(self._key, b"sign-in " + nonce.encode(), hashlib.sha256).hexdigest()

    def signin_ok(self, nonce: str, token: str) -> bool:
        return bool(nonce) and hmac.compare_digest(token.encode(), self.signin_csrf(nonce).encode())

    # The failure limit.

    def retry_after(self, client: str) -> int:
        """Seconds until `client` may try again; 0 when it may now."""
        now = self._now()
        recent = [t for t in self._failed.get(client, []) if t > now - self.window_s]
        if recent:
            self._failed[client] = recent
        else:
            self._failed.pop(client, None)
        if len(recent) < self.failures:
            return 0
        return max(1, int(recent[0] + self.window_s - now + 0.999))

    def failed(self, client: str) -> None:
        now = self._now()
        if len(self._failed) > 4096:  # addresses that stopped failing long ago are forgotten
            self._failed = {c: ts for c, ts in self._failed.items() if ts[-1] > now - self.window_s}
        self._failed.setdefault(client, []).append(now)
