"""An aiohttp app from a participant: its control plane, its data routes, their OpenAPI document.

Every route goes through the same middlewares (errors as JSON, then the credential check of
participants.base.guard), is instrumented by participants.base.observability (GET /metrics added), and is
described in the server's OpenAPI document (participants.base.openapi). The lease watcher runs for the
app's lifetime; at shutdown the participant stops its work, at cleanup it closes its clients.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from engine.admission import Admission
from engine.errors import AdmissionClosed
from engine.phases import LEASE_GRACE_S
from participants.base.control_plane import ControlPlane
from participants.base.guard import MAX_BODY_BYTES, Credentials, Route, authenticate
from participants.base.http_errors import errors_as_json, json_reply
from participants.base.observability import observe
from participants.base.openapi import document
from participants.base.participant import Participant
from participants.base.wire import OPENAPI_PATH

PARTICIPANT: web.AppKey[Participant] = web.AppKey("participant", Participant)


def build_app(participant: Participant, credentials: Credentials, grace: float = LEASE_GRACE_S,
              fronts: Sequence[Route] = ()) -> web.Application:
    """An aiohttp app with the control plane, the participant's own routes and their OpenAPI document.

    `fronts` are routes that speak another framework's wire to the same participant (NeMo Gym's,
    participants.environment.nemo_gym), mounted beside its own. Every route, the document included, needs a
    credential (participants.base.guard)."""
    plane = ControlPlane(participant, grace)
    app = web.Application(middlewares=[errors_as_json, naming_the_checkpoint(participant.admission), authenticate(credentials)],
                          client_max_size=MAX_BODY_BYTES)
    app[PARTICIPANT] = participant

    @functools.cache
    def doc() -> dict[str, Any]:
        # Built on first request: pydantic's schemas take 40 ms of CPU, at every start of every server.
        return document(f"rollbook {participant.kind} server", routes)

    async def openapi(request: web.Request, _body: None) -> web.Response:
        return json_reply(doc())

    # Metrics and spans (participants.base.observability): phases and calls wrapped, GET /metrics added.
    routes = observe(app, [*plane.routes(), *participant.routes(), *fronts,
                           Route("GET", OPENAPI_PATH, openapi, None, None, (), "any", name="openapi")],
                     participant, plane.phases)
    app.add_routes([r.mount() for r in routes])

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(plane.watch_lease())
        yield
        task.cancel()

    async def stop(app: web.Application) -> None:
        await participant.stop()

    async def close(app: web.Application) -> None:
        await participant.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(stop)
    app.on_cleanup.append(close)
    return app


def naming_the_checkpoint(admission: Admission):  # type: ignore[no-untyped-def]
    """Every `admission_closed` this server answers names the checkpoint that holds it closed, whichever
    handler refused: a caller that has resumed from that checkpoint knows this server's resume is on its
    way and asks again at once (engine.admission.Admission.callee_resuming) instead of backing off."""
    @web.middleware
    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        try:
            return await handler(request)
        except AdmissionClosed as exc:
            if admission.closed_for is not None:
                exc.context.setdefault("checkpoint_id", admission.closed_for)
            raise
    return middleware


__all__ = ["PARTICIPANT", "build_app", "naming_the_checkpoint"]
