"""`rollbook fork ROLLOUT --attempt A --at POSITION --count K --config FILE`: start K rollouts from a boundary.

The environment server owns dispatch, so the fork is its control operation (`POST
/rollbook/v1/control/fork`, the control credential of the config): it checks the fork rule
(engine/forks.py), records every fork in one append or refuses with nothing written, and drives
each fork like a dispatched rollout. This command asks for it, prints the forks, and (unless
`--no-wait`) waits for each to end and prints how; a refusal because a checkpoint holds admission
closed is asked again until `--timeout-s`. Asked again with the same origin and group, it
writes nothing and drives again the forks that are neither finished nor running: after a crash and
a restart of the servers, the same command finishes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from adapters.http_client import CONTROL, JsonClient
from engine.errors import AdmissionClosed, ParticipantUnavailable

ENDED = ("finished", "failed")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fork", help="start K new rollouts from a boundary of a rollout's attempt")
    p.add_argument("rollout_id")
    p.add_argument("--attempt", type=int, required=True, help="the attempt whose boundary to fork from")
    p.add_argument("--at", type=int, required=True, dest="position", metavar="POSITION",
                   help="the log position of that boundary (an episode_step or agent_boundary of the attempt)")
    p.add_argument("--count", type=int, required=True, help="how many rollouts to start (1 to 256)")
    p.add_argument("--config", required=True, help="the TOML config file: the environment server's address and the tokens")
    p.add_argument("--group", help="the fork group (fork i is GROUP.i; default ROLLOUT.fPOSITION)")
    p.add_argument("--seed", type=int, help="fork i samples with SEED + i (default: a seed from its id)")
    p.add_argument("--no-wait", action="store_true", help="print the forks and return without waiting for them")
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long to wait for the forks to end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apps import config

    loaded = config.load(args.config)
    out = asyncio.run(fork(loaded.url("environment"), loaded.control_token, loaded.data_token, args))
    print(json.dumps(out))
    return 0 if args.no_wait or all(f.get("status") == "finished" for f in out["forks"]) else 1


async def fork(url: str, control_token: str, data_token: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"rollout_id": args.rollout_id, "attempt": args.attempt, "position": args.position,
                            "count": args.count}
    if args.group is not None:
        body["group"] = args.group
    if args.seed is not None:
        body["seed"] = args.seed
    control, data = JsonClient(control_token), JsonClient(data_token)
    stop = time.monotonic() + args.timeout_s
    try:
        while True:
            try:
                reply = dict(await control.post(f"{url}{CONTROL}/fork", body))
                break
            except AdmissionClosed:  # a checkpoint is in progress: the refusal wrote nothing, ask after it
                if time.monotonic() > stop:
                    raise
                await asyncio.sleep(0.5)
        if not args.no_wait:
            reply["forks"] = [await _wait(data, url, f, stop) for f in reply["forks"]]
        return reply
    finally:
        await control.close()
        await data.close()


async def _wait(client: JsonClient, url: str, fork: dict[str, Any], stop: float) -> dict[str, Any]:
    status: dict[str, Any] = {"status": "unknown"}
    while time.monotonic() < stop:
        try:
            status = dict(await client.get(f"{url}/episodes/{fork['rollout_id']}"))
        except ParticipantUnavailable:  # restarting: ask again
            status = {"status": "unavailable"}
        if status.get("status") in ENDED:
            break
        await asyncio.sleep(0.1)
    return {**fork, "status": status.get("status"), "attempt": status.get("attempt"), "reward": status.get("reward"),
            **({"error": status["error"]} if status.get("error") else {})}
