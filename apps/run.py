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

from adapters import database
from adapters.collection_store import CollectionStore
from adapters.http_client import unpooled_session
from adapters.postgres import PostgresEventStore
from apps.collection import Collection
from apps.config import KINDS, Config
from engine import catalog as ev
from engine.coordinator import abort_expired
from engine.errors import ConfigError, RollbookError
from engine.recovery import run_dispositions
from participants.environments.base import Task


def load_tasks(path: str | Path, configured: frozenset[str] = frozenset()) -> list[Task]:
    """The tasks file, every line checked before anything runs (an unknown environment would
    otherwise fail each of its rollouts one by one, far from its cause). `configured`: the config's
    own environments besides the registered ones (its NeMo Gym servers)."""
    from participants.environments import ENVIRONMENTS

    try:
        text_ = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"tasks file {path} not found", "fix [run] tasks in the config (a path, relative to where you run)") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read tasks file {path} ({exc})", "point [run] tasks at a readable JSONL file") from None
    tasks = []
    for n, line in enumerate(text_.splitlines(), 1):
        if line.strip():
            try:
                task = Task.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{n} is not a task ({exc})",
                                  'write one {"env", "task_id", "prompt", "params"} object per line') from None
            if task.env not in ENVIRONMENTS and task.env not in configured:
                raise ConfigError(f"{path}:{n} names unknown environment {task.env!r}",
                                  f"use one of {', '.join(sorted({*ENVIRONMENTS, *configured}))}")
            tasks.append(task)
    if not tasks:
        raise ConfigError(f"tasks file {path} holds no task", "add one JSON task per line")
    return tasks


def say(**event: Any) -> None:
    print(json.dumps({"t": round(time.time(), 3), **event}), flush=True)


async def check_servers(config: Config, session: aiohttp.ClientSession) -> None:
    """Every server answers its status with our token, or the run stops before dispatching anything."""
    for kind in KINDS:
        if kind not in config.servers:
            raise ConfigError(f"the config has no [servers.{kind}] section", "add one with the port that server listens on")
        url = config.url(kind) + "/rollbook/v1/control/status"
        try:
            async with session.get(url, headers={"Authorization": f"Bearer {config.control_token}"},
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ConfigError(f"cannot reach the {kind} server at {config.url(kind)} ({exc or type(exc).__name__})",
                              f"start it with `rollbook serve {kind} --config FILE`, or fix [servers.{kind}] host and port") from None
        if status == 401:
            raise ConfigError(f"the {kind} server at {config.url(kind)} refused our token",
                              "give every server and `rollbook run` the same config `token`")
        if status != 200:
            raise ConfigError(f"the {kind} server at {config.url(kind)} answered its status with HTTP {status}",
                              f"check that a rollbook {kind} server (`rollbook serve {kind}`) listens there")


async def run_collection(config: Config) -> int:
    if config.run is None:
        raise ConfigError("the config has no [run] section", "add [run] with run_id and tasks (apps/config.py)")
    run = config.run
    # Before the database: a bad tasks file is the cheaper mistake to report.
    tasks = load_tasks(run.tasks, frozenset(config.nemo_gym))
    async with aiohttp.ClientSession() as probe:
        await check_servers(config, probe)
    dsn = database.prepare_database(config.dsn)
    store = PostgresEventStore.connect(dsn, writer=f"run-{run.run_id}", pool=config.database_pool(dsn))
    collection = Collection(config, store, run.run_id, tasks, seed=run.seed, max_steps=run.max_steps,
                            concurrency=run.concurrency, on_finish=lambda rid: say(event="finished", rollout_id=rid),
                            on_wait=lambda rid, code: say(event="waiting", rollout_id=rid, code=code))
    loop = asyncio.get_running_loop()
    wanted = asyncio.Event()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, wanted.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        # Dispatches hold a connection each for a whole episode; the checkpoint's control requests travel
        # on a session of their own, so no number of rollouts in flight makes a prepare wait for one.
        async with unpooled_session() as session, aiohttp.ClientSession() as control:
            for ck in await abort_expired(store):  # a coordinator killed mid-checkpoint left these open
                say(event=ev.CHECKPOINT_ABORTED, checkpoint_id=ck, reason="lease expired")
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
                try:
                    if run.checkpoint_mode == "online" and not stop.is_set():
                        result = await collection.checkpoint_online(control, ck)
                    else:  # a stop parks every server and leaves it parked: no work goes on after the run ends
                        result = await collection.checkpoint(control, ck, resume=not stop.is_set())
                except RollbookError as exc:  # a checkpoint that fails is aborted; the rollouts go on
                    await collection.coordinator(control).resume(ck)
                    result = {"checkpoint_id": ck, "published": False, "error": exc.to_json()["error"]}
                say(event="checkpoint", **result)
                wanted.clear()
                if stop.is_set():
                    dispatch.cancel()
                    say(event="stopped", checkpoint_id=ck if result["published"] else None)
                    return 0
            results = await dispatch
            finished = len(tasks) - len(await collection.unfinished())
            extra = {"refused": dict(sorted(collection.refused.items())[:10])} if collection.refused else {}
            if collection.reasons:  # why, in the words of what refused it: a person acts on these
                extra["reasons"] = dict(sorted(collection.reasons.items())[:10])
            say(event="done", rollouts=len(tasks), finished=finished, this_session=len(results),
                retried=collection.retries, **extra)
            return 0 if finished == len(tasks) else 1
    finally:
        await store.close()


async def _next_checkpoint_id(store: PostgresEventStore, run_id: str) -> str:
    return f"{run_id}-ck{await CollectionStore(store).checkpoint_count(f'{run_id}-ck') + 1}"


def main(config: Config) -> int:
    try:
        return asyncio.run(run_collection(config))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "load_tasks", "KINDS"]
