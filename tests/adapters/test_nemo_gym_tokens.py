"""rollbook's log as NeMo Gym's token-capture transport, checked by NeMo Gym's own conformance suite.

nemo-gym 0.7.0 is installed the light way by testkit/nemo_gym_env.py (no manual step; cached outside
git). `run_conformance` runs against fresh clients over one real PostgreSQL: once in this process,
once with every client in a separate worker process (tests/nemo_gym_worker.py), so a record put by
one process is frozen, resolved and retired by another.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from testkit import nemo_gym_env

nemo_gym_env.ensure()

from nemo_gym.token_id_capture.conformance import ConformanceError, run_conformance  # noqa: E402
from nemo_gym.token_id_capture.lineage import stamp_continuation  # noqa: E402
from nemo_gym.token_id_capture.protocols import (  # noqa: E402
    LineageMatch,
    LineageResolution,
    TokenCaptureSnapshot,
)
from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage  # noqa: E402

from adapters.nemo_gym_tokens import RollbookLineageStore, RollbookTokenCapture  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from apps.replay import history, replay  # noqa: E402
from apps.stack import all_events  # noqa: E402
from engine import catalog as ev  # noqa: E402
from engine.errors import (  # noqa: E402
    CaptureFrozen,
    CaptureRetired,
    InvalidCheckpointState,
    InvalidIdentifier,
    InvalidPayload,
    StaleAttempt,
    TokenEntryConflict,
)
from engine.events import AppendRequest, NewEvent  # noqa: E402
from engine.identity import rollout_stream  # noqa: E402
from engine.token_capture import split_capture_key  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Every check run_conformance (0.7.0) has, in its order. NeMo Gym counts nine: it names the two
# lineage checks (an existing and a fresh resolver) as one, "lineage visibility across clients".
CHECKS = [
    "put_then_freeze_visibility",
    "idempotent_reput",
    "conflicting_reput",
    "mark_incomplete_durability",
    "freeze_idempotency",
    "post_freeze_write_safety",
    "conditional_retirement",
    "lineage_visibility",
    "fresh_client_lineage_visibility",
    "begin_call_custody",
]


def make_entry(rollout_id: str, call: str, prompt: list[int], generation: list[int], *,
               logprobs: list[float] | None = None, text: str = "a") -> TokenEntry:
    entry = TokenEntry(
        rollout_id=rollout_id, model_call_id=call, model="m", prompt_token_ids=prompt, generation_token_ids=generation,
        generation_log_probs=logprobs if logprobs is not None else [-0.1] * len(generation),
        output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
        token_item_index=0, created_at=1700000000.25,
    )
    stamp_continuation(entry, [{"role": "user", "content": "hi"}])
    return stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)


async def log_size(dsn: str) -> tuple[int, int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        events = (await (await conn.execute("SELECT count(*) FROM rollbook.events")).fetchone())[0]
        blobs = (await (await conn.execute("SELECT count(*) FROM rollbook.token_blobs")).fetchone())[0]
    return events, blobs


async def model_call_rows(dsn: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        return await (await conn.execute("SELECT * FROM rollbook.model_call_state ORDER BY call_id")).fetchall()


# ---- the conformance suite ------------------------------------------------------------------------


async def test_nemo_gym_conformance_passes_every_check_with_fresh_clients_in_one_process(dsn: str) -> None:
    passed = await run_conformance(
        lambda: RollbookTokenCapture(dsn), lambda: RollbookTokenCapture(dsn), lambda: RollbookLineageStore(dsn)
    )
    assert passed == CHECKS
    store = PostgresEventStore.connect(dsn, writer="catalog-check")
    try:  # every event the capture wrote is as engine/catalog.py (and so docs/events.md) says
        assert sorted({p for e in await all_events(store) for p in ev.problems(e)}) == []
    finally:
        await store.close()


class _RemoteError(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


class _Worker:
    """One process holding real clients; one request at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()
        self.clients = 0

    @classmethod
    async def start(cls, dsn: str) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.nemo_gym_worker", dsn, cwd=REPO,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def request(self, **body: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self.lock:
            self.proc.stdin.write(json.dumps(body).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited with {await self.proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise _RemoteError(reply["error"]["code"], reply["error"]["detail"])
        return reply["ok"]

    async def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        await asyncio.wait_for(self.proc.wait(), 30)


class _Remote:
    """A fresh client whose real instance lives in a worker process (made on first use)."""

    kind = ""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.handle: int | None = None

    async def _call(self, method: str, **args: Any) -> Any:
        if self.handle is None:
            self.handle = await self.worker.request(op="new", kind=self.kind)
            self.worker.clients += 1
        return await self.worker.request(op="call", handle=self.handle, method=method, args=args)

    async def close(self) -> None:
        if self.handle is not None:
            await self._call("close")


class RemoteCapture(_Remote):
    kind = "capture"

    async def put(self, entry: TokenEntry) -> None:
        await self._call("put", entry=entry.model_dump(mode="json"))

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self._call("mark_incomplete", rollout_id=rollout_id, model_call_id=model_call_id)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._call("begin_call", rollout_id=rollout_id, model_call_id=model_call_id)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        d = await self._call("freeze", rollout_id=rollout_id)
        entries = tuple(TokenEntry.model_validate(e) for e in d["entries"])
        return TokenCaptureSnapshot(d["rollout_id"], entries, d["incomplete"], d["snapshot_id"], d["version"])

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return bool(await self._call("drop", rollout_id=rollout_id, snapshot_id=snapshot_id, version=version))


class RemoteLineage(_Remote):
    kind = "lineage"

    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        d = await self._call("resolve", rollout_id=rollout_id, request_items=request_items)
        match = None if d["match"] is None else LineageMatch(
            d["match"]["model_call_id"], tuple(d["match"]["cumulative_token_ids"]), d["match"]["digest"])
        return LineageResolution(ParentResolutionStatus(d["status"]), match=match, reason=d["reason"])

    def is_process_shared(self) -> bool:
        return True


async def test_nemo_gym_conformance_passes_every_check_with_each_client_in_another_process(dsn: str) -> None:
    workers = await asyncio.gather(_Worker.start(dsn), _Worker.start(dsn))
    turn = itertools.cycle(workers)  # consecutive clients (a check's sink, then its source) never share a process
    try:
        passed = await run_conformance(
            lambda: RemoteCapture(next(turn)), lambda: RemoteCapture(next(turn)), lambda: RemoteLineage(next(turn))
        )
    finally:
        await asyncio.gather(*(w.stop() for w in workers))
    assert passed == CHECKS
    assert all(w.clients >= 5 for w in workers), [w.clients for w in workers]


class _RetiresAnyVersion(RollbookTokenCapture):
    """A negative control: retirement that ignores the version the trainer froze."""

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        state = await self._state(*split_capture_key(rollout_id))
        return await super().drop(rollout_id, snapshot_id=snapshot_id, version=state.version)


async def test_conformance_catches_a_retirement_that_ignores_the_frozen_version(dsn: str) -> None:
    with pytest.raises(ConformanceError) as err:
        await run_conformance(lambda: _RetiresAnyVersion(dsn), lambda: _RetiresAnyVersion(dsn))
    assert err.value.check_name == "mark_incomplete_durability"


# ---- the log shows the calls like any other ---------------------------------------------------------


async def test_a_captured_call_is_in_model_calls_history_and_replay(dsn: str) -> None:
    sink = RollbookTokenCapture(dsn)
    store = PostgresEventStore.connect(dsn, writer="test")
    try:
        await sink.begin_call("gym-7-a2", "c1")
        await sink.put(make_entry("gym-7-a2", "c1", [1, 2, 3], [4, 5], logprobs=[-0.5, -0.25]))
        await sink.mark_incomplete("gym-7-a2", "c2")
        child = make_entry("gym-7-a2", "c3", [1, 2, 3, 4, 5, 6], [7], logprobs=[-1.0])
        await sink.put(stamp_lineage(child, "c1", parent_resolution=ParentResolutionStatus.RESOLVED))
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            rows = await (await conn.execute(
                "SELECT call_id, rollout_id, attempt, status, tokens, receipt->>'blob_id', disposition, parent_call_id "
                "FROM rollbook.model_calls WHERE rollout_id = 'gym-7' ORDER BY call_id")).fetchall()
            stored = await (await conn.execute(
                "SELECT b.token_ids, b.logprobs FROM rollbook.model_calls m "
                "JOIN rollbook.token_blobs b ON b.blob_id = m.receipt->>'blob_id' WHERE m.call_id = 'gym-7.2.c1'")).fetchone()
        assert [r[:5] + (r[6],) for r in rows] == [
            ("gym-7.2.c1", "gym-7", 2, "completed", 2, "captured"),
            ("gym-7.2.c2", "gym-7", 2, "failed", None, None),
            ("gym-7.2.c3", "gym-7", 2, "completed", 1, "captured"),
        ]
        assert rows[0][5].startswith("sha256-") and [r[7] for r in rows] == [None, None, "gym-7.2.c1"]
        assert stored == ([4, 5], [-0.5, -0.25])
        h = await history(store, "gym-7")
        assert [(a["attempt"], a["status"], a["model_calls"]) for a in h["attempts"]] == [(2, "live", 2)]
        assert [t["kind"] for t in h["timeline"]] == [
            "attempt_started", "capture_call_begun", "call_accepted", "capture_entry_put", "call_completed",
            "capture_incomplete", "call_accepted", "call_failed", "capture_entry_put", "call_accepted", "call_completed",
        ]
        steps, state = await replay(store, "gym-7", 2)
        assert state.calls == ["gym-7.2.c1", "gym-7.2.c3"]
        live = await model_call_rows(dsn)
        await store.rebuild_projections()
        assert await model_call_rows(dsn) == live  # the projection of captured calls is derived from the log alone
        assert "call c1 recorded, 3 prompt + 2 generated tokens" in steps[3].change
    finally:
        await sink.close()
        await store.close()


# ---- the contract, rule by rule -------------------------------------------------------------------


async def test_put_then_freeze_round_trips_the_exact_record_from_another_client(dsn: str) -> None:
    a, b = RollbookTokenCapture(dsn), RollbookTokenCapture(dsn)
    entry = make_entry("r1", "c1", [7, 8], [9], logprobs=[-0.1])  # -0.1 is not a float32: stored as it was given
    try:
        await a.put(entry)
        snap = await b.freeze("r1")
        again = await RollbookTokenCapture(dsn).freeze("r1")
    finally:
        await a.close()
        await b.close()
    assert [e.model_dump(mode="json") for e in snap.entries] == [entry.model_dump(mode="json")]
    assert (snap.snapshot_id, snap.version, snap.incomplete) == (again.snapshot_id, again.version, False)
    assert snap.snapshot_id.startswith("r1@")


async def test_a_conflicting_reput_is_refused_and_writes_nothing(dsn: str) -> None:
    sink = RollbookTokenCapture(dsn)
    try:
        await sink.put(make_entry("r2", "c1", [1], [2]))
        before = await log_size(dsn)
        with pytest.raises(TokenEntryConflict) as err:
            await sink.put(make_entry("r2", "c1", [1], [3]))
        assert err.value.code == "token_entry_conflict" and "c1" in err.value.detail
        assert await log_size(dsn) == before
    finally:
        await sink.close()


async def test_a_put_after_freeze_is_refused_and_writes_nothing(dsn: str) -> None:
    sink = RollbookTokenCapture(dsn)
    try:
        await sink.put(make_entry("r3", "c1", [1], [2]))
        await sink.freeze("r3")
        await sink.put(make_entry("r3", "c1", [1], [2]))  # the identical record: a retry, already in the snapshot
        before = await log_size(dsn)
        with pytest.raises(CaptureFrozen) as err:
            await sink.put(make_entry("r3", "c2", [1, 2], [3]))
        assert err.value.code == "capture_frozen" and "c2" in err.value.detail
        assert await log_size(dsn) == before
    finally:
        await sink.close()


@pytest.mark.parametrize("bad", ["rollout id", "token id", "logprob", "call id"])
async def test_bad_records_are_refused_by_name_and_write_nothing(dsn: str, bad: str) -> None:
    entry = make_entry("r4", "c1", [1, 2], [3])
    if bad == "rollout id":
        entry.rollout_id = "no spaces allowed"
    elif bad == "token id":
        entry.prompt_token_ids = [1, -2]
    elif bad == "logprob":
        entry.generation_log_probs = [float("nan")]
    else:
        entry.model_call_id = "../c1"
    sink = RollbookTokenCapture(dsn)
    try:
        before = await log_size(dsn)
        with pytest.raises((InvalidIdentifier, InvalidPayload)) as err:
            await sink.put(entry)
        assert await log_size(dsn) == before
    finally:
        await sink.close()
    expected = {"rollout id": ("invalid_identifier", "rollout id"), "token id": ("invalid_payload", "-2"),
                "logprob": ("invalid_payload", "logprob"), "call id": ("invalid_identifier", "model call id")}[bad]
    assert err.value.code == expected[0] and expected[1] in err.value.detail


async def test_a_fenced_attempt_cannot_capture(dsn: str) -> None:
    sink = RollbookTokenCapture(dsn)
    store = PostgresEventStore.connect(dsn, writer="test")
    try:
        await sink.put(make_entry("r5", "c1", [1], [2]))
        await store.append(AppendRequest((NewEvent(rollout_stream("r5"), "attempt_fenced", {}, "r5", 0),)))
        with pytest.raises(StaleAttempt):
            await sink.put(make_entry("r5", "c2", [1, 2], [3]))
    finally:
        await sink.close()
        await store.close()


async def test_freeze_refuses_tokens_that_are_not_what_was_put(dsn: str) -> None:
    sink = RollbookTokenCapture(dsn)
    try:
        await sink.put(make_entry("r6", "c1", [1, 2], [3]))
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("UPDATE rollbook.token_blobs SET logprobs = '{-0.2}' WHERE token_ids = '{3}'")
        with pytest.raises(InvalidCheckpointState) as err:
            await sink.freeze("r6")
        assert "does not match its digest" in err.value.detail
    finally:
        await sink.close()


async def test_retirement_is_exact_idempotent_and_final(dsn: str) -> None:
    sink, trainer = RollbookTokenCapture(dsn), RollbookTokenCapture(dsn)
    try:
        assert await trainer.drop("r9", snapshot_id="r9@1", version=1) is False  # never frozen
        await sink.put(make_entry("r9", "c1", [1], [2]))
        snap = await trainer.freeze("r9")
        assert await trainer.drop("r9", snapshot_id="r9@999", version=snap.version) is False  # not that snapshot
        assert await trainer.drop("r9", snapshot_id=snap.snapshot_id, version=snap.version) is True
        assert await sink.drop("r9", snapshot_id=snap.snapshot_id, version=snap.version) is True  # a retry
        assert await sink.drop("r9", snapshot_id=snap.snapshot_id, version=snap.version + 1) is False
        before = await log_size(dsn)
        for write in (sink.put(make_entry("r9", "c2", [1, 2], [3])), sink.mark_incomplete("r9", "c2"),
                      sink.begin_call("r9", "c3"), trainer.freeze("r9")):
            with pytest.raises(CaptureRetired) as err:
                await write
            assert err.value.code == "capture_retired" and snap.snapshot_id in err.value.detail
        assert await log_size(dsn) == before
    finally:
        await asyncio.gather(sink.close(), trainer.close())


async def _served_call(store: PostgresEventStore, capture: RollbookTokenCapture, rollout_id: str, attempt: int,
                       call_id: str, prompt: list[int], generated: list[int] | None, parent: str | None = None) -> None:
    """A call as rollbook's model server records it: accepted, then completed with its receipts."""
    stream = f"call:{call_id}"
    await store.append(AppendRequest((NewEvent(stream, "call_accepted", {
        "call_id": call_id, "parent_call_id": parent, "policy_version": "v1", "stream": False}, rollout_id, attempt),)))
    if generated is None:
        return  # still generating
    prompt_receipt = await capture._put_blob(prompt, None)
    receipt = await capture._put_blob(generated, [-0.25 * (i + 1) for i in range(len(generated))])
    await store.append(AppendRequest((NewEvent(stream, "call_completed", {
        "call_id": call_id, "receipt": receipt.to_json(), "prompt_receipt": prompt_receipt.to_json(),
        "reply": {"role": "assistant", "content": "ok"}, "disposition": "generated", "tokens": len(generated),
        "policy_version": "v1", "finish_reason": "stop"}, rollout_id, attempt),)))


async def test_calls_served_by_rollbooks_model_server_are_in_the_snapshot_of_their_attempts_lineage(dsn: str) -> None:
    store = PostgresEventStore.connect(dsn, writer="test")
    capture = RollbookTokenCapture(dsn)
    try:
        await store.append(AppendRequest((NewEvent(rollout_stream("svc"), "attempt_started", {}, "svc", 0),)))
        await _served_call(store, capture, "svc", 0, "svc.0.t0", [1, 2], [3, 4])
        (boundary,) = await store.append(AppendRequest((NewEvent("agent:svc:0", "agent_boundary", {}, "svc", 0),)))
        await _served_call(store, capture, "svc", 0, "svc.0.t1", [1, 2, 3, 4, 5], None, parent="svc.0.t0")  # crashed
        await store.append(AppendRequest((
            NewEvent(rollout_stream("svc"), "attempt_fenced", {}, "svc", 0),
            NewEvent(rollout_stream("svc"), "attempt_started", {
                "parent_attempt": 0, "origin_attempt": 0, "origin_position": boundary.position}, "svc", 1),
        )))
        await _served_call(store, capture, "svc", 1, "svc.1.t1", [1, 2, 3, 4, 5], [6], parent="svc.0.t0")

        fenced, continued = await capture.freeze("svc"), await capture.freeze("svc-a1")
        assert (fenced.incomplete, [e.model_call_id for e in fenced.entries]) == (True, ["svc.0.t0"])
        await capture.mark_incomplete("svc", "svc.0.t1")  # fenced: already incomplete, and not an error
        assert await capture.drop("svc", snapshot_id=fenced.snapshot_id, version=fenced.version + 1) is False
        assert await capture.drop("svc", snapshot_id=fenced.snapshot_id, version=fenced.version) is True
        assert (continued.incomplete, [e.model_call_id for e in continued.entries]) == (False, ["svc.0.t0", "svc.1.t1"])
        first, second = continued.entries
        assert (first.prompt_token_ids, first.generation_token_ids, first.generation_log_probs) == ([1, 2], [3, 4], [-0.25, -0.5])
        assert (second.parent_call_id, second.parent_resolution, second.cum_len) == ("svc.0.t0", "resolved", 6)
        assert second.rollout_id == "svc-a1" and second.policy_version == "v1" and second.finish_reason == "stop"

        await _served_call(store, capture, "svc", 1, "svc.1.t2", [1, 2, 3, 4, 5, 6, 7], [8])  # raced the freeze
        again = await capture.freeze("svc-a1")
        assert (again.snapshot_id, len(again.entries)) == (continued.snapshot_id, 2) and again.version > continued.version
        assert await capture.drop("svc-a1", snapshot_id=continued.snapshot_id, version=continued.version) is False
        assert await capture.drop("svc-a1", snapshot_id=again.snapshot_id, version=again.version) is True
    finally:
        await capture.close()
        await store.close()


class _PausingCapture(RollbookTokenCapture):
    """Stops a write after it has read and decided, before it appends: the window a freeze can hit."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.reached, self.go = asyncio.Event(), asyncio.Event()

    async def _start_if_unknown(self, rollout_id: str, attempt: int, expected: dict[str, int | None]) -> list[NewEvent]:
        if not self.reached.is_set():
            self.reached.set()
            await self.go.wait()
        return await super()._start_if_unknown(rollout_id, attempt, expected)


async def test_a_freeze_landing_between_a_puts_read_and_append_refuses_the_put(dsn: str) -> None:
    """The append is conditional on the capture stream's version: a strict fence, across clients."""
    first, pausing, trainer = RollbookTokenCapture(dsn), _PausingCapture(dsn), RollbookTokenCapture(dsn)
    try:
        await first.put(make_entry("r8", "c1", [1], [2]))
        put = asyncio.ensure_future(pausing.put(make_entry("r8", "c2", [1, 2], [3])))
        await pausing.reached.wait()
        snap = await trainer.freeze("r8")
        pausing.go.set()
        with pytest.raises(CaptureFrozen):
            await put
        after = await trainer.freeze("r8")
    finally:
        await asyncio.gather(first.close(), pausing.close(), trainer.close())
    assert [e.model_call_id for e in snap.entries] == ["c1"]
    assert (after.version, len(after.entries)) == (snap.version, 1)


async def test_puts_racing_freeze_are_each_in_the_snapshot_or_refused(dsn: str) -> None:
    clients = [RollbookTokenCapture(dsn) for _ in range(4)]
    try:
        for i in range(12):
            key = f"race{i}"
            await clients[0].put(make_entry(key, "c1", [1], [2]))

            async def late_freeze(delay: float, key: str = key) -> TokenCaptureSnapshot:
                await asyncio.sleep(delay)
                return await clients[3].freeze(key)

            put, snap = await asyncio.gather(
                clients[1 + i % 2].put(make_entry(key, "c2", [1, 2], [3])), late_freeze(0.004 * i),
                return_exceptions=True,
            )
            assert isinstance(snap, TokenCaptureSnapshot), snap
            landed = "c2" in {e.model_call_id for e in snap.entries}
            assert landed if put is None else (isinstance(put, CaptureFrozen) and not landed), (i, put)
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_the_resolver_keeps_a_bounded_cache_and_reads_an_evicted_rollout_again(dsn: str) -> None:
    sink, resolver = RollbookTokenCapture(dsn), RollbookLineageStore(dsn, max_cached_rollouts=2)
    try:
        parents = {}
        for key in ("ra", "rb", "rc"):
            parents[key] = make_entry(key, "c1", [1, 2], [3], text=f"answer {key}")
            await sink.put(parents[key])
        for key in ("ra", "rb", "rc", "ra"):
            items = [{"role": "user", "content": "hi"}, *parents[key].output_items, {"role": "user", "content": "?"}]
            res = await resolver.resolve(key, items)
            assert res.status == ParentResolutionStatus.RESOLVED and res.match is not None
            assert res.match.cumulative_token_ids == (1, 2, 3)
            assert len(resolver._cache) <= 2
        assert list(resolver._cache) == ["rc", "ra"]
    finally:
        await asyncio.gather(sink.close(), resolver.close())


async def test_a_resolved_parent_carries_tokens_read_back_from_the_store(dsn: str) -> None:
    sink, resolver = RollbookTokenCapture(dsn), RollbookLineageStore(dsn)
    try:
        parent = make_entry("r7", "c1", [1, 2], [3, 4], text="sunny")
        await sink.put(parent)
        follow_up = [{"role": "user", "content": "hi"}, *parent.output_items, {"role": "user", "content": "more"}]
        first = await resolver.resolve("r7", follow_up)
        assert first.status == ParentResolutionStatus.RESOLVED and first.match is not None
        assert first.match.cumulative_token_ids == (1, 2, 3, 4)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("UPDATE rollbook.token_blobs SET token_ids = '{3,5}', digest = 'x' WHERE token_ids = '{3,4}'")
        fresh = RollbookLineageStore(dsn)
        try:
            with pytest.raises(InvalidCheckpointState):
                await fresh.resolve("r7", follow_up)
        finally:
            await fresh.close()
    finally:
        await sink.close()
        await resolver.close()



# ---- the manual's instructions (docs/nemo-gym.md), run as written ------------------------------------


def _readme_blocks(lang: str) -> list[str]:
    """The fenced blocks of one language in the "NeMo Gym token capture" section of docs/nemo-gym.md,
    unindented."""
    text = (REPO / "docs" / "nemo-gym.md").read_text()
    start = text.index("\n## NeMo Gym token capture\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    blocks: list[tuple[str, list[str]]] = []
    current: tuple[str, list[str]] | None = None
    for line in section.splitlines():
        fence = line.strip().startswith("```")
        if current is None and fence:
            current = (line.strip()[3:], [])
        elif current is not None and fence:
            blocks.append(current)
            current = None
        elif current is not None:
            current[1].append(line)
    return [textwrap.dedent("\n".join(body) + "\n") for kind, body in blocks if kind == lang]


async def test_the_readme_round_trip_runs_and_prints_what_the_readme_shows(dsn: str) -> None:
    (snippet,) = _readme_blocks("python")
    shown = _readme_blocks("")[0]  # the output block right after the snippet
    env = {**os.environ, "ROLLBOOK_DSN": dsn, "PYTHONPATH": str(nemo_gym_env.target())}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", snippet, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == shown
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        rows = await (await conn.execute("SELECT call_id, status, parent_call_id, tokens FROM rollbook.model_calls "
                                         "WHERE rollout_id = 'demo-rollout' ORDER BY call_id")).fetchall()
    assert rows == [("demo-rollout.0.call-1", "completed", None, 2),
                    ("demo-rollout.0.call-2", "completed", "demo-rollout.0.call-1", 2)]


def test_the_readme_config_names_rollbook_clients_that_gyms_loader_accepts(dsn: str) -> None:
    """Gym's loader (TokenIdCaptureConfig.build_sink) imports 'module:Class', calls it with the kwargs
    and checks the protocol. Its check reads `Protocol.__protocol_attrs__`, which exists from Python
    3.12 (Gym requires 3.13), so on 3.11 the same steps run here by hand, with runtime protocol checks."""
    from importlib import import_module

    from nemo_gym.token_id_capture.config import TokenIdCaptureConfig
    from nemo_gym.token_id_capture.protocols import LineageResolver, TokenSink, TokenSource

    (block,) = _readme_blocks("yaml")
    settings = TokenIdCaptureConfig.model_validate(yaml.safe_load(block.replace("${oc.env:ROLLBOOK_DSN}", dsn)))
    built = []
    for target, kwargs in ((settings.token_id_capture.sink, settings.token_id_capture.sink_kwargs),
                           (settings.token_id_capture.lineage_store, settings.token_id_capture.lineage_store_kwargs)):
        module, _, name = target.partition(":")
        built.append(getattr(import_module(module), name)(**kwargs))
    sink, lineage = built
    assert isinstance(sink, TokenSink) and isinstance(sink, TokenSource) and isinstance(lineage, LineageResolver)
    assert (type(sink), type(lineage)) == (RollbookTokenCapture, RollbookLineageStore)
    assert sink.dsn == lineage.dsn == dsn and lineage.is_process_shared()
