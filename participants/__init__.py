"""The four servers, one package a kind (agent/, environment/, model/, resources/), over what they
share (base/) and the environments (environments/).

A module that moved keeps its old import path as a clear error: importing it raises
ModuleNotFoundError naming where it lives now, so a config, entry point or backend plugin written
against the old layout says what to change instead of failing with a bare "no module". (Every
server loads this package before it loads a plugin, so the old adapters path is caught here too.)
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "participants.agent_server": "participants.agent.server",
    "participants.environment_server": "participants.environment.server",
    "participants.model_server": "participants.model.server",
    "participants.model_calls": "participants.model.calls",
    "participants.model_progress": "participants.model.progress",
    "participants.model_replies": "participants.model.replies",
    "participants.scripted_model": "participants.model.backends.scripted",
    "participants.openai_wire": "adapters.openai_wire",
    "adapters.generation": "participants.model.backends (OpenAICompatibleBackend: "
                           "participants.model.backends.openai_compatible)",
    "participants.resources_server": "participants.resources.server",
    "participants.resources_wire": "participants.resources.wire",
    "participants.replay": "apps.replay",
    "participants.nemo_gym_relay": "participants.environments.nemo_gym_relay",
    "participants.nemo_gym_launcher": "participants.environments.nemo_gym_launcher",
    "participants.nemo_gym_wire": "participants.base.nemo_gym_rows (the fronts: participants.agent.nemo_gym, "
                                  "participants.environment.nemo_gym)",
    "participants.servers": "participants.<kind>.app (build_agent_app, build_environment_app, build_model_app, "
                            "build_resources_app)",
    **{f"participants.{m}": f"participants.base.{m}" for m in (
        "app", "control_plane", "front", "guard", "http_errors", "instances", "keyed_locks", "observability",
        "openapi", "owners", "participant", "routing", "wire")},
}


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname in MOVED:
            raise ModuleNotFoundError(f"{fullname} moved: it is now {MOVED[fullname]}", name=fullname)
        return None


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
