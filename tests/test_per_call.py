"""Less per call: an append is one transaction of a few statements, whatever it holds."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from engine import catalog as ev
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream, session_stream


async def test_an_append_reads_what_it_plans_from_in_one_statement_after_the_lock(
        store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream("pc-1"), ev.ATTEMPT_STARTED, {"parent_attempt": None},
                                               "pc-1", 0),)))
    sent: list[str] = []
    execute = psycopg.AsyncConnection.execute

    async def recorded(self: psycopg.AsyncConnection[Any], query: Any, *args: Any, **kw: Any) -> Any:
        sent.append(str(query))
        return await execute(self, query, *args, **kw)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", recorded)
    (opened,) = await store.append(AppendRequest((NewEvent(session_stream("pc-1", 0), ev.SESSION_OPENED,
                                                           {"env": "math", "task": {}}, "pc-1", 0),)))
    monkeypatch.undo()
    # Stream heads, idempotency keys, retire marks and attempts: one read, after the log-head lock.
    reads = [q for q in sent if "FROM rollbook.stream_heads" in q or "FROM rollbook.append_keys" in q
             or "FROM rollbook.rollout_state" in q or "FROM rollbook.attempt_state" in q]
    assert len(reads) == 1 and sent.index(reads[0]) == 1 and "FOR UPDATE" in sent[0]
    # The keys are recorded by the statement that moves the heads, not by one of their own.
    assert [q for q in sent if "INSERT INTO rollbook.append_keys" in q] == [q for q in sent if "stream_heads (stream" in q]
    # Lock, read, then one statement writes the events, the heads, the key and the projections.
    assert len(sent) == 3, sent
    assert "INSERT INTO rollbook.events" in sent[2] and "INSERT INTO rollbook.session_state" in sent[2]
    # And what it read was right: the stream was new, and a key recorded that way answers a retry.
    assert opened.stream_version == 1
    closed = NewEvent(session_stream("pc-1", 0), ev.SESSION_CLOSED, {}, "pc-1", 0)
    first = await store.append(AppendRequest((closed,), key="pc-key"))
    again = await store.append(AppendRequest((closed,), key="pc-key"))
    assert [e.position for e in again] == [e.position for e in first] and await store.head() == first[0].position
