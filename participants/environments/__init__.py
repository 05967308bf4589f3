"""The bundled environments, by name."""

from __future__ import annotations

from .base import JSON, Environment, StateMode, Task, ToolError, ToolOutcome, Verification
from .blackjack import BlackjackEnvironment
from .math_env import MathEnvironment
from .sandbox import SandboxEnvironment
from .string_match import StringMatchEnvironment
from .workplace import WorkplaceEnvironment

ENVIRONMENTS: dict[str, type[Environment]] = {
    cls.name: cls
    for cls in (WorkplaceEnvironment, BlackjackEnvironment, MathEnvironment, StringMatchEnvironment, SandboxEnvironment)
}


def enabled_environments(sandbox: bool) -> frozenset[str]:
    """The environments a deployment serves: the sandbox runs commands, so only when configured."""
    return frozenset(n for n in ENVIRONMENTS if sandbox or n != SandboxEnvironment.name)


def get_environment(name: str) -> Environment:
    try:
        return ENVIRONMENTS[name]()
    except KeyError:
        raise ToolError("unknown_environment", f"no environment named {name!r}; known: {sorted(ENVIRONMENTS)}") from None


__all__ = [
    "ENVIRONMENTS", "JSON", "Environment", "StateMode", "Task", "ToolError", "ToolOutcome", "Verification",
    "get_environment", "enabled_environments",
]
