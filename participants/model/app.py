"""The model server's app: its participant, built from the configuration."""

from __future__ import annotations

from aiohttp import web

from engine.checkpoint import ParticipantStore
from participants.base.app import build_app
from participants.base.guard import Credentials
from participants.model.backends import GenerationBackend
from participants.model.calls import TokenStore
from participants.model.progress import PROGRESS_S
from participants.model.server import ModelParticipant


def build_model_app(
    store: ParticipantStore, backend: GenerationBackend, token_store: TokenStore, credentials: Credentials,
    instance: str = "model-0", progress_s: float = PROGRESS_S,
) -> web.Application:
    participant = ModelParticipant(store, backend, token_store, instance, progress_s)
    return build_app(participant, credentials)


__all__ = ["build_model_app"]
