"""What the engine knows of token storage: receipts, and the three things a store must do.

Token arrays never enter the log (a long generation would outgrow any event payload limit); a
model call's events carry a `Receipt` that points into a token store and vouches for what is
there. Implementations live in adapters.token_store; this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Receipt:
    """A stored token sequence: where it is, what it hashes to, how many tokens it holds."""

    blob_id: str
    digest: str
    tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"blob_id": self.blob_id, "digest": self.digest, "tokens": self.tokens}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Receipt:
        return cls(str(d["blob_id"]), str(d["digest"]), int(d["tokens"]))


class TokenSink(Protocol):
    async def put(self, tokens: list[str]) -> Receipt:
        """Store tokens durably; the receipt is valid once this returns."""
        ...


class TokenSource(Protocol):
    async def get(self, blob_id: str) -> list[str]:
        """The stored tokens; raises InvalidCheckpointState if missing or not matching their digest."""
        ...


class LineageStore(Protocol):
    async def snapshot(self, checkpoint_id: str, blob_ids: list[str]) -> dict[str, Any]:
        """Pin the blobs a checkpoint needs; returns {"checkpoint_id", "snapshot_id", "digest"}."""
        ...

    async def validate(self, ref: dict[str, Any], checkpoint_id: str) -> None:
        """Raise InvalidCheckpointState unless `ref` is an intact snapshot of `checkpoint_id`."""
        ...
