"""Model backends: what produces the tokens behind the policy model server. A new backend goes here
(or in a package of your own), registered under the `rollbook.generation_backends` entry point group.

A backend streams one generation as `Start` (the prompt token ids, and how a prefix was honoured),
then `Step`s (some whole generated tokens: integer ids, the sampling logprob of each, and the
chat-completions delta they stand for), then `End` (finish reason, the upstream's usage). The
model server cuts between two steps, so a cut is always at a token boundary, and it accumulates
the deltas into the reply with `merge_delta`.

Continuing after a cut: the server passes the durable `Prefix` (prompt ids, generated ids and
logprobs, the partial message). A backend either continues it exactly (the steps it yields are what
follows the prefix, so prefix + continuation is one generation) and says `{"mode": "continued"}`,
or cannot, and regenerates from the start, saying `{"mode": "regenerated", "reason": ...}`; the
server then drops the prefix and records why. Nothing is ever spliced that the upstream did not
vouch for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from engine.errors import ConfigError


@dataclass(frozen=True)
class Start:
    prompt_token_ids: tuple[int, ...]
    continuation: dict[str, Any] | None = None  # set when a prefix was given: continued or regenerated


@dataclass(frozen=True)
class Step:
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    delta: dict[str, Any]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token; for the client, never stored


@dataclass(frozen=True)
class End:
    finish_reason: str
    usage: dict[str, Any] | None = None


@dataclass(frozen=True)
class Prefix:
    """What a cut left durable: continue from here."""

    prompt_token_ids: tuple[int, ...]
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    message: dict[str, Any] = field(default_factory=dict)


Event = Start | Step | End


class GenerationBackend(Protocol):
    policy_version: str
    model: str

    def check(self, request: dict[str, Any]) -> None:
        """Raise UnsupportedParameter for a request parameter this backend cannot honour."""
        ...

    def generate(self, request: dict[str, Any], prefix: Prefix | None) -> AsyncIterator[Event]:
        """Start, the steps after `prefix` (all of them without one, or when regenerating), End."""
        ...


# ---- the registry: every backend is an entry point of this group, and nothing else names it ----

ENTRY_POINT_GROUP = "rollbook.generation_backends"


@dataclass(frozen=True)
class BackendSettings:
    """What the config's [servers.model] section gives the backend it names (apps/config.py)."""

    url: str | None = None
    model: str | None = None
    api_key: str | None = None
    policy_version: str | None = None
    latency_s: float = 0.0
    token_latency_s: float = 0.0
    connect_s: float = 10.0  # to open a connection to the upstream
    silence_s: float = 900.0  # the longest the upstream may say nothing mid-reply ([limits] reply_s)


def backend_names() -> list[str]:
    """The registered backends' names (pyproject's `rollbook.generation_backends`, or a plugin's)."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def make_backend(name: str, settings: BackendSettings) -> GenerationBackend:
    """The backend registered as `name`: its class's `from_settings(settings)`."""
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not found:
        raise ConfigError(f"unknown generation backend {name!r}", f"use one of {', '.join(backend_names())}")
    factory: Callable[[BackendSettings], GenerationBackend] = next(iter(found)).load().from_settings
    return factory(settings)


def max_tokens(request: dict[str, Any]) -> int | None:
    value = request.get("max_completion_tokens", request.get("max_tokens"))
    return None if value is None else int(value)
