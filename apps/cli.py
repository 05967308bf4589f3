"""The `rollbook` command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import sys

from adapters import database
from engine.errors import ConfigError, RollbookError


def _db(args: argparse.Namespace) -> int:
    if args.action == "url":
        print(database.libpq_dsn(database.prepare_database(args.dsn)))
    elif args.action == "upgrade":
        dsn, _ = database.resolve_dsn(args.dsn)
        rev = database.upgrade(dsn)
        print(json.dumps({"dsn": database.libpq_dsn(dsn), "revision": rev}))
    elif args.action == "stop":
        from adapters import embedded

        stopped = embedded.stop()
        print("stopped the embedded PostgreSQL" if stopped else "the embedded PostgreSQL was not running")
    elif args.action == "status":
        from adapters import embedded

        print(json.dumps({"home": str(embedded.home()), "embedded_dsn": embedded.running_dsn()}))
    elif args.action == "prune-keys":
        print(json.dumps(_prune_keys(args)))
    elif args.action == "retain":
        print(json.dumps(_prune_keys(args, everything=True)))
    return 0


def _prune_keys(args: argparse.Namespace, everything: bool = False) -> dict[str, object]:
    """Drop append idempotency keys older than the retention (adapters.postgres.prune_append_keys says
    why that is safe while the servers write); with `everything` (`retain`), also the events, token
    snapshots and token blobs nothing kept needs (adapters.retention)."""
    from adapters.postgres import DEFAULT_KEY_RETENTION_S
    from adapters.retention import DEFAULT_KEEP_CHECKPOINTS

    dsn, retention, keep = args.dsn, DEFAULT_KEY_RETENTION_S, DEFAULT_KEEP_CHECKPOINTS
    if args.config:
        from apps import config

        loaded = config.load(args.config)
        dsn, retention = dsn or loaded.dsn, loaded.limits.append_key_retention_s
        keep = loaded.limits.retention_keep_checkpoints
    if args.older_than_s is not None:
        retention = args.older_than_s
    if args.keep_checkpoints is not None:
        keep = args.keep_checkpoints

    async def prune(store):  # type: ignore[no-untyped-def]
        from adapters.retention import retain

        try:
            if everything:
                return dataclasses.asdict(await retain(store, retention, keep_checkpoints=keep))
            return {"removed": await store.prune_append_keys(retention), "older_than_s": retention}
        except ValueError as exc:
            raise ConfigError(str(exc), "give --older-than-s (or [limits] append_key_retention_s) of at least that") from None

    return asyncio.run(_with_store(dsn, prune))  # type: ignore[no-any-return]


def _demo(args: argparse.Namespace) -> int:
    from apps.demo import run_demo

    return asyncio.run(run_demo(args))


async def _with_store(dsn: str | None, work):  # type: ignore[no-untyped-def]
    from adapters.postgres import PostgresEventStore

    store = PostgresEventStore.connect(database.prepare_database(dsn), writer="cli")
    try:
        return await work(store)
    finally:
        await store.close()


def _history(args: argparse.Namespace) -> int:
    from apps.replay import history

    h = asyncio.run(_with_store(args.dsn, lambda s: history(s, args.rollout_id)))
    if args.json:
        print(json.dumps(h, default=str))
        return 0
    cols = ["attempt", "status", "parent_attempt", "restored_from", "origin_position", "started_position",
            "ended_position", "events", "model_calls", "mutations", "reward"]
    table = [[str(a[c]) if a[c] is not None else "-" for c in cols] for a in h["attempts"]]
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)] if table else [len(c) for c in cols]
    print(f"rollout {h['rollout_id']}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    print(f"\ntimeline ({len(h['timeline'])} events)")
    for t in h["timeline"]:
        print(f"  {t['position']:>8}  attempt {t['attempt']}  {t['kind']:<22} {t['stream']}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from apps.replay import replay

    steps, state = asyncio.run(_with_store(args.dsn, lambda s: replay(s, args.rollout_id, args.attempt, args.to)))
    if args.json:
        print(json.dumps({"steps": [s.__dict__ for s in steps], "revision": state.revision, "reward": state.reward,
                          "env_state": state.env_state}, default=str))
        return 0
    for s in steps:
        print(f"{s.position:>8}  a{s.attempt}  {s.kind:<20} {s.change}")
    print(f"\nreplayed {len(steps)} events: revision {state.revision}, turn {state.turn}, reward {state.reward}; "
          "no divergence from the recorded state")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from apps import config, serve

    loaded = config.load(args.config)
    if args.kind not in loaded.servers:
        raise ConfigError(f"{args.config} has no [servers.{args.kind}] section", "add one with the port it listens on")
    loaded = serve.with_address(loaded, args.kind, args.host, args.port)
    try:
        serve.serve(args.kind, loaded, args.config, serve.worker_of(args.worker_of))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        s = loaded.servers[args.kind]
        raise ConfigError(f"port {s.port} on {s.bind or s.host} is already in use",
                          f"stop what listens there or change [servers.{args.kind}] port in {args.config}") from None
    return 0


def _run(args: argparse.Namespace) -> int:
    from apps import config, run

    return run.main(config.load(args.config))


def _export(args: argparse.Namespace) -> int:
    from adapters.export import export_command

    print(json.dumps(asyncio.run(export_command(database.prepare_database(args.dsn), args.run, args.out))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollbook", description="Checkpoint and continue multi-turn rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)

    db = sub.add_parser("db", help="the database: url, upgrade, stop, status, prune-keys, retain")
    db.add_argument("action", choices=["url", "upgrade", "stop", "status", "prune-keys", "retain"])
    db.add_argument("--dsn", help="PostgreSQL DSN (default: ROLLBOOK_DSN, else the embedded server)")
    db.add_argument("--config", help="prune-keys, retain: take the DSN and [limits] append_key_retention_s from this file")
    db.add_argument("--older-than-s", type=float, help="prune-keys, retain: the retention in seconds (default: a day)")
    db.add_argument("--keep-checkpoints", type=int,
                    help="retain: how many of the newest published checkpoints stay restorable (default: 3)")
    db.set_defaults(func=_db)

    demo = sub.add_parser("demo", help="run rollouts, checkpoint them mid-flight, crash, restore and finish")
    demo.add_argument("--dsn")
    demo.add_argument("--rollouts", type=int, default=40)
    demo.add_argument("--seed", type=int, default=7)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    demo.add_argument("--keep", action="store_true", help="leave the database for SQL afterwards")
    demo.set_defaults(func=_demo)

    hist = sub.add_parser("history", help="the timeline of every attempt of a rollout")
    hist.add_argument("rollout_id")
    hist.add_argument("--dsn")
    hist.add_argument("--json", action="store_true")
    hist.set_defaults(func=_history)

    rep = sub.add_parser("replay", help="rebuild an attempt's state from the log alone, step by step")
    rep.add_argument("rollout_id")
    rep.add_argument("--attempt", type=int, required=True)
    rep.add_argument("--to", type=int, help="stop at this log position")
    rep.add_argument("--dsn")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=_replay)

    srv = sub.add_parser("serve", help="start one server: environment, model, agent or resources")
    srv.add_argument("kind", choices=["environment", "model", "agent", "resources"])
    srv.add_argument("--config", required=True, help="the TOML config file (see apps/config.py)")
    srv.add_argument("--port", type=int, help="listen here instead of the config's port: another instance of KIND")
    srv.add_argument("--host", help="the host the others reach this instance at (default: the config's)")
    # Given by a front to the workers it starts (apps/workers.py), never by hand.
    srv.add_argument("--worker-of", help=argparse.SUPPRESS)
    srv.set_defaults(func=_serve)

    runp = sub.add_parser("run", help="run a rollout collection from a JSONL of tasks, with checkpoints")
    runp.add_argument("--config", required=True, help="the TOML config file, with a [run] section")
    runp.set_defaults(func=_run)

    exp = sub.add_parser("export", help="one training record per finished rollout of a run (JSONL or Parquet)")
    exp.add_argument("--run", required=True, help="the run id ([run] run_id)")
    exp.add_argument("--out", required=True, help="FILE.jsonl or FILE.parquet: the suffix chooses the format")
    exp.add_argument("--dsn")
    exp.set_defaults(func=_export)

    from apps import checkpoint_cli, fork_cli

    checkpoint_cli.add_parser(sub)
    fork_cli.add_parser(sub)
    from apps import nemo_gym_tasks

    nemo_gym_tasks.add_parser(sub)
    from apps import ui

    ui.add_parser(sub)
    from apps import nemo_gym_install, nemo_gym_sweep

    nemo_gym_sweep.add_parser(nemo_gym_install.add_parser(sub))
    return parser


def explain(exc: BaseException) -> ConfigError | None:
    """A configuration mistake that surfaced as a library's exception, said as cause and fix."""
    import psycopg
    import sqlalchemy.exc

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError | psycopg.OperationalError) and isinstance(
            getattr(exc, "orig", exc), psycopg.OperationalError):
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ConfigError(f"cannot connect to PostgreSQL ({first})", database.CONNECT_FIX)
    if isinstance(exc, sqlalchemy.exc.ArgumentError) and "URL" in str(exc):
        return ConfigError("the database DSN is not a postgresql:// URL", database.DSN_FIX)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RollbookError as exc:
        print(json.dumps(exc.to_json()), file=sys.stderr)
        return 2
    except Exception as exc:  # a mistake in the user's input is one line and exit 2, never a traceback
        problem = explain(exc)
        if problem is None:
            raise
        print(f"rollbook: error: {problem}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
