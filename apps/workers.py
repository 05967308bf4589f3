"""`[servers.KIND] workers = N`: N processes of a server behind its one address.

`rollbook serve KIND` with `workers = N` (N > 1) runs a front (participants/base/front.py) at the
configured address and starts N worker processes on free internal ports, in its own process group
(a signal to the group reaches them all). Each worker is a whole server of its kind, recorded in the
log like an instance at its own address with its front, its parent (this process) and its index
(engine/membership.py), so:

- the coordinator prepares, commits, restores and resumes every live worker directly, and a recorded
  live worker that does not answer fails a paused prepare closed (apps/participant_set.py);
- callers that read the log (the environment to the agent and the resources server, the agent to the
  model and the resources server) pick the worker themselves by the routing rule
  (participants/base/routing.py), and the front picks the same one for everyone else;
- a worker that dies is recorded `instance_stopped` by this process as soon as it sees the exit, so its
  sessions move to a live worker at once instead of a lease later, where they are taken over from the
  log (engine/ownership.py, engine/recovery.py).

Why processes behind a front and not one listening socket shared by N processes (uvicorn's workers,
SO_REUSEPORT): the kernel would hand a session's requests to any of them, and a session's live state
(an agent activation, a sandbox process, a generation in flight) is in one process's memory. A dead
worker is not started again: its work moves to the others, and a restart of the whole server (a new
front at the address) supersedes the old group at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from adapters.http_server import run_bounded
from adapters.membership import MembershipReader
from adapters.postgres import PostgresEventStore
from apps.config import Config, Kind
from apps.processes import free_port, instance_id
from engine import membership as M
from engine.errors import RollbookError
from engine.events import AppendRequest
from participants.base.front import Front, front_app
from participants.base.routing import Peers

log = logging.getLogger(__name__)
WATCH_S = 0.1  # how soon a worker's exit is seen and recorded
STOP_S = 20.0  # a worker's clean shutdown, before it is killed


@dataclass
class Worker:
    index: int
    instance: str
    address: str
    proc: subprocess.Popen[bytes]
    recorded_gone: bool = False


@dataclass
class WorkerSet:
    kind: Kind
    config_path: str
    host: str
    front: str
    parent: str
    count: int
    dsn: str
    store: PostgresEventStore
    workers: list[Worker] = field(default_factory=list)
    _watch: asyncio.Task[None] | None = None

    def running(self) -> list[str]:
        return [w.address for w in self.workers if w.proc.poll() is None]

    async def start(self) -> None:
        env = {**os.environ, "ROLLBOOK_DSN": self.dsn}  # the parent's database, embedded or not
        for i in range(self.count):
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", self.kind, "--config", self.config_path,
                                     "--port", str(port), "--host", self.host,
                                     "--worker-of", f"{self.front},{self.parent},{i}"], env=env)
            self.workers.append(Worker(i, f"{self.parent}-w{i}", f"http://{self.host}:{port}", proc))
        self._watch = asyncio.get_running_loop().create_task(self._watch_exits())

    async def _watch_exits(self) -> None:
        while True:
            for w in self.workers:
                if w.proc.poll() is not None and not w.recorded_gone:
                    await self._record_gone(w)
            await asyncio.sleep(WATCH_S)

    async def _record_gone(self, w: Worker) -> None:
        """A worker this process saw exit is gone for certain: it leaves the deployment now, not a lease later."""
        log.warning("%s worker %d (%s) exited with %s", self.kind, w.index, w.instance, w.proc.returncode)
        try:
            await self.store.append(AppendRequest((M.stop_event(self.kind, w.instance, f"exited {w.proc.returncode}"),)))
            w.recorded_gone = True
        except RollbookError as exc:  # the database is away: the next look records it
            log.warning("%s worker %s: exit not recorded: %s", self.kind, w.instance, exc.detail)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        for w in self.workers:
            try:
                await loop.run_in_executor(None, w.proc.wait, STOP_S)
            except subprocess.TimeoutExpired:
                w.proc.kill()


def serve_front(kind: Kind, config: Config, config_path: str, dsn: str) -> None:
    s = config.servers[kind]
    parent = instance_id(kind)
    store = PostgresEventStore.connect(dsn, writer=parent, pool=config.database_pool(dsn))
    reader = MembershipReader(store)
    workers = WorkerSet(kind, os.path.abspath(config_path), s.host, config.url(kind), parent, s.workers, dsn, store)
    peers = Peers(config.url(kind), kind)
    peers.source = lambda: reader.live_addresses(kind)
    front = Front(kind, peers, workers.running, config.limits.peer_timeouts())
    app = front_app(front, workers.start)

    async def stop(_app: object) -> None:
        await workers.stop()
        await store.close()

    app.on_cleanup.append(stop)
    run_bounded(app, s.bind or s.host, s.port, config.limits.server_limits())


__all__ = ["Worker", "WorkerSet", "serve_front"]
