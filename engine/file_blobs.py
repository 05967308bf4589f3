"""Content-addressed blobs: files of a sandbox session's tree and the manifests that list them.

A blob is named by the SHA-256 of its bytes, so a writer that puts the same bytes twice stores one
row, and a reader checks every blob it gets against its name: a blob changed in storage is caught
where it is read, never used. The log names blobs (a manifest's digest in a `mutation_applied`
effect); it never holds their bytes. A blob may name other blobs (a manifest names its files and the
manifest it is a delta of): retention keeps what a named blob names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import InvalidCheckpointState


def blob_digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


@dataclass(frozen=True)
class Blob:
    content: bytes
    names: tuple[str, ...] = field(default=())  # the blobs this one names (kept with it)

    @property
    def digest(self) -> str:
        return blob_digest(self.content)


class BlobStore(Protocol):
    async def put_blobs(self, blobs: Sequence[Blob]) -> None:
        """Store these; one already stored is kept, and counts as written now (retention's age)."""
        ...

    async def get_blobs(self, digests: Sequence[str]) -> dict[str, bytes]:
        """The content of each digest stored (a missing one is absent), as stored: check it."""
        ...


def checked(digests: Sequence[str], found: Mapping[str, bytes]) -> dict[str, bytes]:
    """Each digest's content, every one present and matching its name; InvalidCheckpointState
    (naming the first that is not) otherwise."""
    out: dict[str, bytes] = {}
    for d in digests:
        content = found.get(d)
        if content is None:
            raise InvalidCheckpointState(f"blob {d} is not in the blob store")
        if blob_digest(content) != d:
            raise InvalidCheckpointState(f"blob {d} does not match its digest: its content was changed in storage")
        out[d] = content
    return out
