"""The front of a server run with `workers = N`: its one public address, routing every request to a worker.

A front holds no state and runs no work. A request about one rollout (a data route under
/rollouts/{rollout_id}/attempts/{attempt}/, an episode) goes to the live worker the routing rule picks
for it (participants/base/routing.py, the same rule a caller that reads the log applies itself), so a
session's requests reach the one process that holds it. When that worker does not answer (it was
killed: the connection is refused or cut before a reply began), the front reads the live set again
and sends the request where it says now; the worker it moves to takes the session over from the log
under the ownership and recovery rules (engine/ownership.py, engine/recovery.py). Every request a
server takes may be asked again (an activation by its index, a model call by its id, a tool call by
its key), so sending it again is what any caller would do; the caller sees one reply, never an error
it must handle. A reply already under way when its worker dies cannot be sent again: that
connection is cut, as the worker's own would have been.

Control operations (prepare, commit, resume, restore) are driven by the coordinator on every live
worker directly, each recorded in the log as a member (apps/participant_set.py); one that reaches the
front anyway is sent to every live worker of this front, and the first refusal is the answer, so a
checkpoint never closes only some of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from aiohttp import web
from yarl import URL

from adapters.http_client import CONTROL, PeerTimeouts
from participants.base.http_errors import error_response
from participants.base.routing import Peers, pick, request_key
from participants.base.wire import CAPTURE_COOKIE

# Not passed on: they describe one hop, and aiohttp sets its own for the next.
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})
FIRST_WAIT_S = 0.05
LAST_WAIT_S = 1.0
MAX_BODY = 64 * 1024 * 1024  # as large as the largest a worker accepts; the worker applies its own limit


class NoWorker(Exception):
    """No live worker answered within the front's patience."""


class Front:
    def __init__(self, kind: str, peers: Peers, own: Callable[[], Sequence[str]], timeouts: PeerTimeouts,
                 patience_s: float = 60.0) -> None:
        """`peers`: the live workers of the kind, from the log; `own`: this front's workers that are running."""
        self.kind, self.peers, self.own, self.timeouts, self.patience_s = kind, peers, own, timeouts, patience_s
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=MAX_BODY)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def _close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            if request.path.startswith(CONTROL) and request.method == "POST":
                return await self._to_every_worker(request, headers, body)
            key = request_key(request.method, request.path, body, request.cookies.get(CAPTURE_COOKIE))
            return await self._to_one_worker(request, headers, body, key)
        except NoWorker:
            return error_response("participant_unavailable",
                                  f"no live {self.kind} worker answered within {self.patience_s:g} s")
        except TimeoutError:
            return error_response("participant_unavailable", f"the {self.kind} worker stayed silent past the limit")

    async def _live(self, key: tuple[str, int] | None) -> str | None:
        if key is None:
            running = self.own()
            return running[0] if running else None
        return pick(await self.peers.live(), *key)

    async def _to_one_worker(self, request: web.Request, headers: dict[str, str], body: bytes,
                             key: tuple[str, int] | None) -> web.StreamResponse:
        wait, waited = FIRST_WAIT_S, 0.0
        while True:
            url = await self._live(key)
            if url is not None:
                try:
                    return await self._relay(request, url, headers, body)
                except (aiohttp.ClientConnectionError, OSError):
                    self.peers.forget()  # no reply began; its parent records a dead worker stopped at once
            if waited >= self.patience_s:
                raise NoWorker
            await asyncio.sleep(wait)
            waited += wait
            wait = min(wait * 2, LAST_WAIT_S)

    async def _relay(self, request: web.Request, url: str, headers: dict[str, str], body: bytes) -> web.StreamResponse:
        assert self.session is not None
        # The path as it came, still escaped: a tool name is one escaped segment (the agent makes it so), and
        # decoding it here would let "a%2F..%2F.." name another route on the worker.
        target = URL(url + request.raw_path, encoded=True)
        async with self.session.request(request.method, target, headers=headers, data=body,
                                        timeout=self.timeouts.for_url(str(target)), allow_redirects=False) as upstream:
            reply = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                       headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await reply.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await reply.write(chunk)
            except (aiohttp.ClientError, OSError):
                # The worker died mid-reply (or the caller left): cut this connection as the worker's was
                # cut; the caller asks again, as after any cut, and the log answers.
                if request.transport is not None:
                    request.transport.close()
                return reply
            await reply.write_eof()
            return reply

    async def _to_every_worker(self, request: web.Request, headers: dict[str, str], body: bytes) -> web.Response:
        assert self.session is not None
        workers = list(self.own())
        if not workers:
            raise NoWorker
        replies = await asyncio.gather(*(self._call(URL(u + request.raw_path, encoded=True), headers, body)
                                         for u in workers))
        status, text, ctype = next((r for r in replies if r[0] >= 400), replies[0])
        return web.Response(status=status, body=text, content_type=ctype)

    async def _call(self, url: URL, headers: dict[str, str], body: bytes) -> tuple[int, bytes, str]:
        assert self.session is not None
        try:
            async with self.session.post(url, headers=headers, data=body, timeout=self.timeouts.for_url(str(url))) as resp:
                return resp.status, await resp.read(), resp.content_type
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # A worker that does not answer fails the operation closed, as a member that does not answer would.
            failed = error_response("participant_unavailable", f"{self.kind} worker {url} did not answer: "
                                    f"{type(exc).__name__}")
            return failed.status, failed.body, "application/json"  # type: ignore[return-value]


def front_app(front: Front, on_bind: Callable[[], Awaitable[None]]) -> web.Application:
    """The front's app, starting its workers once it listens (adapters.http_server.AFTER_BIND)."""
    from adapters.http_server import AFTER_BIND

    front.app.setdefault(AFTER_BIND, []).append(on_bind)
    return front.app


__all__ = ["Front", "NoWorker", "front_app"]
