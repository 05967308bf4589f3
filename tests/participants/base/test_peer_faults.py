"""A caller killed while it sends a request body (a SIGKILLed environment server mid-POST to the
agent, seen by tests/e2e/test_random_faults.py) must not make the server print a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from aiohttp import web

from participants.base.http_errors import errors_as_json
from tests.waiting import NeverHappened, eventually


async def test_a_caller_gone_mid_body_is_one_log_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    reached = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        reached.set()
        await request.json()  # the body never arrives in full
        return web.json_response({})

    app = web.Application(middlewares=[errors_as_json])
    app.router.add_post("/run", handler)
    # As `rollbook serve` runs it (web.run_app: a handler is not cancelled when its caller goes away).
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        with caplog.at_level(logging.INFO):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            # Input: headers that promise 1000 bytes, 10 of them, then the connection is gone.
            writer.write(b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"rollout\":")
            await writer.drain()
            await asyncio.wait_for(reached.wait(), 10)
            writer.transport.abort()
            with contextlib.suppress(NeverHappened):  # what the server logged, or did not, is asserted below
                await eventually("the server's word on the lost request", lambda: any(
                    "closed the connection" in r.getMessage() or r.exc_info for r in caplog.records), timeout=2)
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert any("the client closed the connection before its request body arrived" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
