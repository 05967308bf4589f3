"""Installs that test workers or users may start at the same time on a fresh machine: NeMo Gym's
environment (`rollbook nemo-gym install`) and the light NeMo Gym folder of the tests. Before the lock,
a second installer removed the first one's finished folder while the first was importing from it."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from apps import nemo_gym_install
from testkit import nemo_gym_env


def concurrently(n: int, fn: Any) -> list[Any]:
    results: list[Any] = [None] * n
    def run(i: int) -> None:
        results[i] = fn()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_four_workers_ensuring_the_nemo_gym_folder_at_once_install_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBOOK_TEST_CACHE", str(tmp_path))
    installs = []

    def pip(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:  # what `pip install --target` leaves
        installs.append(cmd)
        time.sleep(0.2)
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "nemo_gym" / "token_id_capture").mkdir(parents=True)
        (target / "nemo_gym" / "token_id_capture" / "conformance.py").write_text("")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(nemo_gym_env.subprocess, "run", pip)
    folders = concurrently(4, nemo_gym_env.ensure)
    assert len(installs) == 1
    assert folders == [nemo_gym_env.target()] * 4
    assert (nemo_gym_env.target() / "nemo_gym" / "token_id_capture" / "conformance.py").exists()


def test_two_nemo_gym_installs_at_once_build_the_environment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBOOK_NEMO_GYM_HOME", str(tmp_path))
    builds = []

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        if "venv" in cmd:
            builds.append(cmd)
            time.sleep(0.2)
            Path(cmd[-1], "bin").mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(nemo_gym_install.subprocess, "run", run)
    results = concurrently(2, lambda: nemo_gym_install.install(Path("/usr/bin/python3")))
    assert len(builds) == 1
    assert sorted(seconds > 0 for _, seconds in results) == [False, True]  # one built it, the other found it built
    assert (nemo_gym_install.venv_dir() / "complete").exists()
