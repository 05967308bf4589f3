"""The environment server's app: its participant, built from the configuration, and its NeMo Gym front.

The outgoing addresses (the agent and resources servers it calls) come from here, from the
configuration, never from a request.
"""

from __future__ import annotations

from aiohttp import web

from engine.checkpoint import ParticipantStore
from participants.base.app import build_app
from participants.base.guard import Credentials
from participants.environment.nemo_gym import EnvironmentFront
from participants.environment.server import EnvironmentParticipant
from participants.environments import enabled_environments


def build_environment_app(store: ParticipantStore, credentials: Credentials, agent_url: str, resources_url: str,
                          instance: str = "environment-0",
                          environments: frozenset[str] = enabled_environments(sandbox=False)) -> web.Application:
    """NeMo Gym's episode protocol comes in on `POST /run`."""
    participant = EnvironmentParticipant(store, instance, credentials.data, agent_url, resources_url, environments)
    return build_app(participant, credentials, fronts=EnvironmentFront(participant).routes())


__all__ = ["build_environment_app"]
