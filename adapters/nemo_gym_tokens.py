"""rollbook's log as NeMo Gym's token-capture transport (nemo_gym.token_id_capture, 0.7.0).

`RollbookTokenCapture` is a `TokenSink` (put, mark_incomplete, and the optional `begin_call`) and a
`TokenSource` (freeze, drop); `RollbookLineageStore` is a `LineageResolver`. Install them in place
of Gym's file store with `install_token_sink` / `install_token_source` / `install_lineage_store`
(docs/nemo-gym.md, "NeMo Gym token capture"). Every instance is its own client: its own connections to the one
PostgreSQL database that all workers share.

Where a `TokenEntry` goes. Its three token arrays go to the token store (rollbook.token_blobs):
the prompt ids as one blob, the generated ids with their logprobs as another, content-addressed
(blob_id = "sha256-" + the digest of {"ids", "logprobs"}). Everything else of the entry (output
items, lineage and continuation stamps, timestamps, extra fields) goes to the log, on the attempt's
capture stream (engine.token_capture), beside rollbook's ordinary custody of the call:
`call_accepted` and `call_completed` (receipt = generated tokens, prompt_receipt = prompt tokens)
on `call:<rollout>.<attempt>.<model_call_id>`, so `rollbook history`, `rollbook replay` and
rollbook.model_calls show the call like any other. All of one put is one atomic append, conditional
on the capture stream's version: when `put` returns, the record is committed, and every client in
any process sees it on its next read.

Gym's rollout key is rollbook's (rollout id, attempt): "R" is attempt 0, "R-aN" attempt N. A key
rollbook has never seen starts its attempt with the first write (`attempt_started`,
`started_by = "nemo_gym_token_capture"`); a key whose attempt rollbook fenced or retired is
refused (`stale_attempt`), like any write of a dead attempt.

Retirement (`drop`) appends a tombstone and deletes nothing: the log is append-only, and a blob may
be shared with other calls or held by a checkpoint. Retention is rollbook's, not the trainer's.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from typing import Any

from nemo_gym.token_id_capture.lineage import RolloutLineage
from nemo_gym.token_id_capture.protocols import LineageMatch, LineageResolution, TokenCaptureSnapshot
from nemo_gym.token_id_capture.records import (
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    stamp_lineage,
)
from sqlalchemy import text

from adapters import database
from adapters.export import call_tokens
from adapters.postgres import PoolLimits, PostgresEventStore, retrying
from adapters.token_store import PostgresTokenStore
from engine import catalog as ev
from engine import token_capture as tc
from engine.catalog import ATTEMPT_FENCED, ATTEMPT_STARTED, ROLLOUT_RETIRED
from engine.errors import InvalidCheckpointState, InvalidPayload, StaleAttempt, VersionConflict
from engine.events import AppendRequest, NewEvent, canonical_json
from engine.identity import call_stream, capture_stream, rollout_stream, validate_id
from engine.lineage import effective_history
from engine.tokens import CallTokens, Receipt, token_digest

ARRAYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
BLOB_PREFIX = "sha256-"
MAX_TOKEN_ID = 2**31 - 1  # token_blobs.token_ids is integer[]
# Writers racing on one capture stream retry on a version conflict; each retry re-reads and decides
# again, so a bound this high is only reached by a stream under a write storm.
MAX_RETRIES = 100
SOURCE = "nemo_gym"


def _check_array(what: str, ids: list[int], logprobs: list[float] | None) -> None:
    bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise InvalidPayload(f"{what}: token ids must be integers from 0 to {MAX_TOKEN_ID}, got {bad!r}")
    if logprobs is not None and not all(math.isfinite(x) for x in logprobs):
        raise InvalidPayload(f"{what}: every logprob must be a finite number")


def entry_digest(payload: dict[str, Any]) -> str:
    """The identity of a record's bytes: Gym's "same payload" is the identical serialized entry."""
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


_CHECKED: dict[str | None, str] = {}


def _checked(dsn: str | None) -> str:
    """The DSN (given, else ROLLBOOK_DSN, else the embedded server), its schema checked once per
    process: a client of a database whose schema is behind or ahead refuses (`schema_mismatch`)."""
    key = dsn if dsn is not None else os.environ.get("ROLLBOOK_DSN")
    if key not in _CHECKED:
        _CHECKED[key] = database.prepare_database(dsn)
    return _CHECKED[key]


class _Client:
    """One client of the shared database: its own event store (and connection pool)."""

    def __init__(self, dsn: str | None = None, *, writer: str | None = None) -> None:
        self.dsn = _checked(dsn)
        self.store = PostgresEventStore.connect(self.dsn, writer or f"nemo-gym-tokens-{os.getpid()}",
                                                 pool=PoolLimits(size=2))
        self._closed = False
        self._started: set[tuple[str, int]] = set()  # attempts known to exist: an attempt never un-starts

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.store.close()

    async def _state(self, rollout_id: str, attempt: int) -> tc.CaptureState:
        return tc.fold(await self.store.read_stream(capture_stream(rollout_id, attempt)))

    # ---- token blobs ---------------------------------------------------------------------------

    @retrying("the token store")  # an upsert of content-addressed rows: safe to repeat
    async def _put_blobs(self, arrays: list[tuple[list[int], list[float] | None]]) -> list[Receipt]:
        """Content-addressed rows, one transaction. Committed without waiting for the disk on purpose:
        nothing points at them until the event holding their receipts commits, and that commit
        (synchronous) flushes the write-ahead log up to itself, these rows included. A crash in
        between leaves at most an unreferenced blob."""
        receipts, rows = [], []
        for ids, logprobs in arrays:
            digest = token_digest(ids, logprobs)
            receipts.append(Receipt(BLOB_PREFIX + digest, digest, len(ids)))
            rows.append({"b": BLOB_PREFIX + digest, "t": ids, "l": logprobs, "d": digest})
        async with self.store.engine.begin() as conn:
            await conn.execute(text("SET LOCAL synchronous_commit = off"))
            for row in rows:
                await conn.execute(
                    text(
                        "INSERT INTO rollbook.token_blobs (blob_id, token_ids, logprobs, digest) "
                        "VALUES (:b, CAST(:t AS integer[]), CAST(:l AS double precision[]), :d) "
                        "ON CONFLICT (blob_id) DO UPDATE SET token_ids = EXCLUDED.token_ids, "
                        "logprobs = EXCLUDED.logprobs, digest = EXCLUDED.digest, created_at = now()"
                    ),
                    row,
                )
        return receipts

    async def _put_blob(self, ids: list[int], logprobs: list[float] | None) -> Receipt:
        return (await self._put_blobs([(ids, logprobs)]))[0]

    @retrying("the token store")
    async def _get_blobs(self, blob_ids: list[str]) -> dict[str, tuple[list[int], list[float] | None]]:
        """Each blob re-hashed on read: a trainer never gets tokens that are not what was put."""
        wanted = sorted(set(blob_ids))
        if not wanted:
            return {}
        async with self.store.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT blob_id, token_ids, logprobs, digest FROM rollbook.token_blobs "
                     "WHERE blob_id = ANY(CAST(:b AS text[]))"),
                {"b": wanted},
            )
            out = {}
            for r in rows:
                ids = list(r.token_ids)
                lps = None if r.logprobs is None else [float(x) for x in r.logprobs]
                actual = token_digest(ids, lps)
                if actual != r.digest or r.blob_id != BLOB_PREFIX + actual:
                    raise InvalidCheckpointState(f"token blob {r.blob_id} does not match its digest", blob_id=r.blob_id)
                out[r.blob_id] = (ids, lps)
        missing = [b for b in wanted if b not in out]
        if missing:
            raise InvalidCheckpointState(f"token blob {missing[0]} is missing", blob_id=missing[0])
        return out

    async def _entries(self, rollout_id: str, calls: list[tc.CapturedCall]) -> list[TokenEntry]:
        blobs = await self._get_blobs([b for c in calls for b in (c.data["prompt_receipt"]["blob_id"], c.data["receipt"]["blob_id"])])
        return [_rebuild_entry(c, blobs) for c in calls]

    # ---- appending -----------------------------------------------------------------------------

    async def _write(self, key: str, decide: Any, events: Any, state: tc.CaptureState | None = None) -> tc.CaptureState | None:
        """Read the capture stream (or start from `state`, just read), decide, append conditional on
        the version read; on a conflict (another client wrote first) read and decide again. Returns
        None if nothing was written."""
        rollout_id, attempt = tc.split_capture_key(key)
        stream = capture_stream(rollout_id, attempt)
        for _ in range(MAX_RETRIES):
            state = state if state is not None else await self._state(rollout_id, attempt)
            if decide(state) is tc.Decision.NOTHING:
                return None
            expected: dict[str, int | None] = {stream: state.version}
            start = await self._start_if_unknown(rollout_id, attempt, expected)
            try:
                await self.store.append(AppendRequest((*start, *events(state, rollout_id, attempt)), expected))
            except VersionConflict:
                state = None
                await asyncio.sleep(0)
                continue
            return state
        raise VersionConflict(f"token capture of {key} kept changing under {MAX_RETRIES} tries; nothing was written")

    async def _start_if_unknown(self, rollout_id: str, attempt: int, expected: dict[str, int | None]) -> list[NewEvent]:
        """A rollout rollbook did not dispatch is started by its first captured write. The rollout
        stream's version is part of the condition, so two clients cannot both start it."""
        if (rollout_id, attempt) in self._started:
            return []
        events = await self.store.read_stream(rollout_stream(rollout_id))
        if any(e.kind == ATTEMPT_STARTED and e.attempt == attempt for e in events):
            self._started.add((rollout_id, attempt))
            return []
        expected[rollout_stream(rollout_id)] = events[-1].stream_version if events else 0
        data = {"started_by": "nemo_gym_token_capture", "capture_key": tc.capture_key(rollout_id, attempt)}
        return [NewEvent(rollout_stream(rollout_id), ATTEMPT_STARTED, data, rollout_id, attempt)]


class RollbookTokenCapture(_Client):
    """NeMo Gym's `TokenSink` (with `begin_call`) and `TokenSource`, on rollbook's log."""

    async def put(self, entry: TokenEntry) -> None:
        rollout_id, attempt = tc.split_capture_key(entry.rollout_id)
        model_call_id = validate_id(entry.model_call_id, "model call id")
        payload = entry.model_dump(mode="json")
        prompt, generated, logprobs = (list(payload[k]) for k in ARRAYS)
        _check_array(f"call {model_call_id} prompt", prompt, None)
        _check_array(f"call {model_call_id} generation", generated, logprobs)
        digest = entry_digest(payload)
        meta = {k: v for k, v in payload.items() if k not in ARRAYS}
        key = entry.rollout_id
        state = await self._state(rollout_id, attempt)
        # Refused before anything is stored: a conflicting or late record writes no blob either.
        if tc.decide_put(state, key, model_call_id, digest) is tc.Decision.NOTHING:
            return
        prompt_receipt, receipt = await self._put_blobs([(prompt, None), (generated, logprobs)])
        call_id = tc.captured_call_id(rollout_id, attempt, model_call_id)
        parent = entry.parent_call_id

        def events(state: tc.CaptureState, rollout_id: str, attempt: int) -> list[NewEvent]:
            receipts = {"receipt": receipt.to_json(), "prompt_receipt": prompt_receipt.to_json()}
            out = [NewEvent(capture_stream(rollout_id, attempt), ev.CAPTURE_ENTRY_PUT,
                            {"model_call_id": model_call_id, "call_id": call_id, "entry_digest": digest,
                             "entry": meta, **receipts}, rollout_id, attempt)]
            if model_call_id not in state.intents:  # begin_call accepted it already
                out.append(_accepted(call_id, model_call_id, rollout_id, attempt, parent))
            completed = {"call_id": call_id, "model_call_id": model_call_id, **receipts, "tokens": len(generated),
                         "disposition": "captured", "entry_digest": digest, "policy_version": None, "source": SOURCE}
            if parent:
                completed["parent_call_id"] = tc.captured_call_id(rollout_id, attempt, parent)
            out.append(NewEvent(call_stream(call_id), ev.CALL_COMPLETED, completed, rollout_id, attempt))
            return out

        await self._write(key, lambda s: tc.decide_put(s, key, model_call_id, digest), events, state)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        key = rollout_id
        model_call_id = validate_id(model_call_id, "model call id")

        def events(state: tc.CaptureState, rid: str, attempt: int) -> list[NewEvent]:
            call_id = tc.captured_call_id(rid, attempt, model_call_id)
            return [
                NewEvent(capture_stream(rid, attempt), ev.CAPTURE_CALL_BEGUN,
                         {"model_call_id": model_call_id, "call_id": call_id}, rid, attempt),
                _accepted(call_id, model_call_id, rid, attempt, None),
            ]

        await self._write(key, lambda s: tc.decide_begin(s, key, model_call_id), events)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        key = rollout_id
        if model_call_id:
            validate_id(model_call_id, "model call id")

        def events(state: tc.CaptureState, rid: str, attempt: int) -> list[NewEvent]:
            out = [NewEvent(capture_stream(rid, attempt), ev.CAPTURE_INCOMPLETE,
                            {"model_call_id": model_call_id, "reason": "capture_failed"}, rid, attempt)]
            if model_call_id and model_call_id not in state.entries:
                call_id = tc.captured_call_id(rid, attempt, model_call_id)
                if model_call_id not in state.intents:
                    out.append(_accepted(call_id, model_call_id, rid, attempt, None))
                out.append(NewEvent(call_stream(call_id), ev.CALL_FAILED, {
                    "call_id": call_id, "model_call_id": model_call_id, "source": SOURCE,
                    "error": {"code": "capture_incomplete", "detail": "the call's tokens were not captured"},
                }, rid, attempt))
            return out

        try:
            await self._write(key, lambda s: tc.decide_incomplete(s, key), events)
        except StaleAttempt:
            rid, attempt = tc.split_capture_key(key)
            if not await self._is_fenced(rid, attempt):
                raise
            # rollbook fenced the attempt, so no call of it can complete any more and a snapshot taken
            # without a freeze of its own reads incomplete already. Succeeding keeps mark_incomplete
            # more available than put, as Gym asks.

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        key = rollout_id
        rid, attempt = tc.split_capture_key(key)

        def events(state: tc.CaptureState, rid: str, attempt: int) -> list[NewEvent]:
            digests = sorted([c.model_call_id, c.entry_digest] for c in state.entries.values())
            return [NewEvent(capture_stream(rid, attempt), ev.CAPTURE_FROZEN, {
                "entries": len(digests), "digest": hashlib.sha256(canonical_json(digests).encode()).hexdigest(),
            }, rid, attempt)]

        fenced = False
        try:
            await self._write(key, lambda s: tc.decide_freeze(s, key), events)
        except StaleAttempt:
            fenced = True
        state = await self._state(rid, attempt)
        tc.decide_freeze(state, key)  # retired in between: refused like any freeze of a retired capture
        abandoned = state.frozen_position is None and fenced
        if abandoned:
            # rollbook fenced (or retired) the attempt before any freeze: nothing of it can land any
            # more, so the fence is its freeze. It did not finish here (a restore continued the rollout
            # under a later attempt, or it was retired), so its snapshot is incomplete: a trainer masks it.
            state.frozen_position = await self._fence_position(rid, attempt)
        assert state.frozen_position is not None
        served = await self._served(rid, attempt, state.frozen_position)
        calls = sorted(state.entries.values(), key=lambda c: c.position)
        return TokenCaptureSnapshot(
            rollout_id=key,
            entries=tuple(await self._entries(rid, calls)) + tuple(await self._served_entries(key, served)),
            incomplete=abandoned or state.is_incomplete() or bool(served.missing),
            snapshot_id=tc.snapshot_id(rid, attempt, state.frozen_position),
            version=state.version + served.late,
        )

    async def _fence_position(self, rollout_id: str, attempt: int) -> int:
        for e in await self.store.read_stream(rollout_stream(rollout_id)):
            if (e.kind == ATTEMPT_FENCED and e.attempt == attempt) or (
                    e.kind == ROLLOUT_RETIRED and int(e.data["through"]) >= attempt):
                return e.position
        raise StaleAttempt(f"attempt {attempt} of rollout {rollout_id} takes no writes, yet no fence or retire "
                           "mark names it", rollout_id=rollout_id, attempt=attempt)

    async def _served(self, rollout_id: str, attempt: int, frozen_position: int | None) -> tc.ServedSnapshot:
        """The model server's own calls of this attempt's lineage (engine.token_capture.served_snapshot)."""
        if frozen_position is None:
            return tc.ServedSnapshot((), (), 0)
        history = await effective_history(self.store, rollout_id, attempt)
        return tc.served_snapshot(history, frozen_position, SOURCE)

    async def _served_entries(self, key: str, served: tc.ServedSnapshot) -> list[TokenEntry]:
        """Each served call through the one record shape (engine.tokens.CallTokens), read the way
        `rollbook export` reads it (adapters.export.call_tokens), so the two cannot disagree."""
        rollout_id, _ = tc.split_capture_key(key)
        tokens = PostgresTokenStore(self.store.engine)
        return [served_entry(key, call, await call_tokens(tokens, call.completed, rollout_id, call.attempt,
                                                          call.accepted.get("parent_call_id")))
                for call in served.calls]

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        key = rollout_id
        rid, attempt = tc.split_capture_key(key)
        stream = capture_stream(rid, attempt)
        state = await self._state(rid, attempt)
        if state.frozen_position is None and state.retired is None and await self._is_fenced(rid, attempt):
            # Fenced before any freeze: its snapshot is the cut at the fence (see freeze), and nothing of
            # it can change, so retiring that snapshot has nothing to record. Any other is refused.
            state.frozen_position = await self._fence_position(rid, attempt)
            served = await self._served(rid, attempt, state.frozen_position)
            return tc.decide_retire(state, rid, attempt, snapshot_id, version, served.late) is tc.Decision.APPEND
        served = await self._served(rid, attempt, state.frozen_position)
        decision = tc.decide_retire(state, rid, attempt, snapshot_id, version, served.late)
        if decision is None:
            return False
        if decision is tc.Decision.NOTHING:
            return True
        event = NewEvent(stream, ev.CAPTURE_RETIRED, {"snapshot_id": snapshot_id, "version": version}, rid, attempt)
        try:
            # Conditional on the capture stream being where the trainer froze it: a write that lands first wins.
            await self.store.append(AppendRequest((event,), {stream: state.version}))
        except VersionConflict:
            return False
        except StaleAttempt:  # fenced since the freeze: nothing more can land, the snapshot stays what it was
            return True
        return True

    async def _is_fenced(self, rollout_id: str, attempt: int) -> bool:
        try:
            await self._fence_position(rollout_id, attempt)
        except StaleAttempt:
            return False
        return True


class RollbookLineageStore(_Client):
    """NeMo Gym's `LineageResolver` over the capture streams, with Gym's own matcher (`RolloutLineage`):
    the index holds fingerprints, digests and lengths; only the winner's tokens are read, and they
    must hash to the digest the record was stamped with."""

    def __init__(self, dsn: str | None = None, *, writer: str | None = None, max_cached_rollouts: int = 4096) -> None:
        super().__init__(dsn, writer=writer)
        # Least recently resolved first; an evicted rollout is read again from the log, which stays the truth.
        self._cache: dict[str, tuple[int, RolloutLineage, dict[str, tc.CapturedCall]]] = {}
        self._max_cached = max(1, max_cached_rollouts)

    def is_process_shared(self) -> bool:
        return True

    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        rid, attempt = tc.split_capture_key(rollout_id)
        version, lineage, calls = self._cache.pop(rollout_id, (0, RolloutLineage(), {}))
        # Only what was appended since this client last looked; a put that returned is in it.
        for e in await self.store.read_stream(capture_stream(rid, attempt), after_version=version):
            version = e.stream_version
            if e.kind == ev.CAPTURE_ENTRY_PUT:
                call = tc.CapturedCall(e.data["model_call_id"], e.data["entry_digest"], e.data, e.position)
                calls[call.model_call_id] = call
                lineage.add_entry(_metadata_entry(call), store_tokens=False)
        self._cache[rollout_id] = (version, lineage, calls)
        while len(self._cache) > self._max_cached:
            del self._cache[next(iter(self._cache))]
        status, node, reason = lineage.resolve_node(request_items)
        if status != ParentResolutionStatus.RESOLVED or node is None:
            return LineageResolution(status, reason=reason)
        tokens = await self._cumulative(rid, node.call_id, calls)
        if node.digest and compute_digest(tokens) != node.digest:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="digest_mismatch")
        return LineageResolution(
            ParentResolutionStatus.RESOLVED,
            match=LineageMatch(model_call_id=node.call_id, cumulative_token_ids=tuple(tokens), digest=node.digest),
        )

    async def _cumulative(self, rollout_id: str, call_id: str, calls: dict[str, tc.CapturedCall]) -> list[int]:
        """The full sequence a child of `call_id` starts with; a delta record stands on its parent's."""
        chain: list[tc.CapturedCall] = []
        current: str | None = call_id
        while current is not None:
            call = calls[current]
            if call in chain:
                raise InvalidCheckpointState(f"the delta chain of call {call_id} has a cycle")
            chain.append(call)
            current = call.data["entry"].get("parent_call_id") if call.data["entry"].get("prompt_is_delta") else None
        tokens: list[int] = []
        for entry in await self._entries(rollout_id, list(reversed(chain))):
            tokens += entry.prompt_token_ids + entry.generation_token_ids
        return tokens


def _accepted(call_id: str, model_call_id: str, rollout_id: str, attempt: int, parent: str | None) -> NewEvent:
    parent_call_id = tc.captured_call_id(rollout_id, attempt, parent) if parent else None
    return NewEvent(call_stream(call_id), ev.CALL_ACCEPTED, {
        "call_id": call_id, "model_call_id": model_call_id, "parent_call_id": parent_call_id,
        "policy_version": None, "source": SOURCE,
    }, rollout_id, attempt)


def _rebuild_entry(call: tc.CapturedCall, blobs: dict[str, tuple[list[int], list[float] | None]]) -> TokenEntry:
    prompt, _ = blobs[call.data["prompt_receipt"]["blob_id"]]
    generated, logprobs = blobs[call.data["receipt"]["blob_id"]]
    payload = {**call.data["entry"], "prompt_token_ids": prompt, "generation_token_ids": generated,
               "generation_log_probs": logprobs or []}
    if entry_digest(payload) != call.entry_digest:
        raise InvalidCheckpointState(
            f"the record of call {call.model_call_id} does not match the digest it was put with",
            model_call_id=call.model_call_id,
        )
    return TokenEntry.model_validate(payload)


def served_entry(key: str, call: tc.ServedCall, record: CallTokens) -> TokenEntry:
    """A call rollbook's model server recorded, as NeMo Gym's record: `CallTokens.to_token_entry`
    (the same ids and logprobs, the parent the agent named) under the trainer's rollout key, with the
    reply as its output item and Gym's lineage stamps (cum_len, digest over prompt + generation)."""
    reply = call.completed.get("reply")
    items = [{"type": "message", "role": "assistant", **reply}] if isinstance(reply, dict) else []
    extra = {k: call.completed[k] for k in ("policy_version", "finish_reason", "segments") if k in call.completed}
    entry = TokenEntry.model_validate({
        **record.to_token_entry(model=str(call.accepted.get("model") or "")), "rollout_id": key,
        "output_items": items, "token_item_index": 0 if items else None, "response_id": call.call_id, **extra,
    })
    status = ParentResolutionStatus.RESOLVED if record.parent_call_id else ParentResolutionStatus.ROOT
    return stamp_lineage(entry, record.parent_call_id or None, parent_resolution=status)


def _metadata_entry(call: tc.CapturedCall) -> TokenEntry:
    """The record without its arrays: what Gym's matcher indexes when tokens stay in the store."""
    meta = dict(call.data["entry"])
    if meta.get("cum_len") is None and not meta.get("prompt_is_delta"):
        meta["cum_len"] = call.data["prompt_receipt"]["tokens"] + call.data["receipt"]["tokens"]
    return TokenEntry.model_validate({**meta, "prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []})


__all__ = ["RollbookLineageStore", "RollbookTokenCapture", "entry_digest", "served_entry"]
