"""The fault machine (testkit/stateful_processes.py) on hosts of their own (testkit/netns.py), with
partitions: each set of servers (one instance of every kind) runs in a network namespace with its own
address, PostgreSQL listens on an address of the machine's own, and two more rules cut one host off,
one direction, for a while, then heal:

- `partition_from_database`: a host's packets to PostgreSQL are dropped, for less than the fence of
  a lease (mostly ridden out; a renewal it caught may land only after TCP's retransmission backoff,
  too late) or for longer than a lease (its instances stop by their own clock and are started again
  as new instances; those, or the other host's, take their work over from the log);
- `partition_hosts`: one host's packets to the other are dropped (its calls to the other's instances
  fail and are asked again, or go to a live instance the log names).

On top of the machine's invariants: no instance wrote an event of a rollout after its lease ended on
the database's clock. At the end of each sequence it counts the takeovers: for every instance a cut
stopped, the rollouts whose work of its kind another instance went on with from the log (and the
model calls recorded lost because the instance that had them was gone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import rule
from sqlalchemy.engine import make_url

from adapters import database
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from testkit import pg
from testkit.netns import Host, Hosts
from testkit.stateful_processes import INSTANCES, TALLY, FaultMachine, World

LEASE_S = 5.0  # fenced at 4 s: a cut of HOLDS[1] outlives it, one of HOLDS[0] does not. Shorter leases
# fenced healthy servers in the full suite, where a real vLLM shares the same 2 cores
HOLDS = (0.5, 6.0)
# The instances live on one host now (by the address they serve at).
LIVE_ON_HOST = "SELECT instance FROM rollbook.participants WHERE state = 'live' AND address LIKE :at"
# Per kind, the rollouts an instance that stopped had work of, which another instance of its kind
# went on with: an event of the rollout by the other, after the stopped one's last. (A model call is
# answered by whichever instance routing picks, so for the model a takeover is a call recorded lost.)
TAKEN_OVER = """
SELECT s.kind, count(DISTINCT e.rollout_id) AS rollouts FROM rollbook.participants s
JOIN rollbook.events e ON e.rollout_id LIKE :p AND e.writer <> s.instance
JOIN rollbook.participants o ON o.instance = e.writer AND o.kind = s.kind
WHERE s.instance = ANY(:stopped) AND s.kind <> 'model'
AND e.position > (SELECT max(x.position) FROM rollbook.events x WHERE x.writer = s.instance AND x.rollout_id = e.rollout_id)
GROUP BY s.kind
"""
CALLS_LOST = """
SELECT count(*) FROM rollbook.events f JOIN rollbook.events a ON a.stream = f.stream AND a.kind = 'call_accepted'
WHERE f.rollout_id LIKE :p AND f.kind = 'call_failed' AND f.data->>'lost' = 'true' AND a.data->>'instance' = ANY(:stopped)
"""
# Events of a rollout written by an instance after its lease ended on the database's clock.
AFTER_LEASE = """
SELECT e.position, e.writer, e.kind FROM rollbook.events e JOIN rollbook.participants p ON p.instance = e.writer
WHERE e.rollout_id LIKE :p AND e.recorded_at > p.renewed_at + make_interval(secs => p.lease_s)
"""


def tcp_database(hosts: Hosts, name: str) -> tuple[str, Callable[[], None], Callable[[], None]]:
    """A PostgreSQL server of the caller's own, listening on `hosts.extra[0]` for the hosts: the DSN
    (over TCP), a restart (every connection dropped) and a stop."""
    server, restart = pg.restartable_server(listen=hosts.extra[0], trust=f"{hosts.net}.0/24")
    local = database.scratch_database(server.admin_dsn, name)
    port = make_url(local).port or 5432

    def stop() -> None:
        for each in server.stop:
            each()

    return f"postgresql://postgres@{hosts.extra[0]}:{port}/{name}", restart, stop


@dataclass
class HostedWorld(World):
    hosts: list[Host] = field(default_factory=list)  # one per set of servers
    database_address: str = ""


def start_hosted_world(hosts: Hosts, dsn: str, restart_db: Any, work: Path, token_latency_s: float = 0.015) -> HostedWorld:
    work.mkdir(parents=True, exist_ok=True)
    sets, placed = [], []
    for which in range(INSTANCES):
        host = hosts.add(f"h{which}")
        placed.append(host)
        servers = {k: cfg.ServerConfig(port=free_port(), host=host.address,
                                       token_latency_s=token_latency_s if k == "model" else 0.0) for k in cfg.KINDS}
        config = cfg.Config(dsn=dsn, control_token="faults-c0ntrol", data_token="faults-d4ta", servers=servers,
                            sandbox=cfg.SandboxConfig(),
                            limits=cfg.LimitsConfig(processes=len(cfg.KINDS) * INSTANCES + 3, instance_lease_s=LEASE_S))
        path = work / ("rollbook.toml" if which == 0 else f"rollbook-{which}.toml")
        cfg.write(config, path)
        sets.append(ServerProcesses(config, path, work, name="" if which == 0 else f"i{which}-",
                                    launch=host.enter))
    world = HostedWorld(dsn, restart_db, sets[0].config, sets[0].config_path, sets, placed, hosts.extra[0])
    world.revive()
    return world


class PartitionMachine(FaultMachine):
    world: HostedWorld

    def __init__(self) -> None:
        super().__init__()
        self.stopped: set[str] = set()  # instances a cut from PostgreSQL stopped, by their lease

    def _held(self, host: Host, address: str, hold: float) -> None:
        host.cut(address)
        try:
            self.run(asyncio.sleep(hold))
        finally:
            host.heal(address)

    @rule(which=st.integers(0, INSTANCES - 1), hold=st.sampled_from(HOLDS))
    def partition_from_database(self, which: int, hold: float) -> None:
        self._live_now("partition_db")
        host = self.world.hosts[which]
        there = [r.instance for r in self.run(self._rows(LIVE_ON_HOST, at=f"%//{host.address}:%"))]
        cut_at = time.monotonic()
        self._held(host, self.world.database_address, hold)
        # A renewal the cut caught may land only after TCP's retransmission backoff (0.2, 0.6, 1.4 s
        # after its send), past the heal, and its instance stops if that is past its fence: so a short
        # cut can stop an instance too, up to a fence after the cut began. Wait that out, then look.
        self.run(asyncio.sleep(max(0.0, cut_at + LEASE_S + 0.5 - time.monotonic())))
        stopped = self.world.dead(which)  # the instances that could not renew stopped by their own clock
        if stopped:
            # Which of the host's instances they were: the fresh ones started below are live instead.
            still = {r.instance for r in self.run(self._rows(LIVE_ON_HOST, at=f"%//{host.address}:%"))}
            self.stopped.update(i for i in there if i not in still)
        self._revive()
        self.steps.append(f"cut host {which} from PostgreSQL for {hold} s" + (f", {','.join(stopped)} stopped" if stopped else ""))
        self._count("partition_db")
        self._count("heal")
        if stopped:
            self._count("partition_db_outlived_a_lease" if hold >= LEASE_S else "partition_db_short_stopped_some")
            TALLY["instances_stopped_by_their_lease"] = TALLY.get("instances_stopped_by_their_lease", 0) + len(stopped)

    @rule(which=st.integers(0, INSTANCES - 1), hold=st.sampled_from(HOLDS))
    def partition_hosts(self, which: int, hold: float) -> None:
        self._live_now("partition_hosts")
        other = self.world.hosts[(which + 1) % INSTANCES]
        self._held(self.world.hosts[which], other.address, hold)
        self.steps.append(f"cut host {which} from host {(which + 1) % INSTANCES} for {hold} s")
        self._count("partition_hosts")
        self._count("heal")

    async def _check(self) -> None:
        await super()._check()
        rows = await self._rows(AFTER_LEASE)
        assert not rows, f"events written after their writer's lease ended: {rows[:5]} after {self.steps}"

    async def _finish(self) -> None:
        await super()._finish()
        taken = {r.kind: r.rollouts for r in await self._rows(TAKEN_OVER, stopped=sorted(self.stopped))}
        lost = (await self._rows(CALLS_LOST, stopped=sorted(self.stopped)))[0][0]
        if lost:
            taken["model"] = lost
        for kind, n in taken.items():
            TALLY[f"taken_over_{kind}"] = TALLY.get(f"taken_over_{kind}", 0) + n
        if taken:
            self._count("takeovers")


__all__ = ["HOLDS", "LEASE_S", "HostedWorld", "PartitionMachine", "start_hosted_world", "tcp_database"]
