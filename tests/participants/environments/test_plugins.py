"""Environments register through one entry point group, `rollbook.environments`, and nothing else.

A package outside rollbook (tests/plugins/rb_coin.py) is installed the way pip would leave it: its
module plus a dist-info with one entry point, in a folder on sys.path. Fresh interpreters then see
it in the registry and the task generator, the shipped conformance suite lists it with every agent, and
the package's own tests (tests/plugins/rb_coin_conformance.py) run the conformance suite over it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from participants.environments import ENTRY_POINT_GROUP, ENVIRONMENTS

ROOT = Path(__file__).resolve().parents[3]


def install_plugin(site: Path) -> dict[str, str]:
    """Install rb_coin into `site` as a distribution with its entry point; the env to see it with."""
    shutil.copy(ROOT / "tests" / "plugins" / "rb_coin.py", site / "rb_coin.py")
    info = site / "rb_coin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rb-coin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ncoin = rb_coin:CoinEnvironment\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_rollbooks_own_environments_are_its_entry_points() -> None:
    from importlib.metadata import entry_points

    declared = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.value.startswith("participants.")}
    assert set(declared) == {"workplace", "blackjack", "math", "string_match", "sandbox"}
    assert {name: f"{cls.__module__}:{cls.__name__}" for name, cls in ENVIRONMENTS.items() if name in declared} == declared


def test_an_environment_from_outside_is_registered_generates_tasks_and_is_played(tmp_path: Path) -> None:
    env = install_plugin(tmp_path)
    probe = ("import json; from participants.environments import ENVIRONMENTS, get_environment; "
             "from participants.environments.base import Trajectory; "
             "from participants.environments.tasks import make_task; t = make_task('coin', 1); coin = get_environment('coin'); "
             "said = [{'role': 'user', 'content': t.prompt}, {'role': 'assistant', 'content': t.params['expected']}]; "
             "print(json.dumps({'names': sorted(ENVIRONMENTS), 'task': t.to_json(), "
             "'reward': coin.verify(t, {}, Trajectory(said, t.params['expected'])), "
             "'without_conversation': coin.verify(t, {}, Trajectory([], t.params['expected'])), "
             "'played': __import__('participants.model.backends.scripted').model.backends.scripted.scripted_reply(said[:1], [], 0)}))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout)
    assert "coin" in seen["names"] and "workplace" in seen["names"]
    assert seen["task"]["env"] == "coin" and seen["task"]["task_id"].startswith("coin-")
    assert (seen["reward"], seen["without_conversation"]) == (1.0, 0.0)  # verify reads the whole trajectory
    # the scripted stand-in model plays it with the player the package brought
    assert seen["played"] == {"role": "assistant", "content": seen["task"]["params"]["expected"]}


def test_a_misdeclared_entry_point_is_refused_by_name(tmp_path: Path) -> None:
    env = install_plugin(tmp_path)
    (tmp_path / "rb_coin-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ndice = rb_coin:CoinEnvironment\n")
    out = subprocess.run([sys.executable, "-c", "import participants.environments"], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "entry point dice = rb_coin:CoinEnvironment names a class whose name is 'coin'" in out.stderr


def test_the_shipped_conformance_suite_picks_up_an_environment_from_outside(tmp_path: Path) -> None:
    env = install_plugin(tmp_path)
    listed = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "--collect-only",
                             "-k", "coin", str(ROOT / "tests" / "participants" / "environments" / "test_conformance.py")], env=env, cwd=ROOT, capture_output=True, text=True)
    collected = sorted(line.split("::")[-1] for line in listed.stdout.splitlines() if "::" in line)
    assert collected == [
        "test_every_boundary_checkpoints_crashes_and_restores_to_the_same_end[coin-restart_only]",
        "test_every_boundary_checkpoints_crashes_and_restores_to_the_same_end[coin-simple]",
    ], listed.stdout[-2000:] + listed.stderr[-2000:]


@pytest.mark.timeout(300)
def test_a_plugin_runs_the_conformance_suite_in_its_own_tests_without_postgresql(tmp_path: Path) -> None:
    env = install_plugin(tmp_path)
    env.pop("ROLLBOOK_TEST_DSN", None)
    shutil.copy(ROOT / "tests" / "plugins" / "rb_coin_conformance.py", tmp_path / "test_rb_coin.py")
    # From the plugin's own folder, with none of rollbook's test configuration: only the installed packages.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_rb_coin.py"],
                         env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert sorted(line.split("::")[-1] for line in out.stdout.splitlines() if line.startswith("PASSED")) == [
        "test_coin_ends_as_an_uninterrupted_run_from_every_boundary[restart_only]",
        "test_coin_ends_as_an_uninterrupted_run_from_every_boundary[simple]"]
