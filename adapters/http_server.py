"""The servers' listening side, bounded: how long a client may take to send a request, and how many
connections one server holds.

aiohttp reads a request's head and body for as long as the client cares to send them, and accepts
every connection it is offered, so one client trickling bytes (or opening thousands of
connections) holds a file descriptor, a task and a parser each, indefinitely. Here:

- a request's head must arrive whole within `head_s` of its first byte;
- its body within `body_s` of its head (a handler that is still reading it does not stretch this:
  bodies are at most a few MiB, read as soon as the route is matched);
- past `max_connections` open connections, a new one is answered 503 `participant_unavailable`
  (which every rollbook client treats as "ask again") and closed.

An idle keep-alive connection between two requests is aiohttp's own `keepalive_timeout` (75 s, its
default): longer than a client keeps an idle connection (aiohttp's client: 15 s), so a client never
sends a request on a connection the server is closing, which fails it ("Server disconnected").
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("rollbook.http")
KEEPALIVE_S = 75.0


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts from its clients ([limits] in the config; apps/config.py)."""

    head_s: float = 15.0
    body_s: float = 60.0
    max_connections: int = 512


_BUSY = json.dumps({"error": {"code": "participant_unavailable",
                              "detail": "this server holds as many connections as it is allowed; ask again"}}).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Content-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class _BoundedHandler(RequestHandler):
    """aiohttp's protocol, with a deadline on each request's head and body and a connection cap."""

    def __init__(self, manager: Any, *, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._head_deadline: float | None = None  # set by a head's first byte, cleared when it is whole
        self._body: StreamReader | None = None  # the body still arriving, and when it must be in
        self._body_deadline = 0.0
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        if manager is not None and len(manager.connections) >= self._limits.max_connections:
            # A connection kept alive between requests gives way first: at 500 rollouts in flight the
            # callers' pools held every slot of the resources server idle, and a checkpoint's prepare,
            # on a connection of its own, was refused.
            idle = next((h for h in manager.connections if isinstance(h, _BoundedHandler) and h.idle()), None)
            if idle is not None:
                idle.force_close()
                super().connection_made(transport)
                return
            # Never handed to aiohttp: no task, no parser, the descriptor closed after one write.
            self._refused = True
            log.warning("refused a connection: %d open, the limit is %d", len(manager.connections),
                        self._limits.max_connections)
            tr: Any = transport
            tr.write(REFUSAL)
            tr.close()
            return
        super().connection_made(transport)

    def idle(self) -> bool:
        """Kept alive after a request and waiting for the next: not one that never spoke (those hold
        their slot until head_s), and not one in the middle of a request."""
        return (self._request_count > 0 and self._current_request is None and not self._messages
                and self._head_deadline is None and self._body is None and self.transport is not None)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        loop = self._loop
        # aiohttp calls this with b"" itself between requests (to parse what it buffered): no new head.
        if data and self._body is None and self._head_deadline is None:
            self._head_deadline = loop.time() + self._limits.head_s
            loop.call_at(self._head_deadline, self._check)
        before = self._request_count
        super().data_received(data)
        if self._request_count > before:  # a head is whole (and maybe a body or more heads behind it)
            self._head_deadline = None
            payload = self._messages[-1][1] if self._messages else None
            if isinstance(payload, StreamReader) and not payload.is_eof():
                self._body = payload
                self._body_deadline = loop.time() + self._limits.body_s
                loop.call_at(self._body_deadline, self._check)
        if self._body is not None and self._body.is_eof():
            self._body = None

    def _check(self) -> None:
        if self.transport is None:
            return
        now = self._loop.time()
        if self._head_deadline is not None and now >= self._head_deadline:
            what = f"its request head did not arrive within {self._limits.head_s:g} s"
        elif self._body is not None and not self._body.is_eof() and now >= self._body_deadline:
            what = f"its request body did not arrive within {self._limits.body_s:g} s"
        else:
            return
        log.warning("closed a connection from %s: %s", self.peername, what)
        self.force_close()


class _BoundedServer(web.Server):
    def __init__(self, *args: Any, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits

    def __call__(self) -> RequestHandler:
        return _BoundedHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)


class BoundedAppRunner(web.AppRunner):
    """web.AppRunner whose connections are bounded by `limits`."""

    def __init__(self, app: web.Application, limits: ServerLimits, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_S)
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        # The app is started by the call above; only the protocol factory differs.
        return _BoundedServer(plain.request_handler, request_factory=plain.request_factory,
                              handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
                              limits=self._limits, **plain._kwargs)


# Run once the server listens, before it serves its first request: only then may a process claim an
# address (a server recording itself before its bind could claim one another process holds).
AFTER_BIND: web.AppKey[list[Callable[[], Awaitable[None]]]] = web.AppKey("after_bind", list)


def run_bounded(app: web.Application, host: str, port: int, limits: ServerLimits) -> None:
    """web.run_app with the bounds above: until SIGINT or SIGTERM, then a graceful shutdown.
    Raises OSError (EADDRINUSE) when the port is taken, before serving anything."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    # A blocking call (a sandbox's command, a NeMo Gym server starting) holds a thread for as long as it
    # takes: a command's minutes. With the default pool (cores + 4) a few such calls would stall every
    # other connection's; one thread per connection lets none wait on another.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=limits.max_connections))
    # As web.run_app does: a handler is not cancelled when its client goes away (its work is in the log).
    runner = BoundedAppRunner(app, limits, handle_signals=True, access_log=None, handler_cancellation=False)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        for hook in app.get(AFTER_BIND, []):
            await hook()

    try:
        loop.run_until_complete(start())
        loop.run_forever()
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            loop.run_until_complete(runner.cleanup())
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
