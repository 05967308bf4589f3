"""`rollbook checkpoint ...` driving a checkpoint by hand against the four servers as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from apps import config as cfg
from apps.processes import ServerProcesses, free_port


@pytest.fixture
def servers(dsn: str):
    work = Path(tempfile.mkdtemp(prefix="rbcli-"))
    config = cfg.Config(dsn=dsn, control_token="cli-control-token", data_token="cli-data-token",
                        servers={k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS})
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(config, work / "rollbook.toml", work)
    procs.start()
    yield config
    procs.stop()


def checkpoint(config: cfg.Config, *args: str) -> tuple[int, dict]:
    participants = [a for k in cfg.KINDS for a in ("--participant", f"{k}={config.url(k)}")]
    # A lease (prepare's, then commit's) that outlasts the commands after it, each a fresh Python
    # process: on a loaded machine 30 s ran out between commit and resume.
    out = subprocess.run([sys.executable, "-m", "apps.cli", "checkpoint", *args, *participants, "--deadline-seconds", "600",
                          "--control-token", config.control_token, "--dsn", config.dsn or ""], capture_output=True, text=True, timeout=60)
    text = out.stdout if out.returncode == 0 else out.stderr
    return out.returncode, json.loads(text.strip().splitlines()[-1])


def test_checkpoint_by_hand_prints_json_at_every_step(servers: cfg.Config) -> None:
    rc, status = checkpoint(servers, "status")
    assert rc == 0 and {s["kind"]: s["phase"] for k, s in status.items() if k in cfg.KINDS} == dict.fromkeys(cfg.KINDS, "idle")
    assert status["aborted_expired"] == []
    rc, prepared = checkpoint(servers, "prepare", "ck-cli")
    assert rc == 0 and prepared["ready"] and set(prepared["reports"]) == set(cfg.KINDS)
    rc, status = checkpoint(servers, "status")
    assert {s["checkpoint_id"] for k, s in status.items() if k in cfg.KINDS} == {"ck-cli"}
    rc, cut = checkpoint(servers, "commit", "ck-cli")
    assert rc == 0 and cut["checkpoint_id"] == "ck-cli" and cut["scope"] == [] and cut["position"] > 0
    rc, resumed = checkpoint(servers, "resume", "ck-cli")
    assert rc == 0 and resumed["failures"] == {}
    rc, err = checkpoint(servers, "prepare", "ck-cli")  # the bad input: reusing an id already resumed
    assert rc == 2 and err["error"]["code"] == "stale_checkpoint"
