"""The agent server's app: its participant, built from the configuration, and its NeMo Gym front.

The outgoing addresses (the model, resources and environment servers it calls) come from here, from
the configuration, never from a request.
"""

from __future__ import annotations

from aiohttp import web

from engine.checkpoint import ParticipantStore
from participants.agent.external import ExternalAgents
from participants.agent.nemo_gym import AgentFront
from participants.agent.server import AgentParticipant
from participants.base.app import build_app
from participants.base.guard import Credentials


def build_agent_app(store: ParticipantStore, credentials: Credentials, model_url: str, resources_url: str,
                    instance: str = "agent-0", participant_cls: type[AgentParticipant] = AgentParticipant,
                    environment_url: str | None = None, agents: ExternalAgents | None = None) -> web.Application:
    """NeMo Gym's flat rows, relayed by its legacy_agent, come in on `POST /run` (no identity in the
    path) and run as episodes on `environment_url`; a task that names one of `agents` is run by it."""
    participant = participant_cls(store, instance, credentials.data, model_url, resources_url)
    participant.environment_url = environment_url
    participant.external_agents = agents
    return build_app(participant, credentials, fronts=AgentFront(participant).routes())


__all__ = ["build_agent_app"]
