"""Which instance of a callee kind a caller reaches (engine/membership.py records them).

Every request of one rollout attempt goes to the same live instance while the set of live instances
stays the same: the instance whose hash with the attempt is highest (rendezvous hashing). So an
attempt's calls meet the state its instance holds in memory, and when an instance joins or leaves
only the attempts that hashed to it move; the instance they move to takes their work over from the
log under the ownership rule (engine/ownership.py). With no instance of the kind recorded, or none
live, the configured address is used, as before instances were recorded.

The same rule routes every request of a kind, whoever sends it: a caller that reads the log (the
environment to the agent and the resources server, the agent to the model and the resources server)
picks a live worker itself, and a front (participants/base/front.py, the public address of a server run with
`workers = N`) picks the same one for a caller that only knows that address. So a session's requests
meet the one process that holds it whichever way they come. An episode is routed by its rollout alone
(`EPISODE_ATTEMPT`): the environment server that drives it moves it to attempt N+1 itself.

Addresses come from the log, never from a request: whoever can append to the log is already trusted
with every rollout's history.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from engine.errors import RollbookError
from participants.base.nemo_gym_rows import flat_row_rollout_id
from participants.base.wire import parse_capture

REFRESH_S = 1.0  # how stale the caller's view of the live instances may be
EPISODE_ATTEMPT = 0  # the attempt an episode is routed under, whatever attempt it runs now
_ROLLOUT_PATH = re.compile(r"^/rollouts/([^/]+)/attempts/([0-9]+)(?:/|$)")
_NG_ROLLOUT_PATH = re.compile(r"^/ng-rollout/([^/]+)/")
_EPISODE_PATH = re.compile(r"^/episodes/([^/]+)/?$")


class Peers:
    def __init__(self, configured: str, kind: str = "", ttl_s: float = REFRESH_S) -> None:
        self.configured = configured.rstrip("/")
        self.kind = kind  # the callee's kind: whose live instances `source` reads
        self.ttl_s = ttl_s
        # The live addresses of the kind; None: instances are not recorded here (a test's servers in process).
        self.source: Callable[[], Awaitable[Sequence[str]]] | None = None
        self._seen: tuple[str, ...] = ()
        self._read_at = float("-inf")

    async def url(self, rollout_id: str, attempt: int, avoid: Collection[str] = ()) -> str:
        """Where (rollout_id, attempt) goes now; `avoid`: addresses this caller found dead just now."""
        if self.source is None:
            return self.configured
        live = [a for a in await self.live() if a not in avoid]
        return pick(live, rollout_id, attempt) or self.configured

    async def live(self) -> tuple[str, ...]:
        """The live addresses of the kind, read from the log at most every ttl_s."""
        if self.source is None:
            return (self.configured,)
        if time.monotonic() - self._read_at > self.ttl_s:
            self._seen = tuple(sorted({a.rstrip("/") for a in await self.source()}))
            self._read_at = time.monotonic()
        return self._seen

    def forget(self) -> None:
        """Read the live set again at the next request (a peer was found dead)."""
        self._read_at = float("-inf")


def pick(addresses: Sequence[str], rollout_id: str, attempt: int) -> str | None:
    """The address an attempt goes to: the highest hash of (address, attempt)."""
    if not addresses:
        return None
    return max(addresses, key=lambda a: hashlib.sha256(f"{a}\n{rollout_id}\n{attempt}".encode()).digest())


def request_key(method: str, path: str, body: bytes, cookie: str | None = None) -> tuple[str, int] | None:
    """The (rollout, attempt) a request to a server is routed by: from the path of a rollout's data
    routes, from the rollout an episode request names, from the activation id a NeMo Gym agent
    carries in its model calls' path or its tool calls' cookie (participants.base.wire.CAPTURE_COOKIE);
    None for a request about no one rollout (the control plane, status, metrics)."""
    m = _ROLLOUT_PATH.match(path)
    if m:
        return m.group(1), int(m.group(2))
    m = _NG_ROLLOUT_PATH.match(path)
    capture = m.group(1) if m else cookie
    if capture is not None:
        try:
            return parse_capture(capture)[:2]
        except RollbookError:
            return None  # the worker that gets it refuses it with the right error
    m = _EPISODE_PATH.match(path)
    if m:
        return m.group(1), EPISODE_ATTEMPT
    if method == "POST" and path.rstrip("/") in ("/episodes", "/run"):
        try:
            request = json.loads(body)
        except ValueError:
            return None  # the worker that gets it refuses it with the right error
        rid = _episode_rollout(request) if isinstance(request, dict) else None
        return (rid, EPISODE_ATTEMPT) if isinstance(rid, str) else None
    return None


def _episode_rollout(request: dict[str, Any]) -> Any:
    """The rollout an episode request names: rollbook's (`rollout_id`), NeMo Gym's episode request
    (`episode_id.rollout_id`, the environment's `/run`) or its flat row (the agent's `/run`), so a
    collector's episodes spread over the workers as rollbook's own do."""
    if "rollout_id" in request:
        return request["rollout_id"]
    episode = request.get("episode_id")
    if isinstance(episode, dict):
        return episode.get("rollout_id")
    return flat_row_rollout_id(request)


__all__ = ["EPISODE_ATTEMPT", "Peers", "pick", "request_key"]
