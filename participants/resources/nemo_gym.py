"""NeMo Gym's tool routes on rollbook's resources server: what a NeMo Gym agent calls, unchanged.

NeMo Gym's `simple_agent` calls a tool as `POST /<tool name>` on its resources server, with the
tool's arguments as the body and the cookies it was called with, and shows the model the reply's
body as text. rollbook calls such an agent with its activation's id in a cookie
(participants.base.wire.CAPTURE_COOKIE): the call goes to that attempt's session like any tool call
that names no key (numbered by the server, answered from the log when the agent runs again:
engine.agent_replay), and the reply is the tool's output alone, spelt canonically. A refusal is rollbook's error body,
which the agent shows the model as the tool's output, as it does a NeMo Gym server's; a call a
checkpoint's closed admission refuses waits for resume instead.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import RootModel

from engine.errors import (
    AdmissionClosed,
    AgentDiverged,
    InvalidIdentifier,
    NotFound,
    StaleAttempt,
    ToolCallRefused,
)
from engine.events import canonical_json
from participants.base.guard import Route
from participants.base.wire import NG_ROLLOUT
from participants.resources.server import ResourcesParticipant
from participants.resources.wire import ToolRequest


class ToolArguments(RootModel[dict[str, Any]]):
    """A NeMo Gym tool call's body: the arguments themselves."""


class ResourcesFront:
    def __init__(self, p: ResourcesParticipant) -> None:
        self.p = p

    def routes(self) -> list[Route]:
        errors = (InvalidIdentifier, StaleAttempt, NotFound, AdmissionClosed, ToolCallRefused, AgentDiverged)
        # An agent that names its rollout in the path instead (NeMo Gym's ServerClient with observability
        # on, as gymnasium_agent's `/run` is driven: its /reset and /step) reaches the same call.
        return [Route("POST", "/{name}", self.call_tool, ToolArguments, None, errors, basic=True, name="nemo_gym_tool"),
                Route("POST", f"{NG_ROLLOUT}/{{name}}", self.call_tool, ToolArguments, None, errors, basic=True,
                      name="nemo_gym_rollout_tool")]

    async def call_tool(self, request: web.Request, body: ToolArguments) -> web.Response:
        while True:
            try:
                reply = await self.p.call_tool(request, ToolRequest(arguments=body.root))
                break
            except AdmissionClosed:
                # A NeMo Gym agent shows a refusal to its model as the tool's output, which an
                # uninterrupted run never sees: the call waits the checkpoint out here instead (it
                # changed nothing, and gave its number back), then is asked again.
                await self.p.admission.wait_open()
        # Spelt canonically: the model is shown this text, and the answer a replayed call gets back from
        # the log (whose JSON keeps no key order) must be the same text, or the agent's next request differs.
        output = json.loads(reply.body)["output"]  # type: ignore[arg-type]
        return web.Response(text=canonical_json(output), content_type="application/json")


__all__ = ["ResourcesFront"]
