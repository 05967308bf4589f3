"""The log's contract: what every implementation of the engine's store protocols promises.

`LogContract` is abstract (pytest collects only the classes that subclass it): a subclass provides
`open_store`, a function that opens one more store, under a writer name, on one fresh log shared by
every store it opens (one database, several connections). tests/adapters/test_postgres.py runs the contract on
PostgreSQL (every server version the fixtures reach) and tests/adapters/test_memory_store.py on the memory
store; the promises only a database keeps (durability, concurrency across connections) stay in
tests/adapters/test_postgres.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from engine import catalog
from engine.attempts import ATTEMPT_FENCED, ATTEMPT_STARTED, ROLLOUT_FORGOTTEN, ROLLOUT_RETIRED
from engine.checkpoint import BOUNDARY_KINDS, ParticipantStore, online_cut_reads, recorded_chain_hash
from engine.errors import InvalidPayload, PayloadTooLarge, StaleAttempt, UnknownAttempt, VersionConflict
from engine.events import GENESIS_HASH, AppendRequest, NewEvent, chain_hash, encode_payload
from engine.identity import agent_stream, checkpoint_stream, episode_stream, rollout_stream, session_stream
from engine.log import append_one
from tests.waiting import eventually

OpenStore = Callable[[str], Any]  # writer -> a store on the contract's log
GROUP = 105  # events in one request: past one chunk of rows a grouping store sends ahead (adapters.postgres)


def ev(stream: str, kind: str = "noted", rollout: str | None = None, attempt: int | None = None, **data: Any) -> NewEvent:
    return NewEvent(stream, kind, data, rollout, attempt)


async def start_attempt(store: ParticipantStore, rollout: str, attempt: int) -> None:
    await append_one(store, ev(rollout_stream(rollout), ATTEMPT_STARTED, rollout, attempt, parent_attempt=None))


STRANGE = ["nul\x00byte", "lone \ud800 surrogate", "\udfff", "the escape \ue000 itself", "\ue000" + "0", "\\u0000 (six characters)",
           "\x00\ud83d\ude00\ud83d", "plain"]


class LogContract:
    @pytest.fixture
    def open_store(self) -> OpenStore:
        raise NotImplementedError("a subclass opens its stores")

    @pytest.fixture
    def log_store(self, open_store: OpenStore) -> ParticipantStore:
        store: ParticipantStore = open_store("test")
        return store

    async def test_fenced_attempt_cannot_append_and_nothing_is_written(self, log_store: ParticipantStore) -> None:
        await start_attempt(log_store, "r1", 0)
        await append_one(log_store, ev(episode_stream("r1", 0), "episode_started", "r1", 0))
        await append_one(log_store, ev(rollout_stream("r1"), ATTEMPT_FENCED, "r1", 0, reason="test"))
        head = await log_store.head()
        with pytest.raises(StaleAttempt) as err:
            await append_one(log_store, ev(episode_stream("r1", 0), "episode_step", "r1", 0, step="agent"))
        assert err.value.code == "stale_attempt"
        assert await log_store.head() == head
        assert len(await log_store.read_stream(episode_stream("r1", 0))) == 1

    async def test_unstarted_attempt_cannot_append(self, log_store: ParticipantStore) -> None:
        with pytest.raises(UnknownAttempt):
            await append_one(log_store, ev("episode:r9:0", "episode_started", "r9", 0))
        assert await log_store.head() == 0

    async def test_version_conflict_names_both_versions_and_writes_nothing(self, log_store: ParticipantStore) -> None:
        await append_one(log_store, ev("acct", "opened"), expected_version=0)
        await append_one(log_store, ev("acct", "credited"), expected_version=1)
        with pytest.raises(VersionConflict) as err:
            await append_one(log_store, ev("acct", "debited"), expected_version=1)
        assert "version 2" in err.value.detail and "expected 1" in err.value.detail
        assert err.value.context == {"stream": "acct", "expected": 1, "actual": 2}
        assert [e.kind for e in await log_store.read_stream("acct")] == ["opened", "credited"]

    async def test_concurrent_writers_of_one_stream_conflict_instead_of_interleaving(self, open_store: OpenStore) -> None:
        a, b = open_store("a"), open_store("b")
        results = await asyncio.gather(
            append_one(a, ev("shared", "by_a"), expected_version=0),
            append_one(b, ev("shared", "by_b"), expected_version=0),
            return_exceptions=True,
        )
        assert sum(isinstance(r, VersionConflict) for r in results) == 1
        (landed,) = await a.read_stream("shared")
        assert landed.writer in {"a", "b"} and landed.kind == f"by_{landed.writer}"

    @pytest.mark.parametrize(
        "bad, error",
        [
            ({"blob": "x" * (1024 * 1024 + 1)}, PayloadTooLarge),  # over the 1 MiB default
            ({"raw": b"bytes"}, InvalidPayload),  # not JSON
            ({"n": float("nan")}, InvalidPayload),  # JSON has no NaN
            ({1: "non-string key"}, None),  # allowed: JSON turns the key into "1"
        ],
    )
    async def test_bad_payloads_are_refused_with_a_code_and_lose_nothing(self, log_store: ParticipantStore, bad: Any,
                                                                         error: type[Exception] | None) -> None:
        good = AppendRequest((ev("ok", "kept"),))
        bad_request = AppendRequest((NewEvent("bad", "refused", bad),))
        results = await asyncio.gather(log_store.append(good), log_store.append(bad_request), return_exceptions=True)
        assert not isinstance(results[0], Exception), "a refused request in the same group must not sink another"
        if error is None:
            assert not isinstance(results[1], Exception)
            assert (await log_store.read_stream("bad"))[0].data == {"1": "non-string key"}
            return
        assert isinstance(results[1], error)
        assert results[1].code in {"invalid_payload", "payload_too_large"}
        assert await log_store.read_stream("bad") == []

    async def test_every_code_point_a_tool_or_a_model_produces_is_stored_and_read_back_exactly(
            self, log_store: ParticipantStore) -> None:
        """JSONB holds neither U+0000 nor a lone surrogate (`printf '\\0'`, an upstream's "\\ud800"): they
        used to be refused (the rollout failed, and its retry ran the command again) or, for a surrogate,
        raised inside the batched append and failed every request of the batch. Now they are stored in
        an escaped spelling, read back as they were, and the hash chain a restore re-derives agrees."""
        data = {"out": STRANGE, "nested": {s: s for s in STRANGE}}
        good = AppendRequest((ev("ok2", "kept"),))
        results = await asyncio.gather(log_store.append(good), log_store.append(AppendRequest((NewEvent("odd", "x", data),))))
        assert all(not isinstance(r, Exception) for r in results)
        (back,) = await log_store.read_stream("odd")
        assert back.data == data
        assert recorded_chain_hash(GENESIS_HASH, back) == back.hash
        assert (await log_store.read_all(back.position - 1, 1))[0].data == data

    async def test_retire_mark_refuses_until_forget(self, log_store: ParticipantStore) -> None:
        await start_attempt(log_store, "r2", 0)
        await append_one(log_store, ev(rollout_stream("r2"), ROLLOUT_RETIRED, "r2", 0, through=0))
        with pytest.raises(StaleAttempt):
            await append_one(log_store, ev("episode:r2:0", "episode_step", "r2", 0))
        with pytest.raises(StaleAttempt):  # a late caller cannot start a retired attempt either
            await start_attempt(log_store, "r2", 0)
        await append_one(log_store, ev(rollout_stream("r2"), ROLLOUT_FORGOTTEN, "r2", 0))
        await append_one(log_store, ev("episode:r2:0", "episode_step", "r2", 0))

    async def test_subscription_catches_up_then_follows(self, log_store: Any) -> None:
        for i in range(3):
            await append_one(log_store, ev("sub", n=i))
        got: list[int] = []

        async def follow() -> None:
            async for e in log_store.subscribe(after=1, poll_seconds=3600):
                got.append(e.data["n"])
                if len(got) == 3:
                    return

        follower = asyncio.create_task(follow())
        await eventually("the follower to catch up", lambda: len(got) == 2)  # now it waits for what comes next
        await append_one(log_store, ev("sub", n=3))
        # An hour's poll: only the append's own wake-up (NOTIFY, on PostgreSQL) can wake the reader in time.
        await asyncio.wait_for(follower, timeout=60)
        assert got == [1, 2, 3]

    async def test_hash_chain_links_each_event_to_its_predecessor(self, log_store: ParticipantStore) -> None:
        for i in range(3):
            await append_one(log_store, ev("chain", n=i))
        prev = GENESIS_HASH
        read = await log_store.read_stream("chain")
        assert [e.stream_version for e in read] == [1, 2, 3]
        for e in read:
            new = NewEvent(e.stream, e.kind, e.data, e.rollout_id, e.attempt, e.schema_version)
            assert e.hash == chain_hash(prev, e.stream, e.stream_version, new, encode_payload(e.data))
            prev = e.hash
        assert [e.data["n"] for e in await log_store.read_stream("chain", after_version=1)] == [1, 2]

    async def test_large_floats_hash_the_way_postgres_hands_them_back(self, log_store: ParticipantStore) -> None:
        # The bad input: floats JSONB returns as integers (1e+16 comes back as 10000000000000000).
        recorded = await append_one(log_store, ev("big", amount=1e16, nested=[{"x": -1.5e20}], small=1e-05, one=1.0))
        (read,) = await log_store.read_stream("big")
        assert read.data == {"amount": 10**16, "nested": [{"x": -150000000000000000000}], "small": 1e-05, "one": 1.0}
        new = NewEvent(read.stream, read.kind, read.data, read.rollout_id, read.attempt, read.schema_version)
        assert read.hash == recorded.hash == chain_hash(GENESIS_HASH, read.stream, 1, new, encode_payload(read.data))

    async def test_a_refused_request_among_concurrent_ones_loses_nothing(self, log_store: ParticipantStore) -> None:
        # A grouping store sends a group's rows to the server while it plans the rest (pipeline mode),
        # so the first request below is on the wire before the second is refused (bad input: a NaN in
        # its second event). The refused request writes nothing; its neighbours land gap-free.
        big = AppendRequest(tuple(ev("big", n=i) for i in range(GROUP)))
        half_bad = AppendRequest((ev("mixed", n=1), NewEvent("mixed", "refused", {"n": float("nan")})))
        after = AppendRequest(tuple(ev("after", n=i) for i in range(3)))
        results = await asyncio.gather(
            log_store.append(big), log_store.append(half_bad), log_store.append(after), return_exceptions=True
        )
        assert isinstance(results[1], InvalidPayload)
        assert [e.position for e in results[0]] == list(range(1, GROUP + 1))  # type: ignore[union-attr]
        assert [e.position for e in results[2]] == [GROUP + 1, GROUP + 2, GROUP + 3]  # type: ignore[union-attr]
        assert await log_store.read_stream("mixed") == []
        assert [e.position for e in await log_store.read_all(limit=1000)] == list(range(1, GROUP + 4))
        assert [e.position for e in await log_store.read_all(after=GROUP, limit=2)] == [GROUP + 1, GROUP + 2]
        assert [e.position for e in await log_store.read_all(after=GROUP, to=GROUP + 1)] == [GROUP + 1]
        assert [e.stream_version for e in await log_store.read_stream("after")] == [1, 2, 3]

    async def test_a_retried_request_returns_what_its_first_try_wrote(self, log_store: ParticipantStore) -> None:
        request = AppendRequest((ev("once", n=1), ev("once", n=2)), key="the-same-key")
        first = await log_store.append(request)
        again = await log_store.append(request)
        assert [e.position for e in again] == [e.position for e in first] == [1, 2]
        assert await log_store.head() == 2

    async def test_a_cataloged_kind_goes_to_its_stream_family_only(self, log_store: ParticipantStore) -> None:
        await start_attempt(log_store, "r3", 0)
        with pytest.raises(InvalidPayload) as err:
            await append_one(log_store, ev("elsewhere", catalog.ATTEMPT_FENCED, "r3", 0, reason="x"))
        assert err.value.context == {"kind": catalog.ATTEMPT_FENCED, "stream": "elsewhere"}
        assert await log_store.head() == 1

    # ---- the projections a server and a cut read ------------------------------------------------

    async def test_the_attempt_check_reads_status_retire_mark_and_fence_position(self, log_store: ParticipantStore) -> None:
        assert await log_store.attempt_status("r4", 0) == (None, -1)
        assert await log_store.fence_position() == 0
        await start_attempt(log_store, "r4", 0)
        assert await log_store.attempt_status("r4", 0) == ("live", -1)
        fence = await append_one(log_store, ev(rollout_stream("r4"), ATTEMPT_FENCED, "r4", 0, reason="test"))
        await start_attempt(log_store, "r4", 1)
        assert await log_store.attempt_status("r4", 0) == ("fenced", -1)
        assert await log_store.fence_position() == fence.position
        retire = await append_one(log_store, ev(rollout_stream("r4"), ROLLOUT_RETIRED, "r4", 1, through=1))
        assert await log_store.attempt_status("r4", 1) == ("retired", 1)  # the live one took the retire's status
        assert await log_store.attempt_status("r4", 0) == ("fenced", 1)  # an ended one kept its own
        assert await log_store.retired_through("r4") == 1
        assert await log_store.fence_position() == retire.position
        # The gate's first check of an attempt: the same three, in one read.
        assert await log_store.attempt_reading("r4", 1) == (retire.position, "retired", 1)
        assert await log_store.attempt_reading("r4", 2) == (retire.position, None, 1)
        await append_one(log_store, ev(rollout_stream("r4"), ROLLOUT_FORGOTTEN, "r4", 1))
        assert await log_store.retired_through("r4") == -1
        assert await log_store.retired_through("never") == -1

    async def test_attempt_rows_and_running_attempts_read_the_projection(self, log_store: ParticipantStore) -> None:
        await start_attempt(log_store, "r5", 0)
        await append_one(log_store, ev(rollout_stream("r5"), catalog.ATTEMPT_FINISHED, "r5", 0, reward=0.5))
        await start_attempt(log_store, "r6", 0)
        await append_one(log_store, ev(rollout_stream("r6"), ATTEMPT_FENCED, "r6", 0, reason="test"))
        await start_attempt(log_store, "r7", 0)
        rows = await log_store.attempt_rows(["r5", "r6", "absent"])
        assert sorted(rows) == [("r5", 0), ("r6", 0)]
        assert (rows[("r5", 0)]["status"], rows[("r5", 0)]["reward"], rows[("r5", 0)]["started_position"],
                rows[("r5", 0)]["ended_position"], rows[("r5", 0)]["retired_through"]) == ("finished", 0.5, 1, 2, None)
        assert rows[("r6", 0)]["status"] == "fenced" and rows[("r6", 0)]["parent_attempt"] is None
        live = await log_store.running_attempts(0, None)  # live now, or finished after position 0
        assert sorted(live) == [("r5", 0), ("r7", 0)] and live[("r7", 0)]["status"] == "live"
        assert sorted(await log_store.running_attempts(2, None)) == [("r7", 0)]  # r5 finished at 2
        for r in ("x-1", "x-9-2", "x", "xy-3"):
            await start_attempt(log_store, r, 0)
        # a rollout's run is its id less a trailing -<n> (engine.identity.run_of): x-9-2 is run x-9's,
        # xy-3 run xy's, and x (no suffix) run x's
        assert sorted(await log_store.running_attempts(0, "x")) == [("x", 0), ("x-1", 0)]
        assert sorted(await log_store.running_attempts(0, "x-9")) == [("x-9-2", 0)]

    async def test_sessions_boundaries_and_heads_as_of_a_position(self, log_store: ParticipantStore) -> None:
        await start_attempt(log_store, "r8", 0)
        await append_one(log_store, ev(session_stream("r8", 0), catalog.SESSION_OPENED, "r8", 0, env="math", revision=0))
        step = await append_one(log_store, ev(episode_stream("r8", 0), catalog.EPISODE_STEP, "r8", 0, step="agent"))
        mutation = await append_one(log_store, ev(session_stream("r8", 0), catalog.MUTATION_APPLIED, "r8", 0, revision=3))
        assert await log_store.open_sessions() == {("r8", 0): "math"}
        assert await log_store.session_revision("r8", 0) == 3
        assert await log_store.session_revision("r8", 1) is None
        keys = [("r8", 0), ("r9", 0)]
        assert await log_store.latest_boundaries(keys, mutation.position, BOUNDARY_KINDS) == {("r8", 0): step.position}
        assert await log_store.latest_boundaries(keys, 1, BOUNDARY_KINDS) == {("r8", 0): 1}
        heads = await log_store.rollout_heads_at(["r8", "r9"], step.position)
        assert heads["r9"] == [] and sorted((s, v) for s, v, _ in heads["r8"]) == [
            (episode_stream("r8", 0), 1), (rollout_stream("r8"), 1), (session_stream("r8", 0), 1)]
        assert await log_store.stream_hashes([(session_stream("r8", 0), 2), ("absent", 1)]) == {
            (session_stream("r8", 0), 2): mutation.hash}
        assert [e.position for e in await log_store.read_rollouts(["r8"], to=step.position)] == [1, 2, 3]
        assert [e.position for e in await log_store.read_rollout("r8", 0, to=2)] == [1, 2]
        assert [e.position for e in await log_store.read_rollout("r8", 0, kinds=[catalog.EPISODE_STEP, ATTEMPT_STARTED])] == [
            1, step.position]
        await append_one(log_store, ev(rollout_stream("r8"), ATTEMPT_FENCED, "r8", 0, reason="test"))
        assert await log_store.open_sessions() == {}  # open, but its attempt is no longer live

    async def test_checkpoints_by_phase(self, open_store: OpenStore) -> None:
        store = open_store("coordinator")
        for cid, kinds in {"a": [catalog.CHECKPOINT_STARTED], "b": [catalog.CHECKPOINT_STARTED, catalog.CHECKPOINT_ABORTED]}.items():
            for kind in kinds:
                await append_one(store, ev(checkpoint_stream(cid), kind, checkpoint_id=cid))
        assert await store.checkpoints_in_phase(["started"]) == ["a"]
        assert await store.checkpoints_in_phase(["started", "aborted"]) == ["a", "b"]
        assert await store.checkpoints_in_phase(["committed"]) == []

    async def test_what_cannot_be_continued_from_a_boundary_is_read_from_the_log(self, log_store: ParticipantStore) -> None:
        """engine.checkpoint.restart_only_at, as both stores answer it: a restart-only session open at
        the boundary, or an activation in progress there on an agent that cannot continue one."""
        for r in ("s1", "s2", "s3", "g1", "g2"):
            await start_attempt(log_store, r, 0)
        # a session opened without its mode takes the one its episode's seed step named
        await append_one(log_store, ev(episode_stream("s3", 0), catalog.EPISODE_STEP, "s3", 0, step="seed",
                                       state_mode="restart_only"))
        await append_one(log_store, ev(session_stream("s3", 0), catalog.SESSION_OPENED, "s3", 0, env="sandbox"))
        opened = await append_one(log_store, ev(session_stream("s1", 0), catalog.SESSION_OPENED, "s1", 0, env="sandbox",
                                                state_mode="restart_only"))
        closed = await append_one(log_store, ev(session_stream("s1", 0), catalog.SESSION_CLOSED, "s1", 0))
        await append_one(log_store, ev(session_stream("s2", 0), catalog.SESSION_OPENED, "s2", 0, env="math",
                                       state_mode="exported"))
        stuck = await append_one(log_store, ev(agent_stream("g1", 0), catalog.AGENT_BOUNDARY, "g1", 0, turn=0,
                                               continuable=False))
        done = await append_one(log_store, ev(agent_stream("g1", 0), catalog.ACTIVATION_COMPLETED, "g1", 0))
        await append_one(log_store, ev(agent_stream("g2", 0), catalog.AGENT_BOUNDARY, "g2", 0, turn=0))
        head = await log_store.head()
        asked = {("s1", 0): opened.position, ("s2", 0): head, ("s3", 0): head, ("g1", 0): stuck.position, ("g2", 0): head}
        assert await log_store.restart_only_at(asked) == [("g1", 0), ("s1", 0), ("s3", 0)]
        later = {("s1", 0): closed.position, ("g1", 0): done.position}  # closed, completed: nothing live is lost
        assert await log_store.restart_only_at(later) == []
        assert await log_store.restart_only_at({}) == []

    async def test_an_online_cut_reads_in_one_moment_what_its_separate_reads_read(self, log_store: ParticipantStore) -> None:
        """CutStore.online_cut_reads (on PostgreSQL one statement) against engine.checkpoint.online_cut_reads
        (the five reads it replaced), on attempts of every kind a cut meets: live with a boundary, live
        with a restart-only session open, finished before and after P, fenced, of another run."""
        for r in ("o-1", "o-2", "o-3", "o-4", "o-5", "other-1"):
            await start_attempt(log_store, r, 0)
        step = await append_one(log_store, ev(episode_stream("o-1", 0), catalog.EPISODE_STEP, "o-1", 0, step="seed"))
        await append_one(log_store, ev(session_stream("o-2", 0), catalog.SESSION_OPENED, "o-2", 0, env="sandbox",
                                       state_mode="restart_only"))
        await append_one(log_store, ev(episode_stream("o-2", 0), catalog.EPISODE_STEP, "o-2", 0, step="agent"))  # open there
        await append_one(log_store, ev(rollout_stream("o-3"), catalog.ATTEMPT_FINISHED, "o-3", 0, reward=1.0))
        await append_one(log_store, ev(rollout_stream("o-4"), ATTEMPT_FENCED, "o-4", 0, reason="test"))
        reads = await log_store.online_cut_reads("o", BOUNDARY_KINDS)
        assert reads == await online_cut_reads(log_store, "o", BOUNDARY_KINDS)
        assert reads.position == await log_store.head()
        assert sorted(reads.attempts) == [("o-1", 0), ("o-2", 0), ("o-5", 0)]  # o-3 finished by P, o-4 fenced
        assert reads.attempts[("o-1", 0)] == {"status": "live", "started_position": 1, "ended_position": None}
        assert reads.boundaries[("o-1", 0)] == step.position
        assert reads.restarts == {("o-2", 0)}
        assert sorted(reads.heads) == ["o-1", "o-2", "o-5"]
        assert sorted((s, v) for s, v, _ in reads.heads["o-1"]) == [(episode_stream("o-1", 0), 1), (rollout_stream("o-1"), 1)]
        assert (await log_store.online_cut_reads(None, BOUNDARY_KINDS)).attempts.keys() == reads.attempts.keys() | {("other-1", 0)}

