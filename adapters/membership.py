"""Instances in the log: a server's lease on its membership, and who is live (engine/membership.py).

`Lease` is held by one server process: it records the instance once the process listens, renews it
every `lease_s * RENEW_SHARE` seconds from a background task and records the stop at a clean
shutdown. `MembershipReader` answers who is in the deployment, from the instance streams and the
database's clock, for the ownership rule (engine/ownership.py) and for the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence

from sqlalchemy import text

from adapters.postgres import PostgresEventStore, retrying
from engine import catalog as ev
from engine import membership as M
from engine.errors import RollbookError
from engine.events import AppendRequest
from engine.identity import checkpoint_stream

log = logging.getLogger(__name__)

_MEMBERS = text(
    "SELECT st.position, st.data, extract(epoch FROM st.recorded_at) AS started_at, last.kind AS last_kind, "
    "extract(epoch FROM last.recorded_at) AS last_at, extract(epoch FROM now()) AS now "
    "FROM rollbook.events st JOIN rollbook.stream_heads h ON h.stream = st.stream "
    "JOIN rollbook.events last ON last.stream = h.stream AND last.stream_version = h.version "
    "WHERE st.kind = :started")


class MembershipReader:
    def __init__(self, store: PostgresEventStore) -> None:
        self.store = store

    @retrying("reading the deployment's instances")
    async def members(self) -> list[M.Member]:
        async with self.store.engine.connect() as conn:
            rows = (await conn.execute(_MEMBERS, {"started": ev.INSTANCE_STARTED})).all()
        now = float(rows[0].now) if rows else 0.0
        return M.members((M.from_started(r.data, r.position, float(r.started_at), r.last_kind, float(r.last_at))
                          for r in rows), now)

    async def live(self, kind: str) -> frozenset[str]:
        return M.live_ids(await self.members(), kind)

    async def live_addresses(self, kind: str) -> list[str]:
        return [m.instance.address for m in await self.members() if m.live and m.instance.kind == kind]

    async def live_workers(self, parent: str) -> list[M.Instance]:
        """The live workers a front's process started (apps/workers.py)."""
        return [m.instance for m in await self.members() if m.live and m.instance.parent == parent]

    async def live_members(self, kinds: Sequence[str] | None = None) -> list[M.Instance]:
        return [m.instance for m in await self.members() if m.live and (kinds is None or m.instance.kind in kinds)]


class Lease:
    """One server process's membership, from its first renewal to its stop.

    Cut off from the database past `engine.membership.fenced_at` by its own clock, the process can no
    longer know that nobody has taken its work over: `on_lapse` is called (the server exits there,
    apps/serve.py) and nothing is renewed again under this instance."""

    def __init__(self, store: PostgresEventStore, kind: str, instance: str, address: str, workers: int = 1,
                 lease_s: float = M.DEFAULT_LEASE_S, of: M.WorkerOf | None = None,
                 on_lapse: Callable[[float], None] | None = None) -> None:
        self.store, self.kind, self.instance = store, kind, instance
        self.address, self.workers, self.lease_s, self.of = address, workers, lease_s, of
        self.on_lapse = on_lapse
        self._task: asyncio.Task[None] | None = None
        self.renewal_sent = 0.0  # monotonic: when the last renewal that landed was sent

    async def start(self) -> None:
        """Record the instance (its stream must be new: an instance id is used once) and keep it renewed."""
        event = M.start_event(self.kind, self.instance, self.address, self.workers, self.lease_s, self.of)
        sent = time.monotonic()
        await self.store.append(AppendRequest((event,), {event.stream: 0}))
        self.renewal_sent = sent
        self._task = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        every, retry = self.lease_s * M.RENEW_SHARE, self.lease_s * M.RETRY_SHARE
        wait = every
        while True:
            fence = M.fenced_at(self.renewal_sent, self.lease_s)
            await asyncio.sleep(max(0.0, min(wait, fence - time.monotonic())))
            sent = time.monotonic()
            if sent < fence:
                try:
                    # Never waits past the fence: a renewal lost in a partition is given up on in time.
                    await asyncio.wait_for(self.store.append(AppendRequest((M.renew_event(self.kind, self.instance),))),
                                           timeout=fence - sent)
                    self.renewal_sent, wait = sent, every
                    continue
                except (RollbookError, TimeoutError) as exc:  # the database is away: tried again sooner
                    detail = exc.detail if isinstance(exc, RollbookError) else "no answer in time"
                    log.warning("instance %s: lease not renewed: %s", self.instance, detail)
                    wait = retry
            if time.monotonic() >= M.fenced_at(self.renewal_sent, self.lease_s):
                silent = time.monotonic() - self.renewal_sent
                log.error("instance %s: no renewal landed for %.1f s of a %g s lease: it stops", self.instance,
                          silent, self.lease_s)
                if self.on_lapse is not None:
                    self.on_lapse(silent)
                return

    async def stop(self, reason: str = "shutdown") -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        with contextlib.suppress(RollbookError):  # not recorded: the lease simply runs out
            await self.store.append(AppendRequest((M.stop_event(self.kind, self.instance, reason),)))




_PAUSED_OPEN = text(
    "SELECT EXISTS (SELECT 1 FROM rollbook.checkpoint_state c JOIN rollbook.events e "
    "ON e.stream = :prefix || c.checkpoint_id AND e.stream_version = 1 "
    "WHERE c.phase = ANY(:open) AND e.data->>'mode' IS DISTINCT FROM 'online' "
    # Judged on the database's clock at both ends (its start's recorded_at and now()), by the span the
    # coordinator gave it: a coordinator whose clock is behind never makes it look over early.
    "AND CASE WHEN e.data ? 'span_s' THEN e.recorded_at + make_interval(secs => (e.data->>'span_s')::double precision) > now() "
    "ELSE COALESCE((e.data->>'deadline')::double precision, 'infinity') > extract(epoch FROM now()) END "
    # A resume ends the pause for everyone, whether or not the commit was recorded.
    "AND NOT EXISTS (SELECT 1 FROM rollbook.events r WHERE r.kind = :resumed AND r.data->>'checkpoint_id' = c.checkpoint_id))")


@retrying("reading open checkpoints")
async def paused_checkpoint_open(store: PostgresEventStore) -> bool:
    """Whether a paused checkpoint is being prepared now (started or prepared, within its deadline,
    no participant resumed from it yet): an instance that joins meanwhile stays closed until it ends."""
    async with store.engine.connect() as conn:
        return bool((await conn.execute(_PAUSED_OPEN, {"prefix": checkpoint_stream(""),
                                                        "open": ["started", "prepared"],
                                                        "resumed": ev.PARTICIPANT_RESUME})).scalar())


def discard_unsent() -> None:
    """Make every socket of this process close with a reset, its unsent data thrown away, when the
    process exits. Called by an instance that stops because it lost its lease: an append it sent into
    a partition sits in its kernel's send buffer, and the kernel would go on retransmitting it after
    the process is gone, to be written once the network heals, after the lease ended and another
    instance took the work over (seen: an agent turn recorded twice)."""
    linger_off = struct.pack("ii", 1, 0)
    for fd in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(fd))
        except (OSError, ValueError):
            continue  # not a socket, or already closed
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_off)
        except OSError:
            pass
        finally:
            sock.detach()  # the fd stays open: it closes, with a reset, when the process exits


__all__ = ["Lease", "MembershipReader", "discard_unsent", "paused_checkpoint_open"]
