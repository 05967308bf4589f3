"""Token stores: where the token arrays of model calls live, since the log only holds receipts.

Two implementations with one behaviour (tests/test_token_store.py runs the same suite on both):
`PostgresTokenStore` uses the tables rollbook.token_blobs / rollbook.token_snapshots that the
first migration creates, `FilesystemTokenStore` writes one JSON file per blob and per snapshot.

Encoding. token_blobs.token_ids is an integer[] and the schema may not change, but our tokens
are strings (the scripted backend's pieces, or an upstream server's text deltas) with no shared
vocabulary to index into. Hashing a string to an int would not be reversible, so each token is
stored as the Unicode code points of its text followed by -1 as a terminator:
["ab", "c"] -> [97, 98, -1, 99, -1]. A terminator (rather than a separator) keeps [] and [""]
apart. Both stores use the same encoding, so their digests agree.

Blobs are content-addressed (blob_id = "sha256-" + digest of the token list), which makes `put`
idempotent: a call retried after a crash stores nothing new. `get` re-hashes what it reads and
compares with both the stored digest and the id, so an edited row is caught even when the
editor also rewrote the digest column.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from adapters.database import sqlalchemy_url
from adapters.postgres import retrying
from engine.errors import InvalidCheckpointState, InvalidIdentifier
from engine.events import canonical_json
from engine.identity import validate_id
from engine.tokens import Receipt

TERMINATOR = -1
BLOB_PREFIX = "sha256-"


def encode_tokens(tokens: list[str]) -> list[int]:
    out: list[int] = []
    for tok in tokens:
        out.extend(ord(ch) for ch in tok)
        out.append(TERMINATOR)
    return out


def decode_tokens(ids: list[int]) -> list[str]:
    tokens: list[str] = []
    current: list[str] = []
    for i in ids:
        if i == TERMINATOR:
            tokens.append("".join(current))
            current = []
        else:
            current.append(chr(i))
    if current:
        raise InvalidCheckpointState("a token blob ends in the middle of a token")
    return tokens


def token_digest(tokens: list[str]) -> str:
    # surrogatepass: an upstream may send a lone surrogate; it must hash, not crash
    return hashlib.sha256(canonical_json(tokens).encode("utf-8", "surrogatepass")).hexdigest()


def snapshot_digest(checkpoint_id: str, blobs: list[tuple[str, str]]) -> str:
    return hashlib.sha256(canonical_json([checkpoint_id, sorted([b, d] for b, d in blobs)]).encode()).hexdigest()


class _TokenStore:
    """The behaviour both stores share; subclasses only move rows or files."""

    async def _save_blob(self, blob_id: str, ids: list[int], digest: str) -> None:
        raise NotImplementedError

    async def _load_blob(self, blob_id: str) -> tuple[list[int], str] | None:
        raise NotImplementedError

    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        raise NotImplementedError

    async def _save_snapshot(self, snapshot_id: str, checkpoint_id: str, blob_ids: list[str], digest: str) -> None:
        raise NotImplementedError

    async def _load_snapshot(self, snapshot_id: str) -> tuple[str, list[str], str] | None:
        raise NotImplementedError

    async def put(self, tokens: list[str]) -> Receipt:
        digest = token_digest(tokens)
        blob_id = BLOB_PREFIX + digest
        await self._save_blob(blob_id, encode_tokens(tokens), digest)
        return Receipt(blob_id, digest, len(tokens))

    async def get(self, blob_id: str) -> list[str]:
        row = await self._load_blob(blob_id)
        if row is None:
            raise InvalidCheckpointState(f"token blob {blob_id} is missing", blob_id=blob_id)
        ids, stored = row
        tokens = decode_tokens(ids)
        actual = token_digest(tokens)
        if actual != stored or blob_id != BLOB_PREFIX + actual:
            raise InvalidCheckpointState(f"token blob {blob_id} does not match its digest", blob_id=blob_id)
        return tokens

    async def snapshot(self, checkpoint_id: str, blob_ids: list[str]) -> dict[str, Any]:
        validate_id(checkpoint_id, "checkpoint id")
        wanted = sorted(set(blob_ids))
        digests = await self._blob_digests(wanted)
        missing = [b for b in wanted if b not in digests]
        if missing:
            raise InvalidCheckpointState(
                f"cannot snapshot checkpoint {checkpoint_id}: {len(missing)} token blob(s) missing, e.g. {missing[0]}"
            )
        digest = snapshot_digest(checkpoint_id, list(digests.items()))
        # Deterministic id (the digest covers the checkpoint id): a retried publish writes one row.
        snapshot_id = f"snapshot-{digest[:40]}"
        await self._save_snapshot(snapshot_id, checkpoint_id, wanted, digest)
        return {"checkpoint_id": checkpoint_id, "snapshot_id": snapshot_id, "digest": digest}

    async def validate(self, ref: dict[str, Any], checkpoint_id: str) -> None:
        """Re-hash every blob: a restore must not continue from tokens that are not what was cut."""
        if not isinstance(ref, dict) or not {"checkpoint_id", "snapshot_id", "digest"} <= ref.keys():
            raise InvalidCheckpointState("a token snapshot reference needs checkpoint_id, snapshot_id and digest")
        if ref["checkpoint_id"] != checkpoint_id:
            raise InvalidCheckpointState(
                f"the token snapshot reference is for checkpoint {ref['checkpoint_id']}, not {checkpoint_id}"
            )
        row = await self._load_snapshot(str(ref["snapshot_id"]))
        if row is None:
            raise InvalidCheckpointState(f"token snapshot {ref['snapshot_id']} is missing")
        owner, blob_ids, stored = row
        if owner != checkpoint_id:
            raise InvalidCheckpointState(f"token snapshot {ref['snapshot_id']} belongs to checkpoint {owner}, not {checkpoint_id}")
        recomputed = []
        for blob_id in blob_ids:
            tokens = await self.get(blob_id)  # raises on a missing or altered blob
            recomputed.append((blob_id, token_digest(tokens)))
        if not (stored == ref["digest"] == snapshot_digest(checkpoint_id, recomputed)):
            raise InvalidCheckpointState(f"token snapshot {ref['snapshot_id']} does not match its digest")


class PostgresTokenStore(_TokenStore):
    def __init__(self, engine_or_dsn: AsyncEngine | str) -> None:
        self._owns_engine = isinstance(engine_or_dsn, str)
        if isinstance(engine_or_dsn, str):
            self.engine = create_async_engine(sqlalchemy_url(engine_or_dsn), pool_size=2, max_overflow=8, pool_pre_ping=True)
        else:
            self.engine = engine_or_dsn

    async def close(self) -> None:
        if self._owns_engine:
            await self.engine.dispose()

    @retrying("the token store")
    async def _save_blob(self, blob_id: str, ids: list[int], digest: str) -> None:
        # DO UPDATE, not DO NOTHING: the content is fixed by the id, so rewriting repairs a damaged row.
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollbook.token_blobs (blob_id, token_ids, digest) VALUES (:b, CAST(:t AS integer[]), :d) "
                    "ON CONFLICT (blob_id) DO UPDATE SET token_ids = EXCLUDED.token_ids, digest = EXCLUDED.digest"
                ),
                {"b": blob_id, "t": ids, "d": digest},
            )

    @retrying("the token store")
    async def _load_blob(self, blob_id: str) -> tuple[list[int], str] | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(text("SELECT token_ids, digest FROM rollbook.token_blobs WHERE blob_id = :b"), {"b": blob_id})
            ).first()
        return None if row is None else (list(row.token_ids), row.digest)

    @retrying("the token store")
    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT blob_id, digest FROM rollbook.token_blobs WHERE blob_id = ANY(CAST(:b AS text[]))"), {"b": blob_ids}
            )
            return {r.blob_id: r.digest for r in rows}

    @retrying("the token store")
    async def _save_snapshot(self, snapshot_id: str, checkpoint_id: str, blob_ids: list[str], digest: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollbook.token_snapshots (snapshot_id, checkpoint_id, blob_ids, digest) "
                    "VALUES (:s, :c, CAST(:b AS text[]), :d) ON CONFLICT (snapshot_id) DO NOTHING"
                ),
                {"s": snapshot_id, "c": checkpoint_id, "b": blob_ids, "d": digest},
            )

    @retrying("the token store")
    async def _load_snapshot(self, snapshot_id: str) -> tuple[str, list[str], str] | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    text("SELECT checkpoint_id, blob_ids, digest FROM rollbook.token_snapshots WHERE snapshot_id = :s"),
                    {"s": snapshot_id},
                )
            ).first()
        return None if row is None else (row.checkpoint_id, list(row.blob_ids), row.digest)


class FilesystemTokenStore(_TokenStore):
    """One JSON file per blob and per snapshot, written to a temporary name, fsynced and renamed,
    so a reader sees a whole file or none. File work runs in a thread to keep the event loop free."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "snapshots").mkdir(parents=True, exist_ok=True)

    def _path(self, kind: str, name: str) -> Path:
        validate_id(name, kind)  # ids become file names: no separators, no '..'
        return self.root / kind / f"{name}.json"

    @staticmethod
    def _write(path: Path, value: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidCheckpointState(f"{path.name} is not readable JSON: {exc}") from exc

    async def _save_blob(self, blob_id: str, ids: list[int], digest: str) -> None:
        await asyncio.to_thread(self._write, self._path("blobs", blob_id), {"token_ids": ids, "digest": digest})

    async def _load_blob(self, blob_id: str) -> tuple[list[int], str] | None:
        row = await asyncio.to_thread(self._read, self._path("blobs", blob_id))
        return None if row is None else (list(row["token_ids"]), str(row["digest"]))

    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for blob_id in blob_ids:
            row = await self._load_blob(blob_id)
            if row is not None:
                out[blob_id] = row[1]
        return out

    async def _save_snapshot(self, snapshot_id: str, checkpoint_id: str, blob_ids: list[str], digest: str) -> None:
        value = {"checkpoint_id": checkpoint_id, "blob_ids": blob_ids, "digest": digest}
        await asyncio.to_thread(self._write, self._path("snapshots", snapshot_id), value)

    async def _load_snapshot(self, snapshot_id: str) -> tuple[str, list[str], str] | None:
        try:
            path = self._path("snapshots", snapshot_id)
        except InvalidIdentifier:
            return None  # no file can have that name, so no such snapshot
        row = await asyncio.to_thread(self._read, path)
        return None if row is None else (str(row["checkpoint_id"]), list(row["blob_ids"]), str(row["digest"]))

    async def close(self) -> None:
        return None
