"""The resources server's app: its participant, built from the configuration, and its NeMo Gym front."""

from __future__ import annotations

from aiohttp import web

from engine.checkpoint import ParticipantStore
from participants.base.app import build_app
from participants.base.guard import Credentials
from participants.environments.sandbox import SandboxLimits
from participants.resources.nemo_gym import ResourcesFront
from participants.resources.server import ResourcesParticipant


def build_resources_app(store: ParticipantStore, credentials: Credentials, instance: str = "resources-0",
                        sandbox: SandboxLimits | None = None) -> web.Application:
    """The resources server; `app[PARTICIPANT]` (participants.base.app) is its participant, for embedding and
    inspection. The sandbox environment is served only when `sandbox` gives its limits."""
    participant = ResourcesParticipant(store, instance, sandbox)
    return build_app(participant, credentials, fronts=ResourcesFront(participant).routes())


__all__ = ["build_resources_app"]
