"""A harness's one way out of its jail: a relay to its own attempt's model route.

A sandbox session's jail has a network namespace of its own with nothing in it
(participants/environments/sandbox.py). The relay's listening socket is made inside that namespace
by the agent server (root, outside the jail), on the jail's loopback, and served by the agent
server's own event loop: the harness connects to `http://127.0.0.1:<port>/v1`, which is all it is
told. Every request under `/v1/` goes to the model server's `/ng-rollout/<capture>/v1/...`, the
capture naming (rollout, attempt, activation), with the data credential added here; the harness
holds no credential (whatever key it sends is dropped) and reaches no other address or route.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from participants.base.http_errors import json_reply

CLONE_NEWNET = 0x40000000
SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40
# What the relay copies back from the model server's reply; hop-by-hop and length headers are its own.
REPLY_HEADERS = ("Content-Type", "Cache-Control")


def listen_in(pid: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 of the network namespace `pid` is in, its loopback up.

    A namespace is entered per thread: a thread of its own enters it, makes the socket (which stays
    in that namespace) and leaves, so no other thread of this server ever sees the jail's network."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        theirs = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(theirs, CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"setns into the network namespace of {pid}: {os.strerror(code)}")
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("127.0.0.1", 0))
                sock.listen(64)
                sock.setblocking(False)
                made.append(sock)
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:  # the thread ends next; back all the same
                    failed.append(OSError(ctypes.get_errno(), "setns back"))
        except BaseException as exc:
            failed.append(exc)
        finally:
            os.close(own)
            os.close(theirs)

    thread = threading.Thread(target=enter, name=f"egress-{pid}", daemon=True)
    thread.start()
    thread.join()
    if failed and not made:
        raise failed[0]
    return made[0]


class Relay:
    """One activation's relay: `await start(pid)` listens in the jail, `port` is where, `await stop()`."""

    def __init__(self, target: Callable[[], Awaitable[str]], capture: str, secret: str | None,
                 timeout: aiohttp.ClientTimeout) -> None:
        self.target = target  # a live model instance's base URL, asked per request
        self.capture = capture
        self.auth = aiohttp.BasicAuth("rollbook", secret) if secret else None
        self.timeout = timeout
        self.runner: web.AppRunner | None = None
        self.http: aiohttp.ClientSession | None = None
        self.port = 0
        self.forwarded = 0
        self.refused = 0

    async def start(self, pid: int) -> None:
        sock = listen_in(pid)
        self.port = sock.getsockname()[1]
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.http = aiohttp.ClientSession(timeout=self.timeout)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.http is not None:
            await self.http.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if not request.path.startswith("/v1/") or ".." in request.path:
            self.refused += 1
            return json_reply({"error": {"code": "relay_refused", "message": f"{request.path}: this relay "
                                          "reaches its attempt's model routes under /v1/ and nothing else"}},
                              status=404)
        assert self.http is not None
        base = (await self.target()).rstrip("/")
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        self.forwarded += 1
        reply: web.StreamResponse | None = None
        try:
            async with self.http.request(request.method, f"{base}/ng-rollout/{self.capture}{request.path_qs}",
                                         data=await request.read(), headers=headers, auth=self.auth) as up:
                reply = web.StreamResponse(status=up.status,
                                           headers={k: up.headers[k] for k in REPLY_HEADERS if k in up.headers})
                await reply.prepare(request)
                async for chunk in up.content.iter_any():
                    await reply.write(chunk)
                await reply.write_eof()
                return reply
        except (aiohttp.ClientError, OSError) as exc:
            if reply is not None:
                raise  # cut mid-reply: the harness sees its connection end, as from the model server itself
            return json_reply({"error": {"code": "model_unreachable", "message": f"{base}: {exc}"}}, status=502)


__all__ = ["Relay", "listen_in"]
