"""Instances on hosts of their own (testkit/netns.py): each model server in a network namespace with
its own address, PostgreSQL listening on an address of the machine's own, and partitions made as
rules on one host's link.

A model server cut off from PostgreSQL with a generation in flight can no longer renew its lease,
and no longer know whether another instance took its work over. It stops, by its own clock, before
its lease ends in the database: before anyone can take its call over. Then another instance takes
the call over: its reply was never recorded, so the call is recorded lost, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import apps.config as cfg
from adapters import database
from adapters.participant_client import HttpParticipant
from adapters.postgres import PostgresEventStore
from apps.serve import LEASE_LOST_EXIT
from engine.catalog import ATTEMPT_STARTED
from engine.coordinator import Coordinator
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream
from testkit import programs
from testkit.checkpoint_rules import PAUSED
from testkit.log_queries import tracebacks
from testkit.netns import Host, Hosts, unavailable
from testkit.stateful_partitions import HOLDS, HostedWorld, PartitionMachine, start_hosted_world, tcp_database
from testkit.stateful_processes import TALLY
from tests.waiting import eventually

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(unavailable() is not None, reason=f"hosts of their own: {unavailable()}")]
ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 5.0  # short enough to wait out, long enough that a loaded machine renews in time
PORT = 8300


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with Hosts() as made:
        yield made


@pytest.fixture
def tcp_dsn(hosts: Hosts) -> Iterator[str]:
    """A PostgreSQL server of this test's own, which the hosts reach on `hosts.extra[0]`."""
    dsn, _, stop = tcp_database(hosts, "rollbook_hosts")
    yield dsn
    stop()


def serve_model(host: Host, config_path: Path, log: Path, skew_s: float = 0.0) -> subprocess.Popen[bytes]:
    """A model server on `host`, its wall clock `skew_s` seconds off (testkit/clock_skew)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if skew_s:
        env.update(PYTHONPATH=str(ROOT / "testkit" / "clock_skew"), ROLLBOOK_TEST_CLOCK_SKEW_S=str(skew_s))
    return host.run([sys.executable, "-m", "apps.cli", "serve", "model", "--config", str(config_path), "--host",
                     host.address, "--port", str(PORT)], stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                    start_new_session=True, cwd=ROOT, env=env)


def model_config(hosts: Hosts, remote: str, path: Path) -> cfg.Config:
    servers = {k: cfg.ServerConfig(port=PORT, host=hosts.gateway) for k in cfg.KINDS}
    servers["model"] = cfg.ServerConfig(port=PORT, host=hosts.gateway, token_latency_s=0.15)
    config = cfg.Config(dsn=remote, control_token=secrets.token_hex(12), data_token=secrets.token_hex(12),
                        servers=servers, limits=cfg.LimitsConfig(instance_lease_s=LEASE_S))
    cfg.write(config, path)
    return config


LIVE_MODELS = "SELECT count(*) FROM rollbook.participants WHERE kind = 'model' AND state = 'live'"


async def scalar(store: PostgresEventStore, sql: str, **params: Any) -> Any:
    from sqlalchemy import text

    async with store.engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar()


@contextlib.asynccontextmanager
async def two_model_servers(hosts: Hosts, dsn: str, tmp_path: Path, names: tuple[str, str], skews: tuple[float, float] = (0.0, 0.0),
                            ) -> AsyncIterator[tuple[cfg.Config, PostgresEventStore, list[Host], list[subprocess.Popen[bytes]]]]:
    """A model server on each of two new hosts (wall clocks `skews` off), both live in the log."""
    placed = [hosts.add(name) for name in names]
    path = tmp_path / "rollbook.toml"
    config = model_config(hosts, dsn, path)
    store = PostgresEventStore.connect(dsn, writer="partition-test")
    procs = [serve_model(h, path, tmp_path / f"{h.name}.log", skew) for h, skew in zip(placed, skews, strict=True)]
    try:
        await eventually("both instances live", lambda: equals(scalar(store, LIVE_MODELS), 2), timeout=60)
        yield config, store, placed, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await store.close()


async def cut_from_the_database(hosts: Hosts, host: Host, proc: subprocess.Popen[bytes], store: PostgresEventStore,
                                log: Path) -> float:
    """Cut `host` off from PostgreSQL: its server exits on losing its lease, before that lease ends on
    the database's clock (before anyone could take its work over). When it stopped."""
    host.cut(hosts.extra[0])  # its packets to PostgreSQL are dropped; everything else still reaches it
    await asyncio.to_thread(proc.wait, 30)
    stopped = time.time()
    assert proc.returncode == LEASE_LOST_EXIT, log.read_text()[-2000:]
    assert "renewed no lease" in log.read_text()
    lease_end = await scalar(store, "SELECT extract(epoch FROM renewed_at) + lease_s FROM rollbook.participants "
                                    "WHERE kind = 'model' AND address LIKE :a", a=f"%{host.address}%")
    assert lease_end is not None and stopped < float(lease_end), (stopped, lease_end)
    return stopped


async def test_a_model_server_cut_off_from_postgresql_stops_before_another_takes_its_call_over(
        hosts: Hosts, tcp_dsn: str, tmp_path: Path) -> None:
    async with two_model_servers(hosts, tcp_dsn, tmp_path, ("a", "b")) as (config, store, (a, b), procs):
        await store.append(AppendRequest((NewEvent(rollout_stream("p1"), ATTEMPT_STARTED, {"parent_attempt": None}, "p1", 0),)))
        body = {"model": "policy", "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
        headers = {"Authorization": f"Bearer {config.data_token}", "X-Rollbook-Call-Id": "p1.0.t0"}
        route = "/rollouts/p1/attempts/0/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            on_a = asyncio.create_task(http.post(f"http://{a.address}:{PORT}{route}", json=body, headers=headers))
            await eventually("the call accepted by a", lambda: scalar(
                store, "SELECT count(*) = 1 FROM rollbook.events WHERE kind = 'call_accepted' AND data->>'call_id' = 'p1.0.t0'"))

            a_stopped = await cut_from_the_database(hosts, a, procs[0], store, tmp_path / "a.log")
            with pytest.raises((aiohttp.ClientError, OSError)):  # its generation ended with it
                await (await on_a).read()

            # The call asked again of b: a is dead to everyone now, so b takes the call over. Its reply
            # was never recorded: b records the call lost, once, and the attempt goes on as a new one.
            async with http.post(f"http://{b.address}:{PORT}{route}", json=body, headers=headers) as resp:
                reply = json.loads(await resp.text())
                assert (resp.status, reply["error"]["code"]) == (409, "attempt_lost"), reply
        taken = await scalar(store, "SELECT json_agg(json_build_array(kind, data->>'lost', extract(epoch FROM recorded_at))) "
                                    "FROM rollbook.events WHERE data->>'call_id' = 'p1.0.t0' AND kind <> 'call_accepted'")
        assert [(kind, lost) for kind, lost, _ in taken] == [("call_failed", "true")], taken
        assert a_stopped < taken[0][2], (a_stopped, taken)


async def test_a_server_started_on_a_host_cut_off_from_postgresql_says_so_within_the_connect_timeout(
        hosts: Hosts, tcp_dsn: str, tmp_path: Path) -> None:
    """Input: `rollbook serve model` on a host whose packets to PostgreSQL are dropped. Without a
    connect timeout the kernel's own retries held it about two minutes, saying nothing."""
    host = hosts.add("cut")
    path = tmp_path / "rollbook.toml"
    model_config(hosts, tcp_dsn, path)
    host.cut(hosts.extra[0])
    started = time.monotonic()
    proc = serve_model(host, path, tmp_path / "cut.log")
    try:
        await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - started
    out = (tmp_path / "cut.log").read_text()
    assert proc.returncode == 2 and "cannot connect to PostgreSQL" in out and "timeout" in out, out[-1500:]
    assert took < database.CONNECT_TIMEOUT_S + 30, took  # the timeout, Python's start, slack for a loaded machine


# A process of the framework's (an event store, as `rollbook run` holds one) on a host: it appends
# once, says "ready", and when told, appends again and prints what that append ended with, and when.
STORE_CLIENT = """
import asyncio, json, sys, time
from adapters.postgres import PostgresEventStore
from engine.catalog import ATTEMPT_STARTED
from engine.errors import RollbookError
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream

def started(rid):
    return AppendRequest((NewEvent(rollout_stream(rid), ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),))

async def main():
    store = PostgresEventStore.connect(sys.argv[1], writer="cut-client")
    await store.append(started("c1"))
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    t0 = time.monotonic()
    try:
        await store.append(started("c2"))
        code = None
    except RollbookError as exc:
        code = exc.code
    print(json.dumps({"code": code, "seconds": time.monotonic() - t0}), flush=True)
    await store.close()

asyncio.run(main())
"""
PATIENCE_S = 3.0
# A process that stops with a commit in flight into a partition (as an instance that lost its lease
# stops mid-append): its transaction's statements went through, its COMMIT was sent into the cut, then
# the process is gone; with `discard` it exits as a lease's stop exits it.
STOPS_MID_COMMIT = """
import os, sys, threading, time
import psycopg
from adapters.database import connect_options, libpq_dsn
from adapters.membership import discard_unsent

dsn, mode = sys.argv[1], sys.argv[2]
conn = psycopg.connect(libpq_dsn(dsn), **connect_options(dsn))
conn.execute("CREATE TABLE IF NOT EXISTS zombie_probe (mode text)")
conn.commit()
conn.execute("INSERT INTO zombie_probe VALUES (%s)", (mode,))
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=conn.commit, daemon=True).start()
time.sleep(1.0)  # the COMMIT is sent, and held back by the cut
if mode == "discard":
    discard_unsent()
os._exit(75)
"""


async def test_an_append_on_a_host_cut_off_from_postgresql_reports_the_database_unavailable_within_seconds(
        hosts: Hosts, tcp_dsn: str) -> None:
    """Input: an event store whose pooled connection to PostgreSQL is open when the host's packets to
    it start vanishing. Its next append is answered `database_unavailable` within the connection's
    timeout and the store's patience; without a TCP user timeout the query waited on the kernel's
    retransmissions, about 15 minutes."""
    host = hosts.add("framework")
    env = {**os.environ, "ROLLBOOK_DB_PATIENCE_S": str(PATIENCE_S), "PYTHONUNBUFFERED": "1"}
    proc = host.run([sys.executable, "-c", STORE_CLIENT, tcp_dsn], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == b"ready"
        host.cut(hosts.extra[0])
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        out, _ = await asyncio.to_thread(proc.communicate, None, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["code"] == "database_unavailable", out.decode()[-1500:]
    assert result["seconds"] < database.CONNECT_TIMEOUT_S + PATIENCE_S + 10, result


async def test_a_commit_sent_into_a_partition_by_a_process_that_stops_never_lands_after_the_heal(
        hosts: Hosts, tcp_dsn: str) -> None:
    """Input: a process whose COMMIT to PostgreSQL is caught by a cut, which then exits (as an
    instance that lost its lease exits), and the cut healed after. Plainly exited, its kernel went on
    retransmitting the COMMIT and PostgreSQL committed after the heal: the control below shows it on
    this machine (the random partitions found it as an agent turn written twice, the dead instance's
    append landing after another had taken the turn over). Exited the way a lease's stop exits
    (`discard_unsent`), nothing lands."""
    landed = "SELECT count(*) FROM zombie_probe WHERE mode = :r"
    store = PostgresEventStore.connect(tcp_dsn, writer="partition-test")
    try:
        for mode in ("plain", "discard"):
            host = hosts.add(mode)
            proc = host.run([sys.executable, "-c", STOPS_MID_COMMIT, tcp_dsn, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
            assert proc.stdin is not None and proc.stdout is not None
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == b"ready", proc.stdout.read()
            host.cut(hosts.extra[0])
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            assert await asyncio.to_thread(proc.wait, 30) == 75
            host.heal(hosts.extra[0])
            if mode == "plain":  # the hazard is real here: the dead process's append lands after the heal
                await eventually("the plain exit's append to land", lambda: scalar(store, landed, r="plain"), timeout=30)
            else:
                await asyncio.sleep(15)  # past every retransmission the kernel would make (tcp_user_timeout)
                assert await scalar(store, landed, r="discard") == 0
    finally:
        await store.close()


async def equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


SKEW_S = 30.0  # six leases, and three times a checkpoint's deadline


async def test_model_servers_whose_clocks_are_a_minute_apart_keep_their_leases_and_take_part_in_a_checkpoint(
        hosts: Hosts, tcp_dsn: str, tmp_path: Path) -> None:
    """Input: one host's clock 30 s ahead of the machine's, another's 30 s behind (a minute apart),
    against a 5 s lease and a checkpoint whose deadline is 10 s away by the coordinator's clock.
    Leases are judged on the database's clock at both ends, so neither instance ever reads expired;
    a deadline travels with the coordinator's clock reading and is judged as the span it grants, so
    the host ahead prepares rather than finding it long past, and the host behind does not hold its
    pause 30 s past it. A cut-off host still stops by its own clock before its lease ends."""
    async with two_model_servers(hosts, tcp_dsn, tmp_path, ("ahead", "behind"), (+SKEW_S, -SKEW_S)) as (
            config, store, (a, b), procs):
        async with aiohttp.ClientSession() as http:
            ours = [HttpParticipant(f"model:{h.name}", "model", f"http://{h.address}:{PORT}", config.control_token, http)
                    for h in (a, b)]
            coordinator = Coordinator(store, ours)
            deadline = time.time() + 10
            prepared = await coordinator.prepare("skew-ck", deadline)
            assert prepared["ready"], prepared
            await coordinator.commit("skew-ck", deadline)
            resumed = await coordinator.resume("skew-ck")
            phases = await scalar(store, "SELECT json_agg(DISTINCT kind) FROM rollbook.events WHERE stream LIKE 'participant:%' "
                                         "AND data->>'checkpoint_id' = 'skew-ck'")
            assert {"participant_prepared", "participant_commit"} <= set(phases), (phases, resumed)
            # Each recorded its pause's deadline on its own clock: about 30 s either side of the coordinator's.
            recorded = await scalar(store, "SELECT json_agg((data->>'deadline')::float ORDER BY (data->>'deadline')::float) "
                                           "FROM rollbook.events WHERE kind = 'participant_prepare' AND data->>'checkpoint_id' = 'skew-ck'")
            assert abs(recorded[0] - (deadline - SKEW_S)) < 5 and abs(recorded[1] - (deadline + SKEW_S)) < 5, (recorded, deadline)
        await asyncio.sleep(3 * LEASE_S)
        assert await scalar(store, LIVE_MODELS) == 2  # three leases on: both renewed all along
        assert await scalar(store, "SELECT count(*) FROM rollbook.events WHERE kind = 'instance_renewed'") >= 12

        await cut_from_the_database(hosts, a, procs[0], store, tmp_path / "ahead.log")

# ---- random sequences with partitions ------------------------------------------------------------

EXAMPLES = int(os.environ.get("ROLLBOOK_PARTITION_EXAMPLES", "2"))  # hypothesis' simplest, then drawn ones
STEPS = int(os.environ.get("ROLLBOOK_STATEFUL_STEPS", "10"))


@pytest.fixture(scope="module")
def hosted() -> Iterator[HostedWorld]:
    """Two hosts, each with one instance of every kind, and PostgreSQL on the machine's own address."""
    with Hosts() as made:
        dsn, restart, stop = tcp_database(made, "rollbook_partitions")
        work = Path(tempfile.mkdtemp(prefix="rbparts-"))
        print(f"server logs: {work}")
        world = start_hosted_world(made, dsn, restart, work)
        try:
            yield world
        finally:
            world.stop()
            stop()


def test_random_partitions_crashes_and_checkpoints_keep_every_invariant_of_the_log(hosted: HostedWorld) -> None:
    chosen = int(os.environ.get("ROLLBOOK_STATEFUL_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"random partitions: seed {chosen}, {EXAMPLES} sequences of up to {STEPS} steps "
          f"(replay: ROLLBOOK_STATEFUL_SEED={chosen})")
    before = dict(TALLY)
    machine = type("Partitions", (PartitionMachine,), {"world": hosted, "MODES": (PAUSED,)})
    programs.run_drawn(machine, examples=EXAMPLES, most=STEPS, chosen=chosen)
    gained = {op: n - before.get(op, 0) for op, n in sorted(TALLY.items()) if n != before.get(op, 0)}
    print(f"random partitions: operations that took effect: {gained}")
    assert gained.get("sequences_checked") == EXAMPLES, gained
    assert not (found := tracebacks(hosted.log_dir)), "\n".join(found)


def test_a_host_cut_from_postgresql_past_its_lease_and_one_cut_from_the_other_host_lose_nothing(
        hosted: HostedWorld) -> None:
    """One fixed sequence with each partition: host 0 cut off from PostgreSQL for longer than a lease
    while rollouts run (its instances stop by their own clock; other instances take their work over
    from the log), a short cut that is ridden out, host 1 cut off from host 0, then a checkpoint, every server
    killed and a restore. Every rollout finishes once, nothing is generated or applied twice, and no
    instance writes after its lease."""
    before = dict(TALLY)
    m = type("Fixed", (PartitionMachine,), {"world": hosted})()
    programs.run(m, [lambda: m.partition_from_database(0, HOLDS[1]), lambda: m.partition_from_database(1, HOLDS[0]),
                     lambda: m.partition_hosts(1, HOLDS[1]), m.checkpoint_and_publish, m.resume, m.crash_and_restore])
    gained = {op: n - before.get(op, 0) for op, n in sorted(TALLY.items()) if n != before.get(op, 0)}
    print(f"partitions, one sequence: operations that took effect: {gained}")
    assert gained["partition_db"] == 2 and gained["partition_hosts"] == 1 and gained["heal"] == 3, gained
    # Host 0's, every kind (and maybe some of host 1's: its short cut can catch a renewal, see stateful_partitions).
    assert gained.get("instances_stopped_by_their_lease", 0) >= len(cfg.KINDS), gained
    assert gained.get("partition_db_outlived_a_lease") == 1, gained
    # Host 0's environment had rollouts live when it stopped; other instances went on with them from the log.
    assert gained.get("taken_over_environment", 0) >= 1, gained
    assert gained.get("sequences_checked") == 1, gained
    assert not (found := tracebacks(hosted.log_dir)), "\n".join(found)
