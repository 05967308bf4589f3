"""Which server processes are in the deployment: each records itself in the log and keeps a lease.

A server process (an *instance*) appends `instance_started` once it listens, naming its kind, its
instance id, the address the others reach it at and its worker count, then `instance_renewed`
every `lease_s * RENEW_SHARE` seconds. Its membership is one of:

- `stopped`: its last event is `instance_stopped` (a clean shutdown);
- `superseded`: a later instance of the same kind started at the same address. Only one process
  can listen on an address at a time, so the earlier one is gone, whatever its lease says; this is
  what lets a restarted server take over its predecessor's work at once instead of a lease later.
  A worker (one of `workers = N` processes behind one public address, apps/workers.py) is recorded
  like an instance at its own internal address, naming its `front` (the public address) and its
  `parent` (the process that serves that address and started it); its *site* is the front. A later
  start at a site by another parent supersedes every earlier one there, workers included: a new
  process holds that public address, so the old group is gone;
- `live`: its last event was recorded less than `lease_s` ago (the database's clock, both ends);
- `expired`: otherwise. An expired instance is dead to everyone: its work is taken over
  (engine/ownership.py) and a checkpoint no longer waits for it.

The `rollbook.participants` view shows the same states, computed by the same rule in SQL; a test
holds the two to agreement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine import catalog as ev
from engine.events import NewEvent
from engine.identity import instance_stream

State = Literal["live", "expired", "stopped", "superseded"]
DEFAULT_LEASE_S = 10.0
RENEW_SHARE = 1 / 3  # renewed three times a lease: two lost renewals in a row still leave it live
RETRY_SHARE = 1 / 10  # after a renewal that did not land, the next is tried sooner
# An instance judges its own lease by its own monotonic clock, never by the database's or another
# host's: the lease the database grants it lasts at least `lease_s` from the moment it *sent* its
# last renewal that landed (the renewal is recorded after it is sent), whatever the clocks read. It
# stops at this share of that, leaving the rest for stopping and for clock rates that differ.
FENCE_SHARE = 0.8


def fenced_at(renewal_sent: float, lease_s: float) -> float:
    """When an instance whose last renewal that landed was sent at `renewal_sent` (its own monotonic
    clock) must have stopped taking and doing work: before anyone can take its work over."""
    return renewal_sent + lease_s * FENCE_SHARE


@dataclass(frozen=True)
class Instance:
    kind: str
    instance: str
    address: str
    workers: int
    lease_s: float
    position: int  # of its instance_started: a later start at its address supersedes it
    started_at: float  # seconds since the epoch, the database's clock
    renewed_at: float  # its latest event's recorded_at
    stopped: bool = False
    front: str | None = None  # a worker's public address (the front that routes to it); None: its own
    parent: str | None = None  # the process that started this worker and serves `front`
    worker: int | None = None  # its index among the parent's workers

    @property
    def site(self) -> str:
        """Where it is reached from outside: one process at a time listens there."""
        return self.front or self.address

    @property
    def group(self) -> str:
        """The processes that come and go together at a site: a parent's workers, or one instance."""
        return self.parent or self.instance


@dataclass(frozen=True)
class Member:
    instance: Instance
    state: State

    @property
    def live(self) -> bool:
        return self.state == "live"


@dataclass(frozen=True)
class WorkerOf:
    """What a worker records beside its own address: the front it serves behind, the parent, its index."""

    front: str
    parent: str
    worker: int


def start_event(kind: str, instance: str, address: str, workers: int, lease_s: float,
                of: WorkerOf | None = None) -> NewEvent:
    if lease_s <= 0:
        raise ValueError(f"a lease must be positive, got {lease_s}")
    data: dict[str, Any] = {"kind": kind, "instance": instance, "address": address, "workers": workers, "lease_s": lease_s}
    if of is not None:
        data |= {"front": of.front, "parent": of.parent, "worker": of.worker}
    return NewEvent(instance_stream(kind, instance), ev.INSTANCE_STARTED, data)


def renew_event(kind: str, instance: str) -> NewEvent:
    return NewEvent(instance_stream(kind, instance), ev.INSTANCE_RENEWED, {})


def stop_event(kind: str, instance: str, reason: str) -> NewEvent:
    return NewEvent(instance_stream(kind, instance), ev.INSTANCE_STOPPED, {"reason": reason})


def from_started(data: dict[str, Any], position: int, started_at: float, last_kind: str, last_at: float) -> Instance:
    """One instance from its instance_started event and the latest event of its stream."""
    worker = data.get("worker")
    return Instance(str(data["kind"]), str(data["instance"]), str(data["address"]), int(data["workers"]),
                    float(data["lease_s"]), position, started_at, last_at, last_kind == ev.INSTANCE_STOPPED,
                    data.get("front"), data.get("parent"), None if worker is None else int(worker))


def members(instances: Iterable[Instance], now: float) -> list[Member]:
    """Every recorded instance with its state at `now` (the database's clock), oldest first."""
    ordered = sorted(instances, key=lambda i: i.position)
    later: dict[tuple[str, str], set[str]] = {}  # the groups that started at a site after the one at hand
    superseded = set()
    for i in reversed(ordered):
        seen = later.setdefault((i.kind, i.site), set())
        if seen - {i.group}:
            superseded.add(i.position)
        seen.add(i.group)
    out = []
    for i in ordered:
        state: State
        if i.stopped:
            state = "stopped"
        elif i.position in superseded:
            state = "superseded"
        elif i.renewed_at + i.lease_s > now:
            state = "live"
        else:
            state = "expired"
        out.append(Member(i, state))
    return out


def live_ids(found: Sequence[Member], kind: str | None = None) -> frozenset[str]:
    return frozenset(m.instance.instance for m in found if m.live and (kind is None or m.instance.kind == kind))


__all__ = ["DEFAULT_LEASE_S", "RENEW_SHARE", "Instance", "Member", "State", "WorkerOf", "from_started", "live_ids",
           "members", "renew_event", "start_event", "stop_event"]
