"""A small JSON client for server-to-server data calls (environment -> agent -> model, resources).

A participant's error reply `{"error": {"code", "detail"}}` comes back as the engine exception
of the same code, so a caller handles a remote `admission_closed` or `stale_attempt` exactly as
it would a local one; the code -> class map is built from the RollbookError tree itself, so a
new error class is understood here without being listed.

Every request is bounded (`PeerTimeouts`): a peer that accepts the connection and never answers
fails the call with `participant_unavailable` after the timeout, and the caller's `Patience` decides
whether to ask again. The bound is on silence, not on the whole reply: a read waits at most `reply_s`
for the next bytes. A reply that legitimately takes as long as the work behind it (an agent's
activation, an episode: `/run`, `/episodes`) is sent whole at the end, so its silence lasts that long and it gets
`work_s` instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from engine.capability import capability
from engine.errors import ParticipantUnavailable, RollbookError
from engine.events import dumps, loads

# The paths every server mounts (participants.base.control_plane) and every client calls.
PREFIX = "/rollbook/v1"
CONTROL = f"{PREFIX}/control"




@dataclass(frozen=True)
class PeerTimeouts:
    """How long a server waits on another server ([limits] in the config; apps/config.py)."""

    connect_s: float = 10.0  # to open the TCP connection
    # Silence while waiting for a reply's next bytes: a model generation, a tool call (above the
    # sandbox's timeout_s), a resources step, a checkpoint operation's answer.
    reply_s: float = 900.0
    # Silence on the routes whose reply is sent when the work ends (LONG_REPLY_PATHS): an activation or
    # an episode may run for hours; a peer hung this long is reported rather than waited on forever.
    work_s: float = 86400.0

    def for_url(self, url: str) -> aiohttp.ClientTimeout:
        read = self.work_s if urlsplit(url).path.rstrip("/").endswith(LONG_REPLY_PATHS) else self.reply_s
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s, sock_read=read)


# The agent's activation (environment -> agent) and a NeMo Gym episode (agent -> environment) end in
# /run, a framework's dispatch (`rollbook run` -> environment) in /episodes: each reply comes only when
# the activation or the episode is over.
LONG_REPLY_PATHS = ("/run", "/episodes")
_default_timeouts = PeerTimeouts()


def set_default_timeouts(timeouts: PeerTimeouts) -> None:
    """The process's bounds for clients built without their own (`rollbook serve` sets the config's)."""
    global _default_timeouts
    _default_timeouts = timeouts


def default_timeouts() -> PeerTimeouts:
    return _default_timeouts


class RemoteError(RollbookError):
    """An error code no engine class carries (e.g. `tool_error`); the code is kept as sent."""

    def __init__(self, code: str, detail: str, status: int = 500, **context: Any) -> None:
        super().__init__(detail, **context)
        self.code = code
        self.status = status


def error_classes() -> dict[str, type[RollbookError]]:
    """Every RollbookError subclass by its code; the most general class wins a shared code."""
    out: dict[str, type[RollbookError]] = {}
    stack: list[type[RollbookError]] = [RollbookError]
    while stack:
        cls = stack.pop(0)  # breadth first: a parent is seen before any subclass reusing its code
        if cls is not RemoteError:
            out.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())
    return out


def error_from_reply(status: int, body: Any) -> RollbookError:
    """The exception a JSON error reply stands for."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return RemoteError(f"http_{status}", f"HTTP {status}: {str(body)[:200]}", status)
    code = str(err.get("code") or f"http_{status}")
    detail = str(err.get("detail") or code)
    context = err.get("context") if isinstance(err.get("context"), dict) else {}
    cls = error_classes().get(code)
    if cls is not None and cls is not RollbookError:
        try:
            return cls(detail, **context)
        except TypeError:  # a subclass with its own constructor: keep the code, lose nothing else
            pass
    return RemoteError(code, detail, status, **context)


def unpooled_session(**kwargs: Any) -> aiohttp.ClientSession:
    """A client session with no cap on its connections. aiohttp caps a session at 100, and a hop that
    holds a connection for a whole episode or activation (dispatch, /run) then queued the 101st
    rollout, and any request behind it, for as long as one of the first hundred lasted: the callers'
    own concurrency (the rollouts in flight) is the bound, and the callee caps what it accepts. Bodies
    are written by engine.events.dumps, not json.dumps."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), **{"json_serialize": dumps, **kwargs})


class JsonClient:
    """POST/GET JSON with an optional bearer token; errors raise, successes return the body."""

    def __init__(self, token: str | None = None, timeouts: PeerTimeouts | None = None) -> None:
        self.token = token
        self._timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def _headers(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        headers.update(extra or {})
        return headers

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created lazily inside the running loop: aiohttp sessions are bound to the loop that made them.
        if self._session is None or self._session.closed:
            self._session = unpooled_session()
        return self._session

    @property
    def timeouts(self) -> PeerTimeouts:
        return self._timeouts or default_timeouts()

    async def request(self, method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None) -> Any:
        try:
            async with self.session.request(method, url, json=body, headers=self._headers(headers),
                                            timeout=self.timeouts.for_url(url)) as resp:
                raw = await resp.read()
                try:
                    data = loads(raw) if raw else None
                except (json.JSONDecodeError, UnicodeDecodeError):
                    data = raw.decode(errors="replace")  # a proxy's or a crashed handler's plain-text page
                if resp.status >= 400:
                    raise error_from_reply(resp.status, data)
                return data
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            # A timeout is a peer that did not answer in time: the caller's Patience may ask again.
            said = str(exc) or type(exc).__name__
            raise ParticipantUnavailable(f"{method} {url} got no answer: {said}") from exc

    async def post(self, url: str, body: Any = None, headers: Mapping[str, str] | None = None) -> Any:
        return await self.request("POST", url, {} if body is None else body, headers)

    async def get(self, url: str, headers: Mapping[str, str] | None = None) -> Any:
        return await self.request("GET", url, None, headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def as_attempt(secret: str | None, rollout_id: str, attempt: int) -> dict[str, str]:
    """The Authorization header of a request that speaks for one attempt only (engine.capability):
    the server it reaches refuses it anywhere but that attempt's routes. None without a secret."""
    return {"Authorization": f"Bearer {capability(secret, rollout_id, attempt)}"} if secret else {}


def data_url(base: str, rollout_id: str, attempt: int, suffix: str) -> str:
    """The identity-prefixed data route of another server."""
    return f"{base.rstrip('/')}/rollouts/{rollout_id}/attempts/{attempt}{suffix}"
