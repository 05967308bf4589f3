"""Conformance of the event log, run against every PostgreSQL server the fixture can reach."""

from __future__ import annotations

import asyncio

import pytest

from adapters.postgres import INSERT_CHUNK_EVENTS, PostgresEventStore
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_STARTED, ROLLOUT_FORGOTTEN, ROLLOUT_RETIRED
from engine.checkpoint import recorded_chain_hash
from engine.errors import InvalidPayload, PayloadTooLarge, StaleAttempt, UnknownAttempt, VersionConflict
from engine.events import GENESIS_HASH, AppendRequest, NewEvent
from engine.identity import episode_stream, rollout_stream
from engine.log import append_one
from tests.waiting import eventually


def ev(stream: str, kind: str = "noted", rollout: str | None = None, attempt: int | None = None, **data) -> NewEvent:
    return NewEvent(stream, kind, data, rollout, attempt)


async def start_attempt(store, rollout: str, attempt: int) -> None:
    await append_one(store, ev(rollout_stream(rollout), ATTEMPT_STARTED, rollout, attempt, parent_attempt=None))


async def test_positions_are_gap_free_in_commit_order_under_concurrent_writers(any_dsn: str) -> None:
    # Several stores = several connections committing concurrently; each store also groups.
    writers = [PostgresEventStore.connect(any_dsn, writer=f"w{i}") for i in range(6)]
    reader = PostgresEventStore.connect(any_dsn, writer="reader")
    per_task, tasks_per_writer = 40, 4
    done = asyncio.Event()
    seen: list[int] = []

    async def write(store: PostgresEventStore, tag: str) -> None:
        for i in range(per_task):
            batch = tuple(ev(f"{tag}", n=i, j=j) for j in range(1 + i % 3))
            await store.append(AppendRequest(batch))

    async def tail() -> None:
        last = 0
        while True:
            finished = done.is_set()
            for e in await reader.read_all(after=last, limit=500):
                # A position below one already read would mean a reader skipped it.
                assert e.position == last + 1, f"read position {e.position} right after {last}"
                last = e.position
                seen.append(e.position)
            if finished:
                return
            await asyncio.sleep(0)

    tailer = asyncio.create_task(tail())
    await asyncio.gather(*(write(w, f"s{i}-{t}") for i, w in enumerate(writers) for t in range(tasks_per_writer)))
    done.set()
    await tailer
    expected = sum(1 + i % 3 for i in range(per_task)) * len(writers) * tasks_per_writer
    assert seen == list(range(1, expected + 1))
    assert await reader.head() == expected
    for s in [*writers, reader]:
        await s.close()


async def test_fenced_attempt_cannot_append_and_nothing_is_written(any_store: PostgresEventStore) -> None:
    await start_attempt(any_store, "r1", 0)
    await append_one(any_store, ev(episode_stream("r1", 0), "episode_started", "r1", 0))
    await append_one(any_store, ev(rollout_stream("r1"), ATTEMPT_FENCED, "r1", 0, reason="test"))
    head = await any_store.head()
    with pytest.raises(StaleAttempt) as err:
        await append_one(any_store, ev(episode_stream("r1", 0), "episode_step", "r1", 0, step="agent"))
    assert err.value.code == "stale_attempt"
    assert await any_store.head() == head
    assert len(await any_store.read_stream(episode_stream("r1", 0))) == 1


async def test_unstarted_attempt_cannot_append(any_store: PostgresEventStore) -> None:
    with pytest.raises(UnknownAttempt):
        await append_one(any_store, ev("episode:r9:0", "episode_started", "r9", 0))
    assert await any_store.head() == 0


async def test_fence_and_inflight_appends_serialize(dsn: str) -> None:
    appender = PostgresEventStore.connect(dsn, writer="agent")
    fencer = PostgresEventStore.connect(dsn, writer="coordinator")
    for round_ in range(5):
        rid = f"race{round_}"
        await start_attempt(appender, rid, 0)

        async def spam(k: int, rid: str = rid) -> None:
            for i in range(30):
                try:
                    await append_one(appender, ev(f"agent:{rid}:0:{k}", "turn", rid, 0, i=i))
                except StaleAttempt:
                    return

        spammers = [asyncio.create_task(spam(k)) for k in range(8)]
        await asyncio.sleep(0.02 * round_)
        fence = await append_one(fencer, ev(rollout_stream(rid), ATTEMPT_FENCED, rid, 0, reason="restore"))
        await asyncio.gather(*spammers)
        late = [e for e in await appender.read_rollout(rid, 0) if e.position > fence.position]
        assert late == [], f"attempt 0 of {rid} wrote after its fence at {fence.position}"
    await appender.close()
    await fencer.close()


async def test_version_conflict_names_both_versions_and_writes_nothing(any_store: PostgresEventStore) -> None:
    await append_one(any_store, ev("acct", "opened"), expected_version=0)
    await append_one(any_store, ev("acct", "credited"), expected_version=1)
    with pytest.raises(VersionConflict) as err:
        await append_one(any_store, ev("acct", "debited"), expected_version=1)
    assert "version 2" in err.value.detail and "expected 1" in err.value.detail
    assert err.value.context == {"stream": "acct", "expected": 1, "actual": 2}
    assert [e.kind for e in await any_store.read_stream("acct")] == ["opened", "credited"]


async def test_concurrent_writers_of_one_stream_conflict_instead_of_interleaving(dsn: str) -> None:
    a = PostgresEventStore.connect(dsn, writer="a")
    b = PostgresEventStore.connect(dsn, writer="b")
    results = await asyncio.gather(
        append_one(a, ev("shared", "by_a"), expected_version=0),
        append_one(b, ev("shared", "by_b"), expected_version=0),
        return_exceptions=True,
    )
    assert sum(isinstance(r, VersionConflict) for r in results) == 1
    assert len(await a.read_stream("shared")) == 1
    await a.close()
    await b.close()


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"blob": "x" * (1024 * 1024 + 1)}, PayloadTooLarge),  # over the 1 MiB default
        ({"raw": b"bytes"}, InvalidPayload),  # not JSON
        ({"n": float("nan")}, InvalidPayload),  # JSON has no NaN
        ({1: "non-string key"}, None),  # allowed: JSON turns the key into "1"
    ],
)
async def test_bad_payloads_are_refused_with_a_code_and_lose_nothing(any_store, bad, error) -> None:
    good = AppendRequest((ev("ok", "kept"),))
    bad_request = AppendRequest((NewEvent("bad", "refused", bad),))
    results = await asyncio.gather(any_store.append(good), any_store.append(bad_request), return_exceptions=True)
    assert not isinstance(results[0], Exception), "a refused request in the same group must not sink another"
    if error is None:
        assert not isinstance(results[1], Exception)
        return
    assert isinstance(results[1], error)
    assert results[1].code in {"invalid_payload", "payload_too_large"}
    assert await any_store.read_stream("bad") == []


STRANGE = ["nul\x00byte", "lone \ud800 surrogate", "\udfff", "the escape \ue000 itself", "\ue000" + "0", "\\u0000 (six characters)",
           "\x00\ud83d\ude00\ud83d", "plain"]


async def test_every_code_point_a_tool_or_a_model_produces_is_stored_and_read_back_exactly(any_store) -> None:
    """JSONB holds neither U+0000 nor a lone surrogate (`printf '\\0'`, an upstream's "\\ud800"): they
    used to be refused (the rollout failed, and its retry ran the command again) or, for a surrogate,
    raised inside the batched append and failed every request of the batch. Now they are stored in
    an escaped spelling, read back as they were, and the hash chain a restore re-derives agrees."""
    data = {"out": STRANGE, "nested": {s: s for s in STRANGE}}
    good = AppendRequest((ev("ok2", "kept"),))
    results = await asyncio.gather(any_store.append(good), any_store.append(AppendRequest((NewEvent("odd", "x", data),))))
    assert all(not isinstance(r, Exception) for r in results)
    (back,) = await any_store.read_stream("odd")
    assert back.data == data
    assert recorded_chain_hash(GENESIS_HASH, back) == back.hash
    assert (await any_store.read_all(back.position - 1, 1))[0].data == data


async def test_retire_mark_refuses_until_forget(any_store: PostgresEventStore) -> None:
    await start_attempt(any_store, "r2", 0)
    await append_one(any_store, ev(rollout_stream("r2"), ROLLOUT_RETIRED, "r2", 0, through=0))
    with pytest.raises(StaleAttempt):
        await append_one(any_store, ev("episode:r2:0", "episode_step", "r2", 0))
    with pytest.raises(StaleAttempt):  # a late caller cannot start a retired attempt either
        await start_attempt(any_store, "r2", 0)
    await append_one(any_store, ev(rollout_stream("r2"), ROLLOUT_FORGOTTEN, "r2", 0))
    await append_one(any_store, ev("episode:r2:0", "episode_step", "r2", 0))


async def test_subscription_catches_up_then_follows(any_store: PostgresEventStore) -> None:
    for i in range(3):
        await append_one(any_store, ev("sub", n=i))
    got: list[int] = []

    async def follow() -> None:
        async for e in any_store.subscribe(after=1, poll_seconds=3600):
            got.append(e.data["n"])
            if len(got) == 3:
                return

    follower = asyncio.create_task(follow())
    await eventually("the follower to catch up", lambda: len(got) == 2)  # now it waits for what comes next
    await append_one(any_store, ev("sub", n=3))
    # An hour's poll: only the NOTIFY hint can wake the reader within the (generous) timeout.
    await asyncio.wait_for(follower, timeout=60)
    assert got == [1, 2, 3]


async def test_hash_chain_links_each_event_to_its_predecessor(any_store: PostgresEventStore) -> None:
    from engine.events import GENESIS_HASH, chain_hash, encode_payload

    for i in range(3):
        await append_one(any_store, ev("chain", n=i))
    prev = GENESIS_HASH
    for e in await any_store.read_stream("chain"):
        new = NewEvent(e.stream, e.kind, e.data, e.rollout_id, e.attempt, e.schema_version)
        assert e.hash == chain_hash(prev, e.stream, e.stream_version, new, encode_payload(e.data))
        prev = e.hash


async def test_large_floats_hash_the_way_postgres_hands_them_back(any_store: PostgresEventStore) -> None:
    # The bad input: floats JSONB returns as integers (1e+16 comes back as 10000000000000000).
    from engine.events import GENESIS_HASH, chain_hash, encode_payload

    recorded = await append_one(any_store, ev("big", amount=1e16, nested=[{"x": -1.5e20}], small=1e-05, one=1.0))
    (read,) = await any_store.read_stream("big")
    assert read.data == {"amount": 10**16, "nested": [{"x": -150000000000000000000}], "small": 1e-05, "one": 1.0}
    new = NewEvent(read.stream, read.kind, read.data, read.rollout_id, read.attempt, read.schema_version)
    assert read.hash == recorded.hash == chain_hash(GENESIS_HASH, read.stream, 1, new, encode_payload(read.data))


async def test_a_refusal_after_rows_already_sent_in_the_group_loses_nothing(any_store: PostgresEventStore) -> None:
    # The store sends a group's rows to the server while it plans the rest (pipeline mode), so the
    # first request below is on the wire before the second is refused (bad input: a NaN in its
    # second event). The refused request writes nothing; its neighbours land gap-free.
    big = AppendRequest(tuple(ev("big", n=i) for i in range(INSERT_CHUNK_EVENTS + 5)))
    half_bad = AppendRequest((ev("mixed", n=1), NewEvent("mixed", "refused", {"n": float("nan")})))
    after = AppendRequest(tuple(ev("after", n=i) for i in range(3)))
    results = await asyncio.gather(
        any_store.append(big), any_store.append(half_bad), any_store.append(after), return_exceptions=True
    )
    assert isinstance(results[1], InvalidPayload)
    assert [e.position for e in results[0]] == list(range(1, INSERT_CHUNK_EVENTS + 6))
    assert [e.position for e in results[2]] == [INSERT_CHUNK_EVENTS + 6, INSERT_CHUNK_EVENTS + 7, INSERT_CHUNK_EVENTS + 8]
    assert await any_store.read_stream("mixed") == []
    assert [e.position for e in await any_store.read_all(limit=1000)] == list(range(1, INSERT_CHUNK_EVENTS + 9))
    assert [e.stream_version for e in await any_store.read_stream("after")] == [1, 2, 3]
