"""A capability: the data plane for one attempt of one rollout, and nothing else.

The data credential opens every data route, so whoever holds it can close, verify or fence any
rollout. A capability is derived from it for one (rollout, attempt), HMAC-SHA256 keyed by the data
credential, spelt `rbcap1.<rollout>.<attempt>.<mac>`: any server can check one without a table, and
it opens only the routes under `/rollouts/<rollout>/attempts/<attempt>/`. The servers act for an
attempt with its capability (the environment server towards the agent and resources servers, the
agent towards the model and resources servers), so a request steered anywhere else (a model's
hostile tool name, say) is refused by the server it reaches; a client that drives one rollout (an
OpenAI SDK pointed at the model server's identity routes) can be given that rollout's capability
instead of the data credential.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "rbcap1."


def capability(secret: str, rollout_id: str, attempt: int) -> str:
    """The capability for (rollout_id, attempt) under the data credential `secret`."""
    return f"{PREFIX}{rollout_id}.{attempt}.{_mac(secret, rollout_id, str(attempt))}"


def capability_opens(token: str, secret: str, rollout_id: str | None, attempt: str | None) -> bool:
    """Whether `token` is a capability made with `secret` for exactly this rollout and attempt (the
    path's, as spelt there); False for a route outside any attempt (rollout_id None)."""
    if not token.startswith(PREFIX) or rollout_id is None or attempt is None:
        return False
    named, _, mac = token[len(PREFIX):].rpartition(".")
    # Compared whole, in constant time: what the token names and what the path names must agree.
    return hmac.compare_digest(f"{named}.{mac}".encode("utf-8", "surrogateescape"),
                               f"{rollout_id}.{attempt}.{_mac(secret, rollout_id, attempt)}".encode())


def _mac(secret: str, rollout_id: str, attempt: str) -> str:
    return hmac.new(secret.encode(), f"{rollout_id}\n{attempt}".encode(), hashlib.sha256).hexdigest()
