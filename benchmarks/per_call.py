"""What one model call costs the database: events, appends, transactions and statements.

    .venv/bin/python benchmarks/per_call.py [--rollouts 12] [--concurrency 1] [--envs workplace,blackjack,math]
                                            [--dsn ADMIN_DSN] [--out PATH]

A fixed, deterministic workload: the four servers of apps/stack.py (real aiohttp servers on
127.0.0.1, each with its own event-store connection, the scripted policy as the model) run
`--rollouts` episodes over the workplace, blackjack and math environments (seed 3), `--concurrency`
at a time (1: one after another, so no append groups two servers' requests and the figures are
per call, not per batch). One warm-up episode runs first and is not counted.

The counts come from the database itself: `pg_stat_statements` (the throwaway embedded server is
restarted once with it preloaded; with --dsn the server must preload it) counts every statement
the servers sent, BEGIN and COMMIT included; `pg_stat_database` counts every transaction (explicit
ones, and single statements in autocommit). The warm-up runs on its own servers, closed before the
counters are reset; the measured servers are closed before they are read, so everything they sent
is counted, their connections' setup included. Append requests
(what a server asked to append atomically) are counted in process. The log's bytes per rollout
are the JSON text of every event of the measured rollouts (`octet_length(data::text)`), and the
share of `agent_boundary` events in them.

It prints a table and writes one JSON object to benchmarks/results/per_call.json. It never asserts
a count or a time: it is a measurement to compare before and after a change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import sqlalchemy  # noqa: E402
from sqlalchemy.pool import Pool  # noqa: E402

from adapters import database  # noqa: E402
from adapters.database import like_prefix  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from apps.stack import start_stack  # noqa: E402
from benchmarks.statements import preloaded_server  # noqa: E402
from engine import catalog as ev  # noqa: E402
from participants.environments.tasks import make_tasks  # noqa: E402
from participants.model.backends.scripted import ScriptedBackend  # noqa: E402

ENVS = ["workplace", "blackjack", "math"]
TASK_SEED = 3


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class AppendCounter:
    """Counts append requests (and their events) made through any PostgresEventStore of this process,
    and connection checkouts from any SQLAlchemy pool (once each a pre-ping round trip, an empty
    statement that pg_stat_statements did not list but pg_stat_database counted as a transaction;
    pools no longer ping, adapters.pg_pool.make_engine)."""

    def __init__(self) -> None:
        self.requests = 0
        self.events = 0
        self.checkouts = 0
        self.by_server: dict[str, int] = {}  # append requests per server kind (the writer's first word)
        self._original = PostgresEventStore.append

    def _checkout(self, *args: object) -> None:
        self.checkouts += 1

    def __enter__(self) -> AppendCounter:
        counter, original = self, self._original

        async def counted(store: PostgresEventStore, request: Any) -> Any:
            counter.requests += 1
            counter.events += len(request.events)
            kind = store.writer.split("-")[0]
            counter.by_server[kind] = counter.by_server.get(kind, 0) + 1
            return await original(store, request)

        PostgresEventStore.append = counted  # type: ignore[method-assign]
        sqlalchemy.event.listen(Pool, "checkout", self._checkout)
        return self

    def __exit__(self, *exc: object) -> None:
        PostgresEventStore.append = self._original  # type: ignore[method-assign]
        sqlalchemy.event.remove(Pool, "checkout", self._checkout)


def statements(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Calls per statement text in this database since the last reset."""
    rows = conn.execute(
        "SELECT query, calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = current_database()").fetchall()
    return {q: int(c) for q, c in rows}


def verb(query: str) -> str:
    words = query.strip().split()
    head = words[0].upper() if words else "?"
    if head == "WITH":  # a data-modifying CTE: name it by what it finally does
        for w in ("INSERT", "UPDATE", "DELETE", "SELECT"):
            if w in query.upper().split(")")[-1]:
                return w
    return head


async def workload(dsn: str, rollouts: int, concurrency: int, envs: list[str]
                   ) -> tuple[list[str], float, tuple[int, int, int], dict[str, int]]:
    warmup = await start_stack(dsn, "warmup", ScriptedBackend())
    try:
        await warmup.episode(make_tasks(1, TASK_SEED + 1, envs)[0], "warmup-0")
    finally:
        await warmup.close()  # its server processes end, so their statistics are in before the reset
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset()")
    stack = await start_stack(dsn, "percall", ScriptedBackend())
    try:
        tasks = make_tasks(rollouts, TASK_SEED, envs)
        ids = [f"percall-{i:03d}" for i in range(rollouts)]
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Any, rid: str) -> None:
            async with gate:
                await stack.episode(task, rid)

        started = time.perf_counter()
        with AppendCounter() as counter:
            await asyncio.gather(*(one(t, r) for t, r in zip(tasks, ids, strict=True)))
            elapsed = time.perf_counter() - started
            # Closing the stack ends every pooled connection: whatever they still had to send is in.
            await stack.close()
        stack = None
        return ids, elapsed, (counter.requests, counter.events, counter.checkouts), counter.by_server
    finally:
        if stack is not None:
            await stack.close()


def measure(dsn: str, ids: list[str], appends: tuple[int, int, int]) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        stmts = statements(conn)
        # Every transaction, explicit or a single autocommit statement; the servers' connections have
        # ended, so their counts are flushed. This connection's own statements come later.
        xacts = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
                             ).fetchone()[0]
        ours = like_prefix("percall-")
        count = dict(conn.execute(
            "SELECT kind, count(*) FROM rollbook.events WHERE rollout_id LIKE %s GROUP BY kind", (ours,)).fetchall())
        size = conn.execute(
            "SELECT coalesce(sum(octet_length(data::text)), 0), "
            "coalesce(sum(octet_length(data::text)) FILTER (WHERE kind = %s), 0), "
            "coalesce(sum(pg_column_size(data)), 0) FROM rollbook.events WHERE rollout_id LIKE %s",
            (ev.AGENT_BOUNDARY, ours)).fetchone()
        finished = conn.execute(
            "SELECT count(*) FROM rollbook.attempts WHERE status = 'finished' AND rollout_id LIKE %s", (ours,)).fetchone()[0]
    mutations = int(count.get(ev.MUTATION_APPLIED, 0))  # the tool calls that changed a session
    model_calls = int(count.get(ev.CALL_ACCEPTED, 0))
    by_verb: dict[str, int] = {}
    for q, c in stmts.items():
        if "pg_stat_statements" in q:
            continue
        by_verb[verb(q)] = by_verb.get(verb(q), 0) + c
    total = sum(by_verb.values())
    event_count = sum(count.values())
    # The statement that writes an append's events starts with them or holds them in a CTE.
    inserts = sum(c for q, c in stmts.items() if "INSERT INTO ROLLBOOK.EVENTS" in q.upper())
    n = max(model_calls, 1)
    return {
        "rollouts": len(ids), "finished": int(finished), "model_calls": model_calls, "mutations": mutations,
        "events": event_count, "events_by_kind": dict(sorted(count.items())),
        "append_requests": appends[0], "append_transactions": inserts, "pool_checkouts": appends[2],
        "transactions_begin": by_verb.get("BEGIN", 0), "transactions": int(xacts), "statements": total, "statements_by_verb": dict(sorted(by_verb.items())),
        "per_model_call": {
            "events": round(event_count / n, 2), "append_requests": round(appends[0] / n, 2),
            "append_transactions": round(inserts / n, 2), "transactions": round(int(xacts) / n, 2),
            "transactions_begin": round(by_verb.get("BEGIN", 0) / n, 2),
            "statements": round(total / n, 2), "pool_checkouts": round(appends[2] / n, 2),
        },
        "log_bytes_per_rollout": round(size[0] / max(len(ids), 1)),
        "agent_boundary_bytes_per_rollout": round(size[1] / max(len(ids), 1)),
        "agent_boundary_share": round(size[1] / size[0], 3) if size[0] else None,
        "stored_bytes_per_rollout": round(size[2] / max(len(ids), 1)),
        "top_statements": sorted(({"calls": c, "query": q[:160]} for q, c in stmts.items()
                                  if "pg_stat_statements" not in q), key=lambda r: -r["calls"])[:40],
    }


def table(r: dict[str, Any]) -> str:
    p = r["per_model_call"]
    rows = [
        ("rollouts (finished)", f"{r['rollouts']} ({r['finished']})"),
        ("model calls / mutations applied", f"{r['model_calls']} / {r['mutations']}"),
        ("events per model call", p["events"]),
        ("append requests per model call", p["append_requests"]),
        *((f"  by the {k} server", v) for k, v in p.get("append_requests_by_server", {}).items()),
        ("append transactions per model call", p["append_transactions"]),
        ("transactions per model call (pg_stat_database)", p["transactions"]),
        ("  of which explicit (BEGIN)", p["transactions_begin"]),
        ("statements per model call", p["statements"]),
        ("pool checkouts per model call (none pinged)", p["pool_checkouts"]),
        ("log bytes per rollout (JSON text)", r["log_bytes_per_rollout"]),
        ("  of which agent_boundary", f"{r['agent_boundary_bytes_per_rollout']} ({r['agent_boundary_share']})"),
        ("stored bytes per rollout (pg_column_size)", r["stored_bytes_per_rollout"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    stop = None
    admin = args.dsn
    if admin is None:
        # every statement counted, and no background transactions in the counts
        admin, stop = preloaded_server({"pg_stat_statements.track": "all", "autovacuum": "off"})
    try:
        dsn = database.scratch_database(admin, f"rollbook_percall_{int(time.time())}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        ids, elapsed, appends, by_server = await workload(dsn, args.rollouts, args.concurrency, args.envs.split(","))
        result = measure(dsn, ids, appends)
        n = max(result["model_calls"], 1)
        result["per_model_call"]["append_requests_by_server"] = {k: round(v / n, 2) for k, v in sorted(by_server.items())}
        result.update({"concurrency": args.concurrency, "workload_s": round(elapsed, 2),
                       "envs": args.envs.split(","), "task_seed": TASK_SEED, "python": platform.python_version()})
        database.drop_database(dsn)
        return result
    finally:
        if stop is not None:
            stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--envs", default=",".join(ENVS), help="comma-separated environments the tasks cycle through")
    parser.add_argument("--dsn", default=None, help="an admin DSN of a server that preloads pg_stat_statements")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "per_call.json"))
    args = parser.parse_args()
    out = asyncio.run(main(args))
    print(table(out))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
