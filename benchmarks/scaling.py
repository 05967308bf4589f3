"""The same rollouts with 1, 2 and 4 processes of every kind on one database, side by side in one run.

    .venv/bin/python benchmarks/scaling.py [--tasks 200] [--shapes 1x1,2x1,4x1] [--in-flight 32,200]
                                           [--token-latency-s 0.004] [--dsn ADMIN_DSN] [--hosts] [--out PATH]

A shape IxW is I instances of every kind (each started with `rollbook serve`) of W workers each.
Instance i of every kind has a config of its own that names the other kinds' instance i, as a
machine of its own would: the framework dispatches rollout r to environment instance r mod I, the
environment calls its agent and resources instances, and every agent reaches every model instance
(participants/base/routing.py). W > 1 sets `[servers.KIND] workers = W`: a front at each address and W
workers behind it, measured together with the front (the process tree).

Every shape runs the same `--tasks` tasks (workplace, blackjack and math, seed 7) once per
`--in-flight` level (that many dispatched at a time), in a fresh migrated database per shape of one
throwaway embedded PostgreSQL (fsync on), one shape after another. For each shape: rollouts/s over the dispatch, the model calls generated, and
the CPU-seconds per model call of every process: each server (user + system time from
/proc/PID/stat, its waited-for children included), PostgreSQL (the postmaster with every backend, the
ones that exited included) and this driver. While it runs it samples pg_stat_activity every 0.2 s:
the connections to the database, how many run a statement, and how many wait on a lock (an append
waits for the log head's row lock: adapters/postgres.py).

With --hosts (root, iproute2: testkit/netns.py), instance i of every kind runs on a host of its own,
a network namespace with its own address on a bridge, and PostgreSQL listens on an address of the
machine's own: every call between two instances sets and every statement crosses a link, as between
machines. The hosts still share this machine's cores, so the table says how far the log, its lock and
its connections carry more hosts, not what more machines would add in CPU.

For sizing, each run also reports the events appended per second, how many cores PostgreSQL kept busy
and how many every process together did (on 2 cores, 2.0 is all of them).

It prints a table and writes one JSON object to benchmarks/results/scaling.json. It never asserts a
time: on a shared 2-core machine the absolute figures move between runs; the shapes side by side
in one run are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from adapters.database import libpq_dsn  # noqa: E402
from adapters.http_client import unpooled_session  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from apps import config as cfg  # noqa: E402
from apps.collection import Collection  # noqa: E402
from apps.processes import ServerProcesses, free_port  # noqa: E402
from benchmarks.append import Server, machine_info, progress, start_server  # noqa: E402
from participants.environments.tasks import make_tasks  # noqa: E402
from testkit import netns, pg  # noqa: E402

ENVS = ["workplace", "blackjack", "math"]
TASK_SEED = 7
TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.2


def parse_shape(text: str) -> tuple[int, int]:
    instances, _, workers = text.partition("x")
    shape = int(instances), int(workers or 1)
    if min(shape) < 1:
        raise SystemExit(f"--shapes: {text!r} is not INSTANCESxWORKERS with both at least 1")
    return shape


def cpu_s(pid: int, children: bool = True) -> float:
    """User + system CPU-seconds of a process (and of its children it has waited for), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + ((cutime + cstime) if children else 0)) / TICK


def tree_cpu_s(pid: int) -> float:
    """A server's process and its live descendants (a front's workers), each by its own time."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_s(p)
        todo += parents.get(p, [])
    return total


def postgres_cpu_s(postmaster: int) -> float:
    """The postmaster with every backend: live children by their own time, exited ones in its cutime."""
    total = cpu_s(postmaster)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            total += cpu_s(int(stat.parent.name), children=False)
    return total


def postmaster_pid(dsn: str) -> int:
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        # Read while connected: the backend exits with its connection.
        return int(Path(f"/proc/{row[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])


def configs(dsn: str, instances: int, workers: int, token_latency_s: float, work: Path,
            hosts: list[netns.Host]) -> list[ServerProcesses]:
    """Instance i of every kind, on hosts[i] when there are hosts, else all on 127.0.0.1."""
    control, data = secrets.token_hex(16), secrets.token_hex(16)
    # Every process's pool fits the server's connections: 4 kinds x instances x (workers, and a front where
    # there are several), the driver and one more.
    limits = cfg.LimitsConfig(processes=len(cfg.KINDS) * instances * (workers + (workers > 1)) + 2)
    sets = []
    for i in range(instances):
        host = hosts[i] if hosts else None
        servers = {}
        for k in cfg.KINDS:
            servers[k] = cfg.ServerConfig(port=free_port(), token_latency_s=token_latency_s if k == "model" else 0.0,
                                          workers=workers, **({"host": host.address} if host else {}))
        config = cfg.Config(dsn=dsn, control_token=control, data_token=data, servers=servers, limits=limits)
        path = work / f"rollbook-{i}.toml"
        cfg.write(config, path)
        sets.append(ServerProcesses(config, path, work, name=f"i{i}-", launch=host.enter if host else ()))
    return sets


class Network:
    """Hosts of their own, made as the shapes need them, and the DSN the servers on them use."""

    def __init__(self) -> None:
        self.hosts = netns.Hosts()
        self.placed: list[netns.Host] = []

    def server(self) -> Server:
        db, _ = pg.restartable_server(listen=self.hosts.extra[0], trust=f"{self.hosts.net}.0/24")
        # Durable as the loopback run's throwaway server is (a test's server of its own is not): the
        # two tables must differ only in where the processes run.
        with psycopg.connect(libpq_dsn(db.admin_dsn), autocommit=True) as conn:
            for setting in ("fsync", "synchronous_commit", "full_page_writes"):
                conn.execute(f"ALTER SYSTEM SET {setting} = on")
            conn.execute("SELECT pg_reload_conf()")
        return Server(db.admin_dsn, cleanup=lambda: [stop() for stop in db.stop])

    def first(self, n: int) -> list[netns.Host]:
        while len(self.placed) < n:
            self.placed.append(self.hosts.add(f"h{len(self.placed)}"))
        return self.placed[:n]

    def over_tcp(self, dsn: str) -> str:
        """The same database, reached from a host: over TCP at the database's own address."""
        url = make_url(dsn)
        return f"postgresql://{url.username or 'postgres'}@{self.hosts.extra[0]}:{url.port or 5432}/{url.database}"


class Spread(Collection):
    environments: list[str]

    def episodes_url(self, i: int) -> str:
        return self.environments[i % len(self.environments)] + "/episodes"


async def sample_activity(dsn: str, samples: list[tuple[int, int, int]], stop: asyncio.Event) -> None:
    """(connections, running a statement, waiting on a lock) of the database, every SAMPLE_S."""
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
        while not stop.is_set():
            cur = await conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE state = 'active'), count(*) FILTER (WHERE wait_event_type = 'Lock') "
                "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
            row = await cur.fetchone()
            if row is not None:
                samples.append((int(row[0]), int(row[1]), int(row[2])))
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_S)
            except TimeoutError:
                pass


async def model_calls(dsn: str, run_id: str) -> int:
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE %s "
            "AND coalesce(data->>'disposition', 'generated') = 'generated'", (f"{run_id}-%",))
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def events_appended(dsn: str, run_id: str) -> int:
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM rollbook.events WHERE rollout_id LIKE %s", (f"{run_id}-%",))
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def run_shape(server: Server, shape: tuple[int, int], args: argparse.Namespace, postmaster: int,
                    network: Network | None) -> list[dict[str, Any]]:
    """Start the shape's processes on a fresh database, then run the tasks once per in-flight level."""
    instances, workers = shape
    dsn = server.new_database()
    work = Path(tempfile.mkdtemp(prefix=f"rb-scaling-{instances}x{workers}-"))
    hosts = network.first(instances) if network else []
    sets = configs(network.over_tcp(dsn) if network else dsn, instances, workers, args.token_latency_s, work, hosts)
    store = PostgresEventStore.connect(dsn, writer="scaling-driver")
    out = []
    try:
        for procs in sets:
            procs.start(120.0)
        for in_flight in args.in_flight:
            out.append(await measure(dsn, store, sets, shape, in_flight, args, postmaster))
            r = out[-1]
            progress(f"{r['shape']} with {in_flight} in flight: {args.tasks - r['unfinished']} rollouts in {r['seconds']} s, "
                     f"{r['model_calls']} model calls")
    finally:
        for procs in sets:
            procs.stop()
        await store.close()
        server.drop_database(dsn)
    return out


async def measure(dsn: str, store: PostgresEventStore, sets: list[ServerProcesses], shape: tuple[int, int], in_flight: int,
                  args: argparse.Namespace, postmaster: int) -> dict[str, Any]:
    instances, workers = shape
    run_id = f"s{instances}x{workers}f{in_flight}"
    coll = Spread(sets[0].config, store, run_id, make_tasks(args.tasks, TASK_SEED, ENVS), seed=TASK_SEED,
                  concurrency=in_flight)
    coll.environments = [procs.config.url("environment") for procs in sets]
    pids = {f"{k}{i}": procs.procs[k].pid for i, procs in enumerate(sets) for k in cfg.KINDS}
    before = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    pg_before, me_before = postgres_cpu_s(postmaster), cpu_s(os.getpid())
    samples: list[tuple[int, int, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_activity(dsn, samples, stop))
    t0 = time.perf_counter()
    async with unpooled_session() as session:
        await coll.dispatch(session)
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    cpu = {name: tree_cpu_s(pid) - before[name] for name, pid in pids.items()}
    cpu["postgres"] = postgres_cpu_s(postmaster) - pg_before
    cpu["driver"] = cpu_s(os.getpid()) - me_before
    calls = await model_calls(dsn, run_id)
    events = await events_appended(dsn, run_id)
    unfinished = len(await coll.unfinished())
    return {"shape": f"{instances}x{workers}", "instances": instances, "workers": workers, "tasks": args.tasks,
            "in_flight": in_flight, "unfinished": unfinished, "seconds": round(wall, 2),
            "rollouts_per_s": round((args.tasks - unfinished) / wall, 2),
            "model_calls_per_s": round(calls / wall, 2), "events": events, "events_per_s": round(events / wall, 1),
            "postgres_cores": round(cpu["postgres"] / wall, 2), "all_cores": round(sum(cpu.values()) / wall, 2),
            "model_calls": calls, "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
            "cpu_ms_per_call": {k: round(1000 * v / max(calls, 1), 2) for k, v in cpu.items()},
            "connections": _spread([s[0] for s in samples]), "running": _spread([s[1] for s in samples]),
            "waiting_on_a_lock": _spread([s[2] for s in samples]), "samples": len(samples)}


def _spread(xs: list[int]) -> dict[str, float]:
    return {"median": float(statistics.median(xs)), "max": float(max(xs))} if xs else {"median": 0.0, "max": 0.0}


def by_kind(r: dict[str, Any]) -> dict[str, float]:
    """CPU ms per model call of each kind, summed over its instances, then PostgreSQL, the driver and the total."""
    per = r["cpu_ms_per_call"]
    out = {k: round(sum(v for n, v in per.items() if n.rstrip("0123456789") == k), 2) for k in cfg.KINDS}
    out["postgres"], out["driver"] = per["postgres"], per["driver"]
    out["total"] = round(sum(out.values()), 2)
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = [("shape (instances x workers)", lambda r: r["shape"]), ("rollouts in flight", lambda r: r["in_flight"]),
            ("rollouts/s", lambda r: r["rollouts_per_s"]),
            ("model calls/s", lambda r: r["model_calls_per_s"]), ("events appended/s", lambda r: r["events_per_s"]),
            ("seconds", lambda r: r["seconds"]), ("unfinished", lambda r: r["unfinished"]),
            ("model calls", lambda r: r["model_calls"]), ("cores busy, PostgreSQL", lambda r: r["postgres_cores"]),
            ("cores busy, every process", lambda r: r["all_cores"])]
    rows += [(f"CPU ms/call {k}", lambda r, k=k: by_kind(r)[k]) for k in [*cfg.KINDS, "postgres", "driver", "total"]]
    rows += [("connections median / max", lambda r: f"{r['connections']['median']:g} / {r['connections']['max']:g}"),
             ("running median / max", lambda r: f"{r['running']['median']:g} / {r['running']['max']:g}"),
             ("waiting on a lock median / max",
              lambda r: f"{r['waiting_on_a_lock']['median']:g} / {r['waiting_on_a_lock']['max']:g}")]
    lines = []
    for label, cell in rows:
        lines.append(f"{label:<32}" + "".join(f"{cell(r)!s:>14}" for r in results))
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    if args.hosts and (why := netns.unavailable()) is not None:
        raise SystemExit(f"--hosts: {why}")
    network = Network() if args.hosts else None
    try:
        if network is not None:
            progress("starting an embedded PostgreSQL on an address of the machine's own, and hosts of their own")
        server = network.server() if network else start_server(args.dsn)
        try:
            info = machine_info(server.admin_dsn)
            postmaster = postmaster_pid(server.admin_dsn)
            results = []
            for shape in shapes:
                results += await run_shape(server, shape, args, postmaster, network)
        finally:
            server.close()
    finally:
        if network is not None:
            network.hosts.close()
    print(table(results))
    out = {"machine": info, "hosts": bool(args.hosts), "tasks": args.tasks, "in_flight": args.in_flight,
           "token_latency_s": args.token_latency_s,
           "loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "shapes": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"runs": {f"{r['shape']}@{r['in_flight']}": {"rollouts_per_s": r["rollouts_per_s"], **by_kind(r)}
                               for r in results}}))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--shapes", default="1x1,2x1,4x1", help="INSTANCESxWORKERS of every kind, comma-separated")
    p.add_argument("--in-flight", type=lambda t: [int(x) for x in t.split(",")], default=[32, 200],
                   help="rollouts dispatched at a time, comma-separated: each shape runs the tasks once per level")
    p.add_argument("--token-latency-s", type=float, default=0.004, help="the scripted model's time per token")
    p.add_argument("--dsn", default=None, help="an admin DSN of a PostgreSQL to use instead of a throwaway one")
    p.add_argument("--hosts", action="store_true",
                   help="instance i of every kind on a host of its own (a network namespace; needs root)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaling.json")
    asyncio.run(main(p.parse_args()))
