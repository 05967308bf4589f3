"""Several instances of a kind on one database, as real processes: each records itself in the log with
a lease, a paused checkpoint closes every live instance, a SIGKILLed instance fails prepare closed
until its lease runs out, and an instance that starts during a checkpoint stays closed until it ends."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.processes import Process, ServerProcesses, free_port
from engine.attempts import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream
from participants.base.wire import CONTROL
from participants.environments.tasks import make_tasks
from testkit.log_queries import ACCEPTED_TWICE

from .test_checkpoint_cli import checkpoint

# Longer than a `rollbook checkpoint` process takes to start on a loaded machine: the killed instance must
# still hold its lease when that process reads the live set (10 s was too short once in a loaded run:
# up to a third of it has passed since the last renewal when the kill comes).
LEASE_S = 20.0


@dataclass
class Deployment:
    config: cfg.Config
    path: Path
    work: Path
    extra: dict[int, Process]

    def serve(self, kind: str, port: int) -> None:
        """`rollbook serve KIND --port P`: another instance of the kind, from the same config."""
        self.extra[port] = ServerProcesses.spawn([sys.executable, "-m", "apps.cli", "serve", kind, "--config",
                                                  str(self.path), "--port", str(port)], self.work / f"{kind}-{port}.log",
                                                 {**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 60
        # Recorded once it listens, so its status may answer a moment before the log has it.
        while status(self.config, port) is None or address(port) not in self.participants():
            assert self.extra[port].poll() is None, (self.work / f"{kind}-{port}.log").read_text()[-2000:]
            assert time.time() < deadline, f"the {kind} instance on {port} did not answer"
            time.sleep(0.1)

    def kill(self, port: int) -> None:
        os.killpg(self.extra[port].pid, signal.SIGKILL)
        self.extra[port].wait()

    def participants(self) -> dict[str, tuple[str, str]]:
        """rollbook.participants: address -> (kind, state)."""
        with psycopg.connect(self.config.dsn or "", autocommit=True) as conn:
            rows = conn.execute("SELECT address, kind, state FROM rollbook.participants").fetchall()
        return {a: (k, s) for a, k, s in rows}


def status(config: cfg.Config, port: int) -> dict[str, Any] | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{CONTROL}/status",
                                 headers={"Authorization": f"Bearer {config.control_token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return dict(json.loads(resp.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def start_probe(config: cfg.Config) -> None:
    store = PostgresEventStore.connect(config.dsn or "", writer="test")

    async def go() -> None:
        try:
            await store.append(AppendRequest((NewEvent(rollout_stream("probe"), ATTEMPT_STARTED, {"parent_attempt": None},
                                                       "probe", 0),)))
        finally:
            await store.close()
    asyncio.run(go())


PROBES = itertools.count()


def admitted(config: cfg.Config, port: int) -> str:
    """A new model call of the probe attempt to the instance on `port`: `ok`, or the refusal's code
    (admission_closed while the instance is closed)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/rollouts/probe/attempts/0/v1/chat/completions",
                                 data=json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                                 headers={"Authorization": f"Bearer {config.data_token}", "Content-Type": "application/json",
                                          "X-Rollbook-Call-Id": f"probe-{port}-{next(PROBES)}"})
    try:
        with urllib.request.urlopen(req, timeout=30):
            return "ok"
    except urllib.error.HTTPError as exc:
        return str(json.loads(exc.read())["error"]["code"])


def address(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def deployment(dsn: str) -> Iterator[Deployment]:
    work = Path(tempfile.mkdtemp(prefix="rbinst-"))
    config = cfg.Config(dsn=dsn, control_token="inst-control-token", data_token="inst-data-token",
                        servers={k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS},
                        limits=cfg.LimitsConfig(instance_lease_s=LEASE_S))
    path = work / "rollbook.toml"
    cfg.write(config, path)
    procs = ServerProcesses(config, path, work)
    procs.start()
    d = Deployment(config, path, work, {})
    wait_until("the four servers are recorded", lambda: len(d.participants()) == len(cfg.KINDS))
    try:
        yield d
    finally:
        for p in d.extra.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
        procs.stop()


def wait_until(what: str, probe: Any, timeout: float = 30.0) -> Any:
    deadline = time.time() + timeout
    while not (got := probe()):
        assert time.time() < deadline, what
        time.sleep(0.1)
    return got


def test_a_paused_checkpoint_closes_every_live_instance_and_a_killed_one_fails_it_closed_until_its_lease_runs_out(
        deployment: Deployment) -> None:
    d, config = deployment, deployment.config
    start_probe(config)
    second = free_port()
    d.serve("model", second)
    found = d.participants()
    assert found[address(second)] == ("model", "live") and found[config.url("model")] == ("model", "live")
    assert {k for k, s in found.values() if s == "live"} == set(cfg.KINDS)

    rc, prepared = checkpoint(config, "prepare", "ck-both")
    assert rc == 0 and prepared["ready"], prepared
    model_reports = [n for n in prepared["reports"] if n.startswith("model")]
    assert len(model_reports) == 2  # the configured model server and the one started with --port
    assert status(config, second)["phase"] == "prepared"  # type: ignore[index]
    assert admitted(config, second) == "admission_closed"
    rc, resumed = checkpoint(config, "resume", "ck-both")
    assert rc == 0 and resumed["failures"] == {}, resumed
    assert status(config, second)["phase"] == "idle"  # type: ignore[index]
    assert admitted(config, second) == "ok"

    d.kill(second)  # SIGKILL: no handler runs, its lease is still in the log
    rc, refused = checkpoint(config, "prepare", "ck-killed")
    assert rc == 0 and not refused["ready"] and refused["failed"].startswith("model:"), refused
    wait_until("the killed instance's lease ran out", lambda: d.participants()[address(second)][1] == "expired", timeout=60)
    rc, prepared = checkpoint(config, "prepare", "ck-without")
    assert rc == 0 and prepared["ready"], prepared
    assert [n for n in prepared["reports"] if n.startswith("model")] == ["model"]
    rc, resumed = checkpoint(config, "resume", "ck-without")
    assert rc == 0 and resumed["failures"] == {}, resumed


def test_an_instance_that_starts_while_a_paused_checkpoint_is_open_stays_closed_until_it_ends(
        deployment: Deployment) -> None:
    d, config = deployment, deployment.config
    start_probe(config)
    rc, prepared = checkpoint(config, "prepare", "ck-open")
    assert rc == 0 and prepared["ready"], prepared
    late = free_port()
    d.serve("model", late)
    assert d.participants()[address(late)] == ("model", "live")
    assert status(config, late)["phase"] == "idle"  # type: ignore[index]  # not part of the checkpoint...
    assert admitted(config, late) == "admission_closed"  # ...and still serving nothing through it
    rc, resumed = checkpoint(config, "resume", "ck-open")
    assert rc == 0
    wait_until("the late instance opened", lambda: admitted(config, late) == "ok")
    # Stopped cleanly, an instance leaves the deployment at once.
    os.killpg(d.extra[late].pid, signal.SIGTERM)
    d.extra[late].wait(timeout=20)
    assert d.participants()[address(late)] == ("model", "stopped")


def test_a_run_reaches_both_model_instances_through_paused_checkpoints_and_finishes_every_rollout_once(dsn: str) -> None:
    """The agent reaches every live model instance (participants/base/routing.py): two model processes on one
    database serve one run with a paused checkpoint every 0.3 s, and every rollout finishes once with no
    call accepted twice."""
    from tests.run_process import Run

    work = Path(tempfile.mkdtemp(prefix="rbinstrun-"))
    tasks = make_tasks(12, seed=13, envs=["math", "blackjack", "workplace"])
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    config = cfg.Config(dsn=dsn, control_token="inst-control-token", data_token="inst-data-token",
                        servers={k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS},
                        run=cfg.RunConfig(run_id="two", tasks=str(work / "tasks.jsonl"), checkpoint_every_s=0.3,
                                          checkpoint_mode="paused", concurrency=6))
    path = work / "rollbook.toml"
    cfg.write(config, path)
    procs = ServerProcesses(config, path, work)
    procs.start()
    d = Deployment(config, path, work, {})
    try:
        d.serve("model", free_port())
        run = Run(path)
        events = run.wait_for("done", timeout=300)
        assert run.proc.wait(timeout=30) == 0, events[-5:]
    finally:
        for p in d.extra.values():
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=20)
        procs.stop()
    done = next(e for e in events if e.get("event") == "done")
    assert done["finished"] == done["rollouts"] == len(tasks), done
    assert [c for c in events if c.get("event") == "checkpoint" and c.get("published")], events[-5:]
    with psycopg.connect(dsn) as conn:
        owners = dict(conn.execute("SELECT data->>'instance', count(*) FROM rollbook.events WHERE kind = 'call_accepted' "
                                   "AND rollout_id LIKE 'two-%' GROUP BY 1").fetchall())
        twice = conn.execute(ACCEPTED_TWICE.replace(":p", "%(p)s"), {"p": "two-%"}).fetchall()
        per_rollout = dict(conn.execute("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') "
                                        "FROM rollbook.attempts WHERE rollout_id LIKE 'two-%' GROUP BY 1").fetchall())
        prepared = conn.execute("SELECT count(DISTINCT stream) FROM rollbook.events WHERE kind = 'participant_prepared' "
                                "AND stream LIKE 'participant:model:%'").fetchone()
    assert len(owners) == 2, owners  # both model instances generated calls of this run
    assert twice == []
    assert per_rollout == {f"two-{i:04d}": 1 for i in range(len(tasks))}, per_rollout
    assert prepared == (2,)  # the paused checkpoints prepared both model instances
