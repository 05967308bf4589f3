"""A coordinator in a process of its own, so the random-fault suite can SIGKILL it mid-checkpoint.

    python -m testkit.coordinator_child --config FILE --run-id ID --rollouts N --checkpoint CK --deadline-s S

It does what `rollbook run` does at each checkpoint (apps.collection.Collection.checkpoint:
prepare, commit, publish, resume; with `--mode online`, Collection.checkpoint_online: the cut from
the log, publish) for the run's rollouts. It prints `ready` once it is connected
and waits for a line on stdin before it starts, so the kill lands inside the checkpoint and not
inside Python's start-up; at the end it prints the checkpoint's result as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp

from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.collection import Collection
from participants.environments.tasks import make_tasks


async def main(args: argparse.Namespace) -> int:
    config = cfg.load(args.config)
    assert config.dsn is not None
    store = PostgresEventStore.connect(config.dsn, writer=f"coordinator-{args.checkpoint}")
    try:
        # Only the number of tasks matters to a checkpoint (it names the run's rollout ids).
        coll = Collection(config, store, args.run_id, make_tasks(args.rollouts, 3, ["math"]))
        async with aiohttp.ClientSession() as session:
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            take = coll.checkpoint if args.mode == "paused" else coll.checkpoint_online
            result = await take(session, args.checkpoint, deadline_s=args.deadline_s)
            print(json.dumps(result), flush=True)
    finally:
        await store.close()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--rollouts", type=int, required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--deadline-s", type=float, default=3.0)
    p.add_argument("--mode", choices=["paused", "online"], default="paused")
    sys.exit(asyncio.run(main(p.parse_args())))
