"""A resources server holding live NeMo Gym sessions, on a host of its own, cut off from PostgreSQL.

Two resources instances run on two hosts of their own (testkit/netns.py), each starting its own
NeMo Gym 0.7.0 Workplace Assistant server, unchanged, beside it on that host; the environment, agent
and model servers run on the machine's own address. Mid-collection the host holding sessions that
already applied tool calls is cut off from PostgreSQL: its resources server cannot renew its lease,
stops by its own clock before the lease ends (and its Workplace server with it), and the other
instance takes those sessions over from the log, replaying their recorded calls into its own
Workplace server. Read back through SQL: every rollout ends with the reward and the tool calls of an
uninterrupted run, no tool call was applied twice in any one live session, a session of the cut
host was replayed by the other, and the cut instance wrote nothing after its lease ended.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest

from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from apps.serve import LEASE_LOST_EXIT
from testkit.netns import Hosts, unavailable
from testkit.stateful_partitions import AFTER_LEASE
from tests.e2e.conftest import Cluster, assert_invariants
from tests.e2e.test_nemo_gym_resources import (
    TWICE_IN_ONE_LIVE_SESSION,
    example_tasks,
    gym,
    gym_python,
    outcomes,
)
from tests.e2e.test_partitions import hosts, tcp_dsn
from tests.waiting import eventually

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(unavailable() is not None, reason=f"hosts of their own: {unavailable()}")]
ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 5.0  # short enough to wait out, long enough that a loaded machine renews in time
__all__ = ["gym_python", "hosts", "tcp_dsn"]  # fixtures, used by name

LIVE_RESOURCES = "SELECT count(*) FROM rollbook.participants WHERE kind = 'resources' AND state = 'live'"
# The instance (and its address) that recorded the run's first applied tool call.
FIRST_MUTATOR = """
SELECT p.instance, p.address FROM rollbook.events e JOIN rollbook.participants p ON p.instance = e.writer
WHERE e.kind = 'mutation_applied' AND e.rollout_id LIKE :p ORDER BY e.position LIMIT 1
"""
# Sessions a stopped instance had applied tool calls in, replayed by another instance afterwards.
REPLAYED_ELSEWHERE = """
SELECT DISTINCT r.rollout_id FROM rollbook.events r
WHERE r.kind = 'session_replayed' AND r.rollout_id LIKE :p AND r.writer <> :cut
AND jsonb_array_length(r.data->'tool_calls') > 0
AND EXISTS (SELECT 1 FROM rollbook.events m WHERE m.kind = 'mutation_applied' AND m.writer = :cut
            AND m.rollout_id = r.rollout_id AND m.position < r.position)
"""


async def test_a_resources_server_cut_off_from_postgresql_hands_its_workplace_sessions_over_applying_nothing_twice(
        hosts: Hosts, tcp_dsn: str, gym_python: Path, tmp_path: Path) -> None:
    dsn = tcp_dsn
    placed = [hosts.add("r0"), hosts.add("r1")]
    port, gym_port = free_port(), free_port()  # the same on both hosts: each has ports of its own
    servers = {k: cfg.ServerConfig(port=free_port(), host=hosts.gateway, token_latency_s=0.01 if k == "model" else 0.0)
               for k in cfg.KINDS}
    config = cfg.Config(dsn=dsn, control_token=secrets.token_hex(12), data_token=secrets.token_hex(12), servers=servers,
                        nemo_gym={"gym_workplace": gym(gym_python, "replay", gym_port)},
                        limits=cfg.LimitsConfig(instance_lease_s=LEASE_S))
    work = Path(tempfile.mkdtemp(prefix="rbgympart-", dir=tmp_path))
    path = work / "rollbook.toml"
    cfg.write(config, path)
    print(f"server logs: {work}")
    rest = ServerProcesses(config, path, work)
    resources: list[subprocess.Popen[bytes]] = []
    store = PostgresEventStore.connect(dsn, writer="gym-partition-test")
    session = aiohttp.ClientSession()
    try:
        for host in placed:
            resources.append(host.run([sys.executable, "-m", "apps.cli", "serve", "resources", "--config", str(path),
                                       "--host", host.address, "--port", str(port)],
                                      stdout=open(work / f"{host.name}.log", "wb"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))
        await asyncio.to_thread(rest.start, 90.0, ("environment", "model", "agent"))
        c = Cluster(config, rest, store, session, work)
        async def both_live() -> bool:
            return bool(await c.scalar(LIVE_RESOURCES) == 2)

        await eventually("both resources instances live", both_live, timeout=60)
        tasks = example_tasks(gym_python, "gym_workplace")

        base = c.collection("base", tasks, seed=5)
        await asyncio.wait_for(base.dispatch(session), 300)
        uninterrupted = await outcomes(c, base)
        assert sum(len(calls) for _, calls in uninterrupted.values()) >= 5

        coll = c.collection("gym", tasks, seed=5)
        run = asyncio.create_task(coll.dispatch(session))
        first = await eventually("a tool call applied", lambda: c.rows(FIRST_MUTATOR, p="gym-%"), timeout=120)
        cut_instance, address = first[0].instance, first[0].address
        which = next(i for i, h in enumerate(placed) if f"//{h.address}:" in address)
        placed[which].cut(hosts.extra[0])  # its packets to PostgreSQL vanish; everything else still reaches it
        await asyncio.to_thread(resources[which].wait, 30)
        log = (work / f"{placed[which].name}.log").read_text()
        assert resources[which].returncode == LEASE_LOST_EXIT and "renewed no lease" in log, log[-2000:]

        await asyncio.wait_for(run, 300)
        await asyncio.wait_for(coll.dispatch(session), 300)  # whatever the cut ended early, to its end
        figures = await assert_invariants(c, coll)
        assert await outcomes(c, coll) == uninterrupted
        assert not await c.rows(TWICE_IN_ONE_LIVE_SESSION, p="gym-%")
        replayed = await c.rows(REPLAYED_ELSEWHERE, p="gym-%", cut=cut_instance)
        assert replayed, "no session of the cut instance was replayed by the other"
        assert not await c.rows(AFTER_LEASE, p="gym-%")
        print(f"NEMO_GYM_PARTITION {figures}, host {placed[which].name} cut, "
              f"{len(replayed)} of its sessions replayed by the other instance")
    finally:
        for proc in resources:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await asyncio.to_thread(rest.stop)
        await session.close()
        await store.close()
