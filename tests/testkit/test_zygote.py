"""The suite's server processes, forked from a zygote: each is what `subprocess.Popen` made of the same
command (its exit, its log, its session, its environment), and a request that differs in what an import
reads is not forked."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.processes import free_port, spawn_server, worker_pids
from testkit.zygote import Forked, Zygote

SERVE = [sys.executable, "-m", "apps.cli", "serve"]


@pytest.fixture
def zygote() -> Zygote:
    z = Zygote()
    yield z
    z.close()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_a_forked_command_exits_and_logs_as_the_same_command_started_by_popen(zygote: Zygote, tmp_path: Path) -> None:
    """Input: `rollbook serve model` with a config file that does not exist (an error reply and exit 2)."""
    argv = [*SERVE, "model", "--config", str(tmp_path / "missing.toml")]
    forked = zygote.spawn(argv, tmp_path / "forked.log", env())
    started = spawn_server(argv, tmp_path / "popen.log", env())
    assert isinstance(forked, Forked)
    assert (forked.wait(60), started.wait(60)) == (2, 2)
    assert (tmp_path / "forked.log").read_text() == (tmp_path / "popen.log").read_text()
    assert "missing.toml" in (tmp_path / "forked.log").read_text()


def test_a_forked_server_leads_a_session_of_its_own_holds_none_of_the_zygotes_files_and_dies_of_sigkill(
        zygote: Zygote, dsn: str, tmp_path: Path) -> None:
    """Input: a real `rollbook serve model` with two workers on the test's database, then SIGKILL to its
    process group. Its workers, started by the server with its environment, show that environment."""
    port = free_port()
    path = tmp_path / "rollbook.toml"
    path.write_text(f'dsn = "{dsn}"\ncontrol_token = "{secrets.token_hex(12)}"\ndata_token = "{secrets.token_hex(12)}"\n'
                    f"[servers.model]\nport = {port}\nworkers = 2\n")
    path.chmod(0o600)
    mine = {**env(), "PYTEST_CURRENT_TEST": "this one"}  # pytest's per-test variable differs: still forked
    proc = zygote.spawn([*SERVE, "model", "--config", str(path)], tmp_path / "model.log", mine)
    assert isinstance(proc, Forked)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, (tmp_path / "model.log").read_text()[-2000:]
            assert time.time() < deadline, "the model server did not listen"
            time.sleep(0.1)
    assert os.getsid(proc.pid) == proc.pid
    while len(workers := worker_pids(proc.pid)) < 2:
        assert time.time() < deadline, "the model server did not start its workers"
        time.sleep(0.1)
    assert b"PYTEST_CURRENT_TEST=this one" in Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
    assert os.getpgid(workers[0]) == proc.pid
    assert Path(f"/proc/{proc.pid}/cwd").resolve() == Path.cwd().resolve()
    assert zygote.proc is not None
    pipes = {os.readlink(f"/proc/{zygote.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote.proc.pid}/fd")}
    requests = {p for p in pipes if p.startswith("pipe:")}
    assert len(requests) >= 2  # its requests and its replies
    held = {os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")}
    assert requests.isdisjoint(held), held
    assert os.readlink(f"/proc/{proc.pid}/fd/1") == str(tmp_path / "model.log")
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert not Path(f"/proc/{proc.pid}").exists()  # reaped, not left a zombie
    assert all(_gone(w) for w in workers)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_command_whose_environment_differs_is_started_by_popen(zygote: Zygote, tmp_path: Path) -> None:
    """Input: the same command with ROLLBOOK_DB_PATIENCE_S set, which a module reads while importing."""
    argv = [*SERVE, "model", "--config", str(tmp_path / "missing.toml")]
    proc = zygote.spawn(argv, tmp_path / "popen.log", {**env(), "ROLLBOOK_DB_PATIENCE_S": "1"})
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(60) == 2
    assert zygote.proc is None  # nothing was asked of a zygote


def test_a_zygote_that_died_leaves_every_later_command_to_popen(zygote: Zygote, tmp_path: Path) -> None:
    """Input: the zygote SIGKILLed after its first child, then two more commands."""
    argv = [*SERVE, "model", "--config", str(tmp_path / "missing.toml")]
    assert zygote.spawn(argv, tmp_path / "first.log", env()).wait(60) == 2
    assert zygote.proc is not None
    os.kill(zygote.proc.pid, signal.SIGKILL)
    zygote.proc.wait()
    later = [zygote.spawn(argv, tmp_path / f"later{i}.log", env()) for i in range(2)]
    assert all(isinstance(p, subprocess.Popen) for p in later)
    assert [p.wait(60) for p in later] == [2, 2]
    assert zygote.proc is None  # not started again for each command
