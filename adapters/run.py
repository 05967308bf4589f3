"""`rollbook run --config FILE`: a rollout collection with periodic checkpoints that survives crashes.

Checkpoints every `run.checkpoint_every_s` seconds and on SIGUSR1; on SIGTERM it checkpoints and
stops without resuming. Started again with the same run id after any crash, it finishes every
rollout that has not finished, each from its latest durable boundary in the log
(engine.recovery): it prints where each stands, then dispatches the unfinished ones again, and the
servers go on from the log. A published checkpoint is not restored: that would roll back work done
after it (`rollbook checkpoint restore` does that on purpose).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from sqlalchemy import text

from adapters import database
from adapters.collection import Collection
from adapters.config import KINDS, Config
from adapters.postgres import PostgresEventStore, retrying
from engine.recovery import run_dispositions
from participants.environments.base import Task


def load_tasks(path: str | Path) -> list[Task]:
    tasks = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(Task.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}:{n}: not a task ({exc}); expected {{\"env\", \"task_id\", \"prompt\", \"params\"}}") from exc
    return tasks


def say(**event: Any) -> None:
    print(json.dumps({"t": round(time.time(), 3), **event}), flush=True)


async def run_collection(config: Config) -> int:
    if config.run is None:
        raise SystemExit("the config has no [run] section")
    run = config.run
    dsn = database.prepare_database(config.dsn)
    store = PostgresEventStore.connect(dsn, writer=f"run-{run.run_id}")
    tasks = load_tasks(run.tasks)
    collection = Collection(config, store, run.run_id, tasks, seed=run.seed, max_steps=run.max_steps,
                            concurrency=run.concurrency, on_finish=lambda rid: say(event="finished", rollout_id=rid))
    loop = asyncio.get_running_loop()
    wanted = asyncio.Event()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, wanted.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        async with aiohttp.ClientSession() as session:
            ids = [collection.rollout_id(i) for i in range(len(tasks))]
            where = run_dispositions(await store.attempt_rows(ids), ids)
            if any(d != "not_started" for d in where.values()):
                counts = {d: sum(1 for v in where.values() if v == d) for d in sorted(set(where.values()))}
                say(event="recovery", latest_published=await collection.latest_published(), **counts)
            dispatch = asyncio.create_task(collection.dispatch(session))
            while not dispatch.done():
                timer = asyncio.create_task(asyncio.sleep(run.checkpoint_every_s))
                waiters = [dispatch, timer, asyncio.create_task(wanted.wait()), asyncio.create_task(stop.wait())]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters[1:]:
                    w.cancel()
                if dispatch.done():
                    break
                ck = await _next_checkpoint_id(store, run.run_id)
                result = await collection.checkpoint(session, ck, resume=not stop.is_set())
                say(event="checkpoint", **result)
                wanted.clear()
                if stop.is_set():
                    dispatch.cancel()
                    say(event="stopped", checkpoint_id=ck if result["published"] else None)
                    return 0
            results = await dispatch
            finished = len(tasks) - len(await collection.unfinished())
            say(event="done", rollouts=len(tasks), finished=finished, this_session=len(results))
            return 0 if finished == len(tasks) else 1
    finally:
        await store.close()


@retrying("numbering the next checkpoint")
async def _next_checkpoint_id(store: PostgresEventStore, run_id: str) -> str:
    async with store.engine.connect() as conn:
        n = (await conn.execute(text("SELECT count(*) FROM rollbook.checkpoints WHERE checkpoint_id LIKE :p"),
                                {"p": f"{run_id}-ck%"})).scalar_one()
    return f"{run_id}-ck{int(n) + 1}"


def main(config: Config) -> int:
    try:
        return asyncio.run(run_collection(config))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "load_tasks", "KINDS"]
