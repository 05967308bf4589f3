"""The environments, by name: every entry point of the group `rollbook.environments`.

rollbook's own five are declared in its pyproject.toml; a package outside rollbook adds one the
same way, and from then on the servers, `make_task`, `rollbook tasks from-gym` and the conformance
suite all see it:

    [project.entry-points."rollbook.environments"]
    coin = "my_package.coin:CoinEnvironment"    # the name must equal the class's `name`
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from .base import JSON, Environment, StateMode, Task, ToolError, ToolOutcome, Trajectory, Verification

ENTRY_POINT_GROUP = "rollbook.environments"


def registered_environments() -> dict[str, type[Environment]]:
    """Load every environment registered under the entry point group, checking each."""
    found: dict[str, type[Environment]] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}) is not an Environment subclass")
        if cls.name != ep.name:
            raise ValueError(f"entry point {ep.name} = {ep.value} names a class whose name is {cls.name!r}")
        if ep.name in found and found[ep.name] is not cls:
            raise ValueError(f"two entry points register an environment named {ep.name!r}")
        found[ep.name] = cls
    if not found:
        # A checkout whose installed metadata predates the entry points: say how to fix it.
        raise RuntimeError(f"no environment is registered under the entry point group {ENTRY_POINT_GROUP!r}; "
                           "reinstall rollbook (pip install -e .) so its metadata declares its own")
    return found


ENVIRONMENTS: dict[str, type[Environment]] = registered_environments()


def enabled_environments(sandbox: bool) -> frozenset[str]:
    """The environments a deployment serves: the sandbox runs commands, so only when configured."""
    from .sandbox import SandboxEnvironment

    return frozenset(n for n in ENVIRONMENTS if sandbox or n != SandboxEnvironment.name)


def get_environment(name: str) -> Environment:
    try:
        return ENVIRONMENTS[name]()
    except KeyError:
        raise ToolError("unknown_environment", f"no environment named {name!r}; known: {sorted(ENVIRONMENTS)}") from None


def open_from_log(data: Mapping[str, Any]) -> tuple[Environment, Task, JSON]:
    """engine.sessions.Opener: a `session_opened` event's environment, task and initial state."""
    env = get_environment(data["env"])
    task = Task.from_json(data["task"])
    return env, task, env.initial_state(task)


__all__ = [
    "ENTRY_POINT_GROUP", "ENVIRONMENTS", "JSON", "Environment", "StateMode", "Task", "ToolError", "ToolOutcome",
    "Trajectory", "Verification", "enabled_environments", "get_environment", "open_from_log", "registered_environments",
]
