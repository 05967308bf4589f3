"""Token stores: where the token arrays of model calls live, since the log only holds receipts.

Three implementations with one behaviour (tests/adapters/test_token_store.py runs the same suite on each):
`PostgresTokenStore` uses the tables rollbook.token_blobs / rollbook.token_snapshots that the
first migration creates, `FilesystemTokenStore` writes one JSON file per blob and per snapshot, and
`MemoryTokenStore` keeps them in dicts (beside adapters.memory_store's log: nothing durable).

Encoding. A blob is a `TokenArray`: integer token ids (token_blobs.token_ids, integer[]) and, for
generated tokens, the sampling logprob of each (token_blobs.logprobs, real[]; NULL for a prompt).
Logprobs are float32 (engine.tokens.f32) before they are hashed or stored, so both stores, the
client's reply and an export agree to the bit.

Blobs are content-addressed (blob_id = "sha256-" + digest of the token list), which makes `put`
idempotent: a call retried after a crash stores nothing new. `get` re-hashes what it reads and
compares with both the stored digest and the id, so an edited row is caught even when the
editor also rewrote the digest column.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from adapters.pg_arrays import float4s, int4s
from adapters.pg_pool import PoolLimits, StoreObserver, make_engine, reading, retrying
from adapters.postgres import PostgresEventStore
from adapters.secret_files import write_private
from engine import tokens
from engine.errors import InvalidCheckpointState, InvalidIdentifier, InvalidPayload
from engine.events import canonical_json
from engine.identity import validate_id
from engine.tokens import Receipt, TokenArray, f32s

BLOB_PREFIX = "sha256-"
MAX_TOKEN_ID = 2**31 - 1  # integer[]


def normalize(ids: list[int] | tuple[int, ...], logprobs: list[float] | tuple[float, ...] | None) -> TokenArray:
    """Check and canonicalize what is about to be stored: ids are int32 and >= 0, logprobs finite float32.
    Every generated token passes here, so the common case is checked at C speed (map, array)."""
    exact = not ids or set(map(type, ids)) == {int}  # then they are stored as they are, not converted one by one
    if not exact or not _int31(ids):
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= MAX_TOKEN_ID]
        if bad:
            raise InvalidPayload(f"token ids must be integers from 0 to {MAX_TOKEN_ID}; got {bad[0]!r}")
    lps = None
    if logprobs is not None:
        if len(logprobs) != len(ids):
            raise InvalidPayload(f"{len(ids)} token ids but {len(logprobs)} logprobs")
        try:
            lps = f32s(logprobs)
            finite = all(map(math.isfinite, lps))
        except TypeError:  # a string, None, a list
            finite = False
        if not finite:
            raise InvalidPayload("a logprob is not a finite number")
    return TokenArray(tuple(ids) if exact else tuple(map(int, ids)), lps)


def _int31(ids: list[int] | tuple[int, ...]) -> bool:
    try:
        tokens.id_words(ids)
    except OverflowError:
        return False
    return True


def token_digest(arr: TokenArray) -> str:
    return tokens.token_digest(arr.ids, arr.logprobs)


def snapshot_digest(checkpoint_id: str, blobs: list[tuple[str, str]], parent_digest: str | None = None) -> str:
    """A root snapshot's digest covers its blobs; a child's also covers its parent's digest, so the
    chain's last digest vouches for every blob of every snapshot before it."""
    listed = sorted([b, d] for b, d in blobs)
    body = [checkpoint_id, listed] if parent_digest is None else [checkpoint_id, listed, parent_digest]
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


@dataclass(frozen=True)
class SnapshotRow:
    checkpoint_id: str
    blob_ids: list[str]
    digest: str
    parent_snapshot_id: str | None = None


class _TokenStore:
    """The behaviour both stores share; subclasses only move rows or files."""

    async def _save_blob(self, blob_id: str, arr: TokenArray, digest: str) -> None:
        raise NotImplementedError

    async def _load_blob(self, blob_id: str) -> tuple[TokenArray, str] | None:
        raise NotImplementedError

    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        raise NotImplementedError

    async def _load_blobs(self, blob_ids: list[str]) -> dict[str, tuple[TokenArray, str]]:
        """Several blobs at once (a snapshot's validation); the PostgreSQL store reads them in one query."""
        out = {}
        for blob_id in blob_ids:
            row = await self._load_blob(blob_id)
            if row is not None:
                out[blob_id] = row
        return out

    async def _save_snapshot(self, snapshot_id: str, row: SnapshotRow) -> None:
        raise NotImplementedError

    async def _load_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        raise NotImplementedError

    async def put(self, ids: list[int], logprobs: list[float] | None = None) -> Receipt:
        arr = normalize(ids, logprobs)
        digest = token_digest(arr)
        blob_id = BLOB_PREFIX + digest
        await self._save_blob(blob_id, arr, digest)
        return Receipt(blob_id, digest, len(arr.ids))

    async def stage(self, ids: list[int], logprobs: list[float] | None = None) -> Receipt:
        """A receipt whose blob is durable no later than the next event this process appends
        (PostgresTokenStore on an event store defers the write to that append; here it is `put`)."""
        return await self.put(ids, logprobs)

    async def get(self, blob_id: str) -> TokenArray:
        return self._checked(blob_id, await self._load_blob(blob_id))

    @staticmethod
    def _checked(blob_id: str, row: tuple[TokenArray, str] | None) -> TokenArray:
        """A blob as read, re-hashed: missing, or not matching its digest or its id, is refused."""
        if row is None:
            raise InvalidCheckpointState(f"token blob {blob_id} is missing", blob_id=blob_id)
        arr, stored = row
        # As written: ids from an integer column, logprobs rounded to float32 again (the text of a
        # `real` parses to the nearest double). No range checks: the digest refuses any other value.
        try:
            arr = TokenArray(tuple(arr.ids), None if arr.logprobs is None else f32s(arr.logprobs))
            actual = token_digest(arr)
        except (TypeError, ValueError):  # not a number, or NaN: no writer hashed that
            actual = None
        if actual != stored or blob_id != BLOB_PREFIX + actual:
            raise InvalidCheckpointState(f"token blob {blob_id} does not match its digest", blob_id=blob_id)
        return arr

    async def snapshot(self, checkpoint_id: str, blob_ids: list[str], parent: dict[str, Any] | None = None) -> dict[str, Any]:
        """Pin `blob_ids` under `checkpoint_id`. With `parent` (the reference of an earlier published
        snapshot of the same run) the new snapshot extends it: `blob_ids` need only be the blobs
        written since the parent's cut, so the cost of a snapshot and of its validation follows what
        the cut added, not the length of the run."""
        validate_id(checkpoint_id, "checkpoint id")
        wanted = sorted(set(blob_ids))
        digests = await self._blob_digests(wanted)
        missing = [b for b in wanted if b not in digests]
        if missing:
            raise InvalidCheckpointState(
                f"cannot snapshot checkpoint {checkpoint_id}: {len(missing)} token blob(s) missing, e.g. {missing[0]}"
            )
        parent_id, parent_digest = None, None
        if parent is not None:
            parent_row = await self._check_ref_row(parent, str(parent.get("checkpoint_id")))
            if parent_row.checkpoint_id == checkpoint_id:
                raise InvalidCheckpointState(f"a snapshot of {checkpoint_id} cannot extend a snapshot of the same checkpoint")
            parent_id, parent_digest = str(parent["snapshot_id"]), parent_row.digest
        digest = snapshot_digest(checkpoint_id, list(digests.items()), parent_digest)
        # Deterministic id (the digest covers the checkpoint id): a retried publish writes one row.
        snapshot_id = f"snapshot-{digest[:40]}"
        await self._save_snapshot(snapshot_id, SnapshotRow(checkpoint_id, wanted, digest, parent_id))
        return {"checkpoint_id": checkpoint_id, "snapshot_id": snapshot_id, "digest": digest}

    async def _check_ref_row(self, ref: dict[str, Any], checkpoint_id: str) -> SnapshotRow:
        """The row a reference names, checked against it without reading any blob."""
        if not isinstance(ref, dict) or not {"checkpoint_id", "snapshot_id", "digest"} <= ref.keys():
            raise InvalidCheckpointState("a token snapshot reference needs checkpoint_id, snapshot_id and digest")
        if ref["checkpoint_id"] != checkpoint_id:
            raise InvalidCheckpointState(
                f"the token snapshot reference is for checkpoint {ref['checkpoint_id']}, not {checkpoint_id}"
            )
        row = await self._load_snapshot(str(ref["snapshot_id"]))
        if row is None:
            raise InvalidCheckpointState(f"token snapshot {ref['snapshot_id']} is missing")
        if row.checkpoint_id != checkpoint_id:
            raise InvalidCheckpointState(
                f"token snapshot {ref['snapshot_id']} belongs to checkpoint {row.checkpoint_id}, not {checkpoint_id}")
        if row.digest != ref["digest"]:
            raise InvalidCheckpointState(f"token snapshot {ref['snapshot_id']} does not match its digest")
        return row

    async def validate(self, ref: dict[str, Any], checkpoint_id: str, deep: bool = False) -> None:
        """What publish checks: the reference names this checkpoint's row, every blob the row lists is
        present under its own digest, and the row's digest is the digest of those (and of its parent's
        recorded digest, which a parent's own publish checked). Publish reads no tokens: a blob's id is
        the digest of its tokens, computed when it was written, and every read re-hashes what it
        returns (`get`), so a restore never continues from tokens that are not what was cut. `deep`
        re-hashes the tokens of every blob of the whole chain (an audit, not a publish)."""
        row = await self._check_ref_row(ref, checkpoint_id)
        snapshot_id = str(ref["snapshot_id"])
        while True:
            recorded = await (self._rehashed(row.blob_ids) if deep else self._recorded(row.blob_ids))
            parent = None
            if row.parent_snapshot_id is not None:
                parent = await self._load_snapshot(row.parent_snapshot_id)
                if parent is None:
                    raise InvalidCheckpointState(f"token snapshot {row.parent_snapshot_id}, parent of {snapshot_id}, is missing")
            if row.digest != snapshot_digest(row.checkpoint_id, recorded, parent.digest if parent else None):
                raise InvalidCheckpointState(f"token snapshot {snapshot_id} does not match its digest")
            if parent is None or not deep:
                return
            snapshot_id, row = str(row.parent_snapshot_id), parent

    async def _recorded(self, blob_ids: list[str]) -> list[tuple[str, str]]:
        """Each blob's recorded digest, in one read of no tokens; missing, or not its id's, is refused."""
        digests = await self._blob_digests(blob_ids)
        for blob_id in blob_ids:
            if blob_id not in digests:
                raise InvalidCheckpointState(f"token blob {blob_id} is missing", blob_id=blob_id)
            if blob_id != BLOB_PREFIX + digests[blob_id]:
                raise InvalidCheckpointState(f"token blob {blob_id} does not match its digest", blob_id=blob_id)
        return [(b, digests[b]) for b in blob_ids]

    async def _rehashed(self, blob_ids: list[str]) -> list[tuple[str, str]]:
        """Each blob's digest, its tokens read and re-hashed (`_checked` refuses any that do not match)."""
        loaded = await self._load_blobs(blob_ids)  # one read for the snapshot's blobs
        for blob_id in blob_ids:
            self._checked(blob_id, loaded.get(blob_id))  # raises on a missing or altered blob
        return [(b, loaded[b][1]) for b in blob_ids]  # so each stored digest is its content's


class PostgresTokenStore(_TokenStore):
    """On its own pool (a DSN), on another's (an engine), or on an event store's: then `stage` writes
    its blobs inside the store's next append transaction, the one that records their receipts."""

    def __init__(self, engine_or_dsn: AsyncEngine | str | PostgresEventStore) -> None:
        self._owns_engine = isinstance(engine_or_dsn, str)
        self._log = engine_or_dsn if isinstance(engine_or_dsn, PostgresEventStore) else None
        if isinstance(engine_or_dsn, str):
            self.engine = make_engine(engine_or_dsn, PoolLimits(size=2, overflow=8))
        elif isinstance(engine_or_dsn, PostgresEventStore):
            self.engine = engine_or_dsn.engine
        else:
            self.engine = engine_or_dsn
        self._pending: list[tuple[dict[str, Any], asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.observers: list[StoreObserver] = []  # told of lost connections (`retrying` reads this)

    async def stage(self, ids: list[int], logprobs: list[float] | None = None) -> Receipt:
        """On an event store: the receipt now, no round trip; the blob is written in the store's next
        append transaction, so an append of an event holding this receipt, made after this call, commits
        it with the blob or after it. Elsewhere it is `put`."""
        if self._log is None:
            return await self.put(ids, logprobs)
        arr = normalize(ids, logprobs)
        digest = token_digest(arr)
        self._log.carry(_write_blob_rows, _blob_row(BLOB_PREFIX + digest, arr, digest))
        return Receipt(BLOB_PREFIX + digest, digest, len(arr.ids))

    async def close(self) -> None:
        if self._owns_engine:
            await self.engine.dispose()

    async def _save_blob(self, blob_id: str, arr: TokenArray, digest: str) -> None:
        """Concurrent puts share one transaction (one commit): a checkpoint cutting 80 generations at
        once writes 160 blobs, and a commit each would make prepare wait on 160 fsyncs."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((_blob_row(blob_id, arr, digest), done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        await done

    @retrying("the token store")  # an upsert of content-addressed rows: safe to repeat
    async def _write_rows(self, rows: list[dict[str, Any]]) -> None:
        async with self.engine.begin() as conn:
            await conn.exec_driver_sql(*_write_blob_rows(rows, "r"))

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._write_rows(_distinct([row for row, _ in batch]))
            except BaseException as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)

    @retrying("the token store")
    async def _load_blob(self, blob_id: str) -> tuple[TokenArray, str] | None:
        async with reading(self.engine) as conn:
            row = (
                await conn.execute(text("SELECT token_ids, logprobs, digest FROM rollbook.token_blobs WHERE blob_id = :b"),
                                   {"b": blob_id})
            ).first()
        if row is None:
            return None
        return TokenArray(tuple(row.token_ids), None if row.logprobs is None else tuple(row.logprobs)), row.digest

    @retrying("the token store")
    async def _load_blobs(self, blob_ids: list[str]) -> dict[str, tuple[TokenArray, str]]:
        async with reading(self.engine) as conn:
            rows = await conn.execute(
                text("SELECT blob_id, token_ids, logprobs, digest FROM rollbook.token_blobs WHERE blob_id = ANY(CAST(:b AS text[]))"),
                {"b": blob_ids})
            return {r.blob_id: (TokenArray(tuple(r.token_ids), None if r.logprobs is None else tuple(r.logprobs)), r.digest)
                    for r in rows}

    @retrying("the token store")
    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        async with reading(self.engine) as conn:
            rows = await conn.execute(
                text("SELECT blob_id, digest FROM rollbook.token_blobs WHERE blob_id = ANY(CAST(:b AS text[]))"), {"b": blob_ids}
            )
            return {r.blob_id: r.digest for r in rows}

    @retrying("the token store")
    async def _save_snapshot(self, snapshot_id: str, row: SnapshotRow) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollbook.token_snapshots (snapshot_id, checkpoint_id, blob_ids, digest, parent_snapshot_id) "
                    "VALUES (:s, :c, CAST(:b AS text[]), :d, :p) ON CONFLICT (snapshot_id) DO NOTHING"
                ),
                {"s": snapshot_id, "c": row.checkpoint_id, "b": row.blob_ids, "d": row.digest, "p": row.parent_snapshot_id},
            )

    @retrying("the token store")
    async def _load_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        async with reading(self.engine) as conn:
            row = (
                await conn.execute(
                    text("SELECT checkpoint_id, blob_ids, digest, parent_snapshot_id FROM rollbook.token_snapshots "
                         "WHERE snapshot_id = :s"),
                    {"s": snapshot_id},
                )
            ).first()
        return None if row is None else SnapshotRow(row.checkpoint_id, list(row.blob_ids), row.digest, row.parent_snapshot_id)


# One statement for any number of blobs (one round trip, one commit): the rows travel as one JSON
# array, since integer[] columns of different lengths cannot be unnested together. DO UPDATE, not
# DO NOTHING: the content is fixed by the id, so rewriting repairs a damaged row. `created_at` is
# when a blob was last written: retention (adapters.retention) keeps what was written recently.
WRITE_BLOBS = (
    "INSERT INTO rollbook.token_blobs (blob_id, token_ids, logprobs, digest) VALUES {values} "
    "ON CONFLICT (blob_id) DO UPDATE "
    "SET token_ids = EXCLUDED.token_ids, logprobs = EXCLUDED.logprobs, digest = EXCLUDED.digest, created_at = now()"
)


def _blob_row(blob_id: str, arr: TokenArray, digest: str) -> dict[str, Any]:
    # Packed here, copied in by PostgreSQL (adapters.pg_arrays): the digest is of the values, not of this form.
    return {"b": blob_id, "t": int4s(arr.ids), "l": None if arr.logprobs is None else float4s(arr.logprobs), "d": digest}


def _distinct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list({row["b"]: row for row in rows}.values())  # one row per blob: ON CONFLICT needs it


def _write_blob_rows(rows: list[dict[str, Any]], name: str) -> tuple[str, dict[str, Any]]:
    """Blobs' rows as one statement and its parameters, each parameter's name starting with `name`
    (a carried statement is one of several in an append's: PostgresEventStore.carry)."""
    distinct = _distinct(rows)
    values = ", ".join(f"(%({name}b{i})s, %({name}t{i})s, %({name}l{i})s, %({name}d{i})s)" for i in range(len(distinct)))
    params = {f"{name}{k}{i}": v for i, row in enumerate(distinct) for k, v in row.items()}
    return WRITE_BLOBS.format(values=values), params


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
        write_private(path, json.dumps(value))  # atomic: a reader sees the old file or the whole new one

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidCheckpointState(f"{path.name} is not readable JSON: {exc}") from exc

    async def _save_blob(self, blob_id: str, arr: TokenArray, digest: str) -> None:
        value = {"token_ids": list(arr.ids), "logprobs": None if arr.logprobs is None else list(arr.logprobs), "digest": digest}
        await asyncio.to_thread(self._write, self._path("blobs", blob_id), value)

    async def _load_blob(self, blob_id: str) -> tuple[TokenArray, str] | None:
        row = await asyncio.to_thread(self._read, self._path("blobs", blob_id))
        if row is None:
            return None
        lps = row.get("logprobs")
        return TokenArray(tuple(row["token_ids"]), None if lps is None else tuple(lps)), str(row["digest"])

    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for blob_id in blob_ids:
            row = await self._load_blob(blob_id)
            if row is not None:
                out[blob_id] = row[1]
        return out

    async def _save_snapshot(self, snapshot_id: str, row: SnapshotRow) -> None:
        value = {"checkpoint_id": row.checkpoint_id, "blob_ids": row.blob_ids, "digest": row.digest,
                 "parent_snapshot_id": row.parent_snapshot_id}
        await asyncio.to_thread(self._write, self._path("snapshots", snapshot_id), value)

    async def _load_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        try:
            path = self._path("snapshots", snapshot_id)
        except InvalidIdentifier:
            return None  # no file can have that name, so no such snapshot
        row = await asyncio.to_thread(self._read, path)
        if row is None:
            return None
        parent = row.get("parent_snapshot_id")
        return SnapshotRow(str(row["checkpoint_id"]), list(row["blob_ids"]), str(row["digest"]),
                           None if parent is None else str(parent))

    async def close(self) -> None:
        return None


class MemoryTokenStore(_TokenStore):
    """Blobs and snapshots in dicts, for a log in memory (adapters.memory_store): one instance is the
    token database of every server that shares it, and outlives their crashes as a database would."""

    def __init__(self) -> None:
        self.blobs: dict[str, tuple[TokenArray, str]] = {}
        self.snapshots: dict[str, SnapshotRow] = {}

    async def _save_blob(self, blob_id: str, arr: TokenArray, digest: str) -> None:
        self.blobs.setdefault(blob_id, (arr, digest))

    async def _load_blob(self, blob_id: str) -> tuple[TokenArray, str] | None:
        return self.blobs.get(blob_id)

    async def _blob_digests(self, blob_ids: list[str]) -> dict[str, str]:
        return {b: self.blobs[b][1] for b in blob_ids if b in self.blobs}

    async def _save_snapshot(self, snapshot_id: str, row: SnapshotRow) -> None:
        self.snapshots[snapshot_id] = row

    async def _load_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        return self.snapshots.get(snapshot_id)

    async def close(self) -> None:
        return None
