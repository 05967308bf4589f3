"""A sandbox session's files, working directory and environment outlive its jail: every command leaves a
snapshot (blobs in PostgreSQL, named by the `mutation_applied` event), and a fresh resources process
continues the session from it, on the real jail (root, cgroups, namespaces)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from adapters.postgres import PostgresEventStore
from engine.checkpoint import make_cut
from engine.events import AppendRequest, NewEvent
from engine.identity import agent_stream, session_stream
from engine.install import install_request
from tests.resources_harness import call, checkpoint, control, open_session, prefix, serving, start, tool

pytestmark = pytest.mark.timeout(120)

# A coding session's moves: a checkout with a folder, an exported variable, a script, a link, modes.
SETUP = ("mkdir -p repo/src && cd repo && printf 'one\\n' > src/a.txt && ln -s src/a.txt link && "
         "printf '%s\\n' '#!/bin/sh' 'cat src/a.txt | tr a-z A-Z' > t.sh && chmod 750 t.sh && "
         "export GREETING='hello world' && unset LC_ALL && echo data > /tmp/scratch")
LOOK = "pwd; echo \"$GREETING\" ${LC_ALL-unset}; ./t.sh; cat link /tmp/scratch; stat -c '%a %U' t.sh | cut -d' ' -f1"


async def run(http: object, rid: str, command: str, attempt: int = 0) -> dict:
    status, reply = await tool(http, rid, "run", {"command": command}, attempt=attempt)  # type: ignore[arg-type]
    assert status == 200, reply
    return reply


async def test_a_fresh_process_continues_a_session_from_its_last_snapshot(dsn: str, store: PostgresEventStore) -> None:
    await start(store, "sb")
    async with serving(dsn, "resources-a") as (http, _):
        await open_session(http, "sb", "sandbox", 1)
        await run(http, "sb", SETUP)
        expected = (await run(http, "sb", LOOK))["output"]["output"]
    assert expected == "/home/sandbox/repo\nhello world unset\nONE\none\ndata\n750\n"
    # The first server and its jails are gone; the log and the blobs are all that is left.
    async with serving(dsn, "resources-b") as (http, second):
        reply = await run(http, "sb", LOOK)
        assert reply["output"]["output"] == expected and reply["revision"] == 3
        assert second.sessions[("sb", 0)].live.uid > 0  # a jail of its own, rebuilt from the snapshot
    mutations = [e for e in await store.read_stream(session_stream("sb", 0)) if e.kind == "mutation_applied"]
    snapshots = [m.data["effect"]["snapshot"] for m in mutations]
    assert all(snapshots) and "unrestorable" not in mutations[-1].data
    # What the log names is in the blob store, the file's content with it.
    assert set(await store.get_blobs(snapshots)) == set(snapshots)
    async with store.engine.connect() as conn:
        held = (await conn.execute(text("SELECT count(*) FROM rollbook.file_blobs WHERE content = 'one'::bytea || '\\x0a'::bytea"))).scalar()
    assert held == 1


async def test_a_background_process_at_the_boundary_makes_the_rollout_restart_with_its_reason(
        dsn: str, store: PostgresEventStore) -> None:
    await start(store, "bg")
    async with serving(dsn, "resources-a") as (http, _):
        await open_session(http, "bg", "sandbox", 1)
        await run(http, "bg", "echo kept > f")
        await run(http, "bg", "sleep 60 &")
        last = (await store.read_stream(session_stream("bg", 0)))[-1]
        assert last.data["unrestorable"] == "1 process still running in the background"
        assert last.data["effect"]["snapshot"] is None
        head = await store.head()
        assert await store.restart_only_at({("bg", 0): head}) == [("bg", 0)]
        # Once nothing runs in the background, the next boundary is restorable again.
        await run(http, "bg", "kill $! && wait; true")
        assert await store.restart_only_at({("bg", 0): await store.head()}) == []
        assert await store.restart_only_at({("bg", 0): head}) == [("bg", 0)]  # the boundary of then still is not
        await run(http, "bg", "sleep 60 &")
        # A paused checkpoint now: the server reports the session as a restart, and the cut, reading the
        # log at the rollout's boundary, dispatches it afresh even with no report.
        status, report = await control(http, "prepare", "ck-bg")
        assert status == 200 and report["restarts"] == [{"rollout_id": "bg", "attempt": 0}], report
        await control(http, "resume", "ck-bg")
        await store.append(AppendRequest((NewEvent(agent_stream("bg", 0), "agent_boundary", {"state": "after_turn"},
                                                   "bg", 0),)))
        cut = await make_cut(store, "ck-bg", None, [], run=None)
        assert cut.scope == () and cut.fresh == (("bg", 0),)
    async with serving(dsn, "resources-b") as (http, _):
        status, reply = await tool(http, "bg", "run", {"command": "cat f"})
    assert (status, reply["error"]["code"]) == (409, "attempt_lost")
    assert "background" in reply["error"]["detail"] and reply["error"]["context"]["lost"] == "session"


@pytest.mark.parametrize("how, said", [
    ("UPDATE rollbook.file_blobs SET content = convert_to('forged content', 'UTF8')", "does not match its digest"),
    ("DELETE FROM rollbook.file_blobs", "is not in the blob store"),
])
async def test_a_tampered_or_missing_blob_is_caught_and_the_rollout_restarts(dsn: str, store: PostgresEventStore,
                                                                            how: str, said: str) -> None:
    await start(store, "tb")
    async with serving(dsn, "resources-a") as (http, _):
        await open_session(http, "tb", "sandbox", 1)
        await run(http, "tb", "echo 'the real content' > notes.txt")
    async with store.engine.begin() as conn:  # someone edits or deletes a file's blob in the database
        changed = (await conn.execute(text(
            f"{how} WHERE content = convert_to('the real content' || chr(10), 'UTF8')"))).rowcount
    assert changed == 1
    async with serving(dsn, "resources-b") as (http, _):
        status, reply = await tool(http, "tb", "run", {"command": "cat notes.txt"})
    assert (status, reply["error"]["code"]) == (409, "attempt_lost")
    assert said in reply["error"]["detail"]


async def test_a_restore_continues_from_the_boundary_tree_without_what_was_edited_after_the_cut(
        dsn: str, store: PostgresEventStore) -> None:
    await start(store, "rc")
    async with serving(dsn, "resources-a") as (http, _):
        await open_session(http, "rc", "sandbox", 1)
        await run(http, "rc", "mkdir w && cd w && echo before > f && export PHASE=one")
        cut = await checkpoint(store, "ck1", {"rc": 1})
        await run(http, "rc", "echo after > f && echo new > g && export PHASE=two && cd /tmp")  # past the cut
    async with serving(dsn, "resources-b") as (http, _):
        status, reply = await control(http, "restore")
        assert status == 200 and reply["detail"] == {"staged": 1, "scope": 1}, reply
        await store.append(install_request(cut, latest={"rc": 0}))
        assert (await control(http, "resume"))[0] == 200
        reply = await run(http, "rc", "pwd; cat f; ls; echo $PHASE", attempt=1)
        assert reply["output"]["output"] == "/home/sandbox/w\nbefore\nf\none\n" and reply["revision"] == 2
        status, _ = await call(http, "POST", f"{prefix('rc', 1)}/close")
        assert status == 200
