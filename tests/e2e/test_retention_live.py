"""`rollbook db retain` while a real `rollbook run` writes: it frees what it promises (old append keys,
token blobs nothing names, the events of exported rollouts), and a checkpoint kept from before it still restores into fresh server
processes, every rollout then finishing once with nothing repeated (the demo's invariants, in SQL)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

from adapters.token_store import PostgresTokenStore
from apps import config as cfg
from apps.demo import REPEATED_CALLS, REPEATED_MUTATIONS, REPEATED_MUTATIONS_WITHIN
from apps.processes import ServerProcesses, free_port
from participants.environments.tasks import make_tasks
from tests.adapters.test_retention import age_everything
from tests.run_process import Run

# Every blob id an event names, that the token store does not hold: what a restore would fail to read.
MISSING_BLOBS = (
    "SELECT count(*) FROM (SELECT jsonb_path_query(data, 'strict $.**.blob_id') #>> '{}' AS blob_id "
    "FROM rollbook.events) n WHERE NOT EXISTS (SELECT 1 FROM rollbook.token_blobs b WHERE b.blob_id = n.blob_id)"
)


def checkpoint(config: cfg.Config, *args: str) -> dict:
    participants = [a for k in cfg.KINDS for a in ("--participant", f"{k}={config.url(k)}")]
    out = subprocess.run([sys.executable, "-m", "apps.cli", "checkpoint", *args, *participants, "--deadline-seconds", "600",
                          "--dsn", config.dsn or ""], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ROLLBOOK_CONTROL_TOKEN": config.control_token})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def orphan_blob(dsn: str) -> str:
    """What a refused outcome leaves behind: a blob no event names."""
    async def put() -> str:
        tokens = PostgresTokenStore(dsn)
        try:
            return (await tokens.put([7, 7, 7, 7], [-0.5] * 4)).blob_id
        finally:
            await tokens.close()
    return asyncio.run(put())


def test_retention_under_a_live_run_frees_what_it_promises_and_a_kept_checkpoint_restores(dsn: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="rbretain-"))
    # Enough rollouts that the run still writes through the export and retention commands that follow its
    # checkpoint (12 ended during them on a loaded machine).
    tasks = make_tasks(24, seed=5, envs=["workplace", "blackjack", "math"])
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    # Tokens take a while to come, so calls are under way while the checkpoint is cut and retention runs.
    servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=0.04 if k == "model" else 0.0) for k in cfg.KINDS}
    config = cfg.Config(dsn=dsn, control_token="c0ntrol-token", data_token="d4ta-token", servers=servers,
                        run=cfg.RunConfig(run_id="ret", tasks=str(work / "tasks.jsonl"), checkpoint_every_s=3600,
                                          concurrency=4))
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(config, work / "rollbook.toml", work)
    procs.start()
    try:
        first = Run(work / "rollbook.toml")
        first.wait_for("finished")
        first.proc.send_signal(signal.SIGUSR1)
        kept = [e for e in first.wait_for("checkpoint") if e.get("event") == "checkpoint"][0]
        assert kept["published"], kept
        # A run that has gone on for days: everything written so far is past the retention, and one blob is
        # named by nothing. Retention runs while the run goes on writing.
        orphan = orphan_blob(dsn)
        # The rollouts finished so far are exported (and marked so): their episode and call streams may go,
        # as the kept checkpoint lists them as completed and restore reads none of their events.
        exported = subprocess.run([sys.executable, "-m", "apps.cli", "export", "--run", "ret", "--out",
                                   str(work / "early.jsonl"), "--dsn", dsn], capture_output=True, text=True, timeout=120)
        assert exported.returncode == 0, exported.stderr[-2000:]
        marked = json.loads(exported.stdout.strip().splitlines()[-1])["newly_marked_exported"]
        age_everything(dsn, hours=48)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE rollbook.events SET recorded_at = now() - interval '48 hours'")
        with psycopg.connect(dsn, autocommit=True) as conn:
            aged_keys = conn.execute("SELECT count(*) FROM rollbook.append_keys "  # the run adds young ones meanwhile
                                     "WHERE recorded_at < now() - interval '1 day'").fetchone()[0]  # type: ignore[index]
            before = conn.execute("SELECT max(position) FROM rollbook.events").fetchone()[0]  # type: ignore[index]
        assert first.proc.poll() is None, "the run ended before retention could run beside it"
        out = subprocess.run([sys.executable, "-m", "apps.cli", "db", "retain", "--dsn", dsn],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        freed = json.loads(out.stdout.strip().splitlines()[-1])
        with psycopg.connect(dsn, autocommit=True) as conn:
            written_meanwhile = conn.execute("SELECT max(position) FROM rollbook.events").fetchone()[0]  # type: ignore[index]
            left_aged = conn.execute("SELECT count(*) FROM rollbook.append_keys "
                                     "WHERE recorded_at < now() - interval '1 day'").fetchone()[0]  # type: ignore[index]
            orphan_left = conn.execute("SELECT count(*) FROM rollbook.token_blobs WHERE blob_id = %s",
                                       (orphan,)).fetchone()[0]  # type: ignore[index]
            missing = conn.execute(MISSING_BLOBS).fetchone()[0]  # type: ignore[index]
        print(f"retention freed {freed}; the run appended {written_meanwhile - before} events meanwhile")
        assert freed["token_blobs"] >= 1 and freed["append_keys"] >= aged_keys > 0
        assert freed["deferred_by"] is None and 0 < freed["attempts"] <= marked and freed["events"] > 0
        assert (left_aged, orphan_left, missing) == (0, 0, 0)

        # A crash with rollouts under way; fresh processes restore the checkpoint kept from before retention.
        first.proc.kill()
        first.proc.wait(timeout=30)
        procs.kill()
        procs.start()
        restored = checkpoint(config, "restore", kept["checkpoint_id"])
        assert restored.get("failures", {}) == {}, restored
        assert checkpoint(config, "resume", kept["checkpoint_id"]).get("failures", {}) == {}
        second = Run(work / "rollbook.toml")
        events = second.wait_for("done", timeout=240)
        assert second.proc.wait(timeout=30) == 0, events[-5:]
    finally:
        procs.stop()
    done = next(e for e in events if e.get("event") == "done")
    assert done["finished"] == done["rollouts"] == len(tasks)
    with psycopg.connect(dsn, autocommit=True) as conn:
        finished = conn.execute("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') FROM rollbook.attempts "
                                "WHERE rollout_id LIKE 'ret-%%' GROUP BY rollout_id").fetchall()
        p = {"p": "ret-%"}
        repeated = [conn.execute(q.replace(":p", "%(p)s"), p).fetchone()[0]  # type: ignore[index]
                    for q in (REPEATED_CALLS, REPEATED_MUTATIONS, REPEATED_MUTATIONS_WITHIN)]
        missing = conn.execute(MISSING_BLOBS).fetchone()[0]  # type: ignore[index]
    assert len(finished) == len(tasks) and all(n == 1 for _, n in finished), finished
    assert repeated == [0, 0, 0] and missing == 0
