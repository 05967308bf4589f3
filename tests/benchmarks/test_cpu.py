"""benchmarks/cpu.py: a process tree's CPU seconds, a child that already exited included."""

import subprocess
import sys

import pytest

from benchmarks import cpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_tree_counts_its_live_child_and_the_child_it_reaped() -> None:
    # The parent burns nothing itself; it runs one child to its end (reaped: cutime), then keeps a second
    # alive, which says when its burn is done (on a loaded machine a fixed wait was not always enough).
    live = BURN + "import sys, time\nsys.stdout.write('burned\\n'); sys.stdout.flush(); time.sleep(30)\n"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN!r}])\n"
                               f"p = subprocess.Popen([sys.executable, '-c', {live!r}])\n"
                               "sys.stdout.write('ready\\n'); sys.stdout.flush(); p.wait()"],
                              stdout=subprocess.PIPE, text=True)
    try:
        before = cpu.sample({"tree": parent.pid})
        assert parent.stdout is not None
        assert {parent.stdout.readline(), parent.stdout.readline()} == {"ready\n", "burned\n"}
        spent = cpu.spent(before, cpu.sample({"tree": parent.pid}))
        assert spent["tree"] is not None and spent["tree"] >= 0.4  # two burns of 0.3 s: more than one
        assert spent["driver"] is not None and spent["driver"] < 0.3  # this process's own CPU is apart
    finally:
        parent.kill()
        parent.wait()


def test_a_process_that_is_gone_has_no_figure() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu.tree_seconds(gone.pid) is None
