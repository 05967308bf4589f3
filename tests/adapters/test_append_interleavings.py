"""Two writers of one log, each request planned before the lock and written under it, with another
writer's request committing in between wherever hypothesis puts one: whatever the order, the log is
one that the rules (engine.attempts.admit, engine.log) admit event by event in position order, its
positions gap-free, every stream's versions and hash chain whole, every caller told what the log
holds, a request made with no other in flight refused exactly when the rules refuse it on the log as it
was (whether its process planned it from a read or from memory), and the projections equal to their
rebuild from the log. Checked through SQL and the store's
reads after each history."""

from __future__ import annotations

import itertools
from typing import Any

import psycopg
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from adapters.postgres import PostgresEventStore
from engine import catalog as ev
from engine.attempts import RolloutState, admit
from engine.errors import RollbookError
from engine.events import GENESIS_HASH, AppendRequest, NewEvent, RecordedEvent, chain_hash, encode_payload
from engine.identity import rollout_stream
from engine.projections import TABLES
from tests.adapters.test_postgres import interrupted

KINDS = ("start", "turn", "fence", "finish", "retire", "forget", "note", "first")
OP = st.tuples(st.sampled_from(KINDS), st.integers(0, 1), st.integers(0, 2), st.booleans(), st.booleans())
_ids = itertools.count()


def request(prefix: str, kind: str, r: int, a: int) -> AppendRequest:
    """One request of `kind` for rollout `r`, attempt `a` (or note stream `r`)."""
    rid = f"{prefix}r{r}"
    rollout: dict[str, tuple[str, dict[str, Any]]] = {
        "start": (ev.ATTEMPT_STARTED, {"parent_attempt": a - 1 if a else None}),
        "fence": (ev.ATTEMPT_FENCED, {"reason": "restore"}),
        "finish": (ev.ATTEMPT_FINISHED, {"reward": 1.0}),
        "retire": (ev.ROLLOUT_RETIRED, {"through": a}),
        "forget": (ev.ROLLOUT_FORGOTTEN, {}),
    }
    if kind in rollout:
        name, data = rollout[kind]
        return AppendRequest((NewEvent(rollout_stream(rid), name, data, rid, a),))
    if kind == "turn":
        return AppendRequest((NewEvent(f"agent:{rid}:{a}", "turn", {"a": a}, rid, a),))
    stream = f"{prefix}s{r}"  # "first" expects a new stream: a second one conflicts
    return AppendRequest((NewEvent(stream, "noted", {"r": r}),), {stream: 0} if kind == "first" else {})


async def outcome(store: PostgresEventStore, req: AppendRequest) -> list[RecordedEvent] | RollbookError:
    try:
        return await store.append(req)
    except RollbookError as exc:
        return exc


def dump(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        return {t: conn.execute(f"SELECT * FROM rollbook.{t} ORDER BY {', '.join(k)}").fetchall() for t, k in TABLES.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OP, min_size=1, max_size=14))
# The second writer read rollout 1 before the first started it: its memory says no attempt, and only a
# read may refuse its next turn (one that trusted a refusal from memory was found here).
@example(ops=[("start", 0, 0, False, False), ("turn", 1, 0, True, False), ("start", 1, 0, False, False),
              ("turn", 1, 0, True, False)])
async def test_any_interleaving_of_two_writers_leaves_a_log_the_rules_admit(
        dsn: str, ops: list[tuple[str, int, int, bool, bool]]) -> None:
    prefix = f"il{next(_ids)}-"
    note(repr(ops))
    stores = [PostgresEventStore.connect(dsn, writer=f"w{i}") for i in range(2)]
    try:
        before = await stores[0].head()
        told: list[list[RecordedEvent] | RollbookError] = []
        # A request made with no other in flight, the head before it and what it was told: a plan from
        # memory (a rollout taken as live at its first attempt, say) must decide as a read would.
        judged: list[tuple[NewEvent, int, list[RecordedEvent] | RollbookError]] = []
        i = 0
        while i < len(ops):
            kind, r, a, by_second, squeeze = ops[i]
            mine = stores[by_second]
            if squeeze and i + 1 < len(ops):  # the next op, by the other writer, lands inside this one
                k2, r2, a2, _, _ = ops[i + 1]

                async def other(k2: str = k2, r2: int = r2, a2: int = a2, by: int = not by_second) -> None:
                    told.append(await outcome(stores[by], request(prefix, k2, r2, a2)))

                interrupted(mine, other)
                told.append(await outcome(mine, request(prefix, kind, r, a)))
                i += 2
            else:
                req = request(prefix, kind, r, a)
                at = await stores[0].head()
                told.append(await outcome(mine, req))
                if kind not in ("note", "first"):  # alone, its verdict is the rules' on the log as it was
                    judged.append((req.events[0], at, told[-1]))
                i += 1
        log = await stores[0].read_all(after=before, limit=10_000)
        assert [e.position for e in log] == list(range(before + 1, await stores[0].head() + 1))
        # Every event is one the rules admit at its position, in one replay of the whole history.
        rollouts: dict[str, RolloutState | None] = {}
        heads: dict[str, tuple[int, bytes]] = {}
        for e in log:
            if e.rollout_id is not None:
                rollouts[e.rollout_id] = admit(NewEvent(e.stream, e.kind, e.data, e.rollout_id, e.attempt),
                                               rollouts.get(e.rollout_id))
            version, previous = heads.get(e.stream, (0, GENESIS_HASH))
            assert e.stream_version == version + 1, e
            assert e.hash == chain_hash(previous, e.stream, e.stream_version, e, encode_payload(e.data)), e
            heads[e.stream] = (e.stream_version, e.hash)
        for event, at, got in judged:
            state: RolloutState | None = None
            for e in log:
                if e.position <= at and e.rollout_id == event.rollout_id:
                    state = admit(NewEvent(e.stream, e.kind, e.data, e.rollout_id, e.attempt), state)
            try:
                admit(event, state)
                verdict: type[Exception] | None = None
            except RollbookError as exc:
                verdict = type(exc)
            assert (type(got) if isinstance(got, RollbookError) else None) == verdict, (event, at, got)
        # Each caller was told what the log holds.
        by_position = {e.position: e for e in log}
        written = [e for o in told if isinstance(o, list) for e in o]
        assert sorted(e.position for e in written) == [e.position for e in log]
        for e in written:
            kept = by_position[e.position]
            assert (kept.stream, kept.stream_version, kept.kind, kept.hash) == (e.stream, e.stream_version, e.kind, e.hash)
        live = dump(dsn)
        await stores[0].rebuild_projections()
        rebuilt = dump(dsn)
        assert rebuilt == live, {t: (sorted(set(live[t]) - set(rebuilt[t])), sorted(set(rebuilt[t]) - set(live[t])))
                                 for t in TABLES if live[t] != rebuilt[t]}
    finally:
        for s in stores:
            await s.close()
