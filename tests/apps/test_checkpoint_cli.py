"""`rollbook checkpoint ...` driving a checkpoint by hand against the four servers as real processes."""

from __future__ import annotations

import json
import os
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


def checkpoint(config: cfg.Config, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    """`rollbook checkpoint`, given the control credential in its environment unless `env` says otherwise:
    never on its command line, where every local user could read it."""
    participants = [a for k in cfg.KINDS for a in ("--participant", f"{k}={config.url(k)}")]
    # A lease as long as the test may take: each command is a fresh Python process, and on a loaded
    # machine the four of them between prepare and resume took longer than the default 30 s lease.
    env = env if env is not None else {**os.environ, "ROLLBOOK_CONTROL_TOKEN": config.control_token}
    out = subprocess.run([sys.executable, "-m", "apps.cli", "checkpoint", *args, *participants, "--deadline-seconds", "600",
                          "--dsn", config.dsn or ""], capture_output=True, text=True, timeout=60, env=env)
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


def test_the_control_credential_comes_from_a_file_only_its_owner_reads(servers: cfg.Config, tmp_path: Path) -> None:
    token = tmp_path / "control-token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, f"{servers.control_token}\n".encode())
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if k != "ROLLBOOK_CONTROL_TOKEN"}
    rc, status = checkpoint(servers, "status", "--control-token-file", str(token), env=env)
    assert rc == 0 and {status[k]["kind"] for k in cfg.KINDS} == set(cfg.KINDS)  # every server let it in
    rc, status = checkpoint(servers, "status", env={**env, "ROLLBOOK_CONTROL_TOKEN": "not-the-token"})
    assert rc == 0 and all("error" in status[k] for k in cfg.KINDS)  # and the wrong one opens none
