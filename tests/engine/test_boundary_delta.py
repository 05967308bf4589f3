"""Agent boundaries store what changed since the previous boundary (engine/boundaries.py), every
reader still gets the whole conversation, and a turn's end and the next turn's start are one append."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from adapters.database import libpq_dsn
from adapters.postgres import PostgresEventStore
from apps.stack import of, start_stack
from engine import catalog as ev
from engine.boundaries import boundary_messages, completed_activations, full_boundary, with_messages
from engine.checkpoint import committed_event, make_cut
from engine.coordinator import Coordinator
from engine.errors import InvalidCheckpointState
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import agent_stream, episode_stream, rollout_stream
from engine.recovery import resume_point
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend

M = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t1"},
     {"role": "assistant", "content": "a2"}]


def boundary(r: str, turn: int, messages: dict[str, Any], state: str = "before_model") -> NewEvent:
    return NewEvent(agent_stream(r, 0), ev.AGENT_BOUNDARY, {"turn": turn, **messages, "state": state, "activation": 0,
                                                             "calls": [], "revisions": {}}, r, 0)


async def rollout(store: PostgresEventStore, r: str, boundaries: list[dict[str, Any]]) -> list[RecordedEvent]:
    """Attempt 0 of `r`: its start, an episode step, then agent boundaries with the given messages parts."""
    events = [NewEvent(rollout_stream(r), ev.ATTEMPT_STARTED, {"parent_attempt": None}, r, 0),
              NewEvent(episode_stream(r, 0), ev.EPISODE_STEP, {"step": "seed", "status": "running"}, r, 0),
              *(boundary(r, i, b) for i, b in enumerate(boundaries))]
    return await store.append(AppendRequest(tuple(events)))


async def view_data(store: PostgresEventStore, r: str) -> list[dict[str, Any]]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(text("SELECT data FROM rollbook.episode_history WHERE rollout_id = :r AND kind = :k "
                                       "ORDER BY position"), {"r": r, "k": ev.AGENT_BOUNDARY})
        return [row.data for row in rows]


# ---- the delta and its rebuild --------------------------------------------------------------------


async def test_deltas_rebuild_to_the_whole_list_for_the_engine_and_the_view(store: PostgresEventStore) -> None:
    recorded = await rollout(store, "bd-1", [boundary_messages(M[:1], None), boundary_messages(M[:3], 1),
                                             boundary_messages(M[:3], 3), boundary_messages(M, 3)])
    stored = of(recorded, ev.AGENT_BOUNDARY)
    assert "messages" in stored[0].data and [b.data.get("messages_kept") for b in stored[1:]] == [1, 3, 3]
    assert [b.data["messages_added"] for b in stored[1:]] == [M[1:3], [], M[3:]]
    whole = [len(b.data["messages"]) for b in of(with_messages(recorded), ev.AGENT_BOUNDARY)]
    assert whole == [1, 3, 3, 4]
    assert full_boundary(recorded, stored[-1]).data["messages"] == M
    assert resume_point(recorded, 0).data["messages"] == M  # type: ignore[union-attr]
    # The public view shows the whole list and none of the delta's fields, as before deltas existed.
    shown = await view_data(store, "bd-1")
    assert [d["messages"] for d in shown] == [M[:1], M[:3], M[:3], M]
    assert not [d for d in shown if "messages_kept" in d or "messages_added" in d]


async def test_a_log_of_whole_list_boundaries_reads_as_before(store: PostgresEventStore) -> None:
    # Written before deltas: every boundary holds its whole list; a later delta builds on one of them.
    recorded = await rollout(store, "bd-old", [{"messages": M[:1]}, {"messages": M[:3]}, boundary_messages(M, 3)])
    rebuilt = of(with_messages(recorded), ev.AGENT_BOUNDARY)
    assert [b.data["messages"] for b in rebuilt] == [M[:1], M[:3], M]
    assert rebuilt[:2] == of(recorded, ev.AGENT_BOUNDARY)[:2]  # stored whole: handed out as stored
    assert [d["messages"] for d in await view_data(store, "bd-old")] == [M[:1], M[:3], M]


async def test_a_delta_that_keeps_more_than_its_predecessor_had_is_refused_by_readers(store: PostgresEventStore) -> None:
    recorded = await rollout(store, "bd-bad", [{"messages": M[:1]}, {"messages_kept": 3, "messages_added": M[3:]}])
    with pytest.raises(InvalidCheckpointState, match="keeps 3 messages"):
        with_messages(recorded)
    with pytest.raises(InvalidCheckpointState, match="keeps 3 messages"):
        resume_point(recorded, 0)
    assert [d["messages"] for d in await view_data(store, "bd-bad")] == [M[:1], None]


# ---- restore refuses a broken chain, installing nothing ----------------------------------------------


async def _tamper(dsn: str, sql: str, position: int) -> None:
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
        assert (await conn.execute(sql, {"p": position})).rowcount == 1


@pytest.mark.parametrize("fault", ["edited", "deleted", "inconsistent"])
async def test_restore_refuses_a_broken_delta_and_installs_nothing(dsn: str, store: PostgresEventStore, fault: str) -> None:
    r = f"bd-{fault}"
    parts = [boundary_messages(M[:1], None), boundary_messages(M[:3], 1), boundary_messages(M, 3)]
    if fault == "inconsistent":  # every hash is right, yet the delta keeps messages its predecessor never had
        parts[1] = {"messages_kept": 2, "messages_added": M[2:3]}
    recorded = await rollout(store, r, parts)
    cut = await make_cut(store, f"ck-{r}", [(r, 0)], [])
    await store.append(AppendRequest((committed_event(cut),)))
    middle = of(recorded, ev.AGENT_BOUNDARY)[1].position
    if fault == "edited":
        await _tamper(dsn, """UPDATE rollbook.events SET data = jsonb_set(data, '{messages_added,0,content}', '"forged"')
                              WHERE position = %(p)s""", middle)
    elif fault == "deleted":
        await _tamper(dsn, "DELETE FROM rollbook.events WHERE position = %(p)s", middle)
    head = await store.head()
    with pytest.raises(InvalidCheckpointState):
        await Coordinator(store, []).restore(f"ck-{r}", time.time() + 10)
    assert await store.head() == head  # nothing appended: no fence, no new attempt
    assert set(await store.attempt_rows([r])) == {(r, 0)}


# ---- the agent writes deltas, one append per moment -------------------------------------------------


async def test_the_agent_writes_deltas_and_appends_a_turns_end_with_the_next_start(dsn: str) -> None:
    stack = await start_stack(dsn, "bd-agent", ScriptedBackend())
    try:
        result = await stack.episode(make_task("workplace", 11), "bd-agent-1")
        store = stack.stores[0]
        events = await store.read_rollout("bd-agent-1")
        async with store.engine.connect() as conn:
            appends = [(row.first_position, row.last_position) for row in await conn.execute(text(
                "SELECT first_position, last_position FROM rollbook.append_keys ORDER BY first_position"))]
    finally:
        await stack.close()
    assert result["attempt"] == 0
    bounds = of(events, ev.AGENT_BOUNDARY)
    (done,) = of(events, ev.ACTIVATION_COMPLETED)
    turns = done.data["reply"]["turns"]
    assert turns >= 2 and len(bounds) == 2 * turns
    # Only the stream's first boundary holds the whole list; the rebuilt lists end in the activation's reply.
    assert "messages" in bounds[0].data and all("messages" not in b.data and "messages_kept" in b.data for b in bounds[1:])
    rebuilt = of(with_messages(events), ev.AGENT_BOUNDARY)
    # The completion stores no conversation: it is the last boundary's, which the reply readers rebuild.
    assert "messages" not in done.data["reply"]
    conversation = completed_activations(events)[0]["messages"]
    assert rebuilt[-1].data["messages"] == conversation
    assert all(b.data["messages"] == conversation[:len(b.data["messages"])] for b in rebuilt)
    # Each after_turn lands in one append with what follows it: the next before_model, or the completion.
    span = {p: (first, last) for first, last in appends for p in range(first, last + 1)}
    for b in bounds:
        if b.data["state"] == "after_turn":
            assert span[b.position] == (b.position, b.position + 1), b.data["turn"]
    assert span[done.position] == (done.position - 1, done.position)
