"""`rollbook checkpoint ...`: drive a checkpoint by hand against running servers, printing JSON."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from adapters import database
from adapters.postgres import PostgresEventStore
from adapters.secret_files import read_private
from adapters.token_store import PostgresTokenStore
from apps.participant_set import LoggedParticipants
from engine.coordinator import Coordinator, ParticipantClient, abort_expired
from engine.errors import ConfigError, RollbookError

TOKEN_FIX = "set ROLLBOOK_CONTROL_TOKEN or pass --control-token-file PATH (a file only you can read: chmod 600)"


def control_token(args: argparse.Namespace) -> str:
    """The control credential from a file or the environment, never from the command line."""
    if args.control_token is not None:
        raise ConfigError("--control-token puts the control credential on the command line, where every local "
                          "user can read it (/proc/PID/cmdline), so it is refused and should be changed",
                          TOKEN_FIX)
    if args.control_token_file:
        token = read_private(args.control_token_file, "control token file").strip()
        if not token:
            raise ConfigError(f"control token file {args.control_token_file} is empty", "write the control credential in it")
        return token
    return os.environ.get("ROLLBOOK_CONTROL_TOKEN", "")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="prepare, commit, publish, resume, restore, retire, forget or status by hand")
    p.add_argument("action", choices=["prepare", "commit", "publish", "resume", "restore", "retire", "forget", "status"])
    p.add_argument("checkpoint_id", nargs="?", default=None)
    p.add_argument("--participant", action="append", default=[], metavar="KIND=URL",
                   help="a participant's base URL, e.g. model=http://127.0.0.1:8101 (repeat for each)")
    p.add_argument("--control-token-file", metavar="PATH",
                   help="a file (mode 0600) holding the control credential (default: ROLLBOOK_CONTROL_TOKEN)")
    # Kept only to refuse it by name: a credential on the command line is in /proc/PID/cmdline,
    # which every local user reads (and without it argparse would take `--control-token X` as an
    # abbreviation of --control-token-file).
    p.add_argument("--control-token", help=argparse.SUPPRESS)
    p.add_argument("--dsn")
    p.add_argument("--deadline-seconds", type=float, default=30.0)
    p.add_argument("--scope", help="JSON list of [rollout_id, attempt] to continue (commit; default: every live attempt)")
    p.add_argument("--rollouts", help="JSON list of [rollout_id, through] (retire) or of rollout ids (forget)")
    p.add_argument("--framework-ref", help="JSON object naming the framework state for this checkpoint (publish)")
    p.add_argument("--token-ref", help="JSON object: the token-store snapshot reference (publish)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    print(json.dumps(asyncio.run(_run(args)), default=str))
    return 0


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    token = control_token(args)
    if args.participant and not token:
        raise ConfigError("no control credential for the participants", TOKEN_FIX)
    dsn = database.prepare_database(args.dsn)
    store = PostgresEventStore.connect(dsn, writer="coordinator-cli")
    deadline = time.time() + args.deadline_seconds
    async with aiohttp.ClientSession() as session:
        # The participants named here and every live instance the log records (apps/participant_set.py).
        members = LoggedParticipants(store, [(k, u) for k, _, u in (p.partition("=") for p in args.participant)],
                                     token, session)
        try:
            clients = list(await members.current())
            if args.action == "status":
                return await _status(store, clients)
            return await _ACTIONS[args.action](Coordinator(store, clients, members), store, args, deadline)
        finally:
            await store.close()


async def _status(store: PostgresEventStore, clients: list[ParticipantClient]) -> dict[str, Any]:
    # Looking is enough to end a checkpoint whose lease ran out (its coordinator died).
    out: dict[str, Any] = {"aborted_expired": await abort_expired(store)}
    for c in clients:
        try:
            out[c.name] = await c.call("status", {})
        except (RollbookError, OSError, aiohttp.ClientError) as exc:
            out[c.name] = {"error": {"code": "participant_unavailable", "detail": str(exc) or type(exc).__name__}}
    return out


async def _commit(c: Coordinator, store: PostgresEventStore, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    scope = [tuple(x) for x in json.loads(args.scope)] if args.scope else None
    return (await c.commit(args.checkpoint_id, deadline, scope)).to_json()  # type: ignore[arg-type]


async def _publish(c: Coordinator, store: PostgresEventStore, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    tokens = PostgresTokenStore(store.engine)
    return await c.publish(args.checkpoint_id, json.loads(args.framework_ref or "{}"), json.loads(args.token_ref or "{}"),
                           tokens)


async def _retire(c: Coordinator, store: PostgresEventStore, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    rollouts = json.loads(args.rollouts or "[]")
    await c.retire(args.checkpoint_id, [tuple(x) for x in rollouts])
    return {"checkpoint_id": args.checkpoint_id, "retired": rollouts}


async def _forget(c: Coordinator, store: PostgresEventStore, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    rollouts = json.loads(args.rollouts or "[]")
    await c.forget(args.checkpoint_id, rollouts)
    return {"checkpoint_id": args.checkpoint_id, "forgotten": rollouts}


Action = Callable[[Coordinator, PostgresEventStore, argparse.Namespace, float], Awaitable[dict[str, Any]]]
_ACTIONS: dict[str, Action] = {
    "prepare": lambda c, _s, a, deadline: c.prepare(a.checkpoint_id, deadline),
    "commit": _commit,
    "publish": _publish,
    "resume": lambda c, _s, a, _d: c.resume(a.checkpoint_id),
    "restore": lambda c, _s, a, deadline: c.restore(a.checkpoint_id, deadline),
    "retire": _retire,
    "forget": _forget,
}
