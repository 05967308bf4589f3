"""Each server kind's app: its participant, built from the configuration, and its NeMo Gym front.

The outgoing addresses (the model, resources, agent and environment servers a participant calls)
come from here, from the configuration, never from a request. The agent and environment servers
also speak NeMo Gym's wire (participants.nemo_gym_wire) on `POST /run`: its fronts are composed here,
so a server module knows nothing of the frameworks that call it.
"""

from __future__ import annotations

from aiohttp import web

from adapters.generation import GenerationBackend
from engine.checkpoint import ParticipantStore
from participants.agent_server import AgentParticipant
from participants.app import build_app
from participants.environment_server import EnvironmentParticipant
from participants.environments import enabled_environments
from participants.environments.sandbox import SandboxLimits
from participants.guard import Credentials
from participants.model_calls import TokenStore
from participants.model_progress import PROGRESS_S
from participants.model_server import ModelParticipant
from participants.nemo_gym_wire import AgentFront, EnvironmentFront
from participants.resources_server import ResourcesParticipant


def build_model_app(
    store: ParticipantStore, backend: GenerationBackend, token_store: TokenStore, credentials: Credentials,
    instance: str = "model-0", progress_s: float = PROGRESS_S,
) -> web.Application:
    participant = ModelParticipant(store, backend, token_store, instance, progress_s)
    return build_app(participant, credentials)


def build_resources_app(store: ParticipantStore, credentials: Credentials, instance: str = "resources-0",
                        sandbox: SandboxLimits | None = None) -> web.Application:
    """The resources server; `app[PARTICIPANT]` (participants.app) is its participant, for embedding and
    inspection. The sandbox environment is served only when `sandbox` gives its limits."""
    participant = ResourcesParticipant(store, instance, sandbox)
    return build_app(participant, credentials)


def build_agent_app(store: ParticipantStore, credentials: Credentials, model_url: str, resources_url: str,
                    instance: str = "agent-0", participant_cls: type[AgentParticipant] = AgentParticipant,
                    environment_url: str | None = None) -> web.Application:
    """NeMo Gym's flat rows, relayed by its legacy_agent, come in on `POST /run` (no identity in the
    path) and run as episodes on `environment_url`."""
    participant = participant_cls(store, instance, credentials.data, model_url, resources_url)
    participant.environment_url = environment_url
    return build_app(participant, credentials, fronts=AgentFront(participant).routes())


def build_environment_app(store: ParticipantStore, credentials: Credentials, agent_url: str, resources_url: str,
                          instance: str = "environment-0",
                          environments: frozenset[str] = enabled_environments(sandbox=False)) -> web.Application:
    """NeMo Gym's episode protocol comes in on `POST /run`."""
    participant = EnvironmentParticipant(store, instance, credentials.data, agent_url, resources_url, environments)
    return build_app(participant, credentials, fronts=EnvironmentFront(participant).routes())


__all__ = ["build_agent_app", "build_environment_app", "build_model_app", "build_resources_app"]
