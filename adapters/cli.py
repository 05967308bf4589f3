"""The `rollbook` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from adapters import database, embedded
from engine.errors import RollbookError


def _db(args: argparse.Namespace) -> int:
    if args.action == "url":
        print(database.libpq_dsn(database.prepare_database(args.dsn)))
    elif args.action == "upgrade":
        dsn, _ = database.resolve_dsn(args.dsn)
        rev = database.upgrade(dsn)
        print(json.dumps({"dsn": database.libpq_dsn(dsn), "revision": rev}))
    elif args.action == "stop":
        stopped = embedded.stop()
        print("stopped the embedded PostgreSQL" if stopped else "the embedded PostgreSQL was not running")
    elif args.action == "status":
        print(json.dumps({"home": str(embedded.home()), "embedded_dsn": embedded.running_dsn()}))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from adapters.demo import run_demo

    return asyncio.run(run_demo(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollbook", description="Checkpoint and continue multi-turn rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)

    db = sub.add_parser("db", help="the database: url, upgrade, stop, status")
    db.add_argument("action", choices=["url", "upgrade", "stop", "status"])
    db.add_argument("--dsn", help="PostgreSQL DSN (default: ROLLBOOK_DSN, else the embedded server)")
    db.set_defaults(func=_db)

    demo = sub.add_parser("demo", help="run rollouts, checkpoint them mid-flight, crash, restore and finish")
    demo.add_argument("--dsn")
    demo.add_argument("--rollouts", type=int, default=40)
    demo.add_argument("--seed", type=int, default=7)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    demo.add_argument("--keep", action="store_true", help="leave the database for SQL afterwards")
    demo.set_defaults(func=_demo)

    from adapters import checkpoint_cli

    checkpoint_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RollbookError as exc:
        print(json.dumps(exc.to_json()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
