"""`rollbook export`: a run stopped mid-generation, its servers SIGKILLed, restored into fresh processes
and finished exports the same training records, token for token, as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from adapters.export import read
from apps import cli
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from participants.environments.tasks import make_tasks
from tests.e2e.test_run_command import Run, wait_for_a_generation_under_way


def export(dsn: str, run_id: str, out: Path) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "apps.cli", "export", "--run", run_id, "--out", str(out), "--dsn", dsn],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["out"] == str(out) and summary["format"] == out.suffix[1:]
    return read(out)


def comparable(records: list[dict], run_id: str) -> list[dict]:
    """What a trainer consumes: everything but the names a crash changes (attempt, call ids)."""
    out = []
    for r in records:
        turns = [{k: v for k, v in t.items() if k != "call_id"} for t in r["turns"]]
        out.append({**{k: v for k, v in r.items() if k not in ("attempt", "turns")},
                    "rollout_id": r["rollout_id"].removeprefix(run_id), "turns": turns})
    return out


def test_a_run_crashed_and_restored_mid_generation_exports_what_an_uninterrupted_run_does(dsn: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="rbexport-"))
    tasks = make_tasks(4, seed=5, envs=["blackjack", "math", "workplace"])
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    paths = {}
    # The reference runs on fast tokens; the crashed run on slow ones (about 2 s a reply), which keep each
    # generation in flight well past the stop, so the stop lands mid-generation. Latency changes no token.
    for run_id, latency in (("ref", 0.01), ("crash", 0.2)):
        servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=latency if k == "model" else 0.0) for k in cfg.KINDS}
        config = cfg.Config(dsn=dsn, control_token="c0ntrol-t0ken", data_token="data-t0ken", servers=servers, run=cfg.RunConfig(
            run_id=run_id, tasks=str(work / "tasks.jsonl"), checkpoint_every_s=3600, concurrency=4))
        paths[run_id] = work / f"{run_id}.toml"
        cfg.write(config, paths[run_id])
    procs = ServerProcesses(cfg.load(paths["ref"]), paths["ref"], work)
    procs.start()
    try:
        ref = Run(paths["ref"])
        ref.wait_for("done", timeout=120)
        assert ref.proc.wait(timeout=30) == 0
    finally:
        procs.stop()
    procs = ServerProcesses(cfg.load(paths["crash"]), paths["crash"], work)
    procs.start()
    try:
        crash = Run(paths["crash"])
        crash.wait_for("finished")  # the others are mid-turn, most of them mid-generation
        wait_for_a_generation_under_way(dsn)
        crash.proc.send_signal(signal.SIGTERM)  # checkpoint and stop: prepare cuts every generation in flight
        seen = crash.wait_for("stopped")
        stopped_at = [e for e in seen if e.get("event") == "checkpoint"]
        assert stopped_at and stopped_at[-1]["published"], stopped_at  # one refused at prepare cuts nothing
        assert crash.proc.wait(timeout=30) == 0
        procs.kill()  # SIGKILL every server
        procs.start()
        again = Run(paths["crash"])
        events = again.wait_for("done", timeout=120)
        assert again.proc.wait(timeout=30) == 0
    finally:
        procs.stop()
    assert next(e for e in events if e.get("event") == "done")["finished"] == 4
    with psycopg.connect(dsn) as conn:
        cut_mid = conn.execute("SELECT count(*) FROM rollbook.events WHERE kind = 'call_cut' AND (data->>'tokens')::int > 0 "
                               "AND rollout_id LIKE 'crash-%'").fetchone()[0]
        continued = conn.execute("SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE "
                                 "'crash-%' AND data->'continuation'->>'mode' = 'continued'").fetchone()[0]
    # The rerun continues every unfinished rollout from the log (docs/protocol.md, "What happens after a crash"),
    # in its own attempt where it can, so what shows it ran is its recovery line and what it finished.
    recovered = [e for e in events if e.get("event") == "recovery"]
    finished_after = sum(1 for e in events if e.get("event") == "finished")
    assert cut_mid >= 1 and continued >= 1 and recovered and finished_after >= 1, (cut_mid, continued, recovered, finished_after)

    want = export(dsn, "ref", work / "ref.jsonl")
    got = export(dsn, "crash", work / "crash.parquet")
    assert len(want) == len(got) == 4
    assert all(r["turns"] and all(len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) for t in r["turns"])
               for r in want)
    assert all(1 in t["loss_mask"] and t["loss_mask"][0] == 0 for r in want for t in r["turns"])
    assert comparable(got, "crash") == comparable(want, "ref")


def test_export_refuses_a_file_that_is_neither_jsonl_nor_parquet(dsn: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "records.csv"
    assert cli.main(["export", "--run", "ref", "--out", str(out), "--dsn", dsn]) == 2
    err = capsys.readouterr().err
    assert "invalid_payload" in err and ".jsonl or .parquet" in err and str(out) in err
    assert not out.exists()


@pytest.mark.parametrize("run_id", ["", "a%", "../x"])
def test_export_refuses_a_run_id_that_is_not_one(dsn: str, tmp_path: Path, capsys, run_id: str) -> None:
    assert cli.main(["export", "--run", run_id, "--out", str(tmp_path / "r.jsonl"), "--dsn", dsn]) == 2
    assert "is not a run id" in capsys.readouterr().err and not (tmp_path / "r.jsonl").exists()
