"""Which instance of a callee kind a caller reaches (engine/membership.py records them).

Every request of one rollout attempt goes to the same live instance while the set of live instances
stays the same: the instance whose hash with the attempt is highest (rendezvous hashing). So an
attempt's calls meet the state its instance holds in memory, and when an instance joins or leaves
only the attempts that hashed to it move; the instance they move to takes their work over from the
log under the ownership rule (engine/ownership.py). With no instance of the kind recorded, or none
live, the configured address is used, as before instances were recorded.

Addresses come from the log, never from a request: whoever can append to the log is already trusted
with every rollout's history.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence

REFRESH_S = 1.0  # how stale the caller's view of the live instances may be


class Peers:
    def __init__(self, configured: str, ttl_s: float = REFRESH_S) -> None:
        self.configured = configured.rstrip("/")
        self.ttl_s = ttl_s
        # The live addresses of the kind; None: instances are not recorded here (a test's servers in process).
        self.source: Callable[[], Awaitable[Sequence[str]]] | None = None
        self._seen: tuple[str, ...] = ()
        self._read_at = float("-inf")

    async def url(self, rollout_id: str, attempt: int) -> str:
        if self.source is None:
            return self.configured
        if time.monotonic() - self._read_at > self.ttl_s:
            self._seen = tuple(sorted({a.rstrip("/") for a in await self.source()}))
            self._read_at = time.monotonic()
        return pick(self._seen, rollout_id, attempt) or self.configured


def pick(addresses: Sequence[str], rollout_id: str, attempt: int) -> str | None:
    """The address an attempt goes to: the highest hash of (address, attempt)."""
    if not addresses:
        return None
    return max(addresses, key=lambda a: hashlib.sha256(f"{a}\n{rollout_id}\n{attempt}".encode()).digest())


__all__ = ["Peers", "pick"]
