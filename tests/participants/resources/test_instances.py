"""Two resources servers on one log (two instances of the kind): what one does to a session the other holds."""

from __future__ import annotations

from adapters.memory_store import MemoryEventStore
from apps.stack import MemoryBacking
from engine.identity import session_stream
from tests.participants.resources.test_server import email_seed, open_session, serving, start, tool


async def test_a_copy_of_a_session_another_server_wrote_since_is_refused_once_then_rebuilt_from_the_log(
        memory_database: MemoryBacking, memory_store: MemoryEventStore) -> None:
    """Two resources servers on one log: B takes over A's session from the log and applies a mutation;
    A's copy is then stale. A's next mutation is refused (the stream moved: no second writer) and A
    drops the copy, so the one after rebuilds the session from the log and goes on from B's revision,
    instead of refusing every request of that session for good."""
    store = memory_store
    async with serving(memory_database, "resources-a") as (a, _):
        await start(store, "w2")
        await open_session(a, "w2", "workplace", email_seed())
        assert (await tool(a, "w2", "update_deal", {"deal_id": "D-101", "seats": 3}))[1]["revision"] == 1
        async with serving(memory_database, "resources-b") as (b, _):
            status, reply = await tool(b, "w2", "update_deal", {"deal_id": "D-101", "seats": 4})
            assert status == 200 and reply["revision"] == 2, reply
        status, refused = await tool(a, "w2", "update_deal", {"deal_id": "D-101", "seats": 5})
        assert status == 409 and refused["error"]["code"] == "version_conflict", refused
        status, reply = await tool(a, "w2", "update_deal", {"deal_id": "D-101", "seats": 6})
        assert status == 200 and reply["revision"] == 3, reply
    applied = [e.data["arguments"]["seats"] for e in await store.read_stream(session_stream("w2", 0))
               if e.kind == "mutation_applied"]
    assert applied == [3, 4, 6]
