"""The fault machine (testkit/stateful_processes.py) on hosts of their own (testkit/netns.py), with
partitions: each set of servers (one instance of every kind) runs in a network namespace with its own
address, PostgreSQL listens on an address of the machine's own, and two more rules cut one host off,
one direction, for a while, then heal:

- `partition_from_database`: a host's packets to PostgreSQL are dropped, for less than the fence of
  a lease (ridden out) or for longer than a lease (its instances stop by their own clock, the other
  host's instances take their work over from the log, and the stopped ones are started again);
- `partition_hosts`: one host's packets to the other are dropped (its calls to the other's instances
  fail and are asked again, or go to a live instance the log names).

On top of the machine's invariants: no instance wrote an event of a rollout after its lease ended on
the database's clock.
"""

from __future__ import annotations

import asyncio
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

LEASE_S = 3.0  # fenced at 2.4 s: a cut of HOLDS[1] outlives it, one of HOLDS[0] does not
HOLDS = (0.5, 4.0)
# Work of an instance that is gone, taken over from the log: calls recorded lost, rollouts recovered.
TAKEN_OVER = """
SELECT count(*) FROM rollbook.events WHERE rollout_id LIKE :p
AND (kind = 'rollout_recovered' OR (kind = 'call_failed' AND data->>'lost' = 'true'))
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

    def _held(self, host: Host, address: str, hold: float) -> None:
        host.cut(address)
        try:
            self.run(asyncio.sleep(hold))
        finally:
            host.heal(address)

    @rule(which=st.integers(0, INSTANCES - 1), hold=st.sampled_from(HOLDS))
    def partition_from_database(self, which: int, hold: float) -> None:
        self._live_now("partition_db")
        before = self.run(self._rows(TAKEN_OVER))[0][0]
        self._held(self.world.hosts[which], self.world.database_address, hold)
        stopped = self.world.dead(which)  # the instances that could not renew stopped by their own clock
        self._revive()
        taken = self.run(self._rows(TAKEN_OVER))[0][0] - before
        self.steps.append(f"cut host {which} from PostgreSQL for {hold} s" + (f", {','.join(stopped)} stopped" if stopped else ""))
        self._count("partition_db")
        self._count("heal")
        if stopped:
            self._count("partition_db_outlived_a_lease")
            TALLY["instances_stopped_by_their_lease"] = TALLY.get("instances_stopped_by_their_lease", 0) + len(stopped)
        if taken:
            self._count("takeovers")
            TALLY["work_taken_over"] = TALLY.get("work_taken_over", 0) + taken

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


__all__ = ["HOLDS", "LEASE_S", "HostedWorld", "PartitionMachine", "start_hosted_world", "tcp_database"]
