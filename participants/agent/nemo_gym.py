"""NeMo Gym's legacy agent `/run` on rollbook's agent server: one flat row, one episode.

The row (participants.base.nemo_gym_rows) becomes an episode request sent to the environment
server's `/run`, and is answered with the row's fields plus a Responses-API `response` and a
`reward`, like a NeMo Gym agent's verify response.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from engine.errors import (
    EpisodeFailed,
    Forbidden,
    InvalidRequest,
    ParticipantUnavailable,
    RolloutIdRequired,
    TaskConflict,
)
from participants.agent.server import AgentParticipant
from participants.base.guard import SENT_BODY, Route
from participants.base.http_errors import json_reply
from participants.base.nemo_gym_rows import (
    EpisodeResponse,
    FlatRow,
    FlatRowReply,
    aggregate_route,
    flat_row_episode,
)


class AgentFront:
    """NeMo Gym's legacy agent `/run` on rollbook's agent server: one flat row, one episode."""

    def __init__(self, p: AgentParticipant) -> None:
        self.p = p

    def routes(self) -> list[Route]:
        return [Route("POST", "/run", self.run, FlatRow, FlatRowReply,
                      (RolloutIdRequired, TaskConflict, Forbidden, EpisodeFailed, ParticipantUnavailable),
                      basic=True, name="gym_flat_row"),
                aggregate_route()]

    async def run(self, request: web.Request, body: FlatRow) -> web.Response:
        row: dict[str, Any] = request[SENT_BODY]  # type: ignore[assignment]  # a FlatRow validated it: an object
        if body.responses_create_params is None:
            # Not a NeMo Gym row: rollbook's own agent route needs the identity in its path.
            raise RolloutIdRequired("POST /run takes a NeMo Gym row (responses_create_params, _ng_task_index, "
                                    "_ng_rollout_index); rollbook's own activations go to "
                                    "/rollouts/{rollout_id}/attempts/{attempt}/run")
        episode = flat_row_episode(row)
        if not self.p.environment_url:
            raise InvalidRequest("this agent server has no environment server configured to run NeMo Gym rows")
        reply = await self.p.client.post(f"{self.p.environment_url.rstrip('/')}/run", episode)
        out = EpisodeResponse.model_validate(reply)
        if out.failure is not None:
            raise EpisodeFailed(out.failure.failure_reason, failure_kind=out.failure.failure_kind, stage=out.failure.stage)
        result = out.result or {}
        return json_reply({**row, "response": result.get("response"), "reward": result.get("reward"),
                           "rollbook": result.get("rollbook")})


__all__ = ["AgentFront"]
